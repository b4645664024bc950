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
- :func:`ddtree_commit_tokens`, :func:`front_rows`: ``eagle_sample``'s outputs ->
  DFlash's committed-block layout, and the accepted path's rows (target hidden
  states) in path order for the draft-KV append.

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

from typing import NamedTuple, Optional, Tuple

import torch

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


def ddtree_commit_tokens(
    predict: torch.Tensor, accept_index: torch.Tensor, accept_lens: torch.Tensor, width: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``eagle_sample``'s outputs (``accept_lens`` = accepted drafts + bonus) ->
    DFlash's committed-block layout: tokens in path order ``[bs, width]`` (0 past
    the path), commit lengths (int32) and the bonus token (the next root).
    ``accept_index`` holds global node rows (``b*W + i``), -1 padded."""
    commit = ddtree_commit(predict, accept_index, accept_lens.long() - 1, width)
    return commit.out_tokens, commit.commit_lens, commit.bonus


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
