#!/usr/bin/env python3
"""DDTree tree construction: the sync-free batched builder vs the paper's heap.

    python bench/bench_builder.py [--quick] [--threads 2,1] [--reps N]

One run, side by side, interleaved rep by rep (so machine noise hits both):

* new:  ``build_ddtree_tree`` + ``compile_ddtree_retrieve`` on the whole batch;
* heap: per request, the paper's best-first heap in Python, including its host
  copy (``.tolist()`` of the top-k inputs) and a Python retrieve compile.

Inputs are per-depth top-k lists already computed (K = budget) from random
draft logits (``randn * 3`` over a 151,936-token vocabulary), depth 15.
Writes bench/results/builder.json and builder.md (medians, ratio heap/new,
torch version, threads, load average).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

# GNU OpenMP busy-waits after every parallel region by default; on a small
# shared machine the spinning worker steals the core the timed code runs on
# (both sides suffer, the numbers become noise). Override from the shell.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.dont_write_bytecode = True  # no __pycache__ inside the patch set (deploy refuses unlisted files)
sys.path.insert(0, str(ROOT / "patches" / "ddtree-temp" / "files"))
sys.path.insert(0, str(ROOT / "bench"))
from bench_payload import heap_build  # noqa: E402  (the paper's heap: one copy)
from sglang.srt.speculative import ddtree_utils as du  # noqa: E402

DEPTH = 15
VOCAB = 151_936
MAIN = (32, 64)
SHAPES = [(32, 64), (1, 16), (1, 256), (8, 16), (8, 256)]


def check_equal(top, budget, tree, enc) -> dict:
    """Our tree vs the heap, per request: identical when the heap's scores have
    no exact ties (the heap sums in float64, we in float32: ties aside)."""
    same = tie = 0
    for b in range(top[0].shape[0]):
        tok, par, first, nxt, sc = heap_build(top[0][b], top[1][b], budget)
        m = len(tok)
        ok_scores = torch.allclose(tree.scores[b, :m].double(), torch.tensor(sc, dtype=torch.float64),
                                   rtol=1e-5, atol=1e-5)
        if len(set(sc[1:])) < m - 1:
            tie += int(ok_scores)
            continue
        assert ok_scores, "scores differ from the heap"
        assert tree.tokens[b, 1:m].tolist() == tok[1:], "tokens differ from the heap"
        assert tree.parents[b, :m].tolist() == par, "parents differ from the heap"
        assert enc.retrive_next_token[b, :m].tolist() == first[:m]
        assert enc.retrive_next_sibling[b, :m].tolist() == nxt[:m]
        same += 1
    return {"identical": same, "tied_same_scores": tie}


def bench_shape(bs: int, budget: int, reps: int, gen: torch.Generator) -> dict:
    logits = torch.randn(bs, DEPTH, VOCAB, generator=gen) * 3
    top = du.draft_topk_logprobs(logits, budget)  # K = budget, sorted
    del logits

    def new():
        tree = du.build_ddtree_tree(top, budget, budget)
        return tree, du.compile_ddtree_retrieve(tree.parents, tree.scores)

    def build_only():
        return du.build_ddtree_tree(top, budget, budget)

    tree_for_compile = build_only()

    def compile_only():
        return du.compile_ddtree_retrieve(tree_for_compile.parents, tree_for_compile.scores)

    def heap():
        for b in range(bs):
            heap_build(top[0][b], top[1][b], budget)

    tree, enc = new()
    check = check_equal(top, budget, tree, enc)
    fns = {"new": new, "heap": heap, "build": build_only, "compile": compile_only}
    for f in fns.values():  # warm-up (plan cache, allocator)
        for _ in range(3):
            f()
    times = {name: [] for name in fns}
    clock = time.perf_counter
    for _ in range(reps):
        for name, f in fns.items():
            t0 = clock()
            f()
            times[name].append((clock() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    q = {k: statistics.quantiles(v, n=10) for k, v in times.items()}
    return {
        "batch": bs, "budget": budget, "depth": DEPTH, "k": budget, "reps": reps,
        "new_ms": round(med["new"], 3), "heap_ms": round(med["heap"], 3),
        "heap_over_new": round(med["heap"] / med["new"], 2),
        "build_ms": round(med["build"], 3), "compile_ms": round(med["compile"], 3),
        "new_p10_p90": [round(q["new"][0], 3), round(q["new"][-1], 3)],
        "heap_p10_p90": [round(q["heap"][0], 3), round(q["heap"][-1], 3)],
        "heap_over_new_min": round(min(times["heap"]) / min(times["new"]), 2),
        "check": check,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="main shape only, 30 reps")
    ap.add_argument("--threads", default=str(torch.get_num_threads()),
                    help="comma-separated torch thread counts (default: what torch gives)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "builder"))
    a = ap.parse_args()
    shapes = [MAIN] if a.quick else SHAPES
    reps = a.reps or (30 if a.quick else 200)
    threads = [int(x) for x in a.threads.split(",")]
    load_before = os.getloadavg()
    rows = []
    for th in threads:
        torch.set_num_threads(th)
        gen = torch.Generator().manual_seed(0)
        for bs, budget in shapes:
            row = dict(threads=th, **bench_shape(bs, budget, reps, gen))
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "threads": threads, "reps": reps, "quick": a.quick,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "command": "python bench/bench_builder.py " + " ".join(sys.argv[1:]),
    }
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    cols = ["threads", "batch", "budget", "new_ms", "heap_ms", "heap_over_new", "build_ms", "compile_ms",
            "new_p10_p90", "heap_p10_p90", "heap_over_new_min"]
    md = [
        "# DDTree builder: sync-free batched build + retrieve vs the paper's heap\n",
        f"`{meta['command']}`\n",
        (f"torch {meta['torch']}, Python {meta['python']}, {meta['cpu_count']} CPUs, "
         f"torch threads {threads}, OMP_WAIT_POLICY={meta['omp_wait_policy']}, depth {DEPTH}, "
         f"K = budget, {reps} interleaved reps; load average {meta['loadavg_before']} -> "
         f"{meta['loadavg_after']}.\n"),
        ("Times in ms per decode step for the whole batch, medians (p10/p90 in brackets). "
         "new = build_ddtree_tree + compile_ddtree_retrieve; heap = per-request Python heap with "
         "its .tolist() host copy and a Python retrieve compile; heap_over_new = ratio of medians "
         "(heap_over_new_min: ratio of the fastest reps); build_ms / compile_ms: the two parts "
         "of new, timed alone.\n"),
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        md.append("| " + " | ".join(str(r[c]) for c in cols) + " |")
    md.append("\nCorrectness (same run): per request, identical tokens/parents/retrieve to the heap "
              "when its scores have no exact ties; else same scores: "
              + "; ".join(f"bs{r['batch']}/b{r['budget']}: {r['check']}" for r in rows if r["threads"] == threads[0]))
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print(f"wrote {out.with_suffix('.json')} and .md")


if __name__ == "__main__":
    main()
