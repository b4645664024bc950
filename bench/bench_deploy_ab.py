#!/usr/bin/env python3
"""Deploy and rollback wall time of two versions of this tool, side by side, on one sandbox host.

    .venv/bin/python bench/bench_deploy_ab.py --old 5b52c24 [--new <folder or commit>] [--runs 2]

Each version is a folder of code: `--new` defaults to this checkout's working tree; a commit is
exported with `git archive` into a temporary folder (no worktree, no change to the repository's
git state). Both run as `python -m ddtree_ops` with the SAME interpreter and that folder first on
PYTHONPATH, so the dependencies are identical and only the code differs; before the first run the
bench checks that each version really imports its own folder.

One sandbox host (stand-in server, zero load time), then blocks of `--runs` deploy → rollback
pairs in the order new, old, new, old, so both versions see the same machine. Per CLI run: wall
time, the controller's CPU (user + sys) and peak RSS (from wait4), the controller's peak thread
count and open file descriptors (sampled from /proc every 20 ms), and the deploy's step times.
Writes bench/results/deploy_ab_rooms.json and .md. Needs root (sandbox). The temporary folders and
the sandbox are removed at the end, also when a run fails or the bench is interrupted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddtree_ops.testing.sandbox import Sandbox  # noqa: E402

ORDER = ("new", "old", "new", "old")
SAMPLE_EVERY_S = 0.02


@dataclass(frozen=True)
class Version:
    label: str
    spec: str  # what was asked for: a folder or a commit
    code: Path  # the folder whose ddtree_ops runs
    commit: str | None  # None: a working tree as it is on disk


@dataclass
class CliRun:
    wall_s: float
    cpu_s: float
    maxrss_kib: int
    peak_threads: int
    peak_fds: int
    doc: dict[str, Any]


@dataclass
class Series:
    """Every measured number of one version, in run order."""

    values: dict[str, list[float]] = field(default_factory=dict)
    steps: list[dict[str, float]] = field(default_factory=list)

    def add(self, key: str, value: float) -> None:
        self.values.setdefault(key, []).append(value)


def _commit(repo: Path, spec: str) -> str:
    p = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{spec!r} is neither a folder nor a commit of {repo}")
    return p.stdout.strip()


def prepare(label: str, spec: str, work: Path, repo: Path) -> Version:
    """A folder is used as it is; anything else must name a commit of `repo`, exported into `work/label`."""
    if Path(spec).is_dir():
        return Version(label, spec, Path(spec).resolve(), None)
    commit = _commit(repo, spec)
    dest = work / label
    dest.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(repo), "archive", commit], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"git archive {commit} failed")
    return Version(label, spec, dest, commit)


def env_for(v: Version) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(v.code), "PYTHONDONTWRITEBYTECODE": "1"}


def check_imports_own_code(v: Version) -> None:
    """The editable install of the checkout must not win over PYTHONPATH, or both columns would
    measure the same code."""
    out = subprocess.run([sys.executable, "-c", "import ddtree_ops; print(ddtree_ops.__file__)"], cwd=v.code,
                         env=env_for(v), capture_output=True, text=True, check=True).stdout.strip()
    if not Path(out).resolve().is_relative_to(v.code):
        raise SystemExit(f"{v.label} ({v.spec}) imports {out}, not its own folder {v.code}")


def patchset_digest(v: Version, name: str) -> str:
    h = hashlib.sha256()
    base = v.code / "patches" / name
    for p in sorted(base.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(base)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def _proc_counts(pid: int) -> tuple[int, int]:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        threads = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads:"))
        return threads, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return 0, 0  # it has just exited


def run_cli(v: Version, *args: str, json_out: bool = True) -> CliRun:
    """One CLI run, sampled while it runs and reaped with wait4 for its own rusage."""
    extra = ("--yes", "--json") if json_out else ()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, "-m", "ddtree_ops", *args, *extra], cwd=v.code,
                             env=env_for(v), stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        threads = fds = 0
        while True:
            t, f = _proc_counts(p.pid)
            threads, fds = max(threads, t), max(fds, f)
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(SAMPLE_EVERY_S)
        wall = time.monotonic() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if p.returncode != 0:
        raise RuntimeError(f"{v.label}: {args[0]} failed ({p.returncode}):\n{stderr[-3000:]}")
    return CliRun(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss, threads, fds,
                  json.loads(stdout) if json_out else {})


def step_durations(doc: dict[str, Any]) -> dict[str, float]:
    steps = doc["hosts"][0]["steps"]
    out: dict[str, float] = {}
    for a, b in zip(steps, steps[1:], strict=False):
        out[a["step"]] = out.get(a["step"], 0.0) + (b["t"] - a["t"])
    return out


def one_pair(v: Version, inv: str, host: str, patchset: str, budget: int, into: Series) -> None:
    d = run_cli(v, "deploy", "-i", inv, "-l", host, "-p", patchset, "--canary", "0", "--budget", str(budget))
    r = run_cli(v, "rollback", "-i", inv, "-l", host)
    for kind, run in (("deploy", d), ("rollback", r)):
        into.add(f"{kind}_wall_s", run.wall_s)
        into.add(f"{kind}_cpu_s", run.cpu_s)
        into.add(f"{kind}_maxrss_mib", run.maxrss_kib / 1024)
        into.add(f"{kind}_peak_threads", run.peak_threads)
        into.add(f"{kind}_peak_fds", run.peak_fds)
    # What any CLI run costs before it touches a host (interpreter, imports, argument parsing).
    into.add("startup_cpu_s", run_cli(v, "--help", json_out=False).cpu_s)
    into.steps.append(step_durations(d.doc))
    print(f"{v.label}: deploy {d.wall_s:.2f} s, rollback {r.wall_s:.2f} s", file=sys.stderr)


def measure(versions: dict[str, Version], runs: int, patchset: str, work: Path) -> dict[str, Series]:
    sb = Sandbox(work / "sandbox")
    series = {label: Series() for label in versions}
    try:
        sb.up(1, load_seconds=0.0)
        inv, host = str(sb.inventory_path), sb.hosts()[0].name
        budget = 16
        for label in ORDER:
            for _ in range(runs):
                one_pair(versions[label], inv, host, patchset, budget, series[label])
                budget += 1
    finally:
        sb.down()
    return series


def _sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # so that the finally blocks remove the sandbox and the folders


# ---------------------------------------------------------------------------------------------
# the report


def summarize(series: dict[str, Series]) -> dict[str, Any]:
    med = {label: {k: statistics.median(xs) for k, xs in s.values.items()} for label, s in series.items()}
    names = list(series["new"].steps[0]) if series["new"].steps else []
    steps = {label: {n: statistics.median(st.get(n, 0.0) for st in s.steps) for n in names}
             for label, s in series.items()}
    return {"median": med, "step_median_s": steps,
            "all": {label: s.values for label, s in series.items()}}


def render_md(doc: dict[str, Any]) -> str:
    s, v = doc["summary"], doc["versions"]
    lines = [f"# deploy / rollback, this change against {v['old']['spec']}, side by side ({doc['when']})", "",
             f"`{doc['command']}`: 1 sandbox host, zero load time, {doc['machine']['cpus']} CPUs (load average "
             f"{doc['machine']['loadavg_before']} before, {doc['machine']['loadavg_after']} after). Order "
             f"{', '.join(ORDER)}, {doc['runs']} deploy → rollback pair(s) per block, one interpreter and its "
             f"dependencies for both, each version's folder first on PYTHONPATH (checked). new = "
             f"{v['new']['spec']} ({v['new']['commit'] or 'working tree'}), old = {v['old']['commit']}. Patch set "
             f"`{doc['patchset']}` from each version's patches/ ({_digest_words(doc['patchset_digest'])}).", "",
             "| per CLI run | new median | old median | new / old | all new | all old |",
             "| --- | --- | --- | --- | --- | --- |"]
    for k, new_all in s["all"]["new"].items():
        n, o = s["median"]["new"][k], s["median"]["old"][k]
        fmt = (lambda x: f"{x:.0f}") if "peak" in k else (lambda x: f"{x:.2f}")
        lines.append(f"| {k} | {fmt(n)} | {fmt(o)} | {n / o if o else float('nan'):.2f} | "
                     f"{', '.join(fmt(x) for x in new_all)} | {', '.join(fmt(x) for x in s['all']['old'][k])} |")
    lines += ["", "| deploy step | new median s | old median s |", "| --- | --- | --- |"]
    for name, n in s["step_median_s"]["new"].items():
        lines.append(f"| {name} | {n:.2f} | {s['step_median_s']['old'].get(name, float('nan')):.2f} |")
    lines += ["", "wall: the whole CLI process (start-up and imports included); cpu: user + sys of the CLI process "
              "(wait4); startup_cpu_s: the same for `python -m ddtree_ops --help` (what every run costs before it "
              "touches a host); peak threads / fds: the CLI process's, sampled every 20 ms from /proc (the SSH "
              "transport's thread and socket included).", ""]
    return "\n".join(lines)


def _digest_words(digest: str | dict[str, str]) -> str:
    if isinstance(digest, str):
        return f"the same bytes in both, digest {digest}"
    return "DIFFERENT in the two versions: " + ", ".join(f"{k} {d}" for k, d in digest.items())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="commit of the 'before' version")
    ap.add_argument("--new", default=str(ROOT), help="folder (default: this working tree) or commit")
    ap.add_argument("--runs", type=int, default=3, help="deploy → rollback pairs per block (4 blocks)")
    ap.add_argument("--patchset", default="ddtree-temp")
    ap.add_argument("--repo", default=str(ROOT), help="the git repository the commits are taken from")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _sigterm)
    work = Path(tempfile.mkdtemp(prefix="ddtree-bench-ab-"))
    load_before = os.getloadavg()
    try:
        repo = Path(args.repo)
        versions = {"new": prepare("new", args.new, work, repo), "old": prepare("old", args.old, work, repo)}
        for v in versions.values():
            check_imports_own_code(v)
        digests = {label: patchset_digest(v, args.patchset) for label, v in versions.items()}
        series = measure(versions, args.runs, args.patchset, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"benchmark": "deploy / rollback A/B on one sandbox host",
           "command": "bench/bench_deploy_ab.py " + " ".join(sys.argv[1:]), "runs": args.runs, "order": ORDER,
           "patchset": args.patchset,
           "patchset_digest": digests["new"] if len(set(digests.values())) == 1 else digests,
           "versions": {k: {"spec": v.spec, "commit": v.commit} for k, v in versions.items()},
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "loadavg_before": [round(x, 2) for x in load_before],
                       "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "summary": summarize(series), "steps": {k: s.steps for k, s in series.items()}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "deploy_ab_rooms.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "deploy_ab_rooms.md").write_text(render_md(doc))
    print(render_md(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
