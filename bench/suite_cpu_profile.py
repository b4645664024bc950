"""The suite's CPU, per test, with everything each test starts counted with it.

As a pytest plugin (root, cgroup v1 with cpuacct mounted at /sys/fs/cgroup/cpuacct):

    DDTREE_OPS_CPU_PROFILE=/tmp/prof PYTHONPATH=bench .venv/bin/python -m pytest -p suite_cpu_profile ...
    .venv/bin/python bench/suite_cpu_profile.py /tmp/prof     # CPU-s by file, then the top tests

Each xdist worker moves itself into a cpuacct cgroup of its own when it starts, so every process
a test starts (CLI runs, sshd, the agents, stand-in servers, the sandbox hosts' systemd, fork
servers) is counted in it, also after a double fork; the cgroup's usage is read around each
test (setup and teardown included). Processes left running by one test (a module's sandbox, a
session's fork server) are counted with the tests that run while they work. Sampling /proc
instead misses short processes and those not waited for.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import sys
import time

import pytest

CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup/cpuacct/ddtree-ops-suite")
_state: dict = {}


def _usage_s() -> float:
    return int((_state["cgroup"] / "cpuacct.usage").read_text()) / 1e9


def pytest_configure(config):
    out = os.environ.get("DDTREE_OPS_CPU_PROFILE")
    if not out:
        raise pytest.UsageError("suite_cpu_profile: set DDTREE_OPS_CPU_PROFILE to a folder for the results")
    worker = getattr(config, "workerinput", {}).get("workerid", "main")
    cgroup = CGROUP_ROOT / worker
    cgroup.mkdir(parents=True, exist_ok=True)
    (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    pathlib.Path(out).mkdir(parents=True, exist_ok=True)
    _state.update(cgroup=cgroup, worker=worker, out=open(pathlib.Path(out) / f"{worker}.jsonl", "a"))


def pytest_unconfigure(config):
    """Back to the parent cgroup, and the worker's own one removed (the last one out removes the
    root): nothing is left under /sys/fs/cgroup by a finished run."""
    if "cgroup" not in _state:
        return
    _state["out"].close()
    (CGROUP_ROOT.parent / "cgroup.procs").write_text(str(os.getpid()))
    try:
        _state["cgroup"].rmdir()
    except OSError:  # a process a test left running is still in it
        pass
    if _state["worker"] == "main":  # the workers have ended by now: their folders are gone
        for folder in [*CGROUP_ROOT.glob("gw*"), CGROUP_ROOT]:
            try:
                folder.rmdir()
            except OSError:
                pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu0, t0 = _usage_s(), time.time()
    yield
    row = {"worker": _state["worker"], "test": item.nodeid, "cpu_s": round(_usage_s() - cpu0, 3),
           "start": t0, "wall_s": round(time.time() - t0, 3)}
    _state["out"].write(json.dumps(row) + "\n")
    _state["out"].flush()


def summarize(folder: pathlib.Path, top: int = 30) -> str:
    rows = [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().splitlines()]
    by_file = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        entry = by_file[r["test"].split("::")[0]]
        entry[0] += r["cpu_s"]
        entry[1] += r["wall_s"]
        entry[2] += 1
    total = sum(v[0] for v in by_file.values())
    lines = [f"{total:.0f} CPU-s in {len(rows)} tests", "", "CPU-s  worker-s  tests  file"]
    for name, (cpu, wall, n) in sorted(by_file.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{cpu:6.1f}  {wall:8.1f}  {n:5d}  {name}")
    lines += ["", f"top {top} tests", "CPU-s  wall-s  test"]
    for r in sorted(rows, key=lambda r: -r["cpu_s"])[:top]:
        lines.append(f"{r['cpu_s']:6.1f}  {r['wall_s']:6.1f}  {r['test']}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(pathlib.Path(sys.argv[1])))
