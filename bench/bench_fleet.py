#!/usr/bin/env python3
"""Wall time of a rolling deploy to 1, 2, 4 and 8 sandbox hosts (zero weight-loading time).

    python bench/bench_fleet.py [--hosts 1,2,4,8] [--repeats 1] [--canary 0] [--forks 10]

Brings up its own sandbox (8 hosts by default, stand-in servers with --load-seconds 0), then for
each N runs `ddtree-ops deploy --limit <first N hosts> --canary C --json` as a subprocess, exactly
as a pipeline would, alternating two patch sets so that every run really changes every host
(backup, install, restart, health gate, commit). With --canary 0 all N hosts form one parallel
batch, so the numbers show how the per-host work overlaps; with the default canary 1 the canary
host's time is added in front. Writes bench/results/fleet.json and fleet.md; tears the sandbox down.
Needs root and the sandbox prerequisites (see `ddtree-ops sandbox up`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from ddtree_ops.testing.sandbox import Sandbox  # noqa: E402

PROBE = "sglang/srt/speculative/ddtree_probe.py"
DFLASH_INFO = "sglang/srt/speculative/dflash_info.py"


def make_ps(root: Path, tag: str) -> Path:
    from conftest import make_patchset, upstream_file

    return make_patchset(root, {PROBE: f"PROBE = {tag!r}\n".encode(),
                                DFLASH_INFO: upstream_file(DFLASH_INFO) + f"\n# bench {tag}\n".encode()},
                         name=f"bench-{tag}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--canary", type=int, default=0)
    ap.add_argument("--forks", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    sizes = [int(x) for x in args.hosts.split(",")]
    work = Path(tempfile.mkdtemp(prefix="ddtree-bench-fleet-"))
    sb = Sandbox(work / "sandbox")
    rows = []
    try:
        t = time.monotonic()
        sb.up(max(sizes), load_seconds=0.0)
        up_s = time.monotonic() - t
        print(f"sandbox with {max(sizes)} hosts up in {up_s:.1f} s", file=sys.stderr)
        pss = [make_ps(work / "a", "a"), make_ps(work / "b", "b")]
        k = 0
        for n in sizes:
            limit = ",".join(f"sbx{i}" for i in range(1, n + 1))
            walls, per_host = [], []
            for _ in range(args.repeats):
                ps = pss[k % 2]
                k += 1
                t0 = time.monotonic()
                r = subprocess.run([sys.executable, "-m", "ddtree_ops", "deploy", "-i", str(sb.inventory_path),
                                    "--limit", limit, "-p", str(ps), "--canary", str(args.canary),
                                    "--forks", str(args.forks), "--yes", "--json"],
                                   capture_output=True, text=True, cwd=ROOT, stdin=subprocess.DEVNULL)
                wall = time.monotonic() - t0
                doc = json.loads(r.stdout)
                if r.returncode != 0 or doc["exit_code"] != 0:
                    raise SystemExit(f"deploy to {n} hosts failed ({r.returncode}):\n{r.stderr[-3000:]}")
                assert all(h["outcome"] == "deployed" for h in doc["hosts"]), doc
                walls.append(wall)
                per_host.extend(h["seconds"] for h in doc["hosts"])
                print(f"{n} host(s): {wall:.1f} s wall", file=sys.stderr)
            rows.append({"hosts": n, "wall_s": [round(w, 2) for w in walls],
                         "wall_median_s": round(statistics.median(walls), 2),
                         "per_host_median_s": round(statistics.median(per_host), 2),
                         "per_host_max_s": round(max(per_host), 2)})
    finally:
        sb.down()
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    base = rows[0]["wall_median_s"] / rows[0]["hosts"] if rows else 0
    for r in rows:
        r["speedup_vs_sequential"] = round(base * r["hosts"] / r["wall_median_s"], 2) if r["wall_median_s"] else None
    result = {
        "benchmark": "fleet deploy wall time (ddtree-ops deploy --json, subprocess)",
        "canary": args.canary, "forks": args.forks, "repeats": args.repeats, "load_seconds": 0.0,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_after": os.getloadavg()},
        "sandbox_up_s": round(up_s, 1),
        "results": rows,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fleet.json").write_text(json.dumps(result, indent=2) + "\n")
    md = ["# Fleet deploy wall time", "",
          f"`python bench/bench_fleet.py --hosts {args.hosts} --repeats {args.repeats} --canary {args.canary}` "
          f"on {os.cpu_count()} CPUs ({platform.platform()}), sandbox hosts, stand-in servers with zero load time, "
          f"--forks {args.forks}. Wall time of the whole `ddtree-ops deploy` process; per host: the "
          "host's own deploy (lock → commit). 'speedup' = N × (1-host time) / N-host time.", "",
          "| hosts | wall (median) s | per host median s | per host max s | speedup vs sequential |",
          "| ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        md.append(f"| {r['hosts']} | {r['wall_median_s']:.1f} | {r['per_host_median_s']:.1f} | "
                  f"{r['per_host_max_s']:.1f} | {r['speedup_vs_sequential']} |")
    md += ["", "The sandbox hosts share this machine's CPUs (every host runs sshd, the systemctl "
           "replacement and a Python stand-in server), so beyond the CPU count the per-host time grows: "
           "on real GPU hosts the per-host work runs on the hosts and only the SSH round trips are local.", ""]
    (out / "fleet.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
