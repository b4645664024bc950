#!/usr/bin/env python3
"""What one decode step costs beyond the model, DFLASH against DDTREE, at TP 2 on a CPU.

    .venv/bin/python bench/bench_step_cost.py [--json] [--out bench/results] [--batches 1,8]
        [--temperatures 0,0.7] [--steps 3] [--patch-rev REV]

Side by side in one run: SGLang 0.5.23's DFLASH step (the pristine wheel), the patch set's
DDTREE step at budget 16 / top-k cap 4 (CT200's) and DDTREE as a chain (budget 15, cap 1: one
node per depth, DFLASH's block), each as ``tp`` real processes over gloo on 127.0.0.1
(bench/step_cost_rank.py: the real workers on toy models, counted by bench/step_counters.py).
Per step, every step but the first of each case (same counts each step): kernel launches
outside CUDA graphs, collectives (count and bytes this rank sends, by kind), host syncs.
``--patch-rev REV`` runs the DDTREE rows on the patch set committed at REV instead of the
working tree (the tests' control: 2.1).

Targets (checked here and in tests/payload/test_step_cost.py), per batch and temperature:

* collective bytes: DDTREE <= DFLASH's verify-side bytes (everything outside its draft graph:
  the row maxima or the full logits, the prediction broadcast; each per verified token) x
  ``W / block`` (the tree verifies ``W = budget + 1`` tokens, 17 at budget 16, where DFLASH
  verifies its block of 16) + the tree's top-k exchange in place of DFLASH's in-graph greedy
  head, ``bs * (block - 1) * (2k + 1) * 4`` bytes per rank (k values, k ids and one
  log-sum-exp per draft row, float32, one all-gather); a sampled step also sends its tree walk:
  SGLang's ``eagle_sample`` broadcasts ``predict`` [bs*W], ``accept_index`` [bs, S] and the counts
  (int32) where DFLASH broadcasts an accept length and a bonus per request, ``4 bs (W + S + 2) -
  12 bs`` bytes more (only the path, its length and the last token are rank 0's decision: a walk
  broadcasting those alone would send ``4 bs (W - 2)`` less; eagle_sample is SGLang's own);
* launches outside graphs: DDTREE <= DFLASH + 10;
* host syncs: 0;
* the chain commits exactly DFLASH's tokens (greedy: the same argmax walk; sampled rows draw
  their coins in a different kernel, so only their count of steps is compared).

A count, not a time: what a launch or a byte costs on a GPU is not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "payload"))
sys.dont_write_bytecode = True

import sglang_env  # noqa: E402

BLOCK = 16
TP = 2
ALGORITHMS = {  # name -> (budget, top-k cap); DFLASH has neither
    "DFLASH": (None, None),
    "DDTREE": (16, 4),
    "DDTREE-chain": (BLOCK - 1, 1),
}
LAUNCH_SLACK = 10


class RankFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(algorithm: str, cases: list, *, steps: int, overlay, work: pathlib.Path,
              timeout: float) -> list:
    """``TP`` rank processes of one algorithm, side by side; returns each rank's output. Each
    is forked from the tests' sglang fork server (tests/payload/sglang_env.py: torch, triton
    and transformers already imported, with TRITON_INTERPRET=1 as the ranks need), so a rank
    costs its SGLang import and its steps only."""
    budget, cap = ALGORITHMS[algorithm]
    model = work / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "block_size": BLOCK}))
    # run_sglang(triton_interpret=True)'s environment: the same fork server as the payload tests
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore",
               TRITON_INTERPRET="1")
    env.pop("PYTHONPATH", None)
    if overlay is not None:
        env["PYTHONPATH"] = str(overlay)
    port = free_port()
    outs, results = [], [None] * TP
    rank_py = ROOT / "bench" / "step_cost_rank.py"

    def one(rank: int, script: str) -> None:
        try:
            if os.environ.get("DDTREE_SGLANG_FORKSERVER", "1") == "0":
                results[rank] = subprocess.run([str(sglang_env.PY), "-c", script], capture_output=True, text=True,
                                               timeout=timeout, cwd=work, env=env)
            else:
                results[rank] = sglang_env.fork_server(env).run(script, work, env, timeout)
        except (subprocess.TimeoutExpired, RuntimeError) as exc:
            results[rank] = exc

    threads = []
    for rank in range(TP):
        spec = {"algorithm": "DFLASH" if algorithm == "DFLASH" else "DDTREE", "budget": budget,
                "topk_cap": cap, "tp": TP, "rank": rank, "port": port, "model": str(model),
                "steps": steps, "cases": cases}
        spec_path, out_path = work / f"spec{rank}.json", work / f"out{rank}.json"
        spec_path.write_text(json.dumps(spec))
        outs.append(out_path)
        script = (f"import runpy, sys\nsys.argv = [{str(rank_py)!r}, {str(spec_path)!r}, {str(out_path)!r}]\n"
                  f"runpy.run_path({str(rank_py)!r}, run_name='__main__')\n")
        threads.append(threading.Thread(target=one, args=(rank, script), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join()
    for rank, r in enumerate(results):
        if isinstance(r, Exception):
            raise RankFailed(f"{algorithm}: rank {rank}: {r}")
        if r.returncode != 0:
            raise RankFailed(f"{algorithm}: rank {rank} exited {r.returncode}:\n{(r.stdout + r.stderr)[-4000:]}")
    return [json.loads(o.read_text()) for o in outs]


def rows_of(algorithm: str, ranks: list) -> list:
    """One row per case: rank 0's counts, checked to be every rank's."""
    rows = []
    for i, case in enumerate(ranks[0]["cases"]):
        steps = case["counts"]
        for other in ranks[1:]:
            mine = [{k: c[k] for k in ("collectives", "collective_bytes")} for c in other["cases"][i]["counts"]]
            assert mine == [{k: c[k] for k in ("collectives", "collective_bytes")} for c in steps], \
                f"{algorithm}: the ranks disagree on their collectives"
            assert other["cases"][i]["committed"] == case["committed"], f"{algorithm}: the ranks committed differently"
        last = steps[-1]
        rows.append({
            "algorithm": algorithm, "batch": case["batch"], "temperature": case["temperature"], "tp": TP,
            "budget": ALGORITHMS[algorithm][0], "topk_cap": ALGORITHMS[algorithm][1],
            "verify_width": case["verify_width"],
            "launches_outside_graphs": max(c["launches_outside_graphs"] for c in steps),
            "collectives": sum(last["collectives"].values()),
            "collective_bytes": sum(last["collective_bytes"].values()),
            "host_syncs": max(c["host_syncs"] for c in steps),
            "collective_bytes_in_graphs": last["collective_bytes_in_graphs"],
            "collectives_by_kind": last["collectives"], "collective_bytes_by_kind": last["collective_bytes"],
            "graph_replays": last["graph_replays"], "launches_by_phase": last["launches_by_phase"],
            "host_sync_sites": last["host_sync_sites"], "ops": last["ops"],
            "committed_tokens": sum(len(toks) for step in case["committed"] for toks in step),
            "committed": case["committed"],
        })
    return rows


def topk_exchange_bytes(batch: int, k: int) -> int:
    return batch * (BLOCK - 1) * (2 * k + 1) * 4


def walk_broadcast_bytes(batch: int, width: int, depth: int) -> int:
    """What a sampled tree walk broadcasts beyond DFLASH's sampled accept: SGLang's
    ``eagle_sample`` sends its walk from rank 0 (int32 ``predict`` [bs*W], ``accept_index``
    [bs, S], the accepted counts [bs]; S = max depth + 1) where DFLASH sends its accept length
    (int32) and bonus (int64) per request."""
    return 4 * batch * (width + depth + 2) - 12 * batch


def allowed_bytes(dflash: dict, width: int, batch: int, k: int, *, depth: int = 0, sampled: bool = False) -> int:
    """DDTREE's byte budget: DFLASH's collectives outside its draft graph (the verify's: the
    row maxima or the full logits, the prediction broadcast; per verified token) at the
    tree's verify width instead of DFLASH's block, plus the tree's top-k exchange in place
    of DFLASH's draft-graph head (its greedy maxima and ids), plus, for a sampled step, the
    tree walk's broadcast beyond DFLASH's chain walk's (:func:`walk_broadcast_bytes`)."""
    verify = dflash["collective_bytes"] - dflash["collective_bytes_in_graphs"]
    walk = walk_broadcast_bytes(batch, width, depth) if sampled else 0
    return -(-verify * width // BLOCK) + topk_exchange_bytes(batch, k) + walk


def check_targets(rows: list) -> list:
    """The issue's targets, one line each: ``(ok, text)``."""
    by = {(r["algorithm"], r["batch"], r["temperature"]): r for r in rows}
    out = []
    for (algo, bs, temp), r in sorted(by.items()):
        if algo == "DFLASH":
            out.append((r["host_syncs"] == 0, f"DFLASH bs {bs} T {temp}: {r['host_syncs']} host syncs"))
            continue
        base = by.get(("DFLASH", bs, temp))
        if base is None:  # no DFLASH row to judge against (a DDTREE-only run)
            continue
        depth = min(r["budget"], BLOCK - 1)
        allow = allowed_bytes(base, r["verify_width"], bs, r["topk_cap"], depth=depth, sampled=temp > 0)
        walk = f" + walk {walk_broadcast_bytes(bs, r['verify_width'], depth)}" if temp > 0 else ""
        out.append((r["collective_bytes"] <= allow,
                    f"{algo} bs {bs} T {temp}: collective bytes {r['collective_bytes']} <= {allow} (DFLASH's "
                    f"{base['collective_bytes'] - base['collective_bytes_in_graphs']} outside its draft graph x "
                    f"{r['verify_width']}/{BLOCK} + top-k {topk_exchange_bytes(bs, r['topk_cap'])}{walk})"))
        out.append((r["launches_outside_graphs"] <= base["launches_outside_graphs"] + LAUNCH_SLACK,
                    f"{algo} bs {bs} T {temp}: launches {r['launches_outside_graphs']} <= DFLASH "
                    f"{base['launches_outside_graphs']} + {LAUNCH_SLACK}"))
        out.append((r["host_syncs"] == 0, f"{algo} bs {bs} T {temp}: {r['host_syncs']} host syncs"))
        if algo == "DDTREE-chain" and temp == 0:
            out.append((r["committed"] == base["committed"],
                        f"DDTREE-chain bs {bs} greedy: commits DFLASH's tokens "
                        f"({r['committed_tokens']} vs {base['committed_tokens']} tokens)"))
    return out


def run(*, batches, temperatures, steps: int, patch_rev: str | None, algorithms=tuple(ALGORITHMS),
        timeout: float = 600) -> dict:
    cases = [{"batch": b, "temperature": t} for b in batches for t in temperatures]
    t0 = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="step-cost-") as tmpdir:
        tmp = pathlib.Path(tmpdir)
        patch_dir = sglang_env.patch_set_at(patch_rev, tmp / "patch") if patch_rev else sglang_env.PATCH_DIR
        overlay = sglang_env.build_overlay(tmp / "overlay", patch_dir)
        for algo in algorithms:
            work = tmp / algo
            work.mkdir()
            ranks = run_ranks(algo, cases, steps=steps, overlay=None if algo == "DFLASH" else overlay,
                              work=work, timeout=timeout)
            rows += rows_of(algo, ranks)
    return {"rows": rows, "targets": [{"ok": ok, "check": text} for ok, text in check_targets(rows)],
            "seconds": round(time.time() - t0, 1), "steps": steps, "patch_rev": patch_rev,
            "machine": {"nproc": os.cpu_count(), "python": platform.python_version()}}


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [
        "# One decode step beyond the model: DFLASH against DDTREE, TP 2 over gloo (CPU counts)",
        "",
        f"`.venv/bin/python bench/bench_step_cost.py` ({result['seconds']} s, {result['machine']['nproc']} CPUs,"
        f" {result['steps']} steps per case, the first not counted; patch set: "
        f"{result['patch_rev'] or 'working tree'}). Real workers (DFLASH: the pristine 0.5.23 wheel; DDTREE: the",
        "patch set) on toy models, 2 processes over gloo; launches = aten operators that do work",
        "outside CUDA graphs, a graph replay, an interpreted Triton kernel or a one-kernel",
        "stand-in counted once, plus each collective outside a graph. Bytes: what one rank sends.",
        "",
        "| algorithm | batch | T | launches outside graphs | collectives | bytes | host syncs | tokens committed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(rows, key=lambda r: (r["batch"], r["temperature"], r["algorithm"])):
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r["collectives_by_kind"].items()))
        lines.append(f"| {r['algorithm']} | {r['batch']} | {r['temperature']} | {r['launches_outside_graphs']} | "
                     f"{r['collectives']} ({kinds}) | {r['collective_bytes']} | {r['host_syncs']} | "
                     f"{r['committed_tokens']} |")
    lines += ["", "Targets:", ""]
    lines += [f"- {'ok' if t['ok'] else '**MISSED**'}: {t['check']}" for t in result["targets"]]
    lines += ["", "The byte budget: DFLASH's bytes outside its draft graph at the tree's verify width, the",
              "tree's top-k exchange, and for a sampled step the tree walk's broadcast (SGLang's",
              "`eagle_sample` sends `predict` [bs*W], `accept_index` [bs, S] and the counts, int32, where",
              "DFLASH sends an accept length and a bonus per request: 992 B more at bs 8, 0.05 % of the",
              "step's bytes, which are the full-logits gather both take). Tokens committed are the toy",
              "models', not a forecast: the toy draft spreads its mass over three tokens per depth, so a",
              "16-node tree reaches less deep than DFLASH's 15-deep chain; the chain commits DFLASH's tokens.",
              "", "Launches by phase (bs 8, T 0):", ""]
    for r in rows:
        if r["batch"] == max(x["batch"] for x in rows) and r["temperature"] == 0:
            phases = ", ".join(f"{k} {n}" for k, n in r["launches_by_phase"].items())
            lines.append(f"- {r['algorithm']}: {phases}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--out", help="write step_cost.{md,json} to this folder")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--patch-rev")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    args = ap.parse_args()
    result = run(batches=[int(b) for b in args.batches.split(",")],
                 temperatures=[float(t) for t in args.temperatures.split(",")],
                 steps=args.steps, patch_rev=args.patch_rev, algorithms=tuple(args.algorithms.split(",")))
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "step_cost.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "step_cost.md").write_text(markdown(result))
    if args.json:
        print(json.dumps(result["rows"], indent=1))
    else:
        print(markdown(result))
    return 0 if all(t["ok"] for t in result["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
