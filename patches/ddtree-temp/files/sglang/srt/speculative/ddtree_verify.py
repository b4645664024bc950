"""DDTree tree verify: the pure parts of one decode step (ddtree-temp 2.0).

Module level imports only stdlib, torch and the other ddtree modules, so every
function here runs (and is tested) on CPU. The DDTree worker
(``ddtree_worker.py``) calls them around 0.5.23's DFlash draft forward, the
target TARGET_VERIFY forward and SGLang's own acceptance (``eagle_sample``):

- :func:`vocab_parallel_topk_logprobs`: per-position top-k log-probs of the
  draft through this rank's LM-head shard, exact over the full vocabulary.
- :func:`ddtree_prepare_verify`: top-k log-probs (or raw draft logits) ->
  best-first tree (``build_ddtree_tree``) -> retrieve arrays, ancestors-or-self
  mask in SGLang's FULL_MASK layout, positions ``prefix + depth``, verify tokens
  in node order. Verify width ``W = budget + 1`` tokens per request, node ``i``
  of request ``b`` at flat row ``b*W + i`` (the retrieve encoding's global index).
- :func:`ddtree_commit_step` (one Triton kernel, or plain torch), :func:`front_rows`:
  ``eagle_sample``'s outputs -> DFlash's committed-block layout, the new lengths, the
  KV move's lists, and the accepted path's rows (target hidden states, logits) in
  path order; :func:`move_accepted_kv`: that move, every layer in one launch.

Node order guarantees ``path[b, k] >= k`` (parents precede children), so one
gather-then-scatter KV move (SGLang's ``move_accept_tokens_to_target_kvcache``)
is exact; the rest of the window (rejected nodes) is left for the next step,
exactly as with EAGLE's over-allocated window.

Kept from 1.x for the CPU proofs against the tiny transformer (they model the
same step in plain torch): :func:`ddtree_accept`, :func:`ddtree_commit`,
:func:`accept_kv_moves`, :func:`apply_kv_moves`, :func:`compact_to_front`,
:func:`front_positions`.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional, Tuple

import torch

try:  # the accept's one kernel (ddtree_commit_step); the CPU paths need no Triton
    import triton
    import triton.language as tl
except ImportError:  # the test hosts' stand-in server imports this module without it
    triton = None

from sglang.srt.speculative.ddtree_utils import (
    DDTree,
    RetrieveEncoding,
    build_ddtree_tree,
    compile_ddtree_retrieve,
    ddtree_full_mask,
    ddtree_positions,
    ddtree_sample_tree_paths,
    ddtree_tree_mask,
    ddtree_verify_greedy,
    ddtree_write_window_mask,
    draft_topk_logprobs,
)


class DDTreeVerifyPlan(NamedTuple):
    tree: DDTree
    retrieve: RetrieveEncoding
    draft_token: torch.Tensor  # int64 [bs*W], node order, root first
    positions: torch.Tensor  # int64 [bs*W], prefix + depth
    tree_mask: torch.Tensor  # bool [bs, W, W], ancestors-or-self
    custom_mask: Optional[torch.Tensor]  # bool, FULL_MASK layout (None if not asked)
    width: int  # W = budget + 1


class DDTreeCommit(NamedTuple):
    out_tokens: torch.Tensor  # int64 [bs, W], path order, 0 padded
    commit_lens: torch.Tensor  # int32 [bs] = accepted drafts + 1 (bonus)
    bonus: torch.Tensor  # int64 [bs], last committed token (next root)
    path: torch.Tensor  # int64 [bs, S] local node ids of the path, -1 padded
    accept_num: torch.Tensor  # int64 [bs] accepted draft tokens


def ddtree_prepare_verify(
    draft_logits,
    root_tokens: torch.Tensor,
    prefix_lens: torch.Tensor,
    budget: int,
    topk_cap: Optional[int] = None,
    seq_lens_sum: Optional[int] = None,
) -> DDTreeVerifyPlan:
    """Draft logits of the DFlash block (``[bs, L, V]``: block positions 1..L,
    i.e. depths 1..L), or their per-depth top-k ``(log-probs, ids)`` (what the
    worker computes through the sharded LM head) -> everything the
    TARGET_VERIFY forward needs.

    ``prefix_lens`` [bs] = committed KV length (the root, the last verified
    token, is written at position ``prefix_lens`` by this verify).
    ``seq_lens_sum`` (host int, = ``prefix_lens.sum()``) builds the FULL_MASK
    custom mask; without it only the dense ``tree_mask`` is returned.
    Padding nodes (when fewer than ``budget`` prefixes exist) get the root's
    token and position; they are never linked, attend to the prefix and
    themselves, and are never accepted.
    """
    cap = budget if topk_cap is None else min(int(topk_cap), int(budget))
    if isinstance(draft_logits, (tuple, list)):
        top = draft_logits  # (log-probs [bs, L, k], ids [bs, L, k]) already ranked
    else:
        top = draft_topk_logprobs(draft_logits, min(cap, draft_logits.shape[-1]))
    bs, depth_max = top[0].shape[0], top[0].shape[1]
    tree = build_ddtree_tree(top, budget, cap, root_tokens=root_tokens)
    retrieve = compile_ddtree_retrieve(tree.parents, tree.scores)
    valid = tree.valid
    tokens = torch.where(valid, tree.tokens, tree.tokens[:, :1])
    positions = ddtree_positions(tree.depths, prefix_lens.to(tree.depths.device))
    tree_mask = ddtree_tree_mask(tree.parents, max_depth=depth_max)
    custom = None
    if seq_lens_sum is not None:
        custom = ddtree_full_mask(tree_mask, prefix_lens, int(seq_lens_sum))
    width = int(budget) + 1
    return DDTreeVerifyPlan(
        tree, retrieve, tokens.reshape(bs * width), positions.reshape(bs * width),
        tree_mask, custom, width,
    )


class DDTreeStepOut(NamedTuple):
    """What one step's tree work hands to the verify (static buffers under a
    CUDA graph): node-ordered tokens and positions ``[bs, W]``, the retrieve
    links ``[bs, W]`` (``retrive_index`` is ``b*W + i``, a constant)."""

    draft_token: torch.Tensor  # int64 [bs, W]
    positions: torch.Tensor  # int64 [bs, W]
    retrive_next_token: torch.Tensor  # int64 [bs, W]
    retrive_next_sibling: torch.Tensor  # int64 [bs, W]


def ddtree_tree_step(
    top_lp: torch.Tensor,
    top_ids: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    bonus: torch.Tensor,
    prefix_lens: torch.Tensor,
    mask: torch.Tensor,
    budget: int,
    topk_cap: int,
) -> DDTreeStepOut:
    """The tree work of one decode step, from the draft's per-depth candidates
    to everything the TARGET_VERIFY forward reads, as one unit with static
    shapes and no host synchronisation, so it can be captured in one CUDA graph
    per batch size (``ddtree_step.DDTreeStepRunner``).

    ``top_lp`` / ``top_ids`` [bs, L, K]: full-vocabulary log-probs at each
    request's temperature and their ids, descending; ``top_k`` / ``top_p``
    [bs]: the request's sampling parameters (``top_k == 1`` is a greedy row:
    its candidates keep their untempered scores); ``bonus`` [bs]: the root
    tokens; ``prefix_lens`` [bs]: committed lengths on the device; ``mask``: the
    1-D FULL_MASK buffer, of which only the tree window is written
    (:func:`ddtree_write_window_mask`)."""
    sampled = top_k.view(-1) != 1
    lp = restrict_draft_logprobs(top_lp, top_k, top_p, sampled)
    tree = build_ddtree_tree((lp, top_ids), budget, topk_cap, root_tokens=bonus)
    retrieve = compile_ddtree_retrieve(tree.parents, tree.scores)
    tokens = torch.where(tree.valid, tree.tokens, tree.tokens[:, :1])
    positions = ddtree_positions(tree.depths, prefix_lens)
    tree_mask = ddtree_tree_mask(tree.parents, max_depth=top_lp.shape[1])
    ddtree_write_window_mask(mask, tree_mask, prefix_lens)
    return DDTreeStepOut(tokens, positions, retrieve.retrive_next_token, retrieve.retrive_next_sibling)


def ddtree_accept(
    logits: torch.Tensor,
    plan: DDTreeVerifyPlan,
    *,
    temperatures: Optional[torch.Tensor] = None,
    top_ks: Optional[torch.Tensor] = None,
    top_ps: Optional[torch.Tensor] = None,
    greedy: Optional[torch.Tensor] = None,
    all_greedy: bool = True,
    max_accept: Optional[int] = None,
    coins=None,
    generator: Optional[torch.Generator] = None,
    use_kernel: Optional[bool] = None,
):
    """Target logits at the nodes (``[bs*W, V]`` or ``[bs, W, V]``) -> the
    kernel outputs ``(predicts [bs*W], accept_index [bs, S], accept_num [bs])``.
    ``all_greedy``: the tree greedy verify (target argmax); otherwise the
    sampling path (per-request temperature/top-k/top-p, greedy rows exact)."""
    w = plan.width
    bs = plan.tree.tokens.shape[0]
    lg = logits.reshape(bs, w, logits.shape[-1])
    cand = plan.tree.tokens
    if all_greedy:
        return ddtree_verify_greedy(lg, cand, plan.retrieve, max_accept=max_accept)
    if temperatures is None:
        raise ValueError("sampled DDTree verify needs temperatures")
    return ddtree_sample_tree_paths(
        lg, cand, plan.retrieve, temperatures.reshape(bs), top_ks, top_ps, greedy,
        max_accept=max_accept, coins=coins, generator=generator, use_kernel=use_kernel,
    )


def ddtree_commit(
    predicts: torch.Tensor, accept_index: torch.Tensor, accept_num: torch.Tensor, width: int
) -> DDTreeCommit:
    """Kernel outputs -> the committed block in path order (DFlash's
    ``out_tokens``/``commit_lens``/``bonus`` layout, row stride ``width``)."""
    bs, s = accept_index.shape
    idx = accept_index.long()
    num = accept_num.long()
    k = torch.arange(s, device=idx.device).unsqueeze(0)
    live = (k <= num.unsqueeze(1)) & (idx >= 0)
    toks = torch.where(live, predicts.long()[idx.clamp(min=0)], torch.zeros_like(idx))
    out = torch.zeros(bs, width, dtype=torch.long, device=idx.device)
    out[:, : min(s, width)] = toks[:, : min(s, width)]
    row = torch.arange(bs, device=idx.device)
    path = torch.where(live, idx - row.unsqueeze(1) * width, torch.full_like(idx, -1))
    bonus = out[row, num]
    return DDTreeCommit(out, (num + 1).to(torch.int32), bonus, path, num)


def accept_kv_moves(
    out_cache_loc: torch.Tensor, accept_index: torch.Tensor, accept_num: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(tgt_loc, src_loc) [bs*S] for ``pool.move_kv_cache(tgt, src)``: the KV of
    the k-th accepted node moves to the k-th slot of the request's window
    (``out_cache_loc.view(bs, W)``). Entries past the path are self-moves (no
    ops), so the shapes are static (no host sync). Same effect as EAGLE's
    ``move_accept_tokens_to_target_kvcache`` for topk > 1."""
    bs, s = accept_index.shape
    window = out_cache_loc.view(bs, -1).long()
    w = window.shape[1]
    idx = accept_index.long()
    k = torch.arange(s, device=idx.device).unsqueeze(0).expand(bs, s)
    live = (k <= accept_num.long().unsqueeze(1)) & (idx >= 0) & (k < w)
    tgt = torch.gather(window, 1, k.clamp(max=w - 1))
    src = torch.where(live, out_cache_loc.long()[idx.clamp(min=0)], tgt)
    return tgt.reshape(-1), src.reshape(-1)


def apply_kv_moves(buffers, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """``move_kv_cache_native`` semantics (gather, then scatter) over a list of
    ``[slots, ...]`` buffers; used by the CPU tests and as documentation of the
    pool's ``move_kv_cache``."""
    for buf in buffers:
        buf[tgt_loc] = buf[src_loc]


def compact_to_front(x: torch.Tensor, accept_index: torch.Tensor, bs: int, width: int) -> torch.Tensor:
    """EAGLE's ``_compact_accept_to_front``: rows of the accepted path (node
    indexed ``[bs*W, ...]``) moved to the front of each request's block; other
    rows unchanged."""
    s1 = accept_index.shape[1]
    safe = accept_index.to(torch.int64).clamp(min=0).reshape(-1)
    gathered = x[safe]
    out = x.clone()
    out.view(bs, width, *x.shape[1:])[:, :s1] = gathered.view(bs, s1, *x.shape[1:])
    return out


def front_positions(prefix_lens: torch.Tensor, width: int) -> torch.Tensor:
    """Positions of the compacted window: ``prefix + k`` ([bs*W] int64), what
    the draft-KV materialisation of the committed tokens uses."""
    return (prefix_lens.long().view(-1, 1) + torch.arange(width, device=prefix_lens.device)).reshape(-1)


def vocab_parallel_topk_logprobs(
    local_logits: torch.Tensor,
    k: int,
    *,
    vocab_start: int = 0,
    gather=None,
    inv_temperature: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` log-probabilities over the whole vocabulary from this TP rank's
    shard of the logits.

    ``inv_temperature`` (optional): ``[T]`` per row, or ``[G]`` for ``G``
    groups of ``T / G`` consecutive rows (a request's depths): the logits are
    multiplied by it first, so the log-probs are those of ``softmax(logits /
    temperature)`` over the whole vocabulary (1.0 leaves a row as it is). The
    ids do not depend on it (a positive scale keeps the order).

    ``local_logits`` [T, V_local]: rows of the LM head this rank holds (padding
    excluded), token ids ``vocab_start + column``. ``gather(t)`` stacks a tensor
    from every rank (``[tp, *t.shape]``, e.g. through ``all_gather_into_tensor``);
    ``None`` means TP 1. Only ``k`` values, ``k`` ids and one log-sum-exp per row
    cross ranks, in one gather (``[T, 2k + 1]`` float32). Every rank gathers the
    same data and runs the same ``topk``, so all ranks build the same tree; the
    values equal ``draft_topk_logprobs`` on
    the full logits (on exact ties the chosen ids may differ from it, as
    ``torch.topk`` does not order ties). Entries beyond the vocabulary (a
    vocabulary smaller than k) are -inf, which the tree builder never selects.
    Returns (log-probs [T, k] float32 descending, ids [T, k] int64).
    """
    logits = local_logits.float()
    rows, v_local = logits.shape
    if inv_temperature is not None:
        groups = inv_temperature.numel()
        scale = inv_temperature.to(logits.dtype).view(groups, 1, 1)
        logits = (logits.view(groups, rows // groups, v_local) * scale).view(rows, v_local)
    kk = min(int(k), v_local)
    vals, idx = torch.topk(logits, kk, dim=-1, largest=True, sorted=True)
    idx = idx + int(vocab_start)
    lse = torch.logsumexp(logits, dim=-1)
    if kk < k:  # a shard smaller than k: pad so every rank sends k entries
        vals = torch.cat([vals, vals.new_full((rows, k - kk), float("-inf"))], dim=1)
        idx = torch.cat([idx, idx.new_zeros((rows, k - kk))], dim=1)
    if gather is None:
        return vals[:, :kk] - lse.unsqueeze(1), idx[:, :kk]
    # One collective, not three: values, ids and the log-sum-exp packed as
    # float32 rows (ids are exact in float32 below 2**24, as SGLang's own
    # row-argmax gather carries them).
    assert int(vocab_start) + v_local < 2**24, "token ids must be exact in float32"
    packed = torch.cat([vals, idx.to(torch.float32), lse.unsqueeze(1)], dim=1)  # [T, 2k + 1]
    g = gather(packed)  # [tp, T, 2k + 1]
    g_vals, g_idx, g_lse = g[..., :k], g[..., k:2 * k].to(torch.int64), g[..., 2 * k]
    tp = g_vals.shape[0]
    total_lse = torch.logsumexp(g_lse, dim=0)
    cand_vals = g_vals.permute(1, 0, 2).reshape(rows, tp * k)
    cand_idx = g_idx.permute(1, 0, 2).reshape(rows, tp * k)
    top_vals, pos = torch.topk(cand_vals, int(k), dim=-1, largest=True, sorted=True)
    return top_vals - total_lse.unsqueeze(1), torch.gather(cand_idx, 1, pos)


def front_rows(x: torch.Tensor, accept_index: torch.Tensor, width: int) -> torch.Tensor:
    """Rows of the accepted path, in path order, at the front of a ``[bs * width]``
    block (what the DFlash draft-KV append reads for positions prefix + k);
    rows past the path are zeros (the append writes only ``commit_lens`` rows).
    ``x`` is node-indexed ``[bs * W, ...]``, ``accept_index`` global rows."""
    bs, s = accept_index.shape
    n = min(s, width)
    idx = accept_index[:, :n].long()
    out = x.new_zeros((bs, width) + tuple(x.shape[1:]))
    picked = x[idx.clamp(min=0).reshape(-1)].view((bs, n) + tuple(x.shape[1:]))
    keep = (idx >= 0).view((bs, n) + (1,) * (x.dim() - 1))
    out[:, :n] = torch.where(keep, picked, torch.zeros_like(picked))
    return out.view((bs * width,) + tuple(x.shape[1:]))


def restrict_draft_logprobs(
    top_lp: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    sampled: torch.Tensor,
) -> torch.Tensor:
    """The draft's per-depth candidates scored under the distribution each
    request is verified against: top-k, then top-p, renormalised, as SGLang's
    verify does (``eagle_sample``: temperature softmax, top-k renorm, top-p
    renorm).

    ``top_lp`` [bs, L, M]: full-vocabulary log-probs at the request's
    temperature, descending (:func:`vocab_parallel_topk_logprobs` with
    ``inv_temperature``); ``top_k`` [bs] (int; ``<= 0`` or ``>= vocab`` = all),
    ``top_p`` [bs] (float, ``1.0`` = all), ``sampled`` [bs] bool: rows to
    restrict (greedy rows, whose target is one-hot on its argmax, keep their
    untempered log-probs). Tokens the candidates show to be outside a request's
    support get ``-inf`` (the builder never makes them nodes); a ``top_p`` of
    1.0 keeps every candidate. Returns [bs, L, M] float32.

    Exact when the support is decided inside the ``M`` candidates: a top-k of
    at most ``M``, and a top-p nucleus that closes inside them. Otherwise the
    mass of the unseen rest is bounded, not known: a top-k above ``M`` keeps
    the full-vocabulary normaliser (the tail beyond the top-k is counted in),
    and an open nucleus is normalised by ``top_p`` itself (the true nucleus
    mass lies in ``[top_p, top_p + p_{M+1})``). Either way every candidate in
    the support keeps a finite score and the order inside a depth is
    unchanged; only the balance between depths can be off by that margin, and
    with a top-k above ``M`` and a top-p below 1 the nucleus is cut on the
    full-vocabulary probabilities, so a candidate just outside the true support
    may keep a finite score (a wasted node, never a wrong token). The tree only
    steers which prefixes are verified: whatever it holds, the acceptance kernel
    keeps the output distribution exact.

    Static shapes, no host synchronisation (runs inside the step's CUDA graph).
    """
    lp = top_lp.float()
    bs, _, m = lp.shape
    ninf = float("-inf")  # a Python scalar: a device tensor made here would be a host copy in the graph
    k = top_k.to(torch.int64).view(bs, 1, 1)
    rank = torch.arange(m, device=lp.device).view(1, 1, m)
    in_k = (k <= 0) | (rank < k)
    lp_k = torch.where(in_k, lp, ninf)
    # top-k renormalisation: exact when the whole top-k is among the candidates
    exact_k = (k > 0) & (k <= m)
    lp_k = lp_k - torch.where(exact_k.view(bs, 1), torch.logsumexp(lp_k, dim=-1), 0.0).unsqueeze(-1)
    # top-p on the top-k-renormalised probabilities: keep the smallest prefix
    # (descending) whose mass reaches top_p (SGLang keeps a token while the mass
    # before it is below top_p; the first token always)
    p = lp_k.exp()
    before = torch.cumsum(p, dim=-1) - p
    pp = top_p.to(lp.dtype).view(bs, 1, 1)
    # (top_p >= 1 keeps all: a float32 mass before a tiny candidate can round to 1.0)
    keep = (before < pp) | (rank == 0) | (pp >= 1.0)
    closed = (before[..., -1:] + p[..., -1:]) >= pp  # the nucleus ends among the candidates
    kept_mass = torch.where(keep, p, 0.0).sum(dim=-1, keepdim=True)
    norm = torch.where(closed, kept_mass, pp).clamp(min=torch.finfo(lp.dtype).tiny).log()
    out = torch.where(keep & in_k, (lp_k - norm).clamp(max=0.0), ninf)
    return torch.where(sampled.view(bs, 1, 1), out, lp)


# ---------------------------------------------------------------------------
# The accept's bookkeeping as one kernel (2.2): commit, KV moves, front rows
# ---------------------------------------------------------------------------


def _runs_triton(t: torch.Tensor) -> bool:
    """The accept's Triton kernels run on a CUDA device, or in Triton's interpreter where it is
    switched on (the CPU tests); elsewhere their plain-torch paths do."""
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


class DDTreeCommitStep(NamedTuple):
    out_tokens: torch.Tensor  # int64 [bs, width], path order, 0 past the path
    commit_lens: torch.Tensor  # int32 [bs] = accepted drafts + 1
    bonus: torch.Tensor  # int64 [bs], the last committed token (next root)
    new_seq_lens: torch.Tensor  # int64 [bs] = prefix + commit_lens
    kv_tgt: torch.Tensor  # int64 [bs * S]: the k-th window slot of each request
    kv_src: torch.Tensor  # int64 [bs * S]: the k-th accepted node's slot (the slot itself past the path)
    front_index: torch.Tensor  # int64 [bs * width]: the k-th accepted node's row (the root's past it)
    front_drop: torch.Tensor  # bool [bs * width]: k past the path (its front row is zeroed)


if triton is not None:

    @triton.jit
    def _ddtree_commit_kernel(
        predict, accept_index, accept_lens, out_cache_loc, prefix_lens,
        out_tokens, commit_lens, bonus, new_seq_lens, kv_tgt, kv_src, front_index, front_drop,
        W, S, WIDTH, BLOCK_S: tl.constexpr, BLOCK_WIDTH: tl.constexpr,
    ):
        b = tl.program_id(0)
        num = tl.load(accept_lens + b).to(tl.int64) - 1  # accepted drafts
        k = tl.arange(0, BLOCK_S)
        in_s = k < S
        idx = tl.load(accept_index + b * S + k, mask=in_s, other=-1).to(tl.int64)
        live = in_s & (k <= num) & (idx >= 0)
        # the KV move: node idx (a global row b*W + i) to the k-th slot of the window
        tgt = tl.load(out_cache_loc + b * W + tl.minimum(k, W - 1), mask=in_s, other=0)
        src = tl.load(out_cache_loc + idx, mask=live & (k < W), other=0)
        src = tl.where(live & (k < W), src, tgt)
        tl.store(kv_tgt + b * S + k, tgt, mask=in_s)
        tl.store(kv_src + b * S + k, src, mask=in_s)
        # the committed block, in path order, and the front rows for the draft-KV append
        j = tl.arange(0, BLOCK_WIDTH)
        in_w = j < WIDTH
        jdx = tl.load(accept_index + b * S + j, mask=in_w & (j < S), other=-1).to(tl.int64)
        jlive = in_w & (j < S) & (j <= num) & (jdx >= 0)
        tok = tl.load(predict + jdx, mask=jlive, other=0).to(tl.int64)
        tok = tl.where(jlive, tok, 0)
        tl.store(out_tokens + b * WIDTH + j, tok, mask=in_w)
        tl.store(front_index + b * WIDTH + j, tl.where(jlive, jdx, b * W), mask=in_w)
        tl.store(front_drop + b * WIDTH + j, jlive == 0, mask=in_w)
        last = tl.sum(tl.where(j == num, tok, 0), axis=0)
        tl.store(bonus + b, last)
        tl.store(commit_lens + b, (num + 1).to(tl.int32))
        tl.store(new_seq_lens + b, tl.load(prefix_lens + b).to(tl.int64) + num + 1)


def _commit_step_torch(predict, accept_index, accept_lens, out_cache_loc, prefix_lens, width):
    """:func:`ddtree_commit_step` in plain torch (the same outputs, many small kernels)."""
    bs, s = accept_index.shape
    w = out_cache_loc.numel() // bs
    commit = ddtree_commit(predict, accept_index, accept_lens.long() - 1, width)
    tgt, src = accept_kv_moves(out_cache_loc, accept_index, accept_lens.long() - 1)
    n = min(s, width)
    idx = torch.full((bs, width), -1, dtype=torch.int64, device=accept_index.device)
    live = commit.path[:, :n] >= 0  # on the path: k <= accepted drafts and a node there
    idx[:, :n] = torch.where(live, accept_index[:, :n].long(), idx[:, :n])
    keep = idx >= 0
    root = (torch.arange(bs, device=idx.device) * w).unsqueeze(1).expand(bs, width)
    return DDTreeCommitStep(
        commit.out_tokens, commit.commit_lens, commit.bonus,
        prefix_lens.long() + commit.commit_lens.long(), tgt, src,
        torch.where(keep, idx, root).reshape(-1), ~keep.reshape(-1),
    )


def ddtree_commit_step(
    predict: torch.Tensor,
    accept_index: torch.Tensor,
    accept_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    prefix_lens: torch.Tensor,
    width: int,
    *,
    use_triton: Optional[bool] = None,
) -> DDTreeCommitStep:
    """Everything the accept derives from ``eagle_sample``'s outputs (``predict`` [bs*W],
    ``accept_index`` [bs, S] global rows -1 padded, ``accept_lens`` = accepted drafts + 1) in
    one launch, as DFLASH's accept is one (``_compute_dflash_accept_bonus_triton``): the
    committed block (:func:`ddtree_commit`'s tokens, lengths, bonus), the new lengths, the KV moves for
    ``pool.move_kv_cache(kv_tgt, kv_src)`` (:func:`accept_kv_moves`: a node already at its slot,
    and every entry past the path, moves onto itself) and the rows :func:`front_rows` gathers
    (``x[front_index]`` with the ``front_drop`` rows zeroed). ``use_triton``: the Triton kernel (default:
    on a CUDA device, or under ``TRITON_INTERPRET=1``); else the same in plain torch."""
    bs, s = accept_index.shape
    # The kernel indexes by these shapes unchecked: a mismatch is an error, never a wild read.
    if bs and (accept_lens.numel() != bs or prefix_lens.numel() != bs or out_cache_loc.numel() % bs
               or predict.numel() < out_cache_loc.numel() or s > out_cache_loc.numel() // bs):
        raise ValueError(
            f"ddtree_commit_step: accept_index {tuple(accept_index.shape)}, accept_lens {accept_lens.numel()}, "
            f"prefix_lens {prefix_lens.numel()}, out_cache_loc {out_cache_loc.numel()}, predict {predict.numel()}")
    if use_triton is None:
        use_triton = _runs_triton(predict)
    if not use_triton:
        return _commit_step_torch(predict, accept_index, accept_lens, out_cache_loc, prefix_lens, width)
    dev = predict.device
    out = DDTreeCommitStep(
        torch.empty((bs, width), dtype=torch.int64, device=dev),
        torch.empty((bs,), dtype=torch.int32, device=dev),
        torch.empty((bs,), dtype=torch.int64, device=dev),
        torch.empty((bs,), dtype=torch.int64, device=dev),
        torch.empty((bs * s,), dtype=torch.int64, device=dev),
        torch.empty((bs * s,), dtype=torch.int64, device=dev),
        torch.empty((bs * width,), dtype=torch.int64, device=dev),
        torch.empty((bs * width,), dtype=torch.bool, device=dev),
    )
    if bs == 0:
        return out
    _ddtree_commit_kernel[(bs,)](
        predict, accept_index, accept_lens, out_cache_loc, prefix_lens, *out,
        out_cache_loc.numel() // bs, s, width,
        BLOCK_S=triton.next_power_of_2(s), BLOCK_WIDTH=triton.next_power_of_2(width),
    )
    return out


# ---------------------------------------------------------------------------
# The accepted-KV move: every layer in one launch, rows already in place skipped
# ---------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _ddtree_move_kv_kernel(
        data_ptrs, strides, tgt_loc, src_loc, num_locs, chunk,
        CHUNK_UPPER: tl.constexpr, WORDS_PER_TILE: tl.constexpr,
    ):
        # SGLang's copy_all_layer_kv_cache_tiled (one program per layer buffer and tile of a
        # row; every row of its list loaded before any is stored, so a path's
        # gather-then-scatter is exact), with three changes: 4-byte words, not bytes; the list
        # cut in chunks of whole requests (a move never crosses requests), so the kernel
        # compiles once per server; and an entry whose source is its target moves nothing.
        buf = tl.program_id(0)
        tile = tl.program_id(1)
        start = tl.program_id(2) * chunk
        stride = tl.load(strides + buf)  # words per row
        base = tl.cast(tl.load(data_ptrs + buf), tl.pointer_type(tl.int32))
        word = tile * WORDS_PER_TILE + tl.arange(0, WORDS_PER_TILE)
        i = start + tl.arange(0, CHUNK_UPPER)
        in_list = (i < num_locs) & (i < start + chunk)
        src = tl.load(src_loc + i, mask=in_list, other=0)
        tgt = tl.load(tgt_loc + i, mask=in_list, other=0)
        mask = (in_list & (src != tgt))[:, None] & (word < stride)[None, :]
        vals = tl.load(base + src[:, None] * stride + word[None, :], mask=mask)
        tl.store(base + tgt[:, None] * stride + word[None, :], vals, mask=mask)


def _kv_buffers(pool):
    """The per-layer buffers a move must cover, or None where the pool keeps more (scales,
    an indexer, a paged layout): those pools move with their own ``move_kv_cache``."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if type(pool) is MLATokenToKVPool:
        return list(pool.kv_buffer)
    if type(pool) is MHATokenToKVPool and not getattr(pool, "use_hnd", False) and all(
        getattr(pool, name, None) is None for name in ("k_scale_buffer", "native_k_scale_buffer")
    ):
        return list(pool.k_buffer) + list(pool.v_buffer)
    return None


def kv_move_table(buffers):
    """``(data_ptrs, row_words, words_per_tile, tiles)`` for per-layer ``[slots, ...]`` buffers
    (:func:`move_kv_rows`), or ``()`` where a row is not whole 4-byte words; the buffers must
    outlive it (a pool's do)."""
    rows = [b.stride(0) * b.element_size() for b in buffers]
    if any(r % 4 for r in rows) or any(b.data_ptr() % 4 for b in buffers):
        return ()
    dev = buffers[0].device
    words = [r // 4 for r in rows]
    tile = min(32, triton.next_power_of_2(max(words)))  # 128 B, SGLang's tile for rows under 4 KB
    return (torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=dev),
            torch.tensor(words, dtype=torch.int64, device=dev), tile, -(-max(words) // tile))


def _move_table(pool):
    """The pool's :func:`kv_move_table`, built once (``()`` for a pool it cannot cover)."""
    table = getattr(pool, "_ddtree_move_table", None)
    if table is None:
        buffers = _kv_buffers(pool)
        table = kv_move_table(buffers) if buffers else ()
        pool._ddtree_move_table = table
    return table or None


# requests per program of the move: a chunk of whole requests, compiled once per server
MOVE_CHUNK_REQUESTS = 4


def move_accepted_kv(pool, tgt_loc: torch.Tensor, src_loc: torch.Tensor, per_request: int) -> None:
    """``pool.move_kv_cache(tgt_loc, src_loc)`` for the accepted paths of a tree step, whose
    lists hold ``per_request`` entries a request (:func:`ddtree_commit_step`): one launch for
    every layer (0.5.23's MLA pool moves layer by layer in torch: two launches per layer, 122 on
    Kimi K2.6), and a row already at its slot (an in-place node, an entry past the path) reads
    and writes nothing. Pools with more than plain per-layer rows, and a host without Triton,
    take the pool's own move."""
    n = int(tgt_loc.numel())
    table = _move_table(pool) if _runs_triton(tgt_loc) and n else None
    if table is None:
        pool.move_kv_cache(tgt_loc, src_loc)
        return
    move_kv_rows(table, tgt_loc, src_loc, per_request)


def move_kv_rows(table, tgt_loc: torch.Tensor, src_loc: torch.Tensor, per_request: int) -> None:
    """The move kernel itself over a :func:`kv_move_table`: row ``src_loc[i]`` of every buffer
    to row ``tgt_loc[i]``, gather then scatter within each chunk of whole requests (a
    request's entries never span two chunks), rows whose source is their target untouched."""
    ptrs, rows, tile, tiles = table
    n = int(tgt_loc.numel())
    chunk = int(per_request) * MOVE_CHUNK_REQUESTS
    _ddtree_move_kv_kernel[(ptrs.numel(), tiles, -(-n // chunk))](
        ptrs, rows, tgt_loc, src_loc, n, chunk,
        CHUNK_UPPER=triton.next_power_of_2(chunk), WORDS_PER_TILE=tile,
    )
