#!/usr/bin/env python3
"""Per-decode-step cost of the DDTree payload: build + retrieve (+ mask and
positions) + sampled verify, vs a per-request heap builder like the paper's.

    python bench/bench_payload.py [--quick] [--device cpu|cuda|all]

Writes bench/results/payload.json and payload.md. Depth 15 (block 16), vocab
151,936. The sampled verify materialises target and draft probabilities
[bs, budget+1, V] float32 as SGLang's path does; on CPU the configurations
whose two tensors exceed --max-sample-gb are skipped (reported as such).
"""

from __future__ import annotations

import argparse
import heapq
import json
import pathlib
import platform
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.dont_write_bytecode = True  # no __pycache__ inside the patch set (deploy refuses unlisted files)
sys.path.insert(0, str(ROOT / "patches" / "ddtree-temp" / "files"))
from sglang.srt.speculative import ddtree_utils as du  # noqa: E402

DEPTH = 15
VOCAB = 151_936


def heap_build(top_lp: torch.Tensor, top_ids: torch.Tensor, budget: int):
    """The paper's best-first heap for one request, plus a Python retrieve
    compile (first child / next sibling); inputs are per-depth top-k lists.
    Returns (tokens, parents, first child, next sibling, scores); bench_builder
    and gpu_kernels use this one copy."""
    vals = top_lp.tolist()
    ids = top_ids.tolist()
    L, K = len(vals), len(vals[0])
    tok, par, sc = [0], [-1], [0.0]
    heap = [(-vals[0][0], (0,), 0)]
    while heap and len(tok) - 1 < budget:
        neg, ranks, parent = heapq.heappop(heap)
        idx = len(tok)
        d = len(ranks)
        tok.append(ids[d - 1][ranks[-1]])
        par.append(parent)
        sc.append(-neg)
        if ranks[-1] + 1 < K:
            heapq.heappush(heap, (neg + vals[d - 1][ranks[-1]] - vals[d - 1][ranks[-1] + 1],
                                  ranks[:-1] + (ranks[-1] + 1,), parent))
        if d < L:
            heapq.heappush(heap, (neg - vals[d][0], ranks + (0,), idx))
    n = budget + 1
    first = [-1] * n
    nxt = [-1] * n
    last = [-1] * n
    for i in range(1, len(tok)):  # nodes come out in score order: siblings too
        p = par[i]
        if first[p] == -1:
            first[p] = i
        else:
            nxt[last[p]] = i
        last[p] = i
    return tok, par, first, nxt, sc


def timeit(fn, sync, reps, warm=1):
    for _ in range(warm):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t) / reps * 1e3


def run(device: str, batches, budgets, reps, max_sample_gb):
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for bs in batches:
        draft_logits = torch.randn(bs, DEPTH, VOCAB, device=dev, generator=g) * 3
        for budget in budgets:
            k = budget
            seq_lens = torch.full((bs,), 1000, device=dev)

            def topk(draft_logits=draft_logits, k=k):
                return du.draft_topk_logprobs(draft_logits, k)

            top = topk()

            def build(top=top, budget=budget, seq_lens=seq_lens):
                tree = du.build_ddtree_tree(top, budget, budget)
                enc = du.compile_ddtree_retrieve(tree.parents, tree.scores)
                du.ddtree_positions(tree.depths, seq_lens)
                du.ddtree_tree_mask(tree.parents, max_depth=DEPTH)
                return tree, enc

            t_topk = timeit(topk, sync, reps)
            t_build = timeit(build, sync, reps)
            top_cpu = (top[0].cpu(), top[1].cpu())

            def heap_all(bs=bs, top_cpu=top_cpu, budget=budget):
                for b in range(bs):
                    heap_build(top_cpu[0][b], top_cpu[1][b], budget)

            t_heap = timeit(heap_all, sync, max(1, reps // 2)) + (
                t_topk if dev.type == "cpu" else t_topk)  # heap also needs the top-k
            tree, enc = build()
            n = budget + 1
            gb = 2 * bs * n * VOCAB * 4 / 1e9
            t_sample = None
            if dev.type == "cuda" or gb <= max_sample_gb:
                logits = torch.randn(bs, n, VOCAB, device=dev, generator=g)
                temps = torch.full((bs,), 0.8, device=dev)
                top_ps = torch.full((bs,), 0.95, device=dev)

                def sample(logits=logits, tree=tree, enc=enc, temps=temps, top_ps=top_ps):
                    du.ddtree_sample_tree_paths(logits, tree.tokens, enc, temps, None, top_ps,
                                                max_accept=DEPTH, generator=g)

                t_sample = timeit(sample, sync, max(1, reps // 2))
                del logits
            row = dict(device=device, batch=bs, budget=budget, depth=DEPTH, vocab=VOCAB,
                       topk_ms=round(t_topk, 3), build_retrieve_mask_ms=round(t_build, 3),
                       ddtree_build_total_ms=round(t_topk + t_build, 3),
                       heap_build_total_ms=round(t_heap, 3),
                       heap_over_ddtree=round(t_heap / (t_topk + t_build), 2),
                       heap_over_ddtree_excl_topk=round((t_heap - t_topk) / t_build, 2),
                       sampling_ms=None if t_sample is None else round(t_sample, 3),
                       step_total_ms=None if t_sample is None else round(t_topk + t_build + t_sample, 3))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="batch {1,8}, budget {16,64}, 2 reps")
    ap.add_argument("--device", default="all", choices=["cpu", "cuda", "all"])
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--max-sample-gb", type=float, default=3.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "payload"))
    a = ap.parse_args()
    batches = [1, 8] if a.quick else [1, 8, 32]
    budgets = [16, 64] if a.quick else [16, 64, 256]
    reps = a.reps or (2 if a.quick else 5)
    devices = ["cpu"] if a.device == "cpu" else ["cuda"] if a.device == "cuda" else (
        ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    for d in devices:
        rows += run(d, batches, budgets, reps, a.max_sample_gb)
    meta = dict(torch=torch.__version__, python=platform.python_version(), machine=platform.machine(),
                threads=torch.get_num_threads(), quick=a.quick, reps=reps,
                cuda=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    cols = ["device", "batch", "budget", "topk_ms", "build_retrieve_mask_ms", "heap_build_total_ms",
            "heap_over_ddtree", "heap_over_ddtree_excl_topk", "sampling_ms", "step_total_ms"]
    md = [f"# DDTree payload per-step cost\n\n{json.dumps(meta)}\n", "| " + " | ".join(cols) + " |",
          "|" + "---|" * len(cols)]
    for r in rows:
        md.append("| " + " | ".join("skipped (memory)" if r[c] is None else str(r[c]) for c in cols) + " |")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print(f"wrote {out.with_suffix('.json')} and .md")


if __name__ == "__main__":
    main()
