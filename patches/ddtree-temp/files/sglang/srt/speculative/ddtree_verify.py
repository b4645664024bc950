"""DDTree tree verify: the pure parts of one decode step (ddtree-temp 1.1.0).

Module level imports only stdlib, torch and the other ddtree modules, so every
function here runs (and is tested) on CPU. The DDTree worker
(``ddtree_worker.py``) calls them around 0.5.23's DFlash draft forward and the
target TARGET_VERIFY forward:

1. :func:`ddtree_prepare_verify`: raw draft logits ``[bs, L, V]`` -> per-position
   top-k log-probs (``log_softmax``, no temperature) -> best-first tree
   (``build_ddtree_tree``) -> retrieve arrays, ancestors-or-self mask in SGLang's
   FULL_MASK layout, positions ``prefix + depth``, verify tokens in node order.
   Verify width ``W = budget + 1`` tokens per request, node ``i`` of request
   ``b`` at flat row ``b*W + i`` (the retrieve encoding's global index).
2. :func:`ddtree_accept`: greedy tree verify or the sampling path (CUDA kernel
   when available, else the reference) on the target logits at the nodes.
3. :func:`ddtree_commit`: the accepted path in path order (tokens, commit
   lengths, bonus) and the KV moves that put the accepted nodes' KV at the
   front of each request's verify window, as EAGLE does for topk > 1
   (``move_accept_tokens_to_target_kvcache``): target slot ``window[b, k]``
   receives source slot ``window[b, path[b, k]]`` for ``k <= accepted``.
   :func:`compact_to_front` is EAGLE's ``_compact_accept_to_front`` (used for the
   target hidden states that DFlash materialises into the draft KV cache).

Node order guarantees ``path[b, k] >= k`` (parents precede children), so one
gather-then-scatter move is exact; the rest of the window (rejected nodes) is
left for the allocator to reuse, exactly as with EAGLE's over-allocated window.
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
    draft_logits: torch.Tensor,
    root_tokens: torch.Tensor,
    prefix_lens: torch.Tensor,
    budget: int,
    topk_cap: Optional[int] = None,
    seq_lens_sum: Optional[int] = None,
) -> DDTreeVerifyPlan:
    """Draft logits of the DFlash block (``[bs, L, V]``: block positions 1..L,
    i.e. depths 1..L) -> everything the TARGET_VERIFY forward needs.

    ``prefix_lens`` [bs] = committed KV length (the root, the last verified
    token, is written at position ``prefix_lens`` by this verify).
    ``seq_lens_sum`` (host int, = ``prefix_lens.sum()``) builds the FULL_MASK
    custom mask; without it only the dense ``tree_mask`` is returned.
    Padding nodes (when fewer than ``budget`` prefixes exist) get the root's
    token and position; they are never linked, attend to the prefix and
    themselves, and are never accepted.
    """
    bs = draft_logits.shape[0]
    cap = budget if topk_cap is None else min(int(topk_cap), int(budget))
    k = min(cap, draft_logits.shape[-1])
    top = draft_topk_logprobs(draft_logits, k)
    tree = build_ddtree_tree(top, budget, cap, root_tokens=root_tokens)
    retrieve = compile_ddtree_retrieve(tree.parents, tree.scores)
    valid = tree.valid
    tokens = torch.where(valid, tree.tokens, tree.tokens[:, :1])
    positions = ddtree_positions(tree.depths, prefix_lens.to(tree.depths.device))
    tree_mask = ddtree_tree_mask(tree.parents, max_depth=draft_logits.shape[1])
    custom = None
    if seq_lens_sum is not None:
        custom = ddtree_full_mask(tree_mask, prefix_lens, int(seq_lens_sum))
    width = int(budget) + 1
    return DDTreeVerifyPlan(
        tree, retrieve, tokens.reshape(bs * width), positions.reshape(bs * width),
        tree_mask, custom, width,
    )


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
