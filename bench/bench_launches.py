#!/usr/bin/env python3
"""Kernel launches of one DDTree decode step's tree work, 2.0 against the working tree, on CPU.

    .venv/bin/python bench/bench_launches.py [--base REV] [--out bench/results]

The real worker step (``tests/payload/worker_fakes.run_case``: SGLang 0.5.23's
pools, ``ForwardBatch``, ``eagle_sample``, the toy target and draft) runs once
per configuration under torch's CPU profiler; ``tests/payload/launch_count.py``
counts the launches of the tree work (the worker's draft top-k and verify input:
everything between the draft forward and the target verify). Side by side in
one run: the patch set at ``--base`` (default: the 2.0 commit, read with ``git
show``: everything eager), and the working tree's patch set with the tree step
replayed from its graph (the CPU stand-in, one launch per replay), and the same with
graphs off (eager). A count, not a time: the same step launches the same
kernels on any machine; what a launch costs on a GPU is not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile
import textwrap
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAYLOAD_TESTS = ROOT / "tests" / "payload"
sys.path.insert(0, str(PAYLOAD_TESTS))
sys.dont_write_bytecode = True

import sglang_env  # noqa: E402

BASE_REV = "7570235"  # the last commit with ddtree-temp 2.0.0
CONFIGS = {
    # CT200 as inventoried: budget 16, topk cap 4, DFlash block 16
    "ct200-b16-k4": {"budget": 16, "cap": 4, "block": 16, "max_prefix": 60},
    # the patch set's default budget
    "b64-k8": {"budget": 64, "cap": 8, "block": 16, "max_prefix": 14},
}
BS = 32


def count(overlay: pathlib.Path, tmp: pathlib.Path, *, graphs: bool) -> dict:
    cases = {}
    for name, c in CONFIGS.items():
        prefixes = [2 + (7 * i) % (c["max_prefix"] - 1) for i in range(BS)]
        case = {"budget": c["budget"], "cap": c["cap"], "block": c["block"], "host_mirror": True,
                "prefixes": prefixes, "ranks": [[0] * (c["block"] - 1)] * BS}
        if graphs:
            case.update(verify_mask_bs=BS, graph_bs=(1, 2, 4, 8, 16, 32))
        cases[name] = case
    code = f"""
    sys.path.insert(0, {str(PAYLOAD_TESTS)!r})
    import worker_fakes as wf  # first: sets TRITON_INTERPRET / SGLANG_NATIVE_MOVE_KV_CACHE
    import torch
    for name, case in {cases!r}.items():
        torch.manual_seed(0)
        out = wf.run_case(model=MODEL, profile=True, **case)
        OUT[name] = out["result"]["launches"]
    """
    # worker_fakes sets TRITON_INTERPRET=1 before its imports: the fork server must know
    return sglang_env.run_sglang(textwrap.dedent(code), tmp, overlay, timeout=1200, triton_interpret=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=BASE_REV)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = pathlib.Path(tmpdir)
        base = sglang_env.patch_set_at(args.base, tmp / "base-patch")
        runs = {}
        t0 = time.time()
        for label, patch_dir, graphs in (("2.0 (eager)", base, False),
                                         ("tree graph", sglang_env.PATCH_DIR, True),
                                         ("tree eager (graphs off)", sglang_env.PATCH_DIR, False)):
            overlay = sglang_env.build_overlay(tmp / f"overlay-{len(runs)}", patch_dir)
            work = tmp / f"work-{len(runs)}"
            work.mkdir()
            runs[label] = count(overlay, work, graphs=graphs)
        seconds = round(time.time() - t0, 1)
    result = {"bs": BS, "configs": CONFIGS, "base_rev": args.base, "runs": runs, "seconds": seconds,
              "machine": {"nproc": os.cpu_count(), "python": platform.python_version()}}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launches.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# Kernel launches of one decode step's tree work (CPU profiler count)",
        "",
        f"`.venv/bin/python bench/bench_launches.py` ({seconds} s, {os.cpu_count()} CPUs). bs {BS};",
        "the real worker step on SGLang 0.5.23's pools with the toy target and draft",
        "(`tests/payload/worker_fakes.py`); counted by `tests/payload/launch_count.py`: the",
        "operators of the draft top-k and the verify input that do work (views and",
        "allocations excluded), a graph replay or an interpreted Triton kernel as one launch.",
        f"2.0 = the patch set at `{args.base}`. A count of launches, not a GPU time.",
        "",
        "| config | 2.0 (eager) | working tree, tree step replayed | working tree, graphs off | replayed / 2.0 |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in CONFIGS:
        old = runs["2.0 (eager)"][name]["launches"]
        new = runs["tree graph"][name]["launches"]
        eager = runs["tree eager (graphs off)"][name]["launches"]
        lines.append(f"| {name} | {old} | {new} | {eager} | {new / old:.3f} |")
    lines += ["", "Outside the graph in the working tree (ct200-b16-k4; the draft top-k eager, "
              "as past the draft graph's batches):", ""]
    lines += [f"- `{op}`: {n}" for op, n in runs["tree graph"]["ct200-b16-k4"]["ops"].items()]
    (out / "launches.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
