#!/usr/bin/env python3
"""What a real `nvidia-smi` says about GPU memory holders, read by our own code.

The deploy asks the host's nvidia-smi who holds GPU memory (`ddtree_ops.host.gpus.QUERY`), tells our
units' processes from strangers by their ancestry (`gpus.of_our_units`, the agent's
`_ancestors`), and after a stop waits until the old server's memory is given back. The sandbox's
nvidia-smi is a script; this runs the same functions against the driver's, on the lent GPU
machine (no torch needed: the CUDA driver API through ctypes):

    python3 bench/gpu_nvidia_smi_check.py --out DIR      # writes DIR/gpu_nvidia_smi.json

A "unit" process starts a worker child that allocates 2 GiB (as SGLang's scheduler children hold
the memory, not the main process), and a double-forked leftover allocates 1 GiB and outlives the
unit (an orphan). Checked: the output parses, the worker counts as the unit's and the orphan as a
stranger, and how long after the unit's SIGTERM the driver stops listing the worker.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ddtree_ops.host.agent.procs import proc_ancestors as _ancestors  # noqa: E402
from ddtree_ops.host.agent.procs import proc_cmdline as _cmdline  # noqa: E402
from ddtree_ops.host.gpus import QUERY, foreign_apps, parse_gpu_apps  # noqa: E402

MARKER = "PR_SET_PDEATHSIG: die with the unit"  # in every command line this script starts

# A process holding `mib` of device memory until it is ended (or its parent is, with PDEATHSIG).
HOLDER = r"""
import ctypes, signal, sys, time
mib, follow_parent = int(sys.argv[1]), sys.argv[2] == "1"
if follow_parent:
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: die with the unit
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
dev = ctypes.c_int(); assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
ctx = ctypes.c_void_p(); assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
ptr = ctypes.c_uint64(); assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(mib << 20)) == 0
assert cuda.cuMemsetD8_v2(ptr, 1, ctypes.c_size_t(mib << 20)) == 0
print("ready", flush=True)
while True:
    time.sleep(1)
"""

# The unit's main process: starts the worker child and waits (SIGTERM ends both).
UNIT = r"""
import subprocess, sys, signal, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], "2048", "1"], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
signal.signal(signal.SIGTERM, lambda *a: (child.terminate(), child.wait(), sys.exit(0)))
while True:
    time.sleep(1)
"""

# A leftover outside the unit: double fork, so it is nobody's child; holds 1 GiB until killed.
ORPHAN = r"""
import os, subprocess, sys
if os.fork():
    os._exit(0)
os.setsid()
p = subprocess.Popen([sys.executable, "-c", sys.argv[1], "1024", "0"], stdin=subprocess.DEVNULL,
                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
assert p.stdout.readline().strip() == "ready"
print(p.pid, flush=True)
os._exit(0)
"""


def query() -> tuple[str, float]:
    t0 = time.monotonic()
    out = subprocess.run(QUERY, check=True, capture_output=True, text=True).stdout
    return out, time.monotonic() - t0


def wait_gone(pid: int, limit_s: float = 30.0) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if pid not in {a.pid for a in parse_gpu_apps(query()[0])}:
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def end_leftovers() -> list[int]:
    """End this script's processes left by an earlier run of it that failed (machine kept warm):
    found by the marker in their command line, so nothing else is touched."""
    ended = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid() and MARKER in _cmdline_full(int(d)):
            try:
                os.kill(int(d), signal.SIGKILL)
                ended.append(int(d))
            except ProcessLookupError:
                pass
    return ended


def _cmdline_full(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    res: dict = {"ended_leftovers": end_leftovers()}
    time.sleep(0.5 if res["ended_leftovers"] else 0)
    res["nvidia_smi_version"] = subprocess.run(["nvidia-smi", "--version"], capture_output=True,
                                               text=True).stdout.strip().splitlines()
    res["idle_raw"], _ = query()
    times = [query()[1] for _ in range(10)]
    res["query_seconds"] = {"min": min(times), "max": max(times), "mean": sum(times) / len(times)}

    unit = subprocess.Popen([sys.executable, "-c", UNIT, HOLDER], stdout=subprocess.PIPE, text=True)
    worker = int(unit.stdout.readline())
    orphan_out = subprocess.run([sys.executable, "-c", ORPHAN, HOLDER], capture_output=True, text=True, timeout=60)
    orphan = int(orphan_out.stdout.split()[0])
    try:
        raw, _ = query()
        apps = parse_gpu_apps(raw)
        procs = {str(a.pid): {"cmd": _cmdline(a.pid), "ancestors": _ancestors(a.pid)}
                 for a in apps if os.path.isdir(f"/proc/{a.pid}")}
        strangers = foreign_apps(apps, procs, {unit.pid})
        res.update({
            "busy_raw": raw, "unit_pid": unit.pid, "worker_pid": worker, "orphan_pid": orphan,
            "parsed": [a.__dict__ for a in apps], "procs": procs,
            "strangers": [a.pid for a in strangers],
            "worker_listed": worker in {a.pid for a in apps},
            "orphan_listed": orphan in {a.pid for a in apps},
            "worker_is_ours": worker in {a.pid for a in apps} and worker not in {a.pid for a in strangers},
            "orphan_is_stranger": orphan in {a.pid for a in strangers},
            "pids_in_our_namespace": all(os.path.isdir(f"/proc/{a.pid}") for a in apps),
        })
        unit.send_signal(signal.SIGTERM)
        unit.wait(timeout=30)
        res["worker_gone_after_unit_stop_s"] = wait_gone(worker)
        res["orphan_still_listed_after_unit_stop"] = orphan in {a.pid for a in parse_gpu_apps(query()[0])}
    finally:
        if unit.poll() is None:
            unit.kill()
        try:
            os.kill(orphan, signal.SIGKILL)
        except ProcessLookupError:
            pass
    res["orphan_gone_after_kill_s"] = wait_gone(orphan)
    res["ok"] = bool(res.get("worker_is_ours") and res.get("orphan_is_stranger")
                     and res.get("worker_gone_after_unit_stop_s") is not None
                     and res.get("orphan_still_listed_after_unit_stop"))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_nvidia_smi.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(res, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
