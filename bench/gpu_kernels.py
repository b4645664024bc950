#!/usr/bin/env python3
"""GPU checks of the DDTree payload, sized for one lent H200 (issue item 6a).

    # on the GPU machine (bench/gpu_kernels_prepare.sh staged bench/.gpu_carry
    # and prints this line; carry that folder with the call):
    python3 -m pip install --no-index --no-deps --find-links bench/.gpu_carry apache-tvm-ffi==0.1.11 && \
        PYTHONUNBUFFERED=1 python3 bench/gpu_kernels.py --carry bench/.gpu_carry --out $OUT
    # anywhere, CPU only (small shapes; CUDA-graph and kernel parts are skipped):
    python bench/gpu_kernels.py --cpu-smoke --out /tmp/gk
    # with nvcc and tvm_ffi but no GPU: only build and load the two kernels
    python bench/gpu_kernels.py --compile-only --arch 90a --out /tmp/gk

Steps (each one recorded as ok / failed (with its error) / skipped (with why)):

0. ``builder_eager`` / ``reference_test_vector``: the builder's first call (it
   caches a per-shape plan; its host syncs are counted under sync-debug "warn")
   with structural checks, and the reference on the published test vector.
1. ``graph_capture``: the builder (``draft_topk_logprobs`` + ``build_ddtree_tree``),
   ``compile_ddtree_retrieve``, ``ddtree_positions`` and ``ddtree_tree_mask`` run
   once eagerly and are captured in a CUDA graph, both with
   ``torch.cuda.set_sync_debug_mode("error")`` active (any host sync raises);
   the graph is replayed on fresh inputs (outputs poisoned first) and compared
   with an eager run (``torch.equal``).
2. ``timing``: build + retrieve at bs 32, budget 64, depth 15, vocab 151,936 via
   CUDA-graph replay timed with CUDA events, with and without the per-depth top-k
   from the logits, beside the paper's heap (``heap_build`` from
   bench/bench_payload.py) including the device->host copy of its top-k inputs;
   ratios. A few other sizes follow if time allows.
3. ``kernel_build``: JIT-compiles SGLang 0.5.23's own
   ``tree_speculative_sampling_target_only`` (module ``speculative_sampling``,
   ``speculative/sampling.cuh`` + flashinfer's sampling headers) and
   ``verify_tree_greedy`` (module ``speculative_tree``, ``speculative/tree.cuh``)
   from the wheel's sources carried in ``--carry``, the way
   ``sglang.kernels.jit.utils.load_jit`` does (same generated wrapper, same nvcc
   flags), loaded with ``tvm_ffi.load_module``. The compiles start in the
   background at start-up.
4. ``kernel_test_vector``, ``kernel_sampling_vs_reference``,
   ``kernel_greedy_vs_reference``: the kernels against the published test vector
   and against ``tree_speculative_sampling_reference`` /
   ``verify_tree_greedy_reference`` on many random trees built by the payload's
   builder, with shared coins: predicts, accept_index, accept_token_num (and the
   mutated draft_probs) must be equal.

Results: ``<out>/gpu_kernels.json`` and ``gpu_kernels.md`` (rewritten after every
step, so a run cut short still leaves what it measured); compiler output in
``gpu_kernels_build.log``. No number is made up: a step that fails is recorded
as failed with its error.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import itertools
import json
import math
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAYLOAD_FILES = ROOT / "patches" / "ddtree-temp" / "files"
DDTREE_UTILS = PAYLOAD_FILES / "sglang" / "srt" / "speculative" / "ddtree_utils.py"


def _load_ddtree_utils():
    """The checkout's payload module by file (stdlib + torch only), so an
    installed sglang can never stand in for it."""
    spec = importlib.util.spec_from_file_location("ddtree_utils_payload", DDTREE_UTILS)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


du = _load_ddtree_utils()
sys.dont_write_bytecode = True  # no __pycache__ inside the patch set (deploy refuses unlisted files)
sys.path.insert(0, str(PAYLOAD_FILES))
sys.path.insert(0, str(ROOT / "bench"))
try:  # the paper's heap; bench_payload is maintained beside this file
    from bench_payload import heap_build
    HEAP_IMPORT_ERROR = None
except Exception as exc:  # noqa: BLE001 - recorded, never hidden  # pragma: no cover - recorded in the results
    heap_build = None
    HEAP_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

DEPTH = 15
VOCAB = 151_936
SKIP_NO_CUDA = "skipped: no CUDA"

# What SGLang 0.5.23 compiles (sglang/kernels/ops/speculative/sampling.py, tree.py).
SAMPLING_MODULE = "speculative_sampling"
SAMPLING_SOURCE = "speculative/sampling.cuh"
SAMPLING_WRAPPER = ("sample", "tree_speculative_sampling_target_only<{vec}, {det}>")
TREE_MODULE = "speculative_tree"
TREE_SOURCE = "speculative/tree.cuh"
TREE_WRAPPERS = (
    ("build_tree_kernel_efficient", "build_tree_kernel_efficient"),
    ("verify_tree_greedy", "verify_tree_greedy"),
    ("reconstruct_indices_from_tree_mask", "reconstruct_indices_from_tree_mask"),
)
# sglang/kernels/jit/utils/compile/spec.py: prepended to every generated unit.
FFI_INCLUDES = (
    "#include <tvm/ffi/container/tensor.h>",
    "#include <tvm/ffi/dtype.h>",
    "#include <tvm/ffi/error.h>",
    "#include <tvm/ffi/extra/c_env_api.h>",
    "#include <tvm/ffi/function.h>",
)

# Published test vector (sgl-kernel tests/speculative/test_speculative_sampling.py).
TV_CANDIDATES = [[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]
TV_RETRIVE_INDEX = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
TV_NEXT_TOKEN = [[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]
TV_NEXT_SIBLING = [[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]
TV_PREDICTS = [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
TV_ACCEPT_INDEX = [[0, 3, 4, 5], [6, 10, 11, -1]]
TV_ACCEPT_NUM = [3, 2]


# ---------------------------------------------------------------------------
# Results bookkeeping
# ---------------------------------------------------------------------------


class Recorder:
    """Collects step results and rewrites the JSON + markdown after each step."""

    def __init__(self, out_dir: pathlib.Path, meta: dict, deadline: float):
        self.out_dir = out_dir
        self.meta = meta
        self.steps: dict = {}
        self.deadline = deadline
        out_dir.mkdir(parents=True, exist_ok=True)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, fn, *, skip: str | None = None, min_time_s: float = 0.0):
        t0 = time.monotonic()
        if skip is not None:
            rec = {"status": "skipped", "reason": skip}
        elif self.time_left() < min_time_s:
            rec = {"status": "skipped",
                   "reason": f"skipped: time budget ({self.time_left():.0f} s left, needs ~{min_time_s:.0f} s)"}
        else:
            print(f"[gpu_kernels] {name} ...", flush=True)
            try:
                data = fn() or {}
                rec = {"status": data.pop("status", "ok"), **data}
            except Exception as exc:  # noqa: BLE001 - recorded, never hidden
                rec = {
                    "status": "failed",
                    "error": f"{type(exc).__name__}: {exc}"[:4000],
                    "traceback": traceback.format_exc()[-6000:],
                }
        rec["wall_s"] = round(time.monotonic() - t0, 3)
        self.steps[name] = rec
        print(f"[gpu_kernels] {name}: {rec['status']}"
              + (f" ({rec.get('reason') or rec.get('error', '')})" if rec["status"] != "ok" else ""),
              flush=True)
        self.write()
        return rec

    def write(self):
        doc = {"meta": self.meta, "steps": self.steps}
        (self.out_dir / "gpu_kernels.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        (self.out_dir / "gpu_kernels.md").write_text(render_markdown(doc))


def render_markdown(doc: dict) -> str:
    meta, steps = doc["meta"], doc["steps"]
    md = ["# DDTree GPU kernel checks (bench/gpu_kernels.py)", ""]
    for k in ("mode", "gpu", "capability", "torch", "torch_cuda", "triton", "nvcc", "driver",
              "python", "tvm_ffi", "sglang_sources", "ddtree_utils", "total_wall_s"):
        if k in meta:
            md.append(f"- {k}: {meta[k]}")
    md += ["", "| step | status | detail |", "|---|---|---|"]
    for name, rec in steps.items():
        detail = rec.get("summary") or rec.get("reason") or rec.get("error") or ""
        md.append(f"| {name} | {rec['status']} | {str(detail).replace('|', '/')[:300]} |")
    timing = steps.get("timing", {})
    rows = timing.get("rows") or []
    if rows:
        cols = ["bs", "budget", "topk_cap", "clock", "ddtree_topk_build_retrieve_ms",
                "ddtree_build_retrieve_ms", "ddtree_full_plan_ms", "topk_only_ms",
                "eager_topk_build_retrieve_ms", "heap_d2h_ms", "heap_host_ms", "heap_upload_ms",
                "heap_total_ms", "heap_over_ddtree", "heap_over_ddtree_excl_topk"]
        md += ["", "## Timing (ms per decode step; median of repeats)", "",
               "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            md.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
        md += ["", ("heap_total = top-k on the GPU + device->host copy of the top-k + the "
               "per-request Python heap (paper); heap_over_ddtree = heap_total / "
               "ddtree_topk_build_retrieve; _excl_topk = (copy + heap) / ddtree_build_retrieve. "
               "heap_upload (tree arrays back to the GPU) is reported, not added.")]
    return "\n".join(md) + "\n"


# ---------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------


def _cmd_output(cmd, timeout=20) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        return (r.stdout or r.stderr).strip() or None
    except Exception:  # noqa: BLE001 - recorded, never hidden
        return None


def tvm_ffi_torch_setup() -> str:
    """Before the first ``import tvm_ffi``: without torch's native DLPack
    exchange API, tvm_ffi would JIT-build an addon at import (minutes of
    device time); its plain ``__dlpack__`` path converts tensors just as well."""
    if hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        return "torch native DLPack exchange API"
    os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    return "__dlpack__ fallback (TVM_FFI_DISABLE_TORCH_C_DLPACK=1)"


def collect_meta(args, device: torch.device) -> dict:
    meta = {
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        "argv": sys.argv[1:],
        "python": platform.python_version(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ddtree_utils": f"{DDTREE_UTILS.relative_to(ROOT)} sha256 "
                        f"{hashlib.sha256(DDTREE_UTILS.read_bytes()).hexdigest()[:16]}",
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001 - recorded, never hidden
        meta["triton"] = f"not importable ({type(exc).__name__})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta["gpu"] = torch.cuda.get_device_name(device)
        meta["capability"] = "{}.{}".format(*torch.cuda.get_device_capability(device))
        meta["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        meta["sm_count"] = props.multi_processor_count
        meta["driver"] = _cmd_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    else:
        meta["gpu"] = None
    nvcc = nvcc_path()
    v = _cmd_output([nvcc, "--version"]) if os.path.exists(nvcc) else None
    meta["nvcc"] = next((ln.strip() for ln in v.splitlines() if "release" in ln), v.splitlines()[-1]) if v else None
    try:
        import tvm_ffi

        meta["tvm_ffi"] = tvm_ffi.__version__
    except Exception as exc:  # noqa: BLE001 - recorded, never hidden
        meta["tvm_ffi"] = f"not importable ({type(exc).__name__})"
    manifest = pathlib.Path(args.carry) / "MANIFEST.json"
    if manifest.exists():
        try:
            meta["sglang_sources"] = json.loads(manifest.read_text()).get("sglang_wheel")
        except (OSError, ValueError) as exc:
            meta["sglang_sources"] = f"MANIFEST.json unreadable: {exc}"
    return meta


# ---------------------------------------------------------------------------
# Step 1: CUDA graph capture under sync-debug "error"
# ---------------------------------------------------------------------------


def plan_fn(logits, seq_lens, budget, cap, depth, *, topk=True, top=None, full=True):
    """One decode step's tree planning; returns a tuple of output tensors."""
    if topk:
        top = du.draft_topk_logprobs(logits, cap)
    tree = du.build_ddtree_tree(top, budget, cap)
    enc = du.compile_ddtree_retrieve(tree.parents, tree.scores)
    outs = (tree.tokens, tree.parents, tree.depths, tree.scores,
            enc.retrive_index, enc.retrive_next_token, enc.retrive_next_sibling)
    if full:
        pos = du.ddtree_positions(tree.depths, seq_lens)
        mask = du.ddtree_tree_mask(tree.parents, max_depth=depth)
        outs = outs + (pos, mask)
    return outs


OUT_NAMES = ("tokens", "parents", "depths", "scores", "retrive_index", "retrive_next_token",
             "retrive_next_sibling", "positions", "tree_mask")


def count_sync_warnings(fn):
    """Run ``fn`` under sync-debug "warn"; returns (result, number of host-sync
    warnings, the first one's text)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    return out, len(syncs), (syncs[0][:300] if syncs else None)


def capture_graph(fn, *, sync_debug: bool):
    """Cold call, eager warm-up, capture. Returns (graph, static outputs, info).

    The builder caches a per-(budget, K, L, device) plan on its first call (a
    one-time upload of index tables, documented in ``build_ddtree_tree``), as
    SGLang's own warm-up would. That cold call runs under sync-debug "warn" and
    its sync warnings are counted; then one eager call and the capture run
    under "error": any host sync there raises."""
    info = {}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        if sync_debug:
            _, n, first = count_sync_warnings(fn)
            info["cold_call_sync_warnings"] = n
            if first:
                info["cold_call_sync_warning_first"] = first
            torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    # torch.cuda.graph() synchronizes on entry (that sync is outside the body);
    # inside the body the stream is capturing, so any host sync also fails there.
    with torch.cuda.graph(g):
        if sync_debug:
            torch.cuda.set_sync_debug_mode("error")
        try:
            outs = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return g, outs, info


def compare_outputs(got, want, names=OUT_NAMES) -> dict:
    res = {}
    for name, a, b in zip(names, got, want, strict=False):
        eq = bool(torch.equal(a, b))
        r = {"equal": eq, "shape": list(a.shape), "dtype": str(a.dtype).replace("torch.", "")}
        if not eq and a.is_floating_point() and a.shape == b.shape:
            fin = torch.isfinite(a) & torch.isfinite(b)
            r["max_abs_diff_finite"] = float((a[fin] - b[fin]).abs().max()) if bool(fin.any()) else None
            r["finite_pattern_equal"] = bool(torch.equal(torch.isfinite(a), torch.isfinite(b)))
        res[name] = r
    return res


def step_graph_capture(device, bs, budget, cap, depth, vocab, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(bs, depth, vocab, device=device, generator=gen) * 3
    seq_lens = torch.randint(1, 4096, (bs,), device=device, generator=gen)

    def fn():
        return plan_fn(logits, seq_lens, budget, cap, depth)

    g, static, cold = capture_graph(fn, sync_debug=True)
    replays = []
    for i in range(2):  # fresh inputs each time: the graph must follow the data
        logits.copy_(torch.randn(bs, depth, vocab, device=device, generator=gen) * 3)
        seq_lens.copy_(torch.randint(1, 4096, (bs,), device=device, generator=gen))
        poisoned = []
        for name, t in zip(OUT_NAMES, static, strict=False):  # poison: the replay must rewrite every output
            try:
                t.fill_(True if t.dtype == torch.bool else -7)
                poisoned.append(name)
            except RuntimeError:  # e.g. an expanded view; compared all the same
                pass
        g.replay()
        torch.cuda.synchronize()
        got = [t.clone() for t in static]
        want = fn()
        torch.cuda.synchronize()
        cmp = compare_outputs(got, want)
        replays.append({"replay": i, "all_equal": all(v["equal"] for v in cmp.values()),
                        "outputs": cmp, "poisoned_before_replay": poisoned,
                        "draft_nodes_mean": float((got[1] >= 0).sum(dim=1).float().mean())})
    ok = all(r["all_equal"] for r in replays)
    return {
        "status": "ok" if ok else "failed",
        "summary": (f"eager call + capture under sync-debug 'error' (no host sync); {len(replays)} replays on "
                    f"fresh inputs {'equal' if ok else 'NOT equal'} to eager; cold first call (plan cache): "
                    f"{cold.get('cold_call_sync_warnings')} sync warnings"),
        "sync_debug_mode": "error (eager warm-up and capture); the cold first call (plan caching) under warn",
        **cold,
        "shape": {"bs": bs, "budget": budget, "topk_cap": cap, "depth": depth, "vocab": vocab},
        "replays": replays,
    }


# ---------------------------------------------------------------------------
# Step 2: timing
# ---------------------------------------------------------------------------


def _median_events(run, reps, repeats, warm=5):
    for _ in range(warm):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            run()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / reps)
    return statistics.median(times), min(times), max(times)


def _median_host(run, reps, warm=2):
    for _ in range(warm):
        run()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def heap_baseline(top, budget, device, reps):
    """The paper's path after the GPU top-k: copy the top-k lists to the host
    (synchronising), run the per-request heap, and (reported separately) upload
    the tree arrays again."""
    if heap_build is None:
        raise RuntimeError(f"heap_build not importable: {HEAP_IMPORT_ERROR}")
    bs = top[0].shape[0]
    state = {}

    def d2h():
        state["cpu"] = (top[0].to("cpu"), top[1].to("cpu"))  # blocking copy = sync

    def heap():
        lp, ids = state["cpu"]
        state["trees"] = [heap_build(lp[b], ids[b], budget) for b in range(bs)]

    def upload():
        n = budget + 1
        rows = []
        for tok, par, first, nxt, _scores in state["trees"]:
            pad = n - len(tok)
            rows.append([tok + [0] * pad, par + [-1] * pad, first, nxt])
        torch.tensor(rows, dtype=torch.long).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()

    d2h()
    heap()
    return {
        "heap_d2h_ms": _median_host(d2h, reps),
        "heap_host_ms": _median_host(heap, max(3, reps // 4)),
        "heap_upload_ms": _median_host(upload, reps),
    }


def time_config_cuda(device, bs, budget, cap, depth, vocab, seed, reps, repeats, sync_debug):
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(bs, depth, vocab, device=device, generator=gen) * 3
    seq_lens = torch.randint(1, 4096, (bs,), device=device, generator=gen)
    top_static = tuple(t.clone() for t in du.draft_topk_logprobs(logits, cap))
    variants = {
        "ddtree_topk_build_retrieve_ms": lambda: plan_fn(logits, seq_lens, budget, cap, depth, full=False),
        "ddtree_build_retrieve_ms": lambda: plan_fn(logits, seq_lens, budget, cap, depth, topk=False,
                                                    top=top_static, full=False),
        "ddtree_full_plan_ms": lambda: plan_fn(logits, seq_lens, budget, cap, depth),
        "topk_only_ms": lambda: du.draft_topk_logprobs(logits, cap),
    }
    row = {"bs": bs, "budget": budget, "topk_cap": cap, "depth": depth, "vocab": vocab,
               "clock": "cuda events, CUDA-graph replay", "reps": reps, "repeats": repeats}
    graph_errors = {}
    for name, fn in variants.items():
        try:
            g, _, _ = capture_graph(fn, sync_debug=sync_debug)
            med, lo, hi = _median_events(g.replay, reps, repeats)
            row[name] = round(med, 4)
            row[name.replace("_ms", "_range_ms")] = [round(lo, 4), round(hi, 4)]
        except Exception as exc:  # noqa: BLE001 - recorded, never hidden
            graph_errors[name] = f"{type(exc).__name__}: {exc}"[:600]
            torch.cuda.set_sync_debug_mode(0)
            med, lo, hi = _median_events(fn, max(3, reps // 10), repeats)
            row[name] = round(med, 4)
            row[name + "_clock"] = "cuda events, EAGER (graph capture failed)"
    med, _, _ = _median_events(variants["ddtree_topk_build_retrieve_ms"], max(3, reps // 10), repeats)
    row["eager_topk_build_retrieve_ms"] = round(med, 4)
    if graph_errors:
        row["graph_errors"] = graph_errors
    heap = heap_baseline(top_static, budget, device, reps=20)
    row.update({k: round(v, 4) for k, v in heap.items()})
    _finish_ratios(row)
    return row


def time_config_cpu(device, bs, budget, cap, depth, vocab, seed, reps):
    """CPU smoke: the same code paths, timed eagerly with perf_counter."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(bs, depth, vocab, device=device, generator=gen) * 3
    seq_lens = torch.randint(1, 4096, (bs,), device=device, generator=gen)
    top_static = du.draft_topk_logprobs(logits, cap)
    row = {"bs": bs, "budget": budget, "topk_cap": cap, "depth": depth, "vocab": vocab,
               "clock": "perf_counter, eager on CPU (smoke; not a GPU number)", "reps": reps}
    row["ddtree_topk_build_retrieve_ms"] = round(_median_host(
        lambda: plan_fn(logits, seq_lens, budget, cap, depth, full=False), reps), 4)
    row["ddtree_build_retrieve_ms"] = round(_median_host(
        lambda: plan_fn(logits, seq_lens, budget, cap, depth, topk=False, top=top_static, full=False), reps), 4)
    row["ddtree_full_plan_ms"] = round(_median_host(lambda: plan_fn(logits, seq_lens, budget, cap, depth), reps), 4)
    row["topk_only_ms"] = round(_median_host(lambda: du.draft_topk_logprobs(logits, cap), reps), 4)
    heap = heap_baseline(top_static, budget, device, reps=reps)
    row.update({k: round(v, 4) for k, v in heap.items()})
    _finish_ratios(row)
    return row


def _finish_ratios(row):
    total = row["topk_only_ms"] + row["heap_d2h_ms"] + row["heap_host_ms"]
    row["heap_total_ms"] = round(total, 4)
    row["heap_total_with_upload_ms"] = round(total + row["heap_upload_ms"], 4)
    row["heap_over_ddtree"] = round(total / row["ddtree_topk_build_retrieve_ms"], 2)
    row["heap_over_ddtree_excl_topk"] = round(
        (row["heap_d2h_ms"] + row["heap_host_ms"]) / row["ddtree_build_retrieve_ms"], 2)
    row["heap_with_upload_over_ddtree"] = round(
        row["heap_total_with_upload_ms"] / row["ddtree_topk_build_retrieve_ms"], 2)


def step_timing(rec: Recorder, device, configs, seed, reps, repeats, cpu):
    rows, skipped, failed = [], [], []
    for i, (bs, budget, cap, depth, vocab) in enumerate(configs):
        if i > 0 and rec.time_left() < 60:
            skipped.append({"bs": bs, "budget": budget, "reason": "time budget"})
            continue
        try:
            if cpu:
                row = time_config_cpu(device, bs, budget, cap, depth, vocab, seed + i, reps)
            else:
                row = time_config_cuda(device, bs, budget, cap, depth, vocab, seed + i, reps, repeats,
                                       sync_debug=True)
        except Exception as exc:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
            if i == 0:
                raise
            failed.append({"bs": bs, "budget": budget, "error": f"{type(exc).__name__}: {exc}"[:600]})
            continue
        rows.append(row)
        print("[gpu_kernels] timing " + json.dumps(row), flush=True)
    p = rows[0]
    summary = (f"bs {p['bs']} budget {p['budget']}: ddtree top-k+build+retrieve "
               f"{p['ddtree_topk_build_retrieve_ms']} ms (build+retrieve {p['ddtree_build_retrieve_ms']} ms), "
               f"heap {p['heap_total_ms']} ms -> x{p['heap_over_ddtree']} "
               f"(excl. top-k x{p['heap_over_ddtree_excl_topk']}) [{p['clock']}]")
    out = {"summary": summary, "rows": rows}
    if skipped:
        out["configs_skipped"] = skipped
    if failed:
        out["configs_failed"] = failed
    if any("graph_errors" in r for r in rows):
        out["status"] = "failed"
        out["summary"] += "; some graph captures FAILED (eager numbers recorded instead)"
    return out


# ---------------------------------------------------------------------------
# Step 3: JIT build of SGLang's kernels from the carried sources
# ---------------------------------------------------------------------------


def cuda_home() -> str:
    """CUDA_HOME / CUDA_PATH, else the toolkit around nvcc on PATH, else
    /usr/local/cuda: the first that holds include/cuda_runtime.h (nvcc on PATH
    may be a wrapper script outside the toolkit)."""
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    cands.append("/usr/local/cuda")
    for c in cands:
        if c and os.path.exists(os.path.join(c, "include", "cuda_runtime.h")):
            return c
    return next(c for c in cands if c)


def nvcc_path() -> str:
    p = os.path.join(cuda_home(), "bin", "nvcc")
    return p if os.path.exists(p) else (shutil.which("nvcc") or p)


def wrapper_source(files, wrappers) -> str:
    """Exactly sglang.kernels.jit.utils.compile.spec._wrapper_source."""
    lines = list(FFI_INCLUDES)
    lines += [f'#include "{path}"' for path in files]
    lines.append("namespace sglang {")
    lines += [f"TVM_FFI_DLL_EXPORT_TYPED_FUNC({name}, ({kernel}));" for name, kernel in wrappers]
    lines.append("}  // namespace sglang")
    return "\n".join(lines) + "\n"


def _find_header_dir(header: str, extra_roots=()) -> str | None:
    """A directory holding ``header``: the CUDA toolkit first, then the
    nvidia-* wheels (torch's cu13 wheels keep curand there)."""
    roots = [os.path.join(cuda_home(), "include"),
             os.path.join(cuda_home(), "targets", "x86_64-linux", "include"),
             os.path.join(cuda_home(), "targets", "sbsa-linux", "include"), *extra_roots]
    for r in roots:
        if os.path.exists(os.path.join(r, header)):
            return r
    try:
        import nvidia  # namespace package of the nvidia-* wheels
    except ImportError:
        return None
    for base in list(getattr(nvidia, "__path__", [])):
        for p in sorted(pathlib.Path(base).glob(f"*/include/{header}")):
            return str(p.parent)
    return None


class KernelBuild:
    """Starts the nvcc compiles of both modules at once, in the background."""

    def __init__(self, carry: pathlib.Path, build_dir: pathlib.Path, arch: str):
        self.carry = carry
        self.build_dir = build_dir
        self.arch = arch  # e.g. "90a"
        self.jobs = {}
        self.info = {}

    def layout(self):
        jit = self.carry / "sglang_jit"
        need = {
            "sglang include": jit / "include" / "sgl_kernel" / "tensor.h",
            "sampling source": jit / "csrc" / SAMPLING_SOURCE,
            "tree source": jit / "csrc" / TREE_SOURCE,
            "flashinfer sampling header": self.carry / "flashinfer" / "include" / "flashinfer" / "sampling.cuh",
        }
        missing = {k: str(v) for k, v in need.items() if not v.exists()}
        return jit, missing

    def start(self):
        import tvm_ffi
        from tvm_ffi.libinfo import (
            find_dlpack_include_path,
            find_include_path,
            find_libtvm_ffi,
        )

        jit, missing = self.layout()
        if missing:
            raise FileNotFoundError(f"carry folder incomplete: {missing}")
        lib = pathlib.Path(find_libtvm_ffi())
        tvm_includes = list(dict.fromkeys([find_include_path(), find_dlpack_include_path()]))
        self.build_dir.mkdir(parents=True, exist_ok=True)
        shim = self.build_dir / "shim_include"
        shim.mkdir(exist_ok=True)
        extra = []
        if os.path.exists(os.path.join(cuda_home(), "include", "curand_kernel.h")):
            self.info["curand"] = "toolkit"
        else:
            env_dir = os.environ.get("GPU_KERNELS_CURAND_INCLUDE")
            src = _find_header_dir("curand_kernel.h", [env_dir] if env_dir else [])
            if src is None:
                self.info["curand"] = "curand_kernel.h not found (toolkit or nvidia wheels)"
            else:  # only the curand headers, so no other wheel header shadows the toolkit
                for h in pathlib.Path(src).glob("curand*.h"):
                    dst = shim / h.name
                    if not dst.exists():
                        dst.symlink_to(h)
                self.info["curand"] = f"from {src} (shimmed)"
                extra.append(str(shim))
        digits = self.arch.rstrip("abcdefghijklmnopqrstuvwxyz")
        major, minor = int(digits[:-1]), int(digits[-1])
        nvcc = nvcc_path()
        cxx = os.environ.get("CXX", "c++")
        base_includes = tvm_includes + [str(jit / "include")]
        modules = {
            SAMPLING_MODULE + "_4_True": {
                "source": jit / "csrc" / SAMPLING_SOURCE,
                "wrappers": [(SAMPLING_WRAPPER[0], SAMPLING_WRAPPER[1].format(vec=4, det="true"))],
                "includes": base_includes + [str(self.carry / "flashinfer" / "include")] + extra},
            TREE_MODULE: {"source": jit / "csrc" / TREE_SOURCE, "wrappers": list(TREE_WRAPPERS),
                              "includes": base_includes + extra},
        }
        self.info.update({"arch": self.arch, "nvcc": nvcc, "cxx": cxx, "tvm_ffi": tvm_ffi.__version__,
                          "tvm_ffi_lib": str(lib), "modules": {}})
        for name, m in modules.items():
            d = self.build_dir / name
            d.mkdir(parents=True, exist_ok=True)
            (d / "cuda.cu").write_text(wrapper_source([str(m["source"])], m["wrappers"]))
            so = d / f"sgl_kernel_jit_{name}.so"
            compile_cmd = [nvcc, "-Xcompiler", "-fPIC", f"-gencode=arch=compute_{self.arch},code=sm_{self.arch}",
                           f"-DSGL_CUDA_ARCH={major * 100 + minor * 10}", "-std=c++20", "-O3",
                           "--expt-relaxed-constexpr", *[f"-I{p}" for p in m["includes"]],
                           "-c", "cuda.cu", "-o", "cuda_0.o"]
            link_cmd = [cxx, "cuda_0.o", "-shared", f"-L{lib.parent}", f"-l{lib.stem.removeprefix('lib')}",
                        f"-L{os.path.join(cuda_home(), 'lib64')}", "-lcudart", "-o", str(so)]
            script = " && ".join(subprocess.list2cmdline(c) for c in (compile_cmd, link_cmd))
            log = open(d / "build.log", "w")  # noqa: SIM115 - closed in wait()
            t0 = time.monotonic()
            proc = subprocess.Popen(["bash", "-c", script], cwd=d, stdout=log, stderr=subprocess.STDOUT)
            self.jobs[name] = {"proc": proc, "t0": t0, "so": so, "log": d / "build.log", "logf": log}
            self.info["modules"][name] = {"wrappers": m["wrappers"], "source": str(m["source"]),
                                          "compile": compile_cmd, "link": link_cmd}

    def wait(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        done = {}
        while len(done) < len(self.jobs):
            for name, job in self.jobs.items():
                if name not in done and job["proc"].poll() is not None:
                    done[name] = (job["proc"].returncode, time.monotonic())
            if len(done) == len(self.jobs):
                break
            if time.monotonic() > deadline:
                for name, job in self.jobs.items():
                    if name not in done:
                        job["proc"].kill()  # our own compile job, by its handle
                        job["proc"].wait()
                        done[name] = ("timeout", time.monotonic())
                break
            time.sleep(0.2)
        results = {}
        for name, job in self.jobs.items():
            job["logf"].close()
            rc, t_end = done[name]
            results[name] = {"rc": rc, "seconds": round(t_end - job["t0"], 1),
                             "so": str(job["so"]) if rc == 0 else None,
                             "log_tail": job["log"].read_text(errors="replace")[-3000:]}
        return results


def sampling_caller(sample):
    """Keyword call -> the positional call sglang's python wrapper makes
    (kernels/ops/speculative/sampling.py); ``deterministic`` picks the module."""

    def call(*, predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
             retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
             draft_probs, threshold_single=1.0, threshold_acc=1.0, deterministic=True):
        assert deterministic and math.gcd(4, target_probs.shape[-1]) == 4, "only <4, true> is built"
        sample(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
               retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
               draft_probs, threshold_single, threshold_acc)

    return call


def load_module(path: str):
    import tvm_ffi

    return tvm_ffi.load_module(path)


# ---------------------------------------------------------------------------
# Step 4: kernels vs the payload's references
# ---------------------------------------------------------------------------


def test_vector_inputs(device, coin_gen):
    bs, n, s, v = 2, 6, 4, 20
    logits = torch.ones(bs, n, v)
    for b, i, t in ((0, 0, 3), (0, 3, 4), (0, 4, 5), (1, 0, 11), (1, 4, 12)):
        logits[b, i, t] = 10.0
    for b in range(bs):
        for i in range(n):
            if float(logits[b, i].max()) < 10.0:
                logits[b, i, 18] = 10.0
    target_probs = torch.softmax(logits / 0.01, dim=-1)
    coins = torch.rand(bs, n, generator=coin_gen).clamp_(max=du.MAX_COIN)
    final = torch.rand(bs, generator=coin_gen).clamp_(max=du.MAX_COIN)
    def lt(x):
        return torch.tensor(x, dtype=torch.long)
    return {
        "predicts": torch.full((bs * n,), -1, dtype=torch.int32),
        "accept_index": torch.full((bs, s), -1, dtype=torch.int32),
        "accept_token_num": torch.zeros(bs, dtype=torch.int32),
        "candidates": lt(TV_CANDIDATES), "retrive_index": lt(TV_RETRIVE_INDEX),
        "retrive_next_token": lt(TV_NEXT_TOKEN), "retrive_next_sibling": lt(TV_NEXT_SIBLING),
        "uniform_samples": coins, "uniform_samples_for_final_sampling": final,
        "target_probs": target_probs, "draft_probs": torch.zeros(bs, n, v),
    }, device


def _to(d, device):
    return {k: v.to(device) for k, v in d.items()}


def _clone(d):
    return {k: v.clone() for k, v in d.items()}


def run_sampling(fn, inputs):
    x = _clone(inputs)
    fn(**x, threshold_single=1.0, threshold_acc=1.0)
    if x["predicts"].is_cuda:
        torch.cuda.synchronize()
    return x


def step_test_vector(device, kernel, trials=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = {"trials": trials, "reference": [], "kernel": []}
    ok = True
    for _ in range(trials):
        inputs, _ = test_vector_inputs(device, gen)
        for label, fn in (("reference", du.tree_speculative_sampling_reference), ("kernel", kernel)):
            if fn is None:
                continue
            x = run_sampling(fn, _to(inputs, device) if label == "kernel" else inputs)
            got = {"predicts": x["predicts"].cpu().tolist(), "accept_index": x["accept_index"].cpu().tolist(),
                       "accept_token_num": x["accept_token_num"].cpu().tolist()}
            match = (got["predicts"] == TV_PREDICTS and got["accept_index"] == TV_ACCEPT_INDEX
                     and got["accept_token_num"] == TV_ACCEPT_NUM)
            ok &= match
            out[label].append({"match": match, **({} if match else got)})
    if kernel is None:
        out.pop("kernel")
        out["kernel_status"] = SKIP_NO_CUDA
    n_ref = sum(r["match"] for r in out["reference"])
    summary = f"reference {n_ref}/{trials} match the published vector"
    if kernel is not None:
        summary += f"; kernel {sum(r['match'] for r in out['kernel'])}/{trials}"
    return {"status": "ok" if ok else "failed", "summary": summary, **out}


def random_case_specs(n_cases: int, seed: int, big_vocab: int, smoke: bool):
    """Deterministic list of (bs, budget, cap, depth, vocab, temp, top_k, top_p,
    greedy_frac, s_kind). Vocabularies are multiples of 4 (one compiled
    VecSize=4 variant, as SGLang picks gcd(4, V))."""
    import random

    r = random.Random(seed)
    specs = []
    vocabs = [20, 64, 1000] if smoke else [20, 64, 1000, 32_000]
    for i in range(n_cases):
        budget = r.choice([1, 3, 8, 16, 64] if smoke else [1, 3, 8, 16, 64, 128])
        cap = r.choice([1, 2, 4, budget, budget])
        cap = max(1, min(cap, budget))
        vocab = big_vocab if (not smoke and i % 8 == 7) else r.choice(vocabs)
        bs = r.choice([1, 2, 5] if smoke else [1, 3, 8, 16])
        if vocab == big_vocab:
            bs = min(bs, 8)
        specs.append({
            "bs": bs, "budget": budget, "cap": cap, "depth": r.choice([1, 2, 4, 15]), "vocab": vocab,
            "temp": r.choice([0.5, 1.0, 1.7]), "top_k": r.choice([None, 5, 40]), "top_p": r.choice([None, 0.9, 0.5]),
            "greedy_frac": r.choice([0.0, 0.0, 0.3]), "s_kind": r.choice(["full", "depth", "two"]),
            "boost": r.choice([0.0, 4.0, 8.0, 12.0])})
    return specs


def make_random_case(spec, device, gen):
    """A tree from the payload's builder on random draft logits, target
    probabilities that often favour the tree's tokens, and coins."""
    bs, budget, cap, depth, vocab = (spec[k] for k in ("bs", "budget", "cap", "depth", "vocab"))
    draft_logits = torch.randn(bs, depth, vocab, generator=gen, device=device) * 2.0
    top = du.draft_topk_logprobs(draft_logits, cap)
    root = torch.randint(vocab, (bs,), generator=gen, device=device)
    tree = du.build_ddtree_tree(top, budget, cap, root_tokens=root)
    enc = du.compile_ddtree_retrieve(tree.parents, tree.scores)
    n = budget + 1
    logits = torch.randn(bs, n, vocab, generator=gen, device=device) * 1.5
    if spec["boost"] > 0:  # raise each node's token at its parent's row
        par = tree.parents
        valid = par >= 0
        b_idx = torch.arange(bs, device=device).unsqueeze(1).expand(bs, n)
        amount = torch.rand(bs, n, generator=gen, device=device) * spec["boost"]
        logits[b_idx[valid], par[valid], tree.tokens[valid]] += amount[valid]
    temps = torch.full((bs,), spec["temp"], device=device)
    top_ks = None if spec["top_k"] is None else torch.full((bs,), spec["top_k"], device=device)
    top_ps = None if spec["top_p"] is None else torch.full((bs,), spec["top_p"], device=device)
    greedy = torch.rand(bs, generator=gen, device=device) < spec["greedy_frac"]
    target_probs = du.ddtree_target_probs(logits, temps, top_ks, top_ps, greedy).contiguous()
    coins, final = du.ddtree_verify_coins(bs, n, device, gen)
    s = {"full": n, "depth": min(n, depth + 1), "two": min(n, 2)}[spec["s_kind"]]
    inputs = {
        "predicts": torch.zeros(bs * n, dtype=torch.int32, device=device),
        "accept_index": torch.full((bs, s), -1, dtype=torch.int32, device=device),
        "accept_token_num": torch.zeros(bs, dtype=torch.int32, device=device),
        "candidates": tree.tokens.contiguous(), "retrive_index": enc.retrive_index.contiguous(),
        "retrive_next_token": enc.retrive_next_token.contiguous(),
        "retrive_next_sibling": enc.retrive_next_sibling.contiguous(),
        "uniform_samples": coins.contiguous(), "uniform_samples_for_final_sampling": final.contiguous(),
        "target_probs": target_probs, "draft_probs": torch.zeros_like(target_probs),
    }
    greedy_inputs = {
        "predicts": torch.zeros(bs * n, dtype=torch.int32, device=device),
        "accept_index": torch.full((bs, s), -1, dtype=torch.int32, device=device),
        "accept_token_num": torch.zeros(bs, dtype=torch.int32, device=device),
        "candidates": inputs["candidates"], "retrive_index": inputs["retrive_index"],
        "retrive_next_token": inputs["retrive_next_token"], "retrive_next_sibling": inputs["retrive_next_sibling"],
        "target_predict": torch.argmax(logits, dim=-1).contiguous(),
    }
    return tree, inputs, greedy_inputs


def check_walk_invariants(tree, x) -> list:
    """Harness self-check of a sampling/greedy result: the accepted path
    follows parent pointers and each accepted node's token was predicted at
    its parent. Returns a list of violations (empty = fine)."""
    bad = []
    bs, n = tree.parents.shape
    par = tree.parents.cpu().tolist()
    tok = tree.tokens.cpu().tolist()
    acc = x["accept_index"].cpu().tolist()
    num = x["accept_token_num"].cpu().tolist()
    pred = x["predicts"].cpu().tolist()
    for b in range(bs):
        path = [g - b * n for g in acc[b][: num[b] + 1]]
        if path[0] != 0 or any(g < 0 for g in path):
            bad.append(f"b{b}: path {path}")
            continue
        for a, c in itertools.pairwise(path):
            if par[b][c] != a or pred[b * n + a] != tok[b][c]:
                bad.append(f"b{b}: edge {a}->{c}")
        if any(g != -1 for g in acc[b][num[b] + 1:]):
            bad.append(f"b{b}: accept_index tail not -1")
    return bad


def step_random_compare(device, sampling_kernel, greedy_kernel, specs, seed, which):
    gen = torch.Generator(device=device).manual_seed(seed)
    n_req = n_eq = 0
    mismatches, harness_bad = [], []
    accepted_total = 0
    for i, spec in enumerate(specs):
        tree, inputs, ginputs = make_random_case(spec, device, gen)
        if which == "sampling":
            ref = run_sampling(du.tree_speculative_sampling_reference, inputs)
            got = run_sampling(sampling_kernel, inputs) if sampling_kernel is not None else None
            fields = ("predicts", "accept_index", "accept_token_num", "draft_probs")
        else:
            ref = _clone(ginputs)
            du.verify_tree_greedy_reference(**ref)
            got = None
            if greedy_kernel is not None:
                got = _clone(ginputs)
                greedy_kernel(*[got[k] for k in ("predicts", "accept_index", "accept_token_num", "candidates",
                                                 "retrive_index", "retrive_next_token", "retrive_next_sibling",
                                                 "target_predict")])
                if got["predicts"].is_cuda:
                    torch.cuda.synchronize()
            fields = ("predicts", "accept_index", "accept_token_num")
        harness_bad += [f"case {i}: {m}" for m in check_walk_invariants(tree, ref)][:5]
        accepted_total += int(ref["accept_token_num"].sum())
        n_req += spec["bs"]
        if got is None:
            continue
        per_req_equal = torch.ones(spec["bs"], dtype=torch.bool, device=device)
        n = spec["budget"] + 1
        for f in fields:
            a, b = got[f], ref[f]
            if f == "predicts":
                eq = (a.view(spec["bs"], n) == b.view(spec["bs"], n)).all(dim=1)
            elif f == "accept_token_num":
                eq = a == b
            else:
                eq = (a.reshape(spec["bs"], -1) == b.reshape(spec["bs"], -1)).all(dim=1)
            per_req_equal &= eq
        n_eq += int(per_req_equal.sum())
        if not bool(per_req_equal.all()) and len(mismatches) < 10:
            b0 = int((~per_req_equal).nonzero()[0, 0])
            mismatches.append({
                "case": i, "spec": spec, "request": b0,
                "kernel": {f: got[f].view(spec["bs"], -1)[b0].tolist() for f in fields if f != "draft_probs"},
                "reference": {f: ref[f].view(spec["bs"], -1)[b0].tolist() for f in fields if f != "draft_probs"},
            })
    out = {"cases": len(specs), "requests": n_req, "accepted_draft_tokens_total": accepted_total,
           "harness_invariant_violations": harness_bad}
    if (sampling_kernel if which == "sampling" else greedy_kernel) is None:
        out["kernel_comparison"] = SKIP_NO_CUDA
        out["status"] = "ok" if not harness_bad else "failed"
        out["summary"] = (f"harness only (reference on {len(specs)} random trees, {n_req} requests, "
                          f"{accepted_total} accepted drafts); kernel comparison {SKIP_NO_CUDA}")
        return out
    out.update({"requests_equal": n_eq, "mismatches": mismatches,
                "compared_fields": list(fields)})
    out["status"] = "ok" if (n_eq == n_req and not harness_bad) else "failed"
    out["summary"] = (f"kernel == reference on {n_eq}/{n_req} requests ({len(specs)} random trees, "
                      f"{accepted_total} accepted drafts; fields {', '.join(fields)})")
    return out


# ---------------------------------------------------------------------------
# Builder sanity on any device (the CPU smoke's computed part)
# ---------------------------------------------------------------------------


def step_builder_eager(device, bs, budget, cap, depth, vocab, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(bs, depth, vocab, device=device, generator=gen) * 3
    seq_lens = torch.randint(1, 4096, (bs,), device=device, generator=gen)
    t0 = time.perf_counter()
    first_syncs = None
    if device.type == "cuda":  # the very first call: it builds the cached plan
        outs, n_sync, first = count_sync_warnings(lambda: plan_fn(logits, seq_lens, budget, cap, depth))
        first_syncs = {"count": n_sync, "first": first}
        torch.cuda.synchronize()
    else:
        outs = plan_fn(logits, seq_lens, budget, cap, depth)
    ms = (time.perf_counter() - t0) * 1e3
    _tokens, parents, depths, scores, ri, nt, ns, pos, mask = outs
    n = budget + 1
    idx = torch.arange(n, device=device).expand(bs, n)
    valid = parents >= 0
    decoded = du.decode_retrieve_parents(nt, ns)
    checks = {
        "parent_before_child": bool(((parents < idx) | ~valid).all()),
        "retrieve_decodes_to_parents": bool(torch.equal(decoded, torch.where(valid, parents, -1))),
        "positions_equal_start_plus_depth": bool(torch.equal(pos, seq_lens.view(-1, 1) + depths)),
        "mask_diagonal": bool(mask[:, torch.arange(n, device=device), torch.arange(n, device=device)].all()),
        "mask_root_column": bool(mask[:, :, 0].all()),
        "scores_nonincreasing": bool((scores[:, 2:] <= scores[:, 1:-1]).all()) if n > 2 else True,
        "retrive_index_is_global": bool(torch.equal(ri, idx + torch.arange(bs, device=device).view(-1, 1) * n)),
    }
    ok = all(checks.values())
    return {"status": "ok" if ok else "failed",
            "summary": f"{int(valid.sum())} draft nodes over {bs} requests, checks {'pass' if ok else 'FAIL'}",
            "shape": {"bs": bs, "budget": budget, "topk_cap": cap, "depth": depth, "vocab": vocab},
            "eager_first_call_ms": round(ms, 3), "checks": checks,
            "first_call_host_sync_warnings": first_syncs if first_syncs is not None else "n/a on CPU",
            "draft_nodes_per_request": valid.sum(dim=1).tolist()}


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def compile_only(args) -> int:
    """Build both modules without a GPU (to check the sources, flags and the
    carry layout on a machine with nvcc); loading needs only libcudart."""
    arch = args.arch or "90a"
    build_dir = pathlib.Path(args.build_dir or tempfile.mkdtemp(prefix="ddtree_gpu_kernels_"))
    b = KernelBuild(pathlib.Path(args.carry), build_dir, arch)
    b.start()
    res = b.wait(timeout_s=args.time_budget_s)
    out = {"arch": arch, "build_dir": str(build_dir), "info": b.info, "results": res, "loaded": {}}
    for name, r in res.items():
        if r["rc"] == 0:
            try:
                mod = load_module(r["so"])
                want = ["sample"] if name.startswith(SAMPLING_MODULE) else [w[0] for w in TREE_WRAPPERS]
                out["loaded"][name] = {w: callable(getattr(mod, w)) for w in want}
            except Exception as exc:  # noqa: BLE001 - recorded, never hidden
                out["loaded"][name] = f"{type(exc).__name__}: {exc}"
    outp = pathlib.Path(args.out)
    outp.mkdir(parents=True, exist_ok=True)
    (outp / "gpu_kernels_compile.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    for name, r in res.items():
        print(f"[gpu_kernels] compile {name}: rc={r['rc']} {r['seconds']} s loaded={out['loaded'].get(name)}")
        if r["rc"] != 0:
            print(r["log_tail"])
    return 0 if all(r["rc"] == 0 for r in res.values()) and all(
        isinstance(v, dict) and all(v.values()) for v in out["loaded"].values()) else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--carry", default=str(ROOT / "bench" / ".gpu_carry"),
                    help="folder staged by bench/gpu_kernels_prepare.sh")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="small shapes on CPU; CUDA-graph and kernel parts are skipped")
    ap.add_argument("--time-budget-s", type=float, default=420.0,
                    help="later steps are skipped (and say so) once this is spent")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--topk-cap", type=int, default=None, help="default: the budget (paper's tree)")
    ap.add_argument("--depth", type=int, default=DEPTH)
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--reps", type=int, default=100, help="graph replays per timed repeat")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cases", type=int, default=64, help="random trees per kernel comparison")
    ap.add_argument("--no-extra-configs", action="store_true", help="time only the main configuration")
    ap.add_argument("--arch", default=None, help="nvcc target, e.g. 90a (default: from the GPU)")
    ap.add_argument("--build-dir", default=None)
    ap.add_argument("--compile-only", action="store_true",
                    help="only build (and load) the two JIT modules for --arch (default 90a); needs nvcc "
                         "and tvm_ffi, no GPU; writes gpu_kernels_compile.json")
    args = ap.parse_args(argv)

    t_start = time.monotonic()
    if not args.cpu_smoke and not args.compile_only and not torch.cuda.is_available():
        print("[gpu_kernels] no CUDA device: running the --cpu-smoke shapes instead", flush=True)
        args.cpu_smoke = True
    cuda = not args.cpu_smoke and not args.compile_only
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        bs, budget, depth, vocab = args.bs, args.budget, args.depth, args.vocab
        cap = min(args.topk_cap or budget, budget)
        configs = [(bs, budget, cap, depth, vocab)]
        if not args.no_extra_configs:
            configs += [(1, budget, cap, depth, vocab), (8, budget, cap, depth, vocab),
                        (bs, 16, 16, depth, vocab), (bs, 256, 256, depth, vocab)]
        reps, cases = args.reps, args.cases
    else:
        bs, budget, depth, vocab = 3, 8, 4, 512
        cap = min(args.topk_cap or budget, budget)
        configs = [(bs, budget, cap, depth, vocab), (2, 16, 4, depth, vocab)]
        reps, cases = 3, 12
    if args.compile_only:
        tvm_ffi_torch_setup()
        return compile_only(args)

    tensor_path = tvm_ffi_torch_setup()
    meta = collect_meta(args, device)
    meta["tvm_ffi_tensor_path"] = tensor_path
    meta["heap_build"] = "bench/bench_payload.py:heap_build" if heap_build else f"missing: {HEAP_IMPORT_ERROR}"
    rec = Recorder(pathlib.Path(args.out), meta, t_start + args.time_budget_s)
    carry = pathlib.Path(args.carry)

    # Kick off the kernel compiles first: they run while the GPU steps do.
    builder = None
    build_start_error = None
    if cuda:
        arch = args.arch
        if arch is None:
            major, minor = torch.cuda.get_device_capability(device)
            arch = f"{major}{minor}" + ("a" if major >= 9 else "")
        build_dir = pathlib.Path(args.build_dir or tempfile.mkdtemp(prefix="ddtree_gpu_kernels_"))
        os.environ.setdefault("TVM_FFI_CACHE_DIR", str(build_dir / "tvm_ffi_cache"))
        builder = KernelBuild(carry, build_dir, arch)
        try:
            builder.start()
        except Exception as exc:  # noqa: BLE001 - recorded, never hidden
            build_start_error = f"{type(exc).__name__}: {exc}"

    rec.run("builder_eager", lambda: step_builder_eager(device, bs, budget, cap, depth, vocab, args.seed))
    rec.run("reference_test_vector", lambda: step_test_vector(torch.device("cpu"), None, seed=args.seed))
    rec.run("graph_capture", lambda: step_graph_capture(device, bs, budget, cap, depth, vocab, args.seed),
            skip=None if cuda else SKIP_NO_CUDA)
    rec.run("timing", lambda: step_timing(rec, device, configs, args.seed, reps, args.repeats, not cuda),
            min_time_s=20)

    sampling_kernel = greedy_kernel = None

    def do_build():
        if build_start_error is not None:
            raise RuntimeError(f"could not start the build: {build_start_error}")
        res = builder.wait(timeout_s=max(30.0, rec.time_left() - 60))
        with open(pathlib.Path(args.out) / "gpu_kernels_build.log", "w") as f:
            f.writelines(f"==== {name} rc={r['rc']} {r['seconds']} s\n{r['log_tail']}\n" for name, r in res.items())
        info = dict(builder.info)
        info["results"] = {k: {kk: vv for kk, vv in v.items() if kk != "log_tail"} for k, v in res.items()}
        nonlocal sampling_kernel, greedy_kernel
        errors = {}
        for name, r in res.items():
            if r["rc"] != 0:
                errors[name] = f"build rc={r['rc']}: {r['log_tail'][-1500:]}"
                continue
            try:
                mod = load_module(r["so"])
                if name.startswith(SAMPLING_MODULE):
                    sampling_kernel = sampling_caller(mod.sample)
                else:
                    greedy_kernel = mod.verify_tree_greedy
            except Exception as exc:  # noqa: BLE001 - recorded, never hidden
                errors[name] = f"load failed: {type(exc).__name__}: {exc}"
        info["errors"] = errors
        secs = {k: v["seconds"] for k, v in res.items()}
        info["summary"] = (f"built {sum(r['rc'] == 0 for r in res.values())}/{len(res)} modules "
                           f"for sm_{builder.arch} ({secs} s)" + (f"; errors: {list(errors)}" if errors else ""))
        info["status"] = "ok" if not errors else "failed"
        return info

    if cuda:
        rec.run("kernel_build", do_build)
    else:
        def layout_only():  # in the smoke, only say whether the carry is complete
            _, missing = KernelBuild(carry, pathlib.Path("."), "90a").layout()
            return {"status": "skipped", "reason": SKIP_NO_CUDA,
                    "carry": str(carry), "carry_missing": missing}
        rec.run("kernel_build", layout_only)
    kernels_ok = cuda and sampling_kernel is not None
    greedy_ok = cuda and greedy_kernel is not None
    no_kernel = SKIP_NO_CUDA if not cuda else None
    rec.run("kernel_test_vector",
            lambda: step_test_vector(device, sampling_kernel, seed=args.seed + 1),
            skip=no_kernel or (None if kernels_ok else "skipped: sampling kernel not built"))
    specs = random_case_specs(cases, args.seed, VOCAB, smoke=not cuda)
    if cuda:
        rec.run("kernel_sampling_vs_reference",
                lambda: step_random_compare(device, sampling_kernel, None, specs, args.seed, "sampling"),
                skip=None if kernels_ok else "skipped: sampling kernel not built", min_time_s=20)
        rec.run("kernel_greedy_vs_reference",
                lambda: step_random_compare(device, None, greedy_kernel, specs, args.seed, "greedy"),
                skip=None if greedy_ok else "skipped: tree kernel not built", min_time_s=10)
    else:  # CPU: the harness runs against the reference; the comparison is skipped
        rec.run("kernel_sampling_vs_reference",
                lambda: step_random_compare(device, None, None, specs, args.seed, "sampling"))
        rec.run("kernel_greedy_vs_reference",
                lambda: step_random_compare(device, None, None, specs, args.seed, "greedy"))

    meta["total_wall_s"] = round(time.monotonic() - t_start, 1)
    rec.write()
    print("\n" + render_markdown({"meta": meta, "steps": rec.steps}), flush=True)
    print(f"[gpu_kernels] wrote {rec.out_dir / 'gpu_kernels.json'} and gpu_kernels.md", flush=True)
    failed = [k for k, v in rec.steps.items() if v["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
