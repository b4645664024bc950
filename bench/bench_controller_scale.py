#!/usr/bin/env python3
"""What one controller costs per host: a canary + batches rolling deploy, then a rolling
rollback, over 16, 64 and 256 fake hosts, in-process (no sandbox, no SSH).

    .venv/bin/python bench/bench_controller_scale.py [--sizes 16,64,256] [--repeats 2] [--batch 10%]

Each (size, repeat) runs in a fresh interpreter, so ru_maxrss is that size's own peak; the sizes
are interleaved over the repeats so machine load spreads over all of them. Per run: the
controller's CPU seconds (user + sys of the process, `time.process_time`) and wall time of the
deploy and of the rollback; peak RSS (the kernel's high-water mark, reset before the rollout); the
rollout's peak thread count (its threads counted as they start and end, not sampled; the kernel's
count read at each start); and peak open file descriptors (sampled every SAMPLE_EVERY_S: a lower
bound).

The fake hosts run the real host agent in-process, so the process's CPU includes work that on a
fleet runs on each host: the agent's CPU is measured apart (thread CPU time around each agent
call) and subtracted in the "controller only" column. The fake's health sleeps advance a fake
clock; the bench still sets the poll and soak intervals to the smallest the schema accepts and
reports the wall time spent in the session's sleeps, so the numbers are the controller's work, not
waits.

Writes bench/results/controller_scale.json and controller_scale.md.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from ddtree_ops.artifacts.patchset import load_patchset  # noqa: E402
from ddtree_ops.fleet.actions import rolling_deploy, rolling_rollback  # noqa: E402
from ddtree_ops.fleet.rollout import Target, plan_batches  # noqa: E402
from ddtree_ops.runbook.options import DeployOptions  # noqa: E402
from ddtree_ops.testing.fake_host import UPSTREAM_BYTES, UPSTREAM_REL, fake_hosts  # noqa: E402
from fast_kit import PROBE_REL, write_patchset  # noqa: E402

# The smallest intervals the inventory schema accepts; a 0.1 s soak still runs two soak rounds.
FAST_HEALTH = {"poll_interval_s": 0.05, "consecutive_successes": 2, "load_deadline_s": 30,
               "min_healthy_s": 0.1, "soak_interval_s": 0.05}
SAMPLE_EVERY_S = 0.01


class BenchFailed(RuntimeError):
    """A rollout did not end with every host deployed (or rolled back): nothing was measured."""


@dataclass(frozen=True)
class Plan:
    """The rollout options, as an operator would pass them."""

    canary: int = 1
    batch: str = "10%"
    forks: int = inspect.signature(rolling_deploy).parameters["forks"].default


@dataclass
class Peaks:
    py_threads: int = 0
    os_threads: int = 0
    fds: int = 0
    rss_kib: int = 0


class Sampler:
    """Samples open fds and VmRSS every SAMPLE_EVERY_S until stopped: a sample can miss a peak, so
    these are lower bounds (the RSS reported is the kernel's high-water mark when it can be reset,
    see `PeakRss`)."""

    def __init__(self) -> None:
        self.fds = 0
        self.rss_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(SAMPLE_EVERY_S):
                self.sample()
                return

    def sample(self) -> None:
        self.rss_kib = max(self.rss_kib, _proc_status().get("VmRSS", 0))
        self.fds = max(self.fds, len(os.listdir("/proc/self/fd")))


class ThreadCount:
    """The threads a rollout starts, counted as they start and end: not sampled, so neither a short
    thread between two samples nor a thread of someone else is in the figure.

    Inside the block, a thread started by the thread that entered it, or by one of the threads it
    started, is ours: `threading.Thread.start` is wrapped (and put back on exit) to give each of
    ours a `run` that counts it up when it begins and down when it returns. `py_threads` is the
    block's own thread plus the most of ours alive at once; `os_threads` the kernel's count of the
    process's threads (/proc/self/status) each time one of ours begins, less the threads that were
    there before the block, plus the block's own (the kernel's view of the same peak: it also
    counts threads that are not Python's). A sampler thread reading /proc while threads come and go
    missed a short-lived peak, and counted the threads another test left running in the same
    pytest worker (and itself)."""

    def __init__(self) -> None:
        self.py_threads = 1
        self.os_threads = 1
        self._lock = threading.Lock()
        self._ours: set[threading.Thread] = set()
        self._live = 0
        self._os_before = 0
        self._root: threading.Thread | None = None
        self._start: Callable[..., None] | None = None

    def __enter__(self) -> ThreadCount:
        self._root = threading.current_thread()
        self._os_before = _proc_status().get("Threads", 1)
        self._start = threading.Thread.start
        start, count = self._start, self

        def counted_start(thread: threading.Thread, *args: Any, **kwargs: Any) -> None:
            count._adopt(thread)
            start(thread, *args, **kwargs)

        threading.Thread.start = counted_start  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        threading.Thread.start = self._start  # type: ignore[method-assign]

    def _adopt(self, thread: threading.Thread) -> None:
        with self._lock:
            if threading.current_thread() is not self._root and threading.current_thread() not in self._ours:
                return  # not started by the rollout
            self._ours.add(thread)
        run = thread.run

        def counted_run() -> None:
            self._began()
            try:
                run()
            finally:
                with self._lock:
                    self._live -= 1
                    self._ours.discard(thread)

        thread.run = counted_run  # type: ignore[method-assign]

    def _began(self) -> None:
        with self._lock:
            self._live += 1
            self.py_threads = max(self.py_threads, 1 + self._live)
            os_now = _proc_status().get("Threads", 0)
            self.os_threads = max(self.os_threads, os_now - self._os_before + 1)


class PeakRss:
    """The process's peak RSS over the block: the kernel's high-water mark (VmHWM), reset to the
    current RSS on entry (`echo 5 > /proc/self/clear_refs`), so it is the block's peak, not the
    process's lifetime one, and never below the RSS on entry. `exact` is False where the reset is
    refused; the caller then has only samples."""

    def __init__(self) -> None:
        self.exact = False
        self.before_kib = 0
        self.peak_kib = 0

    def __enter__(self) -> PeakRss:
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            self.exact = True
        except OSError:
            self.exact = False
        self.before_kib = _proc_status().get("VmRSS", 0)
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak_kib = _proc_status().get("VmHWM", 0) if self.exact else 0


def _proc_status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Threads", "VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


@dataclass
class CpuAccount:
    """CPU seconds of the threads inside wrapped calls (thread_time: this thread's CPU only)."""

    seconds: list[float] = field(default_factory=list)
    sleep_wall_s: list[float] = field(default_factory=list)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds.append(time.thread_time() - t0)
        return timed

    def wrap_sleep(self, fn: Callable[[float], None]) -> Callable[[float], None]:
        def timed(seconds: float) -> None:
            t0 = time.monotonic()
            try:
                fn(seconds)
            finally:
                self.sleep_wall_s.append(time.monotonic() - t0)
        return timed


@dataclass
class Measured:
    """One rollout (deploy or rollback) over all hosts."""

    wall_s: float
    cpu_s: float  # the whole process: controller + the in-process agents
    agent_cpu_s: float  # inside the fake hosts' agent calls (runs on each host on a fleet)
    sleep_wall_s: float  # wall time inside the session's sleep (the fake clock: ~0)
    outcomes: dict[str, int]
    failures: list[str] = field(default_factory=list)  # the first few hosts that did not succeed, why

    @property
    def controller_cpu_s(self) -> float:
        return self.cpu_s - self.agent_cpu_s


@dataclass
class SizeRun:
    hosts: int
    plan: Plan
    batches: int
    largest_batch: int
    deploy: Measured
    rollback: Measured
    peaks: Peaks
    rss_before_kib: int  # after the fake hosts and the patch set exist, before the rollout
    maxrss_kib: int  # ru_maxrss of the whole process

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("deploy", "rollback"):
            m: Measured = getattr(self, k)
            d[k]["controller_cpu_s"] = m.controller_cpu_s
        return d


def _patchset(where: Path, marker: bytes):
    files = {PROBE_REL: b"PROBE = 1\n" + marker, UPSTREAM_REL: UPSTREAM_BYTES + b"# bench\n"}
    return load_patchset(str(write_patchset(where, files, name="bench")))


def _connector(fakes: list, account: CpuAccount) -> Callable:
    by_name = {f.host.name: f for f in fakes}
    for f in fakes:  # the agent's work is the host's on a fleet: counted apart
        f.agent = account.wrap(f.agent)

    def connect(host):
        session = by_name[host.name].session()
        session.sleep = account.wrap_sleep(session.sleep)
        return session
    return connect


def _timed(run: Callable[[], Any], account: CpuAccount) -> tuple[Any, Measured]:
    account.seconds.clear()
    account.sleep_wall_s.clear()
    c0, t0 = time.process_time(), time.monotonic()
    result = run()
    wall, cpu = time.monotonic() - t0, time.process_time() - c0
    outcomes: dict[str, int] = {}
    for r in result.results:
        outcomes[str(r.outcome.value)] = outcomes.get(str(r.outcome.value), 0) + 1
    failures = [f"{r.host}: {r.outcome.value} at {r.failed_step}: {r.message}" for r in result.results
                if str(r.outcome.value) not in ("deployed", "rolled_back")][:3]
    return result, Measured(wall, cpu, sum(account.seconds), sum(account.sleep_wall_s), outcomes, failures)


def _require(m: Measured, outcome: str, hosts: int, what: str) -> None:
    if m.outcomes != {outcome: hosts}:
        raise BenchFailed(f"{what} over {hosts} fake hosts ended {m.outcomes}, not all {outcome}: "
                          + "; ".join(m.failures))


def measure_size(hosts: int, plan: Plan, work: Path, *, marker: bytes = b"") -> SizeRun:
    """Deploy then roll back `hosts` fake hosts in this process; BenchFailed unless every host
    deployed and then rolled back. `marker` goes into the shipped module (FAKE_CRASH: a bad release)."""
    fakes = fake_hosts(work / "hosts", hosts, health=dict(FAST_HEALTH))
    ps = _patchset(work / "ps", marker)
    account = CpuAccount()
    connect = _connector(fakes, account)
    targets = [Target(f.host.name, (f.host,)) for f in fakes]
    opts = DeployOptions(command="bench_controller_scale")
    # The sampler's thread starts before the count: it is not the rollout's.
    with Sampler() as sampler, PeakRss() as rss, ThreadCount() as threads:
        dep, deploy = _timed(lambda: rolling_deploy(targets, ps, opts, canary=plan.canary, batch=plan.batch,
                                                    forks=plan.forks, connect=connect), account)
        _require(deploy, "deployed", hosts, "the deploy")
        _, rollback = _timed(lambda: rolling_rollback(targets, None, opts, batch=plan.batch, forks=plan.forks,
                                                      connect=connect), account)
        _require(rollback, "rolled_back", hosts, "the rollback")
    peaks = Peaks(py_threads=threads.py_threads, os_threads=threads.os_threads, fds=sampler.fds,
                  rss_kib=rss.peak_kib if rss.exact else sampler.rss_kib)
    return SizeRun(hosts, plan, len(dep.batches), max(len(b) for b in dep.batches), deploy, rollback,
                   peaks, rss.before_kib, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


# ---------------------------------------------------------------------------------------------
# driver: one fresh interpreter per (size, repeat)


def run_in_subprocess(hosts: int, plan: Plan) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--one", str(hosts), "--canary", str(plan.canary),
            "--batch", plan.batch, "--forks", str(plan.forks)]
    p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    if p.returncode != 0:
        raise BenchFailed(f"{hosts} hosts: exit {p.returncode}\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def per_host(run: dict[str, Any], key: str) -> float:
    return (run["deploy"][key] + run["rollback"][key]) / run["hosts"]


METRICS: dict[str, Callable[[dict[str, Any]], float]] = {
    "cpu_s_per_host": lambda r: per_host(r, "cpu_s"),
    "controller_cpu_s_per_host": lambda r: per_host(r, "controller_cpu_s"),
    "wall_s_per_host": lambda r: per_host(r, "wall_s"),
    "deploy_cpu_s": lambda r: r["deploy"]["cpu_s"],
    "rollback_cpu_s": lambda r: r["rollback"]["cpu_s"],
    "deploy_controller_cpu_s": lambda r: r["deploy"]["controller_cpu_s"],
    "rollback_controller_cpu_s": lambda r: r["rollback"]["controller_cpu_s"],
    "deploy_wall_s": lambda r: r["deploy"]["wall_s"],
    "rollback_wall_s": lambda r: r["rollback"]["wall_s"],
    "sleep_wall_s": lambda r: r["deploy"]["sleep_wall_s"] + r["rollback"]["sleep_wall_s"],
    "maxrss_mib": lambda r: r["maxrss_kib"] / 1024,
    "rss_before_mib": lambda r: r["rss_before_kib"] / 1024,
    "rollout_rss_kib_per_host": lambda r: (r["peaks"]["rss_kib"] - r["rss_before_kib"]) / r["hosts"],
    "rollout_rss_kib": lambda r: r["peaks"]["rss_kib"] - r["rss_before_kib"],
    "cpu_s": lambda r: r["deploy"]["cpu_s"] + r["rollback"]["cpu_s"],
    "controller_cpu_s": lambda r: r["deploy"]["controller_cpu_s"] + r["rollback"]["controller_cpu_s"],
    "peak_py_threads": lambda r: r["peaks"]["py_threads"],
    "peak_os_threads": lambda r: r["peaks"]["os_threads"],
    "peak_fds": lambda r: r["peaks"]["fds"],
}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per size: median, min and max of every metric; growth of the per-host metrics between sizes."""
    sizes = sorted({r["hosts"] for r in runs})
    per_size: dict[int, dict[str, dict[str, float]]] = {}
    for n in sizes:
        mine = [r for r in runs if r["hosts"] == n]
        per_size[n] = {k: _spread([f(r) for r in mine]) for k, f in METRICS.items()}
        per_size[n]["batches"] = _spread([r["batches"] for r in mine])
        per_size[n]["largest_batch"] = _spread([r["largest_batch"] for r in mine])
    growth, marginal = {}, {}
    for a, b in zip(sizes, sizes[1:], strict=False):
        growth[f"{a}->{b}"] = {k: _ratio(per_size[b][k]["median"], per_size[a][k]["median"])
                               for k in ("cpu_s_per_host", "controller_cpu_s_per_host", "wall_s_per_host",
                                         "maxrss_mib", "peak_os_threads", "peak_fds")}
        # What one more host costs, fixed costs (warm-up, imports done on first use) left out.
        marginal[f"{a}->{b}"] = {k: (per_size[b][k]["median"] - per_size[a][k]["median"]) / (b - a)
                                 for k in ("cpu_s", "controller_cpu_s", "rollout_rss_kib")}
    return {"sizes": sizes, "per_size": {str(n): v for n, v in per_size.items()}, "growth": growth,
            "marginal_per_host": marginal}


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def _ratio(b: float, a: float) -> float | None:
    return b / a if a else None


# ---------------------------------------------------------------------------------------------
# the report


def render_md(doc: dict[str, Any]) -> str:
    s, plan = doc["summary"], doc["plan"]
    sizes = " / ".join(str(n) for n in s["sizes"])
    lines = [f"# One controller over {sizes} fake hosts: CPU, memory, threads ({doc['when']})", "",
             f"`{doc['command']}`: {doc['repeats']} runs per size, each in a fresh interpreter, sizes interleaved; "
             f"{doc['machine']['cpus']} CPUs shared with other work (load average {doc['machine']['loadavg_before']} "
             f"before, {doc['machine']['loadavg_after']} after). Rollout as an operator runs it: canary "
             f"{plan['canary']}, batches of {plan['batch']}, forks {plan['forks']} (the default), max-fail 0; then a "
             f"rolling rollback, batches of {plan['batch']}. Fake hosts (`ddtree_ops.testing.fake_host`), "
             f"in-process, health poll and soak intervals at the smallest the inventory schema accepts, a 0.1 s soak "
             f"({doc.get('health', FAST_HEALTH)}); the fake's sleeps advance a fake clock.", "",
             "Per host = (deploy + rollback) / hosts. CPU = user + sys of the whole process; controller only = "
             "minus the CPU inside the fake hosts' agent calls (the real agent, in-process here, on the host in a "
             "fleet; its share includes the kernel time of its fsyncs, so it moves with the disk's load). "
             "Median [min–max] of the runs.", "",
             "| hosts | batches (largest) | CPU s total | CPU s / host | controller only s / host | wall s / host "
             "| deploy wall s | rollback wall s | peak RSS MiB | RSS during rollout KiB / host "
             "| peak threads (Python / OS) | peak fds |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in s["sizes"]:
        m = s["per_size"][str(n)]
        lines.append(f"| {n} | {m['batches']['median']:.0f} ({m['largest_batch']['median']:.0f}) "
                     f"| {_fmt(m['cpu_s'], 2)} | {_fmt(m['cpu_s_per_host'], 4)} "
                     f"| {_fmt(m['controller_cpu_s_per_host'], 4)} "
                     f"| {_fmt(m['wall_s_per_host'], 3)} | {_fmt(m['deploy_wall_s'], 1)} "
                     f"| {_fmt(m['rollback_wall_s'], 1)} | {_fmt(m['maxrss_mib'], 0)} "
                     f"| {_fmt(m['rollout_rss_kib_per_host'], 0)} "
                     f"| {m['peak_py_threads']['max']:.0f} / {m['peak_os_threads']['max']:.0f} "
                     f"| {m['peak_fds']['max']:.0f} |")
    lines += ["", "Growth of the per-host numbers (ratio of medians; 1.00 = linear, below 1 = better than linear):",
              "", "| sizes | CPU / host | controller only / host | wall / host | peak RSS (whole) | peak OS threads "
              "| peak fds |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for k, g in s["growth"].items():
        lines.append(f"| {k} | " + " | ".join("–" if g[x] is None else f"{g[x]:.2f}" for x in
                                               ("cpu_s_per_host", "controller_cpu_s_per_host", "wall_s_per_host",
                                                "maxrss_mib", "peak_os_threads", "peak_fds")) + " |")
    lines += ["", "Marginal cost of one more host (difference of medians / difference of hosts):", "",
              "| sizes | CPU s | controller only CPU s | RSS during rollout KiB |", "| --- | ---: | ---: | ---: |"]
    for k, m in s["marginal_per_host"].items():
        lines.append(f"| {k} | {m['cpu_s']:.4f} | {m['controller_cpu_s']:.4f} | {m['rollout_rss_kib']:.0f} |")
    lines += ["", f"Wall time inside the session's sleeps, all runs: at most {_max_sleep(s):.3f} s per run (the "
              "fake clock), so wall time is the controller's and the in-process agents' work.", ""]
    lines += doc.get("limits", [])
    return "\n".join(lines) + "\n"


def real_host_numbers(path: Path) -> dict[str, float] | None:
    """The one-host numbers of a real SSH deploy (bench_deploy_ab.py's 'new' medians), if measured."""
    try:
        return json.loads(path.read_text())["summary"]["median"]["new"]
    except (OSError, KeyError, ValueError):
        return None


def waves(hosts: int, plan: Plan) -> int:
    """Rounds of at most `forks` hosts one after another: the wall time is about waves x one host's deploy."""
    return sum(-(-len(b) // plan.forks) for b in plan_batches(hosts, canary=plan.canary, batch=plan.batch))


def growth_verdict(summary: dict[str, Any], key: str = "controller_cpu_s_per_host") -> str:
    """Linear or better when each step's ratio of per-host medians is at most 1 + the runs' spread."""
    parts, linear = [], True
    for step, g in summary["growth"].items():
        a, b = step.split("->")
        spread = max(_rel_spread(summary["per_size"][n][key]) for n in (a, b))
        ok = g[key] is not None and g[key] <= 1 + spread
        linear &= ok
        parts.append(f"{step}: ×{g[key]:.2f} per host (runs spread ±{spread:.0%})")
    word = "linear or better" if linear else "WORSE than linear"
    return f"Growth of the controller's own CPU per host: {word} ({'; '.join(parts)})."


def _rel_spread(m: dict[str, float]) -> float:
    return (m["max"] - m["min"]) / m["median"] if m["median"] else 0.0


def derive_limits(summary: dict[str, Any], plan: Plan, real: dict[str, float] | None) -> list[str]:
    """Where one controller stops, from this run's numbers (and the real-SSH one-host numbers)."""
    sizes = summary["sizes"]
    last = summary["marginal_per_host"][f"{sizes[-2]}->{sizes[-1]}"] if len(sizes) > 1 else None
    big = summary["per_size"][str(sizes[-1])]
    out = [growth_verdict(summary), "", "## Where one controller stops (derived from the numbers above)", ""]
    if last:
        c, m = last["controller_cpu_s"], last["rollout_rss_kib"]
        out.append(f"- CPU: one more host costs {last['cpu_s']:.4f} CPU s here, {c:.4f} s of it the controller's own "
                   f"(the rest is the host agent, in-process here). One Python process runs on one core at a time "
                   f"(GIL), so the fake-host controller is CPU-bound at about {1 / c:.0f} hosts per CPU second.")
        if m > 0:
            out.append(f"- Memory: {m:.0f} KiB more RSS per host in the run (its results, steps and logs, kept to "
                       f"the end for the table and the JSON): about {1024 * 1024 / m:,.0f} hosts per GiB; the "
                       f"{sizes[-1]}-host run peaked at {big['maxrss_mib']['median']:.0f} MiB in all. It grows with "
                       "hosts, not with forks.")
    bound = 1 + min(plan.forks, int(big["largest_batch"]["median"]))
    out.append(f"- Threads: the peak is {big['peak_os_threads']['max']:.0f} at {sizes[-1]} hosts; 1 main + min(forks "
               f"{plan.forks}, largest batch {big['largest_batch']['median']:.0f}) workers = {bound}: bounded by "
               "forks, not by hosts.")
    if real:
        per_conn_threads = real["deploy_peak_threads"] - 2  # main + one rollout worker
        per_conn_fds = real["deploy_peak_fds"] - 3  # stdin, stdout, stderr
        startup = real.get("startup_cpu_s", 0.0)
        c_real = real["deploy_cpu_s"] - startup
        t_host = real["deploy_wall_s"]
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        f_fds = (1024 - 3) / max(per_conn_fds, 1)
        f_cpu = t_host / c_real if c_real > 0 else float("inf")
        out += [f"- Over real SSH (bench_deploy_ab.py, one sandbox host): the CLI peaks at "
                f"{real['deploy_peak_threads']:.0f} threads and {real['deploy_peak_fds']:.0f} fds: at most "
                f"{per_conn_threads:.0f} thread(s) and {per_conn_fds:.0f} fd(s) per connection beyond main, one worker "
                "and stdio (an upper bound: one host does not separate a fixed part; paramiko's Transport is one "
                f"thread and one socket). At forks F: about {1 + per_conn_threads:.0f}·F + 1 threads and "
                f"{per_conn_fds:.0f}·F + 3 fds, so a soft limit of 1024 fds is reached at F ≈ {f_fds:.0f} (this "
                f"machine's limit: {nofile}).",
                f"- A real one-host deploy costs the controller at most {c_real:.2f} CPU s (the deploy run's "
                f"{real['deploy_cpu_s']:.2f} s minus the CLI's start-up, {startup:.2f} s; an upper bound per host: it "
                "still holds the run's fixed work, such as loading and hashing the patch set) over "
                f"{t_host:.1f} s of wall time with zero load time. F hosts in flight use at most F × {c_real:.2f} / "
                f"per-host deploy seconds of one core (the GIL): one core at F ≥ {f_cpu:.0f} with zero load time.",
                f"- So the first limit as forks grow: CPU when a host's deploy takes less than about "
                f"{f_fds * c_real:.0f} s (F_cpu = deploy s / {c_real:.2f} < F_fds ≈ {f_fds:.0f}), file descriptors "
                "at a 1024 soft limit when it takes longer (weights loading for minutes); raised, the thread count "
                "(one per fork plus one per connection) is next. None of these grows with the number of hosts; memory "
                "does, linearly."]
    else:
        out.append("- Real SSH numbers (threads and fds per connection, CPU per host): run bench/bench_deploy_ab.py "
                   "first; not measured in this report.")
    out.append(f"- Wall time: hosts go in waves of at most forks ({plan.forks}); with canary {plan.canary} and batches "
               f"of {plan.batch}: " + ", ".join(f"{n} hosts → {waves(n, plan)} waves" for n in sizes)
               + ". A rollout takes about waves × one host's deploy time: linear in hosts / forks, and forks are "
               "bounded by the limits above.")
    return out + [""]


def _fmt(m: dict[str, float], digits: int) -> str:
    return f"{m['median']:.{digits}f} [{m['min']:.{digits}f}–{m['max']:.{digits}f}]"


def _max_sleep(s: dict[str, Any]) -> float:
    return max(s["per_size"][str(n)]["sleep_wall_s"]["max"] for n in s["sizes"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16,64,256")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--canary", type=int, default=Plan.canary)
    ap.add_argument("--batch", default=Plan.batch)
    ap.add_argument("--forks", type=int, default=Plan.forks)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child: measure one size, print JSON
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--real", default=str(ROOT / "bench" / "results" / "deploy_ab_rooms.json"),
                    help="bench_deploy_ab.py's JSON: the one-host real-SSH numbers the limits section uses")
    args = ap.parse_args()
    plan = Plan(args.canary, args.batch, args.forks)
    if args.one:
        with tempfile.TemporaryDirectory(prefix="ddtree-bench-scale-") as tmp:
            print(json.dumps(measure_size(args.one, plan, Path(tmp)).to_dict()))
        return 0
    sizes = [int(x) for x in args.sizes.split(",")]
    load_before = os.getloadavg()
    runs = []
    for rep in range(args.repeats):
        for n in sizes:
            runs.append(run_in_subprocess(n, plan))
            r = runs[-1]
            print(f"run {rep + 1}: {n} hosts: deploy {r['deploy']['wall_s']:.1f} s wall {r['deploy']['cpu_s']:.2f} s "
                  f"CPU, rollback {r['rollback']['wall_s']:.1f} s wall {r['rollback']['cpu_s']:.2f} s CPU, "
                  f"maxrss {r['maxrss_kib'] / 1024:.0f} MiB, threads {r['peaks']['os_threads']}", file=sys.stderr)
    doc = {"benchmark": "controller scale on fake hosts (in-process)",
           "command": "bench/bench_controller_scale.py " + " ".join(sys.argv[1:]),
           "plan": asdict(plan), "repeats": args.repeats, "health": FAST_HEALTH,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                       "loadavg_before": [round(x, 2) for x in load_before],
                       "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "summary": summarize(runs), "runs": runs}
    doc["limits"] = derive_limits(doc["summary"], plan, real_host_numbers(Path(args.real)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "controller_scale.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "controller_scale.md").write_text(render_md(doc))
    print(render_md(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
