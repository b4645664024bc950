#!/usr/bin/env python3
"""The tool's own overhead for deploy and for rollback on one sandbox host, zero load time.

Runs deploy → rollback N times against one sandbox host whose stand-in server loads in 0 s, so
what is measured is ddtree-ops itself (SSH round trips, backup, install, systemctl, polling).
Reports the median and spread of the wall time and the median time per step, and writes
bench/results/deploy.json and deploy.md. Needs root (sandbox).

    .venv/bin/python bench/bench_deploy.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ddtree_ops.testing.sandbox import Sandbox  # noqa: E402


def cli(*args: str) -> tuple[float, dict]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ddtree_ops", *args, "--yes", "--json"], capture_output=True,
                       text=True, cwd=ROOT)
    took = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"{args[0]} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return took, json.loads(r.stdout)


def step_durations(doc: dict) -> dict[str, float]:
    steps = doc["hosts"][0]["steps"]
    out = {}
    for a, b in zip(steps, steps[1:], strict=False):
        out[a["step"]] = out.get(a["step"], 0.0) + (b["t"] - a["t"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--patchset", default="ddtree-temp")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ddtree-bench-") as tmp:
        sb = Sandbox(Path(tmp) / "sb")
        sb.up(1, load_seconds=0.0)
        inv = str(sb.inventory_path)
        try:
            deploys, rollbacks, steps = [], [], []
            for i in range(args.runs):
                t, doc = cli("deploy", "-i", inv, "-p", args.patchset, "--budget", str(16 + i))
                deploys.append(t)
                steps.append(step_durations(doc))
                t, _ = cli("rollback", "-i", inv)
                rollbacks.append(t)
        finally:
            sb.down()
    names = list(steps[0])
    per_step = {n: statistics.median(s.get(n, 0.0) for s in steps) for n in names}
    result = {
        "runs": args.runs, "patchset": args.patchset, "host_load_seconds": 0.0,
        "deploy_s": {"median": statistics.median(deploys), "min": min(deploys), "max": max(deploys), "all": deploys},
        "rollback_s": {"median": statistics.median(rollbacks), "min": min(rollbacks), "max": max(rollbacks),
                       "all": rollbacks},
        "deploy_step_median_s": per_step,
        "machine": {"cpus": __import__("os").cpu_count()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "deploy.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# deploy / rollback overhead, 1 sandbox host, zero load time ({args.runs} runs, {result['when']})", "",
             "| operation | median s | min s | max s |", "| --- | --- | --- | --- |",
             f"| deploy (whole CLI run) | {result['deploy_s']['median']:.2f} | {min(deploys):.2f} "
             f"| {max(deploys):.2f} |",
             f"| rollback (whole CLI run) | {result['rollback_s']['median']:.2f} | {min(rollbacks):.2f} "
             f"| {max(rollbacks):.2f} |",
             "", "| deploy step | median s |", "| --- | --- |"]
    lines += [f"| {n} | {v:.2f} |" for n, v in per_step.items()]
    (out / "deploy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
