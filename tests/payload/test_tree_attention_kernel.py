"""SGLang 0.5.23's own triton attention kernel on the DDTree verify mask (CPU, Triton's interpreter).

Under DDTREE the target's TARGET_VERIFY forward runs through the (patched) triton backend, which
calls ``extend_attention_fwd`` (``sglang/kernels/ops/attention/extend_attention.py``) with the
tree's FULL_MASK custom mask. The DDTree step writes only the tree window of each row
(``ddtree_write_window_mask``); the prefix columns keep whatever the buffer held, because the
kernel does not read them in TARGET_VERIFY (``skip_prefix_custom_mask`` left at True). One
subprocess in ``.venv-sglang`` (the patch set overlaid, ``TRITON_INTERPRET=1``) runs, for an MLA
shape (1 latent KV head, Lq 576 = 512 + 64, Lv 512, 2 heads), the same at W = 17 over 16 x 16
tiles (the window spans two query and key tiles; the interpreter's own sizes are 32 x 32, those
of an RTX PRO 6000) and a GQA MHA (4 heads, 2 KV heads, head dim 64):

* the backend itself: ``TritonAttnBackend.__init__`` (a stand-in model runner: its fields, a one
  layer KV pool with MLATokenToKVPool's / MHATokenToKVPool's buffer semantics, the real
  ``KVIndexTranslator`` over a random, non-contiguous ``req_to_token``),
  ``init_cuda_graph_state``, ``init_forward_metadata`` (eager), ``forward_extend`` (which picks the
  kernel and its flags), a real ``RadixAttention`` layer and ``DFlashVerifyInput``;
* eager verify batches over the persistent verify-mask buffer and over a fresh ``torch.empty``
  mask (the worker's path for batches above the graph size), both full of random stale bytes
  (about half zero) with only the tree window written;
* the decode CUDA-graph path: the runner's own input registry (``build_decode_registry``,
  ``fill_from``: padded ``seq_lens`` = the backend's fill value 1, ``req_pool_indices`` 0) and
  replay view (``build_replay_fb_view``), ``init_forward_metadata_out_graph`` at capture (per
  batch size, with the runner's all-ones capture mask) and before each replay; the "replay" runs
  ``forward_extend`` with the capture-time ``ForwardMetadata`` (what the captured kernels hold)
  on fresh inputs with padded rows, the tree step's padding windows written at prefix 0 as
  ``DDTreeStepRunner`` does;
* trees from the payload's builder (``ddtree_prepare_verify``) on random draft logits, irregular,
  with padding nodes; every row compared with a float64 dense reference (the node sees its whole
  prefix through ``req_to_token`` and its ancestors-or-self, walked from the parent pointers).

Controls that must fail: one wrong window bit (the kernel follows it exactly), the stale prefix
bytes read with ``skip_prefix_custom_mask=False`` (while a mask with a full prefix gives the
reference either way: the window sits where the kernel reads it), a causal-chain reference.
The same subprocess also runs bench/gpu_kernels.py's tree-attention step (the check prepared for
the lent GPU) on this kernel, loaded as that machine loads it.

Not covered here: bf16 (Triton 3.8's interpreter computes bf16 ``tl.dot`` wrongly; the GPU
script checks bf16), a real CUDA graph, the GPU's block sizes (H200: 32 x 64 for Lq 576).
"""

from __future__ import annotations

import inspect
import time

import pytest

from sglang_env import REPO, ancestors_or_self, run_sglang

pytestmark = pytest.mark.sglang

TOL = 2e-4  # float32 kernel vs float64 reference

CODE = r'''
import time
import types

import torch
from transformers import PretrainedConfig

from sglang.kernels.ops.attention import extend_attention as ea
from sglang.srt.configs.model_config import AttentionArch
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
from sglang.srt.model_executor.cuda_graph_buffer_registry import build_decode_registry
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import build_replay_fb_view
from sglang.srt.runtime_context import reset_context
from sglang.srt.server_args import prepare_server_args
from sglang.srt.speculative import ddtree_utils as du
from sglang.srt.speculative.ddtree_verify import ddtree_prepare_verify
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_utils import resolve_num_tokens_per_req
from sglang.test.parallel_groups import publish

T0 = time.monotonic()
TV = ForwardMode.TARGET_VERIFY
ALGO = SpeculativeAlgorithm.from_string("DDTREE")
NS = types.SimpleNamespace


def publish_ddtree(c):
    args = prepare_server_args([
        "--model-path", MODEL, "--speculative-draft-model-path", MODEL, "--device", "cuda",
        "--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", str(c["budget"]),
        "--speculative-ddtree-topk-cap", str(c["cap"]),
        "--speculative-num-draft-tokens", str(c["block"])])
    reset_context()
    publish(args, role="scheduler")


class ModelConfig:
    """The fields of ModelConfig that TritonAttnBackend.__init__ reads."""

    def __init__(self, c):
        mla = c["kind"] == "mla"
        self.attention_arch = AttentionArch.MLA if mla else AttentionArch.MHA
        self.hf_config = PretrainedConfig(
            architectures=["DeepseekV3ForCausalLM" if mla else "LlamaForCausalLM"])
        self.linear_attn_registry_result = None
        self.is_draft_model = self.is_encoder_decoder = False
        self.v_head_dim, self.swa_v_head_dim = c["dv"], None
        self.context_len, self.head_dim = c["ctx"], c["dq"]
        self._heads, self._kv_heads = c["heads"], c["kv_heads"]

    def get_max_num_attention_heads(self):
        return self._heads

    def get_num_kv_heads(self, tp_size, dcp_size):
        return self._kv_heads


class KVPool:
    """One layer of MLATokenToKVPool (v = the first kv_lora_rank columns of the
    k rows, a view) or MHATokenToKVPool (separate k and v)."""

    start_layer = 0

    def __init__(self, k, v, dv):
        self.k, self.v, self.dv = k, v, dv

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.k[..., : self.dv] if self.v is None else self.v

    def set_kv_buffer(self, layer, loc, k, v, *args, **kwargs):
        self.k[loc.loc] = k
        if self.v is not None:
            self.v[loc.loc] = v


def small_tiles(m, n):
    """Only extend_attention_fwd's BLOCK_M / BLOCK_N change (the kernel, its flags and head
    blocks stay): a small window then spans several query and key tiles, as W = 65 does on
    an H200 (BLOCK_M 32, BLOCK_N 64 for Lq 576). Set before the backend is built, which
    reads BLOCK_M too."""
    orig = ea._get_block_sizes_for_extend_attention

    def sizes(Lq, Lv):
        d, dpe, dv, _, _, warps = orig(Lq, Lv)
        return d, dpe, dv, m, n, warps

    ea._get_block_sizes_for_extend_attention = sizes
    return orig


def make_env(c, gen):
    publish_ddtree(c)
    W = c["budget"] + 1
    rows, width = c["graph_bs"] + 4, c["ctx"] + W
    slots = rows * width
    rtt = (torch.randperm(slots, generator=gen) + 1).view(rows, width).to(torch.int32)
    k = torch.randn(slots + 1, c["kv_heads"], c["dq"], generator=gen)
    v = None if c["kind"] == "mla" else torch.randn(slots + 1, c["kv_heads"], c["dv"], generator=gen)
    pool = KVPool(k, v, c["dv"])
    translator = KVIndexTranslator(req_to_token=rtt, token_to_kv_pool_allocator=None,
                                   token_to_kv_pool=None, page_size=1, device="cpu")
    runner = NS(
        req_to_token_pool=NS(size=rows, req_to_token=rtt), token_to_kv_pool=pool,
        token_to_kv_pool_allocator=None, sliding_window_size=None, page_size=1,
        kv_index_translator=translator, model_config=ModelConfig(c), device="cpu", gpu_id=0,
        is_draft_worker=False, spec_algorithm=ALGO,
        decode_num_tokens_per_req=lambda: resolve_num_tokens_per_req(
            phase="target_verify", spec_algorithm=ALGO, is_draft_worker=False))
    orig = small_tiles(*c["tiles"]) if c.get("tiles") else None
    backend = TritonAttnBackend(runner)
    G = c["graph_bs"]
    backend.init_cuda_graph_state(G, G * W)
    scale = c["dq"] ** -0.5 * 1.7
    layer = RadixAttention(c["heads"], c["dq"], scale, c["kv_heads"], 0, v_head_dim=c["dv"])
    calls = []
    real_fwd = backend.extend_attention_fwd

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real_fwd(*args, **kwargs)

    backend.extend_attention_fwd = spy
    return NS(c=c, W=W, rtt=rtt, pool=pool, translator=translator, backend=backend, layer=layer,
              gen=gen, calls=calls, real_fwd=real_fwd, orig_tiles=orig, G=G)


def garbage(n, gen):
    """Random bytes, about half of them zero."""
    keep = torch.randint(0, 2, (n,), generator=gen, dtype=torch.uint8)
    return keep * torch.randint(1, 256, (n,), generator=gen, dtype=torch.uint8)


def trees(env, prefix, chains=()):
    """The payload builder on random draft logits; the requests in `chains`
    get one possible token per depth, so a chain and padding nodes."""
    c, bs = env.c, len(prefix)
    logits = torch.randn(bs, c["depth"], c["vocab"], generator=env.gen) * 3
    for b in chains:
        logits[b, :, 1:] = float("-inf")
    roots = torch.randint(c["vocab"], (bs,), generator=env.gen)
    plan = ddtree_prepare_verify(logits, roots, prefix, c["budget"], c["cap"])
    return plan


def reference(env, q, k_ext, v_ext, prefix, rpi, parents, chain=False, extra=None):
    """float64 dense attention: node i of request b sees the request's whole
    prefix (through req_to_token) and its ancestors-or-self in the tree
    (``chain``: nodes 0..i; ``extra`` (b, i, j): one more visible node)."""
    c, W = env.c, env.W
    H, Hkv = c["heads"], c["kv_heads"]
    kb = env.pool.get_key_buffer(0)
    vb = env.pool.get_value_buffer(0)
    out = torch.zeros(len(prefix) * W, H, c["dv"], dtype=torch.float64)
    for b, (p, r) in enumerate(zip(prefix.tolist(), rpi.tolist())):
        slots = env.rtt[r, :p].long()
        allowed = torch.zeros(W, p + W, dtype=torch.bool)
        allowed[:, :p] = True
        for i, anc in enumerate(ancestors_or_self(parents[b])):
            cols = range(i + 1) if chain else sorted(anc)
            allowed[i, [p + j for j in cols]] = True
        if extra is not None and extra[0] == b:
            allowed[extra[1], p + extra[2]] = True
        rows = slice(b * W, (b + 1) * W)
        K = torch.cat([kb[slots], k_ext[rows]]).double().repeat_interleave(H // Hkv, dim=1)
        V = torch.cat([vb[slots], v_ext[rows]]).double().repeat_interleave(H // Hkv, dim=1)
        s = torch.einsum("ihd,jhd->hij", q[rows].double(), K) * env.layer.scaling
        s = s.masked_fill(~allowed, float("-inf"))
        out[rows] = torch.einsum("hij,jhd->ihd", torch.softmax(s, dim=-1), V)
    return out


def qkv(env, n_tokens):
    c, g = env.c, env.gen
    q = torch.randn(n_tokens, c["heads"], c["dq"], generator=g)
    k = torch.randn(n_tokens, c["kv_heads"], c["dq"], generator=g)
    # MLA: v is k_nope (the latent part of the same row), as forward_absorb passes it
    v = k[..., : c["dv"]].clone() if c["kind"] == "mla" else torch.randn(
        n_tokens, c["kv_heads"], c["dv"], generator=g)
    return q, k, v


def tree_loc(env, prefix, rpi):
    return torch.cat([env.rtt[r, p:p + env.W] for r, p in zip(rpi.tolist(), prefix.tolist())]).long()


def verify_input(env, plan, mask, kv_plan):
    return DFlashVerifyInput(draft_token=plan.draft_token, positions=plan.positions,
                             draft_token_num=env.W, custom_mask=mask, kv_loc_plan=kv_plan)


def batch(env, bs, rpi, seq_lens, spec_info, out_cache_loc, kv_plan, **extra):
    return NS(forward_mode=TV, batch_size=bs, req_pool_indices=rpi, seq_lens=seq_lens,
              seq_lens_sum=int(seq_lens.sum()) + bs * env.W, spec_info=spec_info,
              out_cache_loc=out_cache_loc, out_cache_loc_is_physical=False, kv_loc_plan=kv_plan,
              mha_one_shot=False, attn_attend_prefix_cache=None, extend_seq_lens_cpu=None,
              encoder_lens=None, **extra)


def row_err(out, ref, n_rows):
    o = out.view(-1, ref.shape[1], ref.shape[2])[:n_rows].double()
    return (o - ref).abs().amax(dim=(1, 2))


def tree_stats(plan):
    par = plan.tree.parents
    return {"padding_nodes": ((par[:, 1:] < 0).sum(dim=1)).tolist(),
            "distinct_trees": len({tuple(r) for r in par.tolist()})}


def eager_step(env, prefix, rpi, mask_kind, chains=()):
    W, bs = env.W, len(prefix)
    plan = trees(env, prefix, chains)
    if mask_kind == "buffer":  # the backend's persistent verify-mask buffer
        mask = env.backend.verify_mask.buffer
        mask.copy_(garbage(mask.numel(), env.gen))
    else:  # a fresh torch.empty mask (batches the buffer cannot hold)
        mask = torch.empty(W * int(prefix.sum()) + bs * W * W, dtype=torch.bool)
        mask.view(torch.uint8).copy_(garbage(mask.numel(), env.gen))
    du.ddtree_write_window_mask(mask, plan.tree_mask, prefix)
    loc = tree_loc(env, prefix, rpi)
    kv_plan = env.translator.plan(req_pool_indices=rpi, seq_lens=prefix, seq_lens_cpu=prefix,
                                  write_virtual=loc, read_extent=W)
    fb = batch(env, bs, rpi, prefix, verify_input(env, plan, mask, kv_plan), loc, kv_plan)
    env.backend.init_forward_metadata(fb)
    q, k, v = qkv(env, bs * W)
    env.calls.clear()
    out = env.backend.forward_extend(q, k, v, env.layer, fb)
    ref = reference(env, q, k, v, prefix, rpi, plan.tree.parents.tolist())
    err = row_err(out, ref, bs * W)
    res = {"mask": mask_kind, "bs": bs, "prefix": prefix.tolist(), "max_err": float(err.max()),
           "kv_saved": bool(torch.equal(env.pool.k[loc], k)), **tree_stats(plan)}
    return res, NS(plan=plan, mask=mask, q=q, k=k, v=v, ref=ref, out=out, prefix=prefix, rpi=rpi,
                   call=env.calls[-1])


def call_flags(env, call):
    args, kwargs = call
    k_buf, v_buf = args[4], args[5]
    return {"is_causal": args[10], "max_len_extend": args[12],
            "skip_prefix_custom_mask": kwargs.get("skip_prefix_custom_mask", "default True"),
            "sliding_window_size": kwargs.get("sliding_window_size"),
            "page_size": kwargs.get("page_size"),
            "mask_is_backend_buffer": args[9].data_ptr() == env.backend.verify_mask.buffer.data_ptr(),
            "v_buffer_is_k_buffer_view": v_buf.data_ptr() == k_buf.data_ptr(),
            "q_k_v_o_dims": [args[0].shape[-1], args[1].shape[-1], args[2].shape[-1], args[3].shape[-1]],
            "kv_group_num": args[0].shape[1] // args[1].shape[1]}


def rerun(env, step, mask=None, **kwargs):
    """The backend's recorded kernel call again, with the mask or a flag changed."""
    args, kw = step.call
    args = list(args)
    args[3] = torch.zeros_like(args[3])
    if mask is not None:
        args[9] = mask
    env.real_fwd(*args, **{**kw, **kwargs})
    return args[3]


def wrong_bit(env, step):
    """Make one window bit wrong: a real node i of the request with the
    shortest prefix also sees a node j < i that is not its ancestor. The kernel
    must follow that bit exactly (equal to the reference with it) and so miss
    the true reference at that row only."""
    W, par = env.W, step.plan.tree.parents.tolist()
    for b in sorted(range(len(par)), key=lambda b: int(step.prefix[b])):
        anc = ancestors_or_self(par[b])
        pairs = [(i, j) for i in range(W - 1, 0, -1) if par[b][i] >= 0 for j in range(i) if j not in anc[i]]
        if pairs:
            i, j = pairs[0]
            break
    flat = du.ddtree_window_mask_index(step.prefix, W)[b, i, j]
    old = step.mask.view(-1)[flat].clone()
    step.mask.view(-1)[flat] = 1
    out = rerun(env, step)
    step.mask.view(-1)[flat] = old
    err = row_err(out, step.ref, len(par) * W)
    flipped = reference(env, step.q, step.k, step.v, step.prefix, step.rpi, par, extra=(b, i, j))
    row = b * W + i
    return {"request": b, "row": i, "col": j, "row_err": float(err[row]),
            "other_rows_max_err": float(torch.cat([err[:row], err[row + 1:]]).max()),
            "max_err_vs_flipped_reference": float(row_err(out, flipped, len(par) * W).max())}


def controls(env, step):
    full = du.ddtree_full_mask(step.plan.tree_mask, step.prefix, int(step.prefix.sum()))
    chain_ref = reference(env, step.q, step.k, step.v, step.prefix, step.rpi,
                          step.plan.tree.parents.tolist(), chain=True)
    n = step.ref.shape[0]

    def err(out):
        return float(row_err(out, step.ref, n).max())

    return {
        "wrong_bit": wrong_bit(env, step),
        "prefix_garbage_read": err(rerun(env, step, skip_prefix_custom_mask=False)),
        "full_mask_prefix_read": err(rerun(env, step, mask=full, skip_prefix_custom_mask=False)),
        "full_mask_default": err(rerun(env, step, mask=full)),
        "chain_reference_err": float(row_err(step.out, chain_ref, n).max()),
    }


def graph_state(env):
    """The decode CUDA-graph runner's static inputs (its own registry: padded
    seq_lens filled with the backend's fill value, the rest zero)."""
    G, W = env.G, env.W
    fill = env.backend.get_cuda_graph_seq_len_fill_value()
    reg = build_decode_registry(device=torch.device("cpu"), max_bs=G, max_num_token=G * W,
                                seq_len_fill_value=fill, cache_loc_dtype=torch.int64,
                                register_global_num_tokens=False, share_pool=False)
    bufs = NS(**{n: reg.get_slot(n).buffer for n in reg.slot_names()}, encoder_lens=None,
              mamba_track_indices=None)
    # base_runner: (max_bs * fill + max_num_token) * num_tokens_per_req, all ones
    runner_mask = torch.ones((G * fill + G * W) * W, dtype=torch.bool)
    return NS(reg=reg, bufs=bufs, fill=fill, runner_mask=runner_mask, md={})


def capture(env, gs, cbs):
    W, b = env.W, gs.bufs
    spec = DFlashVerifyInput(draft_token=None, positions=None, draft_token_num=W,
                             custom_mask=gs.runner_mask, capture_hidden_mode=CaptureHiddenMode.FULL)
    kv_plan = env.translator.plan(req_pool_indices=b.req_pool_indices[:cbs], seq_lens=b.seq_lens[:cbs],
                                  seq_lens_cpu=None, write_virtual=None)
    fb = batch(env, cbs, b.req_pool_indices[:cbs], b.seq_lens[:cbs], spec, b.out_cache_loc[: cbs * W],
               kv_plan)
    env.backend.init_forward_metadata_out_graph(fb, in_capture=True)
    gs.md[cbs] = env.backend.forward_metadata
    q, k, v = qkv(env, cbs * W)
    out = env.backend.forward_extend(q, k, v, env.layer, fb)
    return bool(torch.isfinite(out).all())


def replay(env, gs, prefix, rpi, chains=()):
    W, raw = env.W, len(prefix)
    gbs = min(x for x in gs.md if x >= raw)
    # the tree step (DDTreeStepRunner) writes live windows, then padding rows with prefix 0
    plan = trees(env, torch.cat([prefix, torch.zeros(gbs - raw, dtype=prefix.dtype)]), chains)
    mask = env.backend.verify_mask.buffer
    mask.copy_(garbage(mask.numel(), env.gen))  # earlier steps' windows: stale bytes
    du.ddtree_write_window_mask(mask, plan.tree_mask, torch.cat(
        [prefix, torch.zeros(gbs - raw, dtype=prefix.dtype)]))
    loc = tree_loc(env, prefix, rpi)
    kv_plan = env.translator.plan(req_pool_indices=rpi, seq_lens=prefix, seq_lens_cpu=prefix,
                                  write_virtual=loc, read_extent=W)
    spec = verify_input(env, plan, mask, kv_plan)
    fb = batch(env, raw, rpi, prefix, spec, loc, kv_plan, input_ids=plan.draft_token[: raw * W],
               positions=plan.positions[: raw * W], seq_lens_cpu=prefix.clone(), max_seq_len_host=None,
               out_cache_loc_virtual=None, kv_loc_cols=None, max_seq_len_override=None, lora_ids=None,
               can_run_decode_cuda_graph=True)
    gs.reg.fill_from(fb, raw_bs=raw, padded_bs=gbs, raw_num_tokens=raw * W, padded_num_tokens=gbs * W)
    view = build_replay_fb_view(forward_batch=fb, buffers=gs.bufs, bs=gbs, raw_bs=raw, num_tokens=gbs * W,
                                global_num_tokens_cpu=None, seq_len_fill_value=gs.fill,
                                capture_forward_mode=TV, is_encoder_decoder=False)
    before = env.backend.forward_metadata
    env.backend.init_forward_metadata_out_graph(view)
    kept = env.backend.forward_metadata is before
    # the replayed kernels: the capture-time metadata of this bucket over the static buffers
    env.backend.forward_metadata = gs.md[gbs]
    q, k, v = qkv(env, gbs * W)
    b = gs.bufs
    fb_graph = batch(env, gbs, b.req_pool_indices[:gbs], b.seq_lens[:gbs], spec, b.out_cache_loc[: gbs * W],
                     kv_plan)
    out = env.backend.forward_extend(q, k, v, env.layer, fb_graph)
    ref = reference(env, q, k, v, prefix, rpi, plan.tree.parents[:raw].tolist())
    err = row_err(out, ref, raw * W)
    pad = out.view(gbs * W, -1)[raw * W:]
    return {"raw_bs": raw, "graph_bs": gbs, "prefix": prefix.tolist(), "max_err": float(err.max()),
            "padded_rows_finite": bool(torch.isfinite(pad).all()), "metadata_kept": kept,
            "padded_seq_lens": b.seq_lens[raw:gbs].tolist(),
            "padded_req_pool_indices": b.req_pool_indices[raw:gbs].tolist(),
            "kv_saved": bool(torch.equal(env.pool.k[loc], k[: raw * W])),
            "padding_nodes": tree_stats(plan)["padding_nodes"][:raw]}


def run_case(c, seed):
    t = time.monotonic()
    env = make_env(c, torch.Generator().manual_seed(seed))
    res = {"W": env.W, "tiles": list(ea._get_block_sizes_for_extend_attention(c["dq"], c["dv"])[3:5]),
           "num_head": env.backend.num_head, "num_kv_head": env.backend.num_kv_head,
           "v_head_dim": env.backend.v_head_dim,
           "target_verify_num_tokens_per_req": env.backend.target_verify_num_tokens_per_req,
           "mask_buffer_numel": env.backend.verify_mask.buffer.numel()}
    eager = []
    for kind, (prefix, rpi, chains) in zip(("buffer", "fresh"), c["eager"]):
        r, step = eager_step(env, torch.tensor(prefix), torch.tensor(rpi), kind, chains)
        eager.append(r)
        if kind == "buffer":
            res["call"] = call_flags(env, step.call)
            if c.get("controls"):
                res["controls"] = controls(env, step)
    res["eager"] = eager
    gs = graph_state(env)
    res["capture_finite"] = [capture(env, gs, cbs) for cbs in sorted(c["capture_bs"], reverse=True)]
    res["replays"] = [replay(env, gs, torch.tensor(p), torch.tensor(r), ch) for p, r, ch in c["replays"]]
    if env.orig_tiles is not None:
        ea._get_block_sizes_for_extend_attention = env.orig_tiles
    res["wall_s"] = round(time.monotonic() - t, 2)
    return res


BASE = {"depth": 3, "vocab": 40, "block": 4, "ctx": 128, "graph_bs": 4, "capture_bs": [2, 4]}
MLA = {"kind": "mla", "heads": 2, "kv_heads": 1, "dq": 576, "dv": 512}
CASES = {
    # CPU block sizes for Lq 576: BLOCK_M = BLOCK_N = 32, the RTX PRO 6000's (sm_120) too
    "mla": {**BASE, **MLA, "budget": 8, "cap": 3, "controls": True,
            "eager": [([5, 29, 50], [3, 1, 5], (0,)), ([23, 2, 41, 9, 17], [2, 6, 1, 4, 7], (3,))],
            "replays": [([12, 64, 30], [5, 2, 7], (1,)), ([40], [3], ())]},
    # W = 17 (CT200's budget 16) over 16 x 16 tiles: the window spans two query and key tiles
    "mla_w17_16x16_tiles": {**BASE, **MLA, "budget": 16, "cap": 4, "depth": 4, "tiles": (16, 16),
                            "eager": [([3, 50], [4, 2], (1,)), ([33, 8, 20, 5, 12], [1, 5, 3, 7, 6], ())],
                            "replays": [([40, 19, 5], [2, 7, 4], (2,)), ([11, 50], [6, 1], ())]},
    "mha_gqa": {**BASE, "kind": "mha", "heads": 4, "kv_heads": 2, "dq": 64, "dv": 64, "budget": 16, "cap": 4,
                "depth": 4, "controls": True,
                "eager": [([6, 45, 80], [2, 4, 1], (2,)), ([17, 3, 9, 30, 11], [6, 3, 1, 2, 5], ())],
                "replays": [([25, 60], [1, 5], (0,)), ([9, 70, 33], [4, 2, 6], ())]},
}
OUT["cases"] = {name: run_case(c, seed) for seed, (name, c) in enumerate(CASES.items())}
OUT["block_sizes_cpu"] = {"mla": list(ea._get_block_sizes_for_extend_attention(576, 512)),
                          "mha64": list(ea._get_block_sizes_for_extend_attention(64, 64))}
OUT["backend_wall_s"] = round(time.monotonic() - T0, 2)


def gpu_script_check():
    """bench/gpu_kernels.py's tree-attention harness on the same kernel: loaded the way
    the lent GPU machine loads it (the wheel's three files, copied from this pristine
    install into a carry folder, with the script's stand-ins for their sglang imports)."""
    import importlib.util
    import pathlib
    import shutil

    spec = importlib.util.spec_from_file_location("gpu_kernels_under_test", GPU_KERNELS)
    gk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gk)
    carry = pathlib.Path("carry")
    folder = carry / "sglang_py" / "attention"
    folder.mkdir(parents=True)
    for f in gk.ATTENTION_FILES:
        shutil.copy(pathlib.Path(ea.__file__).parent / f, folder / f)
    kernel = gk.tree_attention_kernel(carry, cuda=False)
    out = {"kernel": kernel[1], "module_is_a_fresh_load": kernel[2] is not ea}
    cfg = gk.tree_attention_configs(smoke=True)[0]
    r = gk.step_tree_attention(cfg, torch.device("cpu"), kernel, 7)
    out[cfg["name"]] = {k: r[k] for k in ("status", "summary", "eager_buffer_mask", "eager_fresh_mask",
                                          "controls", "graph_replays", "trees_irregular", "block_sizes")}
    return out


OUT["gpu_script"] = gpu_script_check()
OUT["wall_s"] = round(time.monotonic() - T0, 2)
'''


@pytest.fixture(scope="module")
def result(sglang_overlay, tmp_path_factory):
    t0 = time.monotonic()
    code = ("GPU_KERNELS = %r\n" % str(REPO / "bench" / "gpu_kernels.py") + inspect.getsource(ancestors_or_self)
            + CODE)
    out = run_sglang(code, tmp_path_factory.mktemp("tree_attn"), sglang_overlay, triton_interpret=True, timeout=600)
    out["subprocess_wall_s"] = round(time.monotonic() - t0, 1)
    print(f"tree attention kernel subprocess: {out['subprocess_wall_s']} s")
    return out


def _cases(result):
    return result["cases"].items()


def test_eager_verify_matches_dense_tree_attention(result):
    for name, case in _cases(result):
        assert [e["mask"] for e in case["eager"]] == ["buffer", "fresh"], name
        for e in case["eager"]:
            assert e["max_err"] < TOL, (name, e)
            assert e["kv_saved"], (name, e)  # forward_extend stored the tree's KV first


def test_graph_replays_with_padded_rows_match_dense_tree_attention(result):
    padded = 0
    for name, case in _cases(result):
        assert case["capture_finite"] == [True, True], name
        for r in case["replays"]:
            assert r["max_err"] < TOL, (name, r)
            assert r["metadata_kept"], (name, r)  # replay prep refills buffers, never rebuilds
            assert r["padded_rows_finite"] and r["kv_saved"], (name, r)
            pad = r["graph_bs"] - r["raw_bs"]
            assert r["padded_seq_lens"] == [1] * pad and r["padded_req_pool_indices"] == [0] * pad, (name, r)
            padded += pad > 0
    assert padded >= 3  # every case replays at least one padded batch


def test_backend_calls_the_extend_kernel_causal_without_reading_the_prefix_mask(result):
    for name, case in _cases(result):
        call = case["call"]
        assert call["is_causal"] is True, name
        assert call["skip_prefix_custom_mask"] == "default True", name
        assert call["sliding_window_size"] == -1 and call["page_size"] == 1, name
        assert call["max_len_extend"] == case["W"] == case["target_verify_num_tokens_per_req"], name
        assert call["mask_is_backend_buffer"], name
        if name.startswith("mla"):
            # absorbed MLA: 576-wide q/k, v = the latent 512 columns of the same pool rows
            assert call["q_k_v_o_dims"] == [576, 576, 512, 512], name
            assert call["v_buffer_is_k_buffer_view"] and call["kv_group_num"] == case["num_head"], name
            assert case["num_kv_head"] == 1 and case["v_head_dim"] == 512, name
        else:
            assert call["kv_group_num"] == 2 and not call["v_buffer_is_k_buffer_view"], name


def test_verify_mask_buffer_is_sized_for_the_tree(result):
    for name, case in _cases(result):
        W, g, ctx, block = case["W"], 4, 128, 4
        assert case["mask_buffer_numel"] == g * W * (ctx + block + W), name


def test_trees_are_irregular_with_padding_and_tiles_are_crossed(result):
    for name, case in _cases(result):
        buf = case["eager"][0]
        assert buf["distinct_trees"] == len(buf["prefix"]), name
        assert any(buf["padding_nodes"]), name  # the chain request leaves padding slots
    assert result["block_sizes_cpu"]["mla"][3:5] == [32, 32]
    crossed = result["cases"]["mla_w17_16x16_tiles"]
    assert crossed["tiles"] == [16, 16] and crossed["W"] == 17


def test_one_wrong_window_bit_is_caught(result):
    for name in ("mla", "mha_gqa"):
        wb = result["cases"][name]["controls"]["wrong_bit"]
        assert wb["row_err"] > 100 * TOL, (name, wb)
        assert wb["other_rows_max_err"] < TOL and wb["max_err_vs_flipped_reference"] < TOL, (name, wb)


def test_stale_prefix_bytes_would_matter_if_the_prefix_mask_were_read(result):
    for name in ("mla", "mha_gqa"):
        c = result["cases"][name]["controls"]
        assert c["prefix_garbage_read"] > 100 * TOL, (name, c)
        assert c["full_mask_prefix_read"] < TOL and c["full_mask_default"] < TOL, (name, c)
        assert c["chain_reference_err"] > 100 * TOL, (name, c)  # the trees are not chains


def test_gpu_script_harness_passes_on_the_same_kernel(result):
    gs = result["gpu_script"]
    assert gs["kernel"].endswith("(Triton interpreter)") and gs["module_is_a_fresh_load"]
    r = gs["mla_w9"]
    assert r["status"] == "ok", r
    assert all(c["ok"] for c in r["controls"].values()), r["controls"]
    assert r["eager_buffer_mask"]["max_err"] < TOL and r["eager_fresh_mask"]["max_err"] < TOL
    assert r["graph_replays"] and all(x["ok"] for x in r["graph_replays"])
    assert r["block_sizes"][3:5] == [32, 32]
