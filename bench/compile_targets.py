#!/usr/bin/env python3
"""Every Triton kernel of the DDTree tree path, compiled ahead of time on a CPU for the two chips
it is served on, against each chip's limits.

    .venv-sglang/bin/python bench/compile_targets.py            # writes bench/results/compile_targets.{md,json}
    .venv-sglang/bin/python bench/compile_targets.py --json --out /tmp/ct

A kernel that needs more shared memory than its chip has per block (or more registers than a
block may hold) fails at its first launch, on every rank, while serving: Triton raises
``OutOfResources`` when it loads the binary, not when it compiles. SGLang picks the extend
attention's block sizes from the GPU's compute capability (sm_120, CT200's RTX PRO 6000, has
about 99 KB per block where Hopper has 227 KB), so a check on an H200 compiles Hopper's sizes
and proves nothing for sm_120. This script compiles each kernel for each target the way the
server would: SGLang 0.5.23's own wrappers are called with CPU tensors of the served shapes and
dtypes, the modules' platform flags set as on that chip (``_is_cuda``, ``CUDA_CAPABILITY``), and
Triton's JIT compiles for that target instead of launching (``compile_only``: a driver that
names the target, and ``JITFunction.run`` with ``warmup=True``). The PTX goes through the
wheel's own ptxas with Triton's flags (``-v``) for registers and spills; shared memory is the
compiled kernel's own figure (``metadata.shared``).

The kernels (``TREE_PATH``): the target verify's extend attention with the tree mask (MLA as
Kimi K2.6 / DeepSeek-V3 per TP rank, Lq 576 / Lv 512, at W 17 and 65, and a GQA MHA at W 65;
bf16, the verify mask uint8 at every batch size), the verify and draft windows' cache locations
(``assign_extend_cache_locs``, also behind ``fill_front_out_cache_loc_func``), the accept's
bookkeeping (the patch set's ``_ddtree_commit_kernel``: the committed block, the KV move's lists,
the front rows' indices) and its one-launch KV move (``_ddtree_move_kv_kernel``, MLA rows) and,
for a model with a final logit
softcap under TP, the greedy verify's row maxima (``softcap_row_argmax``). (0.5.23's own MLA pool moves KV in a torch
loop over its layers; the patch set's move kernel replaces it for the tree's accepted path.)

Limits (CUDA C Programming Guide, technical specifications per compute capability): shared
memory per block 227 KB (232,448 B) on 9.0, 99 KB (101,376 B) on 12.0; 255 registers per
thread and 64 K registers per block on both.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.dont_write_bytecode = True  # nothing may leave bytecode under patches/ (gpu_kernels loads from there)
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    arch: int  # compute capability, 90 = 9.0
    chip: str
    smem_per_block: int  # bytes, the opt-in maximum a kernel may ask for
    regs_per_thread: int = 255
    regs_per_block: int = 65536


TARGETS = (
    Target("sm_90", 90, "H200 / H100 (Hopper)", 232_448),
    Target("sm_120", 120, "RTX PRO 6000 Blackwell (CT200)", 101_376),
)


# -- compiling for a target instead of launching ---------------------------------------------


class _CompileOnlyDriver:
    """What Triton's JIT asks the active driver for, answered for a GPU that is not here. The
    device id is the arch: the JIT caches its binder (and target) per device."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.arch = arch
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return self.arch

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


_ABSENT = object()


@contextlib.contextmanager
def _attrs(obj, **values):
    """``obj``'s attributes set for the block (one absent before is removed after)."""
    saved = {k: getattr(obj, k, _ABSENT) for k in values}
    for k, v in values.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is _ABSENT:
                delattr(obj, k)
            else:
                setattr(obj, k, v)


@contextlib.contextmanager
def compile_only(target: Target, compiled: list):
    """Inside: every Triton launch compiles for ``target`` and appends ``(name, kernel)`` to
    ``compiled`` instead of running; SGLang's kernel modules see the platform of that chip."""
    import triton
    from sglang.kernels.ops.attention import extend_attention
    from sglang.kernels.ops.speculative import cache_locs
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    real_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    capability = (target.arch // 10, target.arch % 10)
    saved = driver._active  # reset_active() would build the default driver, which needs a GPU
    driver.set_active(_CompileOnlyDriver(target.arch))
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_attrs(JITFunction, run=run))
            stack.enter_context(_attrs(extend_attention, _is_cuda=True, CUDA_CAPABILITY=capability))
            stack.enter_context(_attrs(cache_locs, _is_cuda=True, _is_cpu=False))
            yield
    finally:
        driver._active = saved
    assert triton  # imported for its side effects on the driver registry


# -- the tree path's launches, as the server makes them ---------------------------------------


def _attention_launches(block_override=None, fresh_mask_dtype=None, only=None):
    """TARGET_VERIFY's extend attention (TritonAttnBackend.forward_extend on CUDA), per shape:
    one batch through the persistent uint8 verify mask and one over-size batch with a fresh
    mask of the tree step's dtype (one compile for both when the dtypes agree).
    ``block_override`` (BLOCK_M, BLOCK_N), ``fresh_mask_dtype`` and ``only`` (config names) are
    for what-ifs: another chip's block sizes, another mask dtype, fewer shapes."""
    import gpu_kernels as gk
    from sglang.kernels.ops.attention import extend_attention

    ddtree_step = _patch_set_module("ddtree_step")

    def kernel(*args, **kwargs):
        if block_override is None:
            return extend_attention.extend_attention_fwd(*args, **kwargs)
        real = extend_attention._get_block_sizes_for_extend_attention

        def forced(lq, lv):
            dm, dpe, dv, _, _, warps = real(lq, lv)
            return (dm, dpe, dv, *block_override, warps)

        with _attrs(extend_attention, _get_block_sizes_for_extend_attention=forced):
            return extend_attention.extend_attention_fwd(*args, **kwargs)

    fresh_dtype = ddtree_step.MASK_DTYPE if fresh_mask_dtype is None else fresh_mask_dtype
    launches = []
    for cfg in gk.tree_attention_configs(smoke=False):
        if only is not None and cfg["name"] not in only:
            continue
        cfg = {**cfg, "ctx": 256}  # the prefix length changes no compiled code, only the grid

        def launch(cfg=cfg):
            env = gk.TreeAttnEnv(cfg, torch.device("cpu"), kernel, seed=0)
            for bs, mask_of in ((2, "buffer"), (env.G + 1, "fresh")):
                prefix, rpi = [40 + 7 * i for i in range(bs)], list(range(1, bs + 1))
                qo, kvp, kvi, mip = env.eager_meta(prefix, rpi)
                q, k, v = env.qkv(bs * env.W)
                o = torch.empty(bs * env.W, cfg["heads"], cfg["dv"], dtype=env.dtype)
                mask = env.mask_buffer if mask_of == "buffer" else torch.zeros(int(mip[-1]), dtype=fresh_dtype)
                env.call(q, k, v, o, qo, kvp, kvi, mask, mip)

        launches.append((f"extend_attention {cfg['name']}", launch))
    return launches


def _index_launches():
    from sglang.kernels.ops.speculative import cache_locs

    bs, W, block, width = 8, 17, 16, 512
    rtt = torch.arange(bs * width, dtype=torch.int32).view(bs, width)
    rpi = torch.arange(bs, dtype=torch.int64)
    prefix = torch.full((bs,), 100, dtype=torch.int64)

    def verify_window():  # ddtree_verify_input: the tree's W slots
        cache_locs.assign_extend_cache_locs_func(
            req_pool_indices=rpi, req_to_token=rtt, start_offset=prefix, end_offset=prefix + W,
            batch_size=bs, draft_token_num=W, device="cpu")

    def draft_block():  # ddtree_draft_block: DFlash's block
        cache_locs.assign_extend_cache_locs_func(
            req_pool_indices=rpi, req_to_token=rtt, start_offset=prefix, end_offset=prefix + block,
            batch_size=bs, draft_token_num=block, device="cpu")

    def accept_move():  # ddtree_commit_step: the commit, the KV move's lists, the front rows
        verify = _patch_set_module("ddtree_verify")
        accept_index = torch.zeros(bs, block, dtype=torch.int32)  # S = max depth + 1
        verify.ddtree_commit_step(torch.zeros(bs * W, dtype=torch.int32), accept_index,
                                  torch.ones(bs, dtype=torch.int32), torch.arange(bs * W, dtype=torch.int64),
                                  prefix, block, use_triton=True)
        # the one-launch move over Kimi K2.6's MLA rows (latent 512 + rope 64, bf16) per layer
        layers = [torch.zeros(64, 1, 576, dtype=torch.bfloat16) for _ in range(2)]
        moves = torch.zeros(bs * block, dtype=torch.int64)
        verify.move_kv_rows(verify.kv_move_table(layers), moves, moves, block)

    return [("cache locs: verify window", verify_window), ("cache locs: draft block", draft_block),
            ("accept: commit and KV move lists", accept_move)]


def _greedy_launches():
    """The deferred greedy verify (a model with a final logit softcap, under TP): each rank's
    row maxima of its vocabulary shard (``LogitsProcessor.deferred_argmax``)."""
    from sglang.kernels.ops.sampling.softcap_row_argmax import softcap_row_argmax

    def row_maxima():  # bs 8 x W 17 rows, a 163,840 vocabulary over 8 ranks
        logits = torch.zeros(8 * 17, 163_840 // 8, dtype=torch.float32)
        softcap_row_argmax(logits, 30.0, logits.shape[1], 0)

    return [("greedy verify: row maxima (deferred gather)", row_maxima)]


TREE_PATH = (_attention_launches, _index_launches, _greedy_launches)


def _patch_set_module(name: str):
    """A module the patch set adds to ``sglang.srt.speculative`` (a namespace package), found
    beside the installed SGLang's own: the added modules import only torch and each other."""
    import importlib

    import sglang.srt.speculative as speculative

    folder = str(ROOT / "patches" / "ddtree-temp" / "files" / "sglang" / "srt" / "speculative")
    if folder not in list(speculative.__path__):
        speculative.__path__.append(folder)
    return importlib.import_module(f"sglang.srt.speculative.{name}")


# -- what each compiled kernel needs ----------------------------------------------------------


def ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers and spills of the kernel's PTX, through the wheel's ptxas with Triton's flags."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as d:
        src = pathlib.Path(d) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                            f"--gpu-name={sm_arch_from_capability(arch)}", str(src), "-o", str(src) + ".o"],
                           capture_output=True, text=True, timeout=600, check=True)
    log = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    smem = re.search(r"(\d+) bytes smem", log)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spill.group(1)) if spill else None,
            "spill_load_bytes": int(spill.group(2)) if spill else None,
            "static_smem_bytes": int(smem.group(1)) if smem else 0}


def _constexprs(kernel) -> dict:
    consts = getattr(kernel.src, "constants", {}) or {}
    out = {}
    for key, value in consts.items():
        name = kernel.src.fn.arg_names[key[0]] if isinstance(key, tuple) else str(key)
        if name.startswith("BLOCK") and isinstance(value, int):
            out[name] = value
    return out


def _mask_dtype(kernel):
    sig = getattr(kernel.src, "signature", {}) or {}
    return sig.get("mask_ptr")


def verdict(row: dict, target: Target) -> list:
    """What in ``row`` exceeds ``target`` (empty: it fits)."""
    over = []
    if row["shared_bytes"] > target.smem_per_block:
        over.append(f"shared memory {row['shared_bytes']} B > {target.smem_per_block} B per block")
    if row["registers"] is not None:
        if row["registers"] > target.regs_per_thread:
            over.append(f"{row['registers']} registers per thread > {target.regs_per_thread}")
        if row["registers"] * row["threads"] > target.regs_per_block:
            over.append(f"{row['registers']} x {row['threads']} threads registers > {target.regs_per_block} per block")
    return over


def compile_launch(label: str, launch, target: Target) -> list:
    compiled: list = []
    with compile_only(target, compiled):
        launch()
    rows, seen = [], set()
    for name, kernel in compiled:
        if kernel.hash in seen:  # the same specialization launched again: one compile
            continue
        seen.add(kernel.hash)
        md = kernel.metadata
        usage = ptxas_usage(kernel.asm["ptx"], target.arch)
        row = {"site": label, "kernel": name, "target": target.name, "chip": target.chip,
               "num_warps": md.num_warps, "num_stages": md.num_stages, "threads": md.num_warps * 32,
               "shared_bytes": int(md.shared) + usage["static_smem_bytes"], "shared_limit": target.smem_per_block,
               **{k: usage[k] for k in ("registers", "spill_store_bytes", "spill_load_bytes")},
               "blocks": _constexprs(kernel), "mask_dtype": _mask_dtype(kernel),
               "specializations_at_site": len({k.hash for n, k in compiled if n == name})}
        row["over"] = verdict(row, target)
        rows.append(row)
    return rows


def compile_all(targets=TARGETS) -> list:
    rows = []
    for target in targets:
        for sites in TREE_PATH:
            for label, launch in sites():
                rows.extend(compile_launch(label, launch, target))
    return rows


def what_ifs() -> list:
    """Rows that are not served, for comparison: Hopper's MLA tiles (BLOCK_M 32, BLOCK_N 64)
    compiled for sm_120, what a check run on an H200 alone would have vouched for."""
    sm120 = next(t for t in TARGETS if t.arch == 120)
    (label, launch), = _attention_launches(block_override=(32, 64), only=["mla_h16_w17"])
    return [{**r, "site": f"{label}, Hopper's tiles (what-if)"} for r in compile_launch(label, launch, sm120)]


def _table(rows: list) -> list:
    lines = ["| site | kernel | target | warps | stages | BLOCK sizes | mask | shared / limit (B) | registers | "
             "spills (st/ld B) | fits |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        blocks = ", ".join(f"{k[6:] or k}={v}" for k, v in sorted(r["blocks"].items())) or "-"
        lines.append(
            f"| {r['site']} | `{r['kernel']}` | {r['target']} | {r['num_warps']} | {r['num_stages']} | {blocks} | "
            f"{r['mask_dtype'] or '-'} | {r['shared_bytes']:,} / {r['shared_limit']:,} | {r['registers']} | "
            f"{r['spill_store_bytes']}/{r['spill_load_bytes']} | "
            f"{'yes' if not r['over'] else '**NO**: ' + '; '.join(r['over'])} |")
    return lines


def render_markdown(rows: list, meta: dict, ifs: list = ()) -> str:
    over = [r for r in rows if r["over"]]
    spills = [r for r in rows if r["spill_store_bytes"]]
    lines = ["# The tree path's Triton kernels, compiled for each chip (bench/compile_targets.py)", "",
             "`.venv-sglang/bin/python bench/compile_targets.py` (on a CPU: Triton compiles for each target, "
             "nothing is launched).", "",
             f"Triton {meta['triton']}, ptxas from the wheel ({meta['ptxas']}), torch {meta['torch']}, "
             f"SGLang {meta['sglang']}. Shared memory is the compiled kernel's own figure (`metadata.shared`); "
             "registers and spills from `ptxas -v` with Triton's flags. Limits per block: "
             + "; ".join(f"{t['name']} ({t['chip']}) {t['smem_per_block']:,} B shared, "
                         f"{t['regs_per_thread']} registers per thread, {t['regs_per_block']:,} per block"
                         for t in meta["targets"]) + ".", ""]
    lines += _table(rows)
    lines += ["", f"**{len(rows) - len(over)} of {len(rows)} compiled kernels fit their chip.**" if not over else
              f"**{len(over)} of {len(rows)} compiled kernels exceed their chip.**"]
    if spills:
        lines += ["", "Spilling (fits, but registers run out and locals go to memory): " + "; ".join(
            f"{r['site']} on {r['target']} ({r['registers']} registers, {r['spill_store_bytes']} B stored / "
            f"{r['spill_load_bytes']} B loaded)" for r in spills) + "."]
    if ifs:
        lines += ["", "## What-if, not served", ""] + _table(list(ifs))
    return "\n".join(lines) + "\n"


def collect_meta() -> dict:
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        from importlib.metadata import version

        sglang_version = version("sglang")
    except Exception:  # noqa: BLE001 - recorded as unknown, not guessed
        sglang_version = "unknown"
    ptxas = subprocess.run([get_ptxas(120).path, "--version"], capture_output=True, text=True).stdout
    release = re.search(r"release ([\d.]+)", ptxas)
    return {"triton": triton.__version__, "torch": torch.__version__, "sglang": sglang_version,
            "ptxas": f"CUDA {release.group(1)}" if release else "unknown version",
            "targets": [dataclasses.asdict(t) for t in TARGETS]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help="folder for compile_targets.{md,json}")
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON on stdout")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_targets: TRITON_INTERPRET=1 runs kernels in Python; unset it to compile", file=sys.stderr)
        return 2
    meta = collect_meta()
    rows = compile_all()
    ifs = what_ifs()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile_targets.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "what_ifs": ifs}, indent=1) + "\n")
    (args.out / "compile_targets.md").write_text(render_markdown(rows, meta, ifs))
    if args.json:
        print(json.dumps(rows))
    over = [r for r in rows if r["over"]]
    for r in over:
        print(f"compile_targets: {r['site']} ({r['kernel']}) on {r['target']}: {'; '.join(r['over'])}", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
