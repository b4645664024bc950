#!/usr/bin/env python3
"""Before/after of the one-agent-per-operation change, side by side.

Runs the CLI of two versions of the tool against the same sandbox hosts (zero weight-loading
time), alternating old, new, old, new, so both see the same machine:

* 1 host, `--runs` deploy → rollback pairs per version: wall time, the `preflight` and `commit`
  steps (from the --json step times), processes started on the machine during the deploy (the
  kernel's last-PID counter, /proc/sys/kernel/ns_last_pid: sshd sessions, shells, Python starts,
  systemctl calls; the stand-in server's start is in both), and the controller's CPU time
  (user + sys of the CLI process, from wait4's rusage);
* N hosts (default 8) at once, once per version: the controller's CPU time per host.

The old version is a git revision checked out into a temporary worktree and run by the same
interpreter with that folder first on PYTHONPATH, so only the code differs.

    .venv/bin/python bench/bench_agent_ab.py --old 227321c [--runs 3] [--hosts 8]

Writes bench/results/agent_ab.json and agent_ab.md. Needs root (sandbox); run it on an idle
machine: the process count and CPU time include everything else that runs meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_fleet import make_ps  # noqa: E402  (the fleet bench's two patch sets)

from ddtree_ops.testing.sandbox import Sandbox  # noqa: E402

FOOTNOTE = (
    "deploy_pids: PIDs the kernel allocated on this machine during the deploy: every process and thread started "
    "(sshd session children, shells, the agent's Python, systemctl calls, the server); other activity on the "
    "machine adds to both columns. When this was measured the sandbox's systemctl was a Python program "
    "(docker-systemctl-replacement, since replaced by real systemd) that allocated 30-70 PIDs per call, so on a "
    "real host (systemctl in C) the ratio is smaller: there, what "
    "changes is SSH execs per deploy (one per remote call before, 31 on a fake host with no load time; one "
    "per operation now) and Python starts (one per agent call before, 20; one now). cpu: user+sys of the "
    "controller process (CLI start-up and imports included, about 0.4 s).")


def last_pid() -> int:
    return int(Path("/proc/sys/kernel/ns_last_pid").read_text())


def pids_since(start: int) -> int:
    """PIDs allocated since `start` was the last one (the counter wraps at pid_max, to 300)."""
    now = last_pid()
    if now >= start:
        return now - start
    return (int(Path("/proc/sys/kernel/pid_max").read_text()) - start) + (now - 300)


def run(code_dir: Path, *args: str) -> dict:
    """One CLI run of the version in `code_dir`: wall time, the CLI's CPU time (user + sys, from
    the RUSAGE_CHILDREN delta: runs are sequential), PIDs allocated meanwhile, its JSON."""
    env = {**os.environ, "PYTHONPATH": str(code_dir), "PYTHONDONTWRITEBYTECODE": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    pid0, t0 = last_pid(), time.monotonic()
    p = subprocess.run([sys.executable, "-m", "ddtree_ops", *args, "--yes", "--json"], cwd=code_dir, env=env,
                       capture_output=True, text=True)
    wall, pids = time.monotonic() - t0, pids_since(pid0)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"{code_dir}: {args[0]} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "pids": pids, "doc": json.loads(p.stdout), "cpu": cpu}


def step_durations(doc: dict, host: int = 0) -> dict[str, float]:
    steps = doc["hosts"][host]["steps"]
    out: dict[str, float] = {}
    for a, b in zip(steps, steps[1:], strict=False):
        out[a["step"]] = out.get(a["step"], 0.0) + (b["t"] - a["t"])
    return out


def commit_s(doc: dict) -> float:
    """From the `commit` journal step to the `committed` step: the commit's remote work."""
    steps = {s["step"]: s["t"] for s in doc["hosts"][0]["steps"]}
    return steps["committed"] - steps["commit"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="git revision of the 'before' version")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--fleet-repeats", type=int, default=2, choices=(1, 2), help="N-host deploys per version")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ddtree-bench-agent-"))
    old_dir = work / "old"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old_dir), args.old], check=True,
                   capture_output=True)
    versions = {"new": ROOT, "old": old_dir}
    sb = Sandbox(work / "sandbox")
    rows: dict[str, dict[str, list[float]]] = {v: {} for v in versions}
    fleet: dict[str, dict] = {}
    try:
        sb.up(max(args.hosts, 1), load_seconds=0.0)
        inv = str(sb.inventory_path)
        first = sb.hosts()[0].name
        ps = [make_ps(work / "ps", t) for t in ("a", "b")]
        for i in range(args.runs):
            for v in ("old", "new") if i % 2 == 0 else ("new", "old"):
                d = run(versions[v], "deploy", "-i", inv, "-l", first, "-p", str(ps[i % 2]), "--canary", "0")
                steps = step_durations(d["doc"])
                for k, val in (("deploy_wall_s", d["wall"]), ("preflight_s", steps["preflight"]),
                               ("commit_s", commit_s(d["doc"])), ("deploy_pids", d["pids"]),
                               ("deploy_cpu_s", d["cpu"])):
                    rows[v].setdefault(k, []).append(val)
                r = run(versions[v], "rollback", "-i", inv, "-l", first)
                rows[v].setdefault("rollback_wall_s", []).append(r["wall"])
                rows[v].setdefault("rollback_pids", []).append(r["pids"])
        if args.hosts > 1:
            samples: dict[str, list[dict]] = {"old": [], "new": []}
            for j, v in enumerate(("old", "new", "new", "old")[:2 * args.fleet_repeats]):
                d = run(versions[v], "deploy", "-i", inv, "-p", str(ps[j % 2]), "--canary", "0")
                back = run(versions[v], "rollback", "-i", inv)
                samples[v].append({"cpu_s": d["cpu"], "cpu_per_host_s": d["cpu"] / args.hosts, "wall_s": d["wall"],
                                   "pids": d["pids"], "rollback_wall_s": back["wall"]})
            fleet = {v: {"hosts": args.hosts, "samples": ss,
                         **{k: statistics.median(x[k] for x in ss) for k in ss[0]}} for v, ss in samples.items()}
    finally:
        sb.down()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old_dir)], capture_output=True)
    med = {v: {k: statistics.median(x) for k, x in r.items()} for v, r in rows.items()}
    result = {"old": args.old, "runs": args.runs, "single_host": rows, "median": med, "fleet": fleet,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "agent_ab.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# One agent process per operation: before ({args.old}) and after, side by side",
             "", f"{result['when']}, {os.cpu_count()} CPUs, sandbox hosts, zero load time. 1 host: {args.runs} "
             f"deploy → rollback pairs per version, alternating. Command: `bench/bench_agent_ab.py --old {args.old} "
             f"--runs {args.runs} --hosts {args.hosts} --fleet-repeats {args.fleet_repeats}`.", "",
             "| 1 host | new median | old median | new / old | all new | all old |",
             "| --- | --- | --- | --- | --- | --- |"]
    for k in rows["new"]:
        n, o = med["new"][k], med["old"][k]
        fmt = (lambda x: f"{x:.0f}") if "pids" in k else (lambda x: f"{x:.2f}")
        lines.append(f"| {k} | {fmt(n)} | {fmt(o)} | {n / o if o else float('nan'):.2f} | "
                     f"{', '.join(fmt(x) for x in rows['new'][k])} | {', '.join(fmt(x) for x in rows['old'][k])} |")
    if fleet:
        lines += ["", f"| {args.hosts} hosts at once (median of {args.fleet_repeats}) | new | old | new / old |",
                  "| --- | --- | --- | --- |"]
        for k in ("cpu_per_host_s", "cpu_s", "wall_s", "pids", "rollback_wall_s"):
            n, o = fleet["new"][k], fleet["old"][k]
            fmt = (lambda x: f"{x:.0f}") if k == "pids" else (lambda x: f"{x:.2f}")
            lines.append(f"| {k} | {fmt(n)} | {fmt(o)} | {n / o:.2f} |")
    lines += ["", FOOTNOTE]
    (out / "agent_ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
