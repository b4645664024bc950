#!/usr/bin/env python3
"""GPU checks of the DDTree payload, sized for one lent H200.

    # on the GPU machine (bench/gpu_kernels_prepare.sh staged bench/.gpu_carry
    # and prints this line; carry that folder with the call):
    python3 -m pip install --no-index --no-deps --find-links bench/.gpu_carry apache-tvm-ffi==0.1.11 && \
        PYTHONUNBUFFERED=1 python3 bench/gpu_kernels.py --carry bench/.gpu_carry --out $OUT
    # anywhere, CPU only (small shapes; CUDA-graph and kernel parts are skipped):
    python bench/gpu_kernels.py --cpu-smoke --out /tmp/gk
    # with nvcc and tvm_ffi but no GPU: only build and load the two kernels
    python bench/gpu_kernels.py --compile-only --arch 90a --out /tmp/gk
    # only the tree-attention steps; on a CPU with Triton, the real kernel under its
    # interpreter (tests/payload/test_tree_attention_kernel.py runs them this way):
    TRITON_INTERPRET=1 python bench/gpu_kernels.py --cpu-smoke --tree-attention-only \
        --carry bench/.gpu_carry --out /tmp/gk

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
1b. ``tree_step_unit_b16`` / ``_b64``: the worker's own per-step unit
   (``ddtree_step.DDTreeStepRunner`` over ``ddtree_verify.ddtree_tree_step``:
   the top-k/top-p restriction, builder, retrieve, positions and the mask's
   tree window written into a persistent buffer) captured per batch size
   (1, 2, 4, 8) under sync-debug "error", replayed for full and padded batches
   of mixed greedy / sampled rows and run eagerly past the largest graph (bs 11,
   its fresh mask sized from a host copy of the lengths taken before the checked
   region; on CPU the same regions refuse every host read, ``sync_checked``);
   all outputs and the mask window equal to the eager function's; replay vs
   eager timed with CUDA events.
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
5. ``tree_attention_<config>`` (run after ``graph_capture``): SGLang 0.5.23's own
   triton ``extend_attention_fwd`` (``kernels/ops/attention/extend_attention.py``
   from the wheel, carried; its ``sglang.srt.utils`` / ``sglang.srt.environ``
   imports get small stand-ins, see ``load_extend_attention``) on DDTree verify
   batches, called as ``TritonAttnBackend.forward_extend`` calls it in
   TARGET_VERIFY on CUDA (``is_causal=True``, ``skip_prefix_custom_mask`` at its
   default True, MLA's v buffer a view of the k rows) with the metadata its
   ``init_forward_metadata`` (eager) and ``_update_target_verify_buffers``
   (graph replay) build: MLA at 16 heads, Lq 576 / Lv 512, bf16, W = 17 and 65,
   and a GQA MHA at W = 65; prefixes of a few thousand tokens through a random
   ``req_to_token`` slot mapping. The mask is the backend's persistent FULL_MASK
   buffer full of random stale bytes with only the tree window written
   (``ddtree_write_window_mask``), or a fresh ``torch.empty`` one for a batch
   above the graph size. Eager, and captured in CUDA graphs (batch sizes 4 and 8)
   replayed on fresh inputs with padded rows (seq_len 1, req_pool_index 0, the
   tree step's padding windows at prefix 0); every live row must match a float64
   dense reference (each node: the whole prefix and its ancestors-or-self) within
   1.5e-2 + 8e-3 |ref| (bf16). Controls that must fail: one wrong window bit (the
   kernel must follow it exactly), the stale prefix bytes read with
   ``skip_prefix_custom_mask=False``, a causal-chain reference. Without CUDA the
   same harness runs on small float32 shapes with the kernel under Triton's
   interpreter (TRITON_INTERPRET=1 and the carry) or a torch emulation, and the
   graphs are an eager stand-in.

Results: ``<out>/gpu_kernels.json`` and ``gpu_kernels.md`` (rewritten after every
step, so a run cut short still leaves what it measured); compiler output in
``gpu_kernels_build.log``. No number is made up: a step that fails is recorded
as failed with its error.
"""

from __future__ import annotations

import argparse
import contextlib
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

# Before anything is imported from the patch set (ddtree_utils by file path below, bench_payload
# through sys.path): every file under patches/*/files ships, and the patch-set loader refuses an
# unlisted one such as a __pycache__, whatever PYTHONDONTWRITEBYTECODE says.
sys.dont_write_bytecode = True

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

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


class HostReadError(RuntimeError):
    """A device value read on the host inside a checked region (a host sync on CUDA)."""


# What reads a device value on the host (each one a host sync on CUDA): a scalar out of a tensor
# (.item(), int(t), bool(t), float(t), `if t:`), a result whose size depends on the values
# (nonzero, masked_select, boolean indexing, unique, bincount, repeat_interleave), and a value
# compare that answers on the host (torch.equal).
_HOST_READ_OPS = frozenset({
    "_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "nonzero_static", "argwhere",
    "masked_select", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "bincount",
    "repeat_interleave",
})
_HOST_READ_METHODS = ("tolist", "numpy", "item", "cpu")


def _reads_by_mask(func, args) -> bool:
    """Indexing with a bool/uint8 mask: the selection's size is read on the host."""
    if func.overloadpacket.__name__ not in ("index", "index_put", "index_put_"):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices or ())


class _HostReadFunctions(TorchFunctionMode):
    """Tensor methods that hand a value to the host (``tolist``, ``item``, ...), refused."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_READ_METHODS and getattr(func, "__objclass__", None) is not None:
            raise HostReadError(f"Tensor.{name}() reads a device value on the host in a checked region")
        return func(*args, **(kwargs or {}))


class _HostReadDispatch(TorchDispatchMode):
    """The aten ops that read a value on the host (``_HOST_READ_OPS``, mask indexing), refused."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _HOST_READ_OPS or _reads_by_mask(func, args):
            raise HostReadError(f"aten.{name} reads a device value on the host in a checked region")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def sync_checked(cuda: bool):
    """A region in which reading a device value on the host is an error: CUDA's sync-debug
    "error" mode on a GPU; on a CPU, where nothing syncs, the two modes above refuse the same
    reads, so a CPU run catches a helper that would trip the GPU check. Whatever the region
    needs from the host (a size, a count) is read before it starts."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
    else:
        with _HostReadFunctions(), _HostReadDispatch():
            yield


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
# Step 1b: the worker's tree-step unit (ddtree_step.DDTreeStepRunner) from graphs
# ---------------------------------------------------------------------------


class _EagerUnit:
    """Without CUDA: the runner's graph interface, replaying the body eagerly."""

    def capture(self, body):
        body()
        self.body = body

    def replay(self):
        self.body()


def oversize_mask_numel(prefix_lens: list, W: int) -> int:
    """The verify mask's size for a batch: each row's window is W * (prefix + W)."""
    return sum(W * (int(p) + W) for p in prefix_lens)


def step_tree_step_unit(device, budget, cap, depth, vocab, seed, cuda: bool):
    """The worker's per-step tree unit as it runs in the server: the real
    ``DDTreeStepRunner`` captures ``ddtree_tree_step`` (support restriction,
    builder, retrieve, positions, the mask's tree window written into a
    persistent buffer) once per batch size under sync-debug "error", then
    replays full, padded and over-size batches of mixed greedy / sampled rows;
    every output and the mask window must equal the eager function's. On CUDA
    the replay and the eager step are timed with CUDA events."""
    from sglang.srt.speculative import ddtree_step, ddtree_verify

    W, context, sizes, max_bs = budget + 1, 4096, [1, 2, 4, 8], 8
    buffer = torch.zeros(max_bs * W * (context + W), dtype=torch.uint8, device=device)
    runner = ddtree_step.DDTreeStepRunner(budget=budget, topk_cap=cap, draft_len=depth, device=device,
                                          mask_buffer=buffer, mask_bs_limit=max_bs)
    gen = torch.Generator(device=device).manual_seed(seed)

    def inputs(bs):
        lp = torch.log_softmax(torch.randn(bs, depth, vocab, device=device, generator=gen) * 3, -1)
        top_lp, top_ids = torch.topk(lp, cap, dim=-1)
        top_k = torch.tensor([[1, 1 << 30, 20, 1 << 30][i % 4] for i in range(bs)], device=device)  # 1: greedy
        top_p = torch.tensor([[1.0, 0.9, 1.0, 0.7][i % 4] for i in range(bs)], device=device)
        bonus = torch.randint(0, vocab, (bs,), device=device, generator=gen)
        prefix = torch.randint(1, context, (bs,), device=device, generator=gen)
        return top_lp, top_ids, top_k, top_p, bonus, prefix

    def eager(args):
        mask = torch.zeros(oversize_mask_numel(args[5].tolist(), W), dtype=torch.uint8, device=device)
        return ddtree_verify.ddtree_tree_step(*args, mask, budget, cap), mask

    eager(inputs(2))  # the builder's per-shape plan, cached before any capture
    with sync_checked(cuda):
        runner.capture(sizes, ddtree_step.cuda_graph_factory() if cuda else _EagerUnit)
    checks = []
    for bs in (8, 3, 1, 6, 11):
        args = inputs(bs)
        # The over-size batch's mask is sized from the host's copy of the lengths, read here as
        # the scheduler has them on the host, not from the device tensor inside the region.
        numel = oversize_mask_numel(args[5].tolist(), W)
        with sync_checked(cuda):
            out, mask = runner.run(*args, mask_numel=lambda n=numel: n)
        want, want_mask = eager(args)
        idx = du.ddtree_window_mask_index(args[5], W)
        equal = {name: bool(torch.equal(a, b)) for name, a, b in zip(out._fields, out, want, strict=True)}
        equal["mask_window"] = bool(torch.equal(mask[idx], want_mask[idx]))
        checks.append({"bs": bs, "graph_bs": runner.graph_bs(bs), "equal": equal})
    ok = all(all(c["equal"].values()) for c in checks)
    res = {"status": "ok" if ok else "failed", "captured": runner.capture_bs, "checks": checks,
           "shape": {"budget": budget, "topk_cap": cap, "depth": depth, "vocab": vocab, "context": context}}
    if cuda:  # bs 8, inputs already on the device: the copies + replay against the eager unit
        args = inputs(8)
        mask = torch.zeros_like(buffer)
        res["replay_ms"] = round(_median_events(lambda: runner.run(*args, mask_numel=lambda: 0), 50, 5)[0], 4)
        res["eager_ms"] = round(_median_events(
            lambda: ddtree_verify.ddtree_tree_step(*args, mask, budget, cap), 20, 5)[0], 4)
        res["eager_over_replay"] = round(res["eager_ms"] / res["replay_ms"], 2)
    res["summary"] = (f"captured at bs {runner.capture_bs} under sync-debug 'error'; replays (full, padded) and "
                      f"an eager over-size batch {'equal' if ok else 'NOT equal'} to the eager unit")
    return res


def step_accept_kernels(device, seed, cuda: bool):
    """The accept's two Triton kernels (payload 2.2) on the device against their plain-torch
    step: ``ddtree_commit_step`` on random walks (paths in place, padded, every length) and the
    one-launch KV move on bf16 buffers shaped as Kimi K2.6's MLA rows (latent 512 + rope 64)
    against a gather-then-scatter, both under the sync check. On a CPU only the torch path
    runs (the kernels need CUDA here), so the unit compares torch with torch: recorded so."""
    from sglang.srt.speculative import ddtree_verify as dv

    gen = torch.Generator().manual_seed(seed)
    use_triton = cuda and dv.triton is not None
    checks = []
    for bs, W, S, width in ((1, 17, 16, 16), (8, 17, 16, 16), (33, 17, 16, 16)):
        num = torch.randint(0, S, (bs,), generator=gen)
        accept_index = torch.full((bs, S), -1, dtype=torch.int32)
        for b in range(bs):
            nodes = sorted(torch.randperm(W - 1, generator=gen)[: int(num[b])].add(1).tolist())
            if b % 3 == 0:
                nodes = list(range(1, int(num[b]) + 1))  # already in place
            accept_index[b, : len(nodes) + 1] = torch.tensor([0] + nodes, dtype=torch.int32) + b * W
        args = [torch.randint(0, 1000, (bs * W,), dtype=torch.int32, generator=gen), accept_index,
                (num + 1).to(torch.int32), torch.randperm(4 * bs * W, generator=gen)[: bs * W],
                torch.randint(1, 200, (bs,), generator=gen)]
        dev_args = [a.to(device) for a in args]
        with sync_checked(cuda):
            got = dv.ddtree_commit_step(*dev_args, width, use_triton=use_triton)
        want = dv.ddtree_commit_step(*args, width, use_triton=False)
        equal = all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))
        moved = None
        if use_triton:
            slots = 4 * bs * W
            bufs = [torch.randn(slots, 1, 576, generator=gen).to(torch.bfloat16).to(device) for _ in range(3)]
            ref = [b.clone() for b in bufs]
            with sync_checked(cuda):
                dv.move_kv_rows(dv.kv_move_table(bufs), got.kv_tgt, got.kv_src, S)
            for r in ref:
                r[got.kv_tgt] = r[got.kv_src].clone()
            moved = all(torch.equal(a, b) for a, b in zip(bufs, ref, strict=True))
        checks.append({"bs": bs, "commit_equal": equal, "move_equal": moved})
    ok = all(c["commit_equal"] and c["move_equal"] in (True, None) for c in checks)
    return {"status": "ok" if ok else "failed", "triton": use_triton, "checks": checks,
            "summary": (f"commit {'kernel' if use_triton else 'torch path'} and "
                        f"{'the one-launch move' if use_triton else 'no move (CPU)'} "
                        f"{'equal' if ok else 'NOT equal'} to the torch step")}


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
# Step 5: SGLang's triton extend-attention kernel on the DDTree verify mask
# ---------------------------------------------------------------------------

# Staged by gpu_kernels_prepare.sh from the sglang 0.5.23 wheel into <carry>/sglang_py/attention,
# loaded in this order under their own module names.
ATTENTION_PKG = "sglang.kernels.ops.attention"
ATTENTION_FILES = ("score_mod.py", "decode_attention.py", "extend_attention.py")
# Everything else those files import from sglang at module level, and what stands in for it
# here (the lent machine has no sglang): the same answers sglang/srt/utils/common.py gives on
# an NVIDIA machine; ``envs`` is read only on ROCm paths, so the stand-in raises if reached.
ATTENTION_STUBBED = {
    "sglang.srt.environ": ("envs",),
    "sglang.srt.utils": ("get_device_core_count", "is_cuda", "is_gfx95_supported",
                         "is_gfx1250_supported", "is_hip"),
}


class _EnvsStandIn:
    def __getattr__(self, name):
        class _Var:
            def get(self):
                raise RuntimeError(f"sglang.srt.environ.envs.{name} read: a ROCm-only path was taken "
                                   "(bench/gpu_kernels.py stands in for sglang.srt.environ)")
        return _Var()


def _utils_standin():
    import types

    m = types.ModuleType("sglang.srt.utils")
    m.is_hip = lambda: torch.version.hip is not None
    m.is_cuda = lambda: torch.cuda.is_available() and torch.version.cuda is not None

    def not_rocm():  # is_gfx95_supported / is_gfx1250_supported: False on every non-HIP build
        if torch.version.hip:
            raise RuntimeError("ROCm: bench/gpu_kernels.py's sglang.srt.utils stand-in has no gcnArchName check")
        return False

    m.is_gfx95_supported = m.is_gfx1250_supported = not_rocm
    m.get_device_core_count = lambda device_id=0: (
        torch.cuda.get_device_properties(device_id).multi_processor_count if torch.cuda.is_available() else 0)
    return m


def attention_sglang_imports(folder: pathlib.Path) -> dict:
    """``{module: names}`` that the staged files import from sglang at module level."""
    import ast

    found: dict = {}
    for f in ATTENTION_FILES:
        for node in ast.parse((folder / f).read_text()).body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang"):
                found.setdefault(node.module, set()).update(a.name for a in node.names)
            elif isinstance(node, ast.Import) and any(a.name.startswith("sglang") for a in node.names):
                found.setdefault("import", set()).update(a.name for a in node.names)
    return {k: sorted(v) for k, v in found.items()}


def check_attention_imports(folder: pathlib.Path) -> None:
    own = {f"{ATTENTION_PKG}.{f[:-3]}" for f in ATTENTION_FILES}
    unknown = {m: names for m, names in attention_sglang_imports(folder).items()
               if m not in own and not set(names) <= set(ATTENTION_STUBBED.get(m, ()))}
    if unknown:
        raise RuntimeError(f"the staged attention files import {unknown} from sglang, which "
                           "bench/gpu_kernels.py does not stand in for: update ATTENTION_STUBBED")


def load_extend_attention(carry: pathlib.Path):
    """SGLang 0.5.23's ``extend_attention`` module from the carried wheel files. Their
    ``sglang.*`` imports resolve, during the load only, to each other and to the stand-ins
    above; ``sys.modules`` is restored afterwards (the patch set's ``sglang`` namespace, which
    ``bench_payload`` imports, is left as it was)."""
    import types

    folder = carry / "sglang_py" / "attention"
    missing = [f for f in ATTENTION_FILES if not (folder / f).exists()]
    if missing:
        raise FileNotFoundError(f"{folder} lacks {missing}: run bench/gpu_kernels_prepare.sh")
    check_attention_imports(folder)
    environ = types.ModuleType("sglang.srt.environ")
    environ.envs = _EnvsStandIn()
    temp = {"sglang.srt.environ": environ, "sglang.srt.utils": _utils_standin()}
    for name in ("sglang.kernels", "sglang.kernels.ops", ATTENTION_PKG):
        temp[name] = types.ModuleType(name)
        temp[name].__path__ = [str(folder)] if name == ATTENTION_PKG else []
    loaded = {}
    saved = {k: sys.modules.get(k) for k in list(temp) + [f"{ATTENTION_PKG}.{f[:-3]}" for f in ATTENTION_FILES]}
    try:
        sys.modules.update(temp)
        for f in ATTENTION_FILES:
            name = f"{ATTENTION_PKG}.{f[:-3]}"
            spec = importlib.util.spec_from_file_location(name, folder / f)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
            loaded[f[:-3]] = mod
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return loaded["extend_attention"]


def emulated_extend_attention(q, k, v, o, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, mask, is_causal,
                              mask_indptr, max_len_extend, k_scale, v_scale, sm_scale, *,
                              skip_prefix_custom_mask=True, **_unused):
    """What ``extend_attention_fwd`` computes for a TARGET_VERIFY batch, in torch: each row
    reads its FULL_MASK row (``mask_indptr``, rows ``prefix + n`` long), the prefix through
    ``kv_indices`` (all of it when ``skip_prefix_custom_mask``), its own request's tokens from
    ``k``/``v``. The CPU smoke's stand-in when neither CUDA nor Triton's interpreter runs the
    real kernel (the tree mask is lower triangular, so the kernel's causal tile bound changes
    nothing)."""
    qo, kvp, mip = qo_indptr.tolist(), kv_indptr.tolist(), mask_indptr.tolist()
    group = q.shape[1] // k.shape[1]
    for b in range(len(qo) - 1):
        q0, q1, k0, k1 = qo[b], qo[b + 1], kvp[b], kvp[b + 1]
        n, p = q1 - q0, k1 - k0
        allowed = mask[mip[b]: mip[b] + n * (p + n)].view(n, p + n) != 0
        if skip_prefix_custom_mask:
            allowed[:, :p] = True
        slots = kv_indices[k0:k1]
        keys = torch.cat([k_buf[slots], k[q0:q1]]).double() * k_scale
        vals = torch.cat([v_buf[slots], v[q0:q1]]).double() * v_scale
        o[q0:q1] = dense_attention(q[q0:q1].double(), keys, vals, allowed, sm_scale, group).to(o.dtype)


def dense_attention(q, keys, vals, allowed, scale, group):
    """q [n, H, D], keys [m, Hkv, D], vals [m, Hkv, Dv], allowed [n, m] -> [n, H, Dv]."""
    n, h, d = q.shape
    qg = q.view(n, h // group, group, d)
    s = torch.einsum("ikgd,jkd->kgij", qg, keys) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("kgij,jkd->ikgd", p, vals).reshape(n, h, vals.shape[-1])


def tree_ancestors(parents: list) -> list:
    """Ancestors-or-self of every node, walking the parent pointers (padding: itself)."""
    out = []
    for i in range(len(parents)):
        seen, j = set(), i
        while j >= 0 and j not in seen:
            seen.add(j)
            j = parents[j] if j > 0 else -1
        out.append(seen)
    return out


# A row passes when |out - ref| <= atol + rtol * |ref| everywhere (float64 reference on the same
# inputs). bf16: the kernel rounds p to bf16 before P.V (up to 2^-9 of max |v|, absolute) and
# the output to bf16 (2^-9 relative).
TREE_ATTN_TOL = {torch.float32: 2e-4, torch.bfloat16: 1.5e-2}  # atol
TREE_ATTN_RTOL = {torch.float32: 1e-4, torch.bfloat16: 8e-3}


def tree_attention_configs(smoke: bool) -> list:
    """DeepSeek-V3 / Kimi-style MLA per TP rank (1 latent KV head, Lq 576 = 512 + 64 rope,
    Lv 512) at W = 17 and 65, and a GQA MHA; each a verify batch through the persistent mask
    buffer, one bigger than the graph batch (a fresh mask) and graph replays with padded
    rows. One short prefix per batch keeps the controls' effect far above bf16 noise. The
    smoke shapes are float32: Triton 3.8's interpreter computes bf16 ``tl.dot`` wrongly."""
    if smoke:
        base = {"depth": 3, "vocab": 40, "block": 4, "ctx": 96, "capture_bs": [2, 4]}
        return [
            {**base, "name": "mla_w9", "kind": "mla", "heads": 2, "kv_heads": 1, "dq": 576, "dv": 512,
             "budget": 8, "cap": 3, "dtype": "float32", "eager": [[5, 29, 50], [3, 1, 5], [0]],
             "fresh": [[23, 2, 41, 9, 17], [2, 6, 1, 4, 7], [3]],
             "replays": [[[12, 64, 30], [5, 2, 7], [1]]]},
            {**base, "name": "mha_gqa_w9", "kind": "mha", "heads": 4, "kv_heads": 2, "dq": 64, "dv": 64,
             "budget": 8, "cap": 4, "dtype": "float32", "eager": [[6, 45, 3], [2, 4, 1], [2]],
             "fresh": [[17, 3, 8, 30, 11], [6, 3, 1, 2, 5], []],
             "replays": [[[9, 70, 33], [4, 2, 6], [0]]]},
        ]
    base = {"depth": 15, "vocab": 64, "block": 16, "ctx": 8192, "capture_bs": [4, 8], "dtype": "bfloat16"}
    mla = {**base, "kind": "mla", "heads": 16, "kv_heads": 1, "dq": 576, "dv": 512}
    eager = [[3000, 5, 1500, 4096, 2222, 777, 64, 3333], [3, 1, 5, 7, 2, 8, 4, 6], [6]]
    fresh = [[2048, 9, 3500, 120, 5000, 2600, 1024, 4000, 700, 3100],
             [9, 2, 10, 5, 1, 3, 8, 4, 7, 6], [2]]
    replays = [[[4100, 7, 2500, 900, 3000, 1800, 60], [4, 8, 1, 9, 2, 6, 3], [1]],
               [[6, 5000, 2048], [7, 3, 5], []]]
    return [
        {**mla, "name": "mla_h16_w17", "budget": 16, "cap": 4, "eager": eager, "fresh": fresh, "replays": replays},
        {**mla, "name": "mla_h16_w65", "budget": 64, "cap": 8, "eager": eager, "fresh": fresh, "replays": replays},
        {**base, "name": "mha_h8_kv2_d128_w65", "kind": "mha", "heads": 8, "kv_heads": 2, "dq": 128, "dv": 128,
         "budget": 64, "cap": 8, "eager": eager, "fresh": fresh, "replays": replays},
    ]


class TreeAttnEnv:
    """A KV pool behind a req_to_token table (a random, non-contiguous slot mapping; row 0
    is the padding row), the triton backend's persistent buffers for a graph batch ``G``,
    and the kernel (the real one, or the torch emulation)."""

    def __init__(self, cfg, device, kernel, seed):
        self.cfg, self.device, self.kernel = cfg, device, kernel
        self.dtype = getattr(torch, cfg["dtype"])
        self.W = cfg["budget"] + 1
        self.G = max(cfg["capture_bs"])
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        rows = 1 + max(max(e[1]) for e in [cfg["eager"], cfg["fresh"], *cfg["replays"]])
        width = cfg["ctx"] + self.W
        self.rtt = (torch.randperm(rows * width, generator=self.gen) + 1).view(rows, width).to(torch.int32)
        slots = rows * width + 1  # slot 0: where padded rows write
        self.k_buf = self._randn(slots, cfg["kv_heads"], cfg["dq"])
        # MLATokenToKVPool.get_value_buffer: the first kv_lora_rank columns of the same rows
        self.v_buf = (self.k_buf[..., : cfg["dv"]] if cfg["kind"] == "mla"
                      else self._randn(slots, cfg["kv_heads"], cfg["dv"]))
        self.rtt = self.rtt.to(device)
        self.scale = cfg["dq"] ** -0.5 * 1.7
        # TritonAttnBackend.__init__: kv_indptr int32 [max_bs + 1], qo_indptr and mask_indptr
        # int64; init_cuda_graph_state: kv_indices int64 [max_num_tokens * max_context_len],
        # the verify mask uint8 [G * W * (context + block + W)] (FULL_MASK, ddtree-temp sizing)
        self.kv_indptr = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.qo_indptr = torch.zeros(rows + 1, dtype=torch.int64, device=device)
        self.mask_indptr = torch.zeros(rows + 1, dtype=torch.int64, device=device)
        self.graph_kv_indices = torch.zeros(self.G * self.W * cfg["ctx"], dtype=torch.int64, device=device)
        self.mask_buffer = torch.zeros(self.G * self.W * (cfg["ctx"] + cfg["block"] + self.W),
                                       dtype=torch.uint8, device=device)

    def _randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.dtype).to(self.device)

    def garbage(self, n):
        """Random bytes, about half of them zero."""
        keep = torch.randint(0, 2, (n,), generator=self.gen, dtype=torch.uint8)
        return (keep * torch.randint(1, 256, (n,), generator=self.gen, dtype=torch.uint8)).to(self.device)

    def trees(self, bs, chains=()):
        """The payload's builder on random draft logits (``ddtree_prepare_verify``'s chain);
        requests in ``chains`` get one possible token per depth: a chain plus padding nodes."""
        c = self.cfg
        logits = torch.randn(bs, c["depth"], c["vocab"], generator=self.gen) * 3
        for b in chains:
            logits[b, :, 1:] = float("-inf")
        top = du.draft_topk_logprobs(logits.to(self.device), min(c["cap"], c["vocab"]))
        tree = du.build_ddtree_tree(top, c["budget"], c["cap"])
        return tree.parents, du.ddtree_tree_mask(tree.parents, max_depth=c["depth"])

    def qkv(self, n):
        c = self.cfg
        q = self._randn(n, c["heads"], c["dq"])
        k = self._randn(n, c["kv_heads"], c["dq"])
        # MLA (forward_absorb_core, non-absorbing backends): v is k_nope, k's first 512 columns
        v = k[..., : c["dv"]].clone() if c["kind"] == "mla" else self._randn(n, c["kv_heads"], c["dv"])
        return q, k, v

    def tree_loc(self, prefix, rpi):
        return torch.cat([self.rtt[r, p: p + self.W] for r, p in zip(rpi, prefix, strict=True)]).long()

    def gather_kv_indices(self, prefix, rpi, out):
        """The translator's passthrough pack (create_flashinfer_kv_indices_triton): each
        request's ``req_to_token`` row up to its prefix, back to back."""
        n = 0
        for r, p in zip(rpi, prefix, strict=True):
            out[n: n + p] = self.rtt[r, :p]
            n += p
        return out

    def save_kv(self, loc, k, v):
        """forward_extend saves the verify tokens' KV before the kernel (MLA: the 576 row)."""
        self.k_buf[loc] = k
        if self.cfg["kind"] != "mla":
            self.v_buf[loc] = v

    def call(self, q, k, v, o, qo, kvp, kvi, mask, mip, **over):
        """The call TritonAttnBackend.forward_extend makes on CUDA (not ROCm) in TARGET_VERIFY:
        is_causal=True, max_extend_len=W, unit KV scales, layer.scaling, no logit cap,
        sliding_window_size=-1, page_size=1, skip_prefix_custom_mask left at its default."""
        self.kernel(q, k, v, o, self.k_buf, self.v_buf, qo, kvp, kvi, mask, True, mip, self.W, 1.0, 1.0,
                    self.scale, logit_cap=0.0, sliding_window_size=-1, sinks=None, window_kv_offsets=None,
                    xai_temperature_len=-1, page_size=1, score_mod=None, aux_tensors=None,
                    extend_seq_lens_cpu=None, **over)

    def eager_meta(self, prefix, rpi):
        """init_forward_metadata, TARGET_VERIFY branch."""
        bs, W = len(prefix), self.W
        seq = torch.tensor(prefix, device=self.device)
        qo = torch.arange(0, (1 + bs) * W, step=W, dtype=torch.int32, device=self.device)
        kvi = self.gather_kv_indices(prefix, rpi, torch.empty(sum(prefix) + bs * W, dtype=torch.int64,
                                                              device=self.device))
        kvp = self.kv_indptr[: bs + 1]
        kvp[1:] = torch.cumsum(seq, dim=0)
        self.mask_indptr[1: bs + 1] = torch.cumsum(W * (seq + W), dim=0)
        return qo, kvp, kvi, self.mask_indptr[: bs + 1]

    def graph_meta_update(self, gbs, prefix, rpi, fill):
        """_update_target_verify_buffers on the runner's padded inputs (seq_lens padded with
        get_cuda_graph_seq_len_fill_value() = 1, req_pool_indices with 0)."""
        W, raw = self.W, len(prefix)
        prefix = list(prefix) + [fill] * (gbs - raw)
        rpi = list(rpi) + [0] * (gbs - raw)
        seq = torch.tensor(prefix, device=self.device)
        self.qo_indptr[: gbs + 1] = torch.arange(0, (1 + gbs) * W, step=W, dtype=torch.int32, device=self.device)
        self.kv_indptr[1: gbs + 1] = torch.cumsum(seq, dim=0)
        self.gather_kv_indices(prefix, rpi, self.graph_kv_indices)
        self.mask_indptr[1: gbs + 1] = torch.cumsum(W * (seq + W), dim=0)

    def reference(self, q, k, v, prefix, rpi, parents, *, chain=False):
        """float64 dense attention: node i of request b sees the whole prefix (through
        req_to_token) and its ancestors-or-self in the tree (``chain``: nodes 0..i)."""
        W, c = self.W, self.cfg
        out = torch.zeros(len(prefix) * W, c["heads"], c["dv"], dtype=torch.float64, device=self.device)
        for b, (p, r) in enumerate(zip(prefix, rpi, strict=True)):
            allowed = torch.zeros(W, p + W, dtype=torch.bool)
            allowed[:, :p] = True
            for i, anc in enumerate(tree_ancestors(parents[b])):
                allowed[i, [p + j for j in (range(i + 1) if chain else sorted(anc))]] = True
            out[b * W: (b + 1) * W] = self.reference_rows(q, k, v, b, p, r, allowed.to(self.device))
        return out

    def reference_rows(self, q, k, v, b, p, r, allowed):
        W = self.W
        rows = slice(b * W, (b + 1) * W)
        slots = self.rtt[r, :p].long()
        keys = torch.cat([self.k_buf[slots], k[rows]]).double()
        vals = torch.cat([self.v_buf[slots], v[rows]]).double()
        return dense_attention(q[rows].double(), keys, vals, allowed, self.scale,
                               self.cfg["heads"] // self.cfg["kv_heads"])


def _row_err(out, ref):
    """Per row: how far |out - ref| exceeds rtol * |ref| (rtol by ``out``'s dtype), at most;
    a row passes at <= atol."""
    n = ref.shape[0]
    diff = (out.reshape(-1, ref.shape[1], ref.shape[2])[:n].double() - ref).abs()
    return (diff - TREE_ATTN_RTOL[out.dtype] * ref.abs()).clamp(min=0).amax(dim=(1, 2))


def tree_attention_eager(env, prefix, rpi, chains, mask_kind):
    """One verify batch outside a graph: the tree window written into the persistent buffer
    (``fresh``: into a new ``torch.empty`` bool mask, the worker's path for batches the buffer
    cannot hold) over random stale bytes, then the kernel with the eager metadata."""
    W, bs = env.W, len(prefix)
    parents, tree_mask = env.trees(bs, chains)
    if mask_kind == "buffer":
        mask = env.mask_buffer
        mask.copy_(env.garbage(mask.numel()))
    else:
        mask = torch.empty(W * sum(prefix) + bs * W * W, dtype=torch.bool, device=env.device)
        mask.view(torch.uint8).copy_(env.garbage(mask.numel()))
    seq = torch.tensor(prefix, device=env.device)
    du.ddtree_write_window_mask(mask, tree_mask, seq)
    q, k, v = env.qkv(bs * W)
    loc = env.tree_loc(prefix, rpi)
    env.save_kv(loc, k, v)
    meta = env.eager_meta(prefix, rpi)
    o = torch.zeros(bs * W, env.cfg["heads"], env.cfg["dv"], dtype=env.dtype, device=env.device)
    qo, kvp, kvi, mip = meta
    env.call(q, k, v, o, qo, kvp, kvi, mask, mip)
    ref = env.reference(q, k, v, prefix, rpi, parents.tolist())
    return {"q": q, "k": k, "v": v, "o": o, "ref": ref, "mask": mask, "meta": meta, "seq": seq,
            "prefix": prefix, "rpi": rpi, "parents": parents.tolist(), "tree_mask": tree_mask,
            "err": _row_err(o, ref)}


def _rerun(env, run, mask=None, **over):
    o = torch.zeros_like(run["o"])
    qo, kvp, kvi, mip = run["meta"]
    env.call(run["q"], run["k"], run["v"], o, qo, kvp, kvi, run["mask"] if mask is None else mask, mip, **over)
    return o


def _wrong_bit_candidates(run, limit=64):
    """(request, node, column) triples: a real node i and a j < i that is not its ancestor,
    shortest prefixes first (there one key moves the output most)."""
    out = []
    for b in sorted(range(len(run["prefix"])), key=lambda b: (run["prefix"][b], b)):
        par = run["parents"][b]
        anc = tree_ancestors(par)
        out += [(b, i, j) for i in range(1, len(par)) if par[i] >= 0 for j in range(i) if j not in anc[i]]
        if out:
            return out[:limit]
    return out


def control_wrong_bit(env, run, tol):
    """Flip one window bit a real node reads (of the candidates, the one that moves the
    reference most): the kernel must follow that bit exactly (equal to the reference
    recomputed with it) and so miss the true reference at that row."""
    W = env.W
    best = None
    for b, i, j in _wrong_bit_candidates(run):
        p, r = run["prefix"][b], run["rpi"][b]
        allowed = torch.zeros(W, p + W, dtype=torch.bool)
        allowed[:, :p] = True
        for n, a in enumerate(tree_ancestors(run["parents"][b])):
            allowed[n, [p + x for x in a]] = True
        allowed[i, p + j] = True
        moved = env.reference_rows(run["q"], run["k"], run["v"], b, p, r, allowed.to(env.device))
        delta = float((moved[i] - run["ref"][b * W + i]).abs().max())
        if best is None or delta > best[0]:
            best = (delta, b, i, j, moved)
    if best is None:
        return {"ok": False, "why": "no node with a non-ancestor before it"}
    delta, b, i, j, moved = best
    flat = du.ddtree_window_mask_index(run["seq"], W)[b, i, j]
    old = run["mask"].view(-1)[flat].clone()
    run["mask"].view(-1)[flat] = 1
    try:
        o = _rerun(env, run)
    finally:
        run["mask"].view(-1)[flat] = old
    flipped_ref = run["ref"].clone()
    flipped_ref[b * W: (b + 1) * W] = moved
    err_true = float(_row_err(o, run["ref"])[b * W + i])
    err_flipped = float(_row_err(o, flipped_ref).max())
    return {"ok": err_true > 5 * tol and err_flipped <= tol, "request": b, "node": i, "col": j,
            "row_err_vs_true_reference": err_true, "max_err_vs_flipped_reference": err_flipped,
            "reference_delta": delta}


def control_prefix_mask(env, run, tol):
    """The prefix columns hold random stale bytes: with ``skip_prefix_custom_mask=False``
    the kernel would read them (and miss the reference), while a FULL_MASK whose prefix
    columns are all set (``ddtree_full_mask``) gives the reference either way, which also
    proves the window sits where the kernel reads it."""
    # uint8 like the buffer: the same kernel specialisations (fewer compiles on the GPU)
    full = du.ddtree_full_mask(run["tree_mask"], run["seq"], sum(run["prefix"])).to(torch.uint8)
    garbage_read = _rerun(env, run, skip_prefix_custom_mask=False)
    err_garbage = float(_row_err(garbage_read, run["ref"]).max())
    err_full_read = float(_row_err(_rerun(env, run, mask=full, skip_prefix_custom_mask=False), run["ref"]).max())
    err_full = float(_row_err(_rerun(env, run, mask=full), run["ref"]).max())
    return {"ok": err_garbage > 5 * tol and err_full_read <= tol and err_full <= tol,
            "garbage_prefix_read_max_err": err_garbage, "full_mask_prefix_read_max_err": err_full_read,
            "full_mask_default_max_err": err_full}


def control_chain(env, run, tol):
    """The trees are not chains: a causal-chain reference misses the kernel."""
    chain = env.reference(run["q"], run["k"], run["v"], run["prefix"], run["rpi"], run["parents"], chain=True)
    err = float(_row_err(run["o"], chain).max())
    return {"ok": err > 5 * tol, "max_err_vs_chain_reference": err}


def tree_stats(parents) -> dict:
    return {"padding_nodes": [sum(1 for x in row[1:] if x < 0) for row in parents],
            "distinct_trees": len({tuple(row) for row in parents})}


class _EagerGraph:
    """CPU stand-in for a captured graph: ``replay()`` runs the body again over the same
    static tensors (the smoke checks the replay logic; that the captured kernels follow the
    updated buffers is what only the GPU run proves)."""

    def __init__(self, body):
        self.replay = body


class TreeAttnGraph:
    """The verify kernel as the decode CUDA-graph runner replays it: one graph per captured
    batch size over static inputs (q, k, v, out_cache_loc) and the backend's persistent
    metadata; metadata updated in place outside the graph, as init_forward_metadata_out_graph
    does before each replay."""

    def __init__(self, env):
        self.env, self.graphs, self.fill = env, {}, 1
        c, n = env.cfg, env.G * env.W
        self.q, self.k, self.v = env.qkv(n)
        self.o = torch.zeros(n, c["heads"], c["dv"], dtype=env.dtype, device=env.device)
        self.loc = torch.zeros(n, dtype=torch.int64, device=env.device)

    def body(self, bs):
        env, n = self.env, bs * self.env.W
        env.save_kv(self.loc[:n], self.k[:n], self.v[:n])
        env.call(self.q[:n], self.k[:n], self.v[:n], self.o[:n], env.qo_indptr[: bs + 1], env.kv_indptr[: bs + 1],
                 env.graph_kv_indices, env.mask_buffer, env.mask_indptr[: bs + 1])

    def capture(self, bs):
        env = self.env
        env.graph_meta_update(bs, [], [], self.fill)
        if env.device.type != "cuda":
            self.body(bs)
            self.graphs[bs] = _EagerGraph(lambda: self.body(bs))
            return
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self.body(bs)  # compiles the kernel; a warm-up, as the runner does before capture
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.body(bs)
        torch.cuda.synchronize()
        self.graphs[bs] = g

    def replay(self, prefix, rpi, chains, tol):
        env, W, raw = self.env, self.env.W, len(prefix)
        gbs = min(b for b in self.graphs if b >= raw)
        # stale bytes everywhere, then the tree step's writes (DDTreeStepRunner): the live
        # windows and, for the padding rows, windows at prefix 0
        env.mask_buffer.copy_(env.garbage(env.mask_buffer.numel()))
        parents, tree_mask = env.trees(gbs, chains)
        du.ddtree_write_window_mask(env.mask_buffer, tree_mask,
                                    torch.tensor(list(prefix) + [0] * (gbs - raw), device=env.device))
        q, k, v = env.qkv(gbs * W)  # fresh inputs; the padded rows' are as arbitrary
        for static, new in ((self.q, q), (self.k, k), (self.v, v)):
            static[: gbs * W].copy_(new)
        self.loc.zero_()
        self.loc[: raw * W] = env.tree_loc(prefix, rpi)
        env.graph_meta_update(gbs, prefix, rpi, self.fill)
        self.o.fill_(float("nan"))  # the replay must write every row it owns
        self.graphs[gbs].replay()
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        ref = env.reference(q, k, v, prefix, rpi, parents.tolist()[:raw])
        err = float(_row_err(self.o, ref).max())
        pad = self.o[raw * W: gbs * W]
        return {"raw_bs": raw, "graph_bs": gbs, "prefix": list(prefix), "max_err": err,
                "padded_rows_finite": bool(torch.isfinite(pad).all()),
                "ok": err <= tol and bool(torch.isfinite(pad).all()),
                **tree_stats(parents.tolist()[:raw])}


def step_tree_attention(cfg, device, kernel, seed):
    """``kernel``: (function, name, its module or None), from :func:`tree_attention_kernel`."""
    fn, kernel_name, module = kernel
    env = TreeAttnEnv(cfg, device, fn, seed)
    tol = TREE_ATTN_TOL[env.dtype]
    out = {"config": {k: v for k, v in cfg.items() if k not in ("eager", "fresh", "replays")},
           "W": env.W, "kernel": kernel_name, "tolerance": {"atol": tol, "rtol": TREE_ATTN_RTOL[env.dtype]}}
    if module is not None:  # (BLOCK_DMODEL, BLOCK_DPE, BLOCK_DV, BLOCK_M, BLOCK_N, num_warps) here
        out["block_sizes"] = list(module._get_block_sizes_for_extend_attention(cfg["dq"], cfg["dv"]))
    for kind in ("buffer", "fresh"):
        prefix, rpi, chains = cfg["eager" if kind == "buffer" else "fresh"]
        run = tree_attention_eager(env, prefix, rpi, chains, kind)
        out[f"eager_{kind}_mask"] = {"bs": len(prefix), "max_err": float(run["err"].max()),
                                     "ok": float(run["err"].max()) <= tol, **tree_stats(run["parents"])}
        if kind == "buffer":  # now: the next batch rewrites the shared metadata and KV slots
            out["controls"] = {"wrong_bit": control_wrong_bit(env, run, tol),
                               "prefix_mask": control_prefix_mask(env, run, tol),
                               "chain": control_chain(env, run, tol)}
            stats = tree_stats(run["parents"])
            out["trees_irregular"] = {"ok": stats["distinct_trees"] > 1 and any(stats["padding_nodes"]), **stats}
    g = TreeAttnGraph(env)
    for bs in sorted(cfg["capture_bs"], reverse=True):
        g.capture(bs)
    out["graph_replays_kind"] = "CUDA graphs" if device.type == "cuda" else "eager stand-in (no CUDA)"
    out["graph_replays"] = [g.replay(p, r, ch, tol) for p, r, ch in cfg["replays"]]
    checks = [out["eager_buffer_mask"]["ok"], out["eager_fresh_mask"]["ok"], out["trees_irregular"]["ok"],
              *(c["ok"] for c in out["controls"].values()), *(r["ok"] for r in out["graph_replays"])]
    out["status"] = "ok" if all(checks) else "failed"
    worst = max([out["eager_buffer_mask"]["max_err"], out["eager_fresh_mask"]["max_err"]]
                + [r["max_err"] for r in out["graph_replays"]])
    caught = all(c["ok"] for c in out["controls"].values())
    rtol = TREE_ATTN_RTOL[env.dtype]
    out["summary"] = (f"{cfg['name']} W={env.W} {cfg['dtype']} [{kernel_name}]: max err {worst:.2e} "
                      f"(|out - ref| - {rtol} |ref|; atol {tol}) over eager (buffer and fresh mask) and "
                      f"{len(out['graph_replays'])} padded replays ({out['graph_replays_kind']}); "
                      f"controls {'caught' if caught else 'NOT caught'}")
    return out


def tree_attention_kernel(carry: pathlib.Path, cuda: bool):
    """(function, name, module): SGLang's kernel from the carry on CUDA, or under Triton's
    interpreter (TRITON_INTERPRET=1) on the CPU; otherwise the torch emulation."""
    if cuda or os.environ.get("TRITON_INTERPRET") == "1":
        ea = load_extend_attention(carry)
        name = "sglang 0.5.23 extend_attention_fwd" + ("" if cuda else " (Triton interpreter)")
        return ea.extend_attention_fwd, name, ea
    return emulated_extend_attention, "torch emulation (no CUDA, no TRITON_INTERPRET=1)", None


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
    ap.add_argument("--tree-attention-only", action="store_true",
                    help="only the tree_attention_* steps (with --cpu-smoke and TRITON_INTERPRET=1: the real "
                         "kernel from --carry under Triton's interpreter, small shapes)")
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

    if args.tree_attention_only:
        run_tree_attention_steps(rec, args, device, cuda)
        return finish(rec, meta, t_start)
    rec.run("builder_eager", lambda: step_builder_eager(device, bs, budget, cap, depth, vocab, args.seed))
    rec.run("reference_test_vector", lambda: step_test_vector(torch.device("cpu"), None, seed=args.seed))
    rec.run("graph_capture", lambda: step_graph_capture(device, bs, budget, cap, depth, vocab, args.seed),
            skip=None if cuda else SKIP_NO_CUDA)
    for unit_budget, unit_cap in ((16, 4), (64, 8)):  # CT200's tree, the default budget
        rec.run(f"tree_step_unit_b{unit_budget}",
                lambda b=unit_budget, k=unit_cap: step_tree_step_unit(
                    device, b, k, depth, vocab if cuda else 64, args.seed, cuda),
                min_time_s=15)
    rec.run("accept_kernels", lambda: step_accept_kernels(device, args.seed, cuda))
    run_tree_attention_steps(rec, args, device, cuda)
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

    return finish(rec, meta, t_start)


def run_tree_attention_steps(rec: Recorder, args, device, cuda: bool) -> None:
    """One step per configuration (tree_attention_<name>); the kernel is loaded once."""
    state = {}

    def load():
        if "kernel" not in state:
            state["kernel"] = tree_attention_kernel(pathlib.Path(args.carry), cuda)
        return state["kernel"]

    for i, cfg in enumerate(tree_attention_configs(smoke=not cuda)):
        rec.run(f"tree_attention_{cfg['name']}",
                lambda cfg=cfg, i=i: step_tree_attention(cfg, device, load(), args.seed + 100 + i),
                min_time_s=0 if not cuda else 45)


def finish(rec: Recorder, meta: dict, t_start: float) -> int:
    meta["total_wall_s"] = round(time.monotonic() - t_start, 1)
    rec.write()
    print("\n" + render_markdown({"meta": meta, "steps": rec.steps}), flush=True)
    print(f"[gpu_kernels] wrote {rec.out_dir / 'gpu_kernels.json'} and gpu_kernels.md", flush=True)
    failed = [k for k, v in rec.steps.items() if v["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
