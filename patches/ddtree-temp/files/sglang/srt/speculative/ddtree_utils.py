"""DDTree: draft-tree construction and tree verification (greedy and sampled).

Pure PyTorch. This module imports only the standard library and torch at module
level, so it loads on hosts that have neither SGLang's third-party dependencies
nor a GPU. SGLang internals (the CUDA verify kernel) are imported lazily.

Conventions (all tensors batched over requests, ``bs`` first):

* A tree has ``N = budget + 1`` node slots. Node 0 is the root: the last
  verified token, not yet in the KV cache. ``parents[b, 0] = -1``.
* Draft nodes come out in non-increasing cumulative score (sum of draft
  log-probabilities along the path), so ``parent < child``; siblings are ordered
  by descending score (lower index first on equal score).
* When fewer than ``budget`` prefixes exist (``topk_cap ** depth`` is small, or
  the draft gives ``-inf`` log-probabilities), the unused slots are *padding*:
  ``parents = -1``, ``tokens = 0``, ``depths = 0``, ``scores = -inf``. Padding
  slots are never linked into the retrieve encoding, so the verifier never
  reaches them; they attend only to the prefix and themselves.
* The retrieve encoding is the one of SGLang's ``tree_speculative_sampling_
  target_only`` / ``verify_tree_greedy`` kernels: ``retrive_index[b, i] = b*N+i``,
  ``retrive_next_token`` = first child or -1, ``retrive_next_sibling`` = next
  sibling or -1.

Nothing on the hot path (build, compile, mask, positions, verify) calls
``.item()``, ``.tolist()`` or branches on tensor values on the host; loops run
over depths (at most the draft length) or sibling ranks (pointer doubling,
``log2 N`` steps), never over nodes or requests.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Tuple

import torch

# SGLang clamps seeded coins to this: a coin of exactly 1.0 walks past the last
# bucket of the kernel's cumulative sums.
MAX_COIN = 1.0 - 2.0**-24


class DDTree(NamedTuple):
    """A batch of draft trees, all tensors ``[bs, budget + 1]``."""

    tokens: torch.Tensor  # int64; tokens[:, 0] = root token (or 0 when unknown)
    parents: torch.Tensor  # int64; -1 for the root and for padding
    depths: torch.Tensor  # int64; root 0
    scores: torch.Tensor  # float32; root 0.0, padding -inf

    @property
    def valid(self) -> torch.Tensor:
        v = self.parents >= 0
        v[:, 0] = True
        return v


class RetrieveEncoding(NamedTuple):
    retrive_index: torch.Tensor  # int64 [bs, N]
    retrive_next_token: torch.Tensor  # int64 [bs, N]
    retrive_next_sibling: torch.Tensor  # int64 [bs, N]


# ---------------------------------------------------------------------------
# Draft log-probabilities
# ---------------------------------------------------------------------------


def draft_topk_logprobs(
    draft_logits: torch.Tensor, k: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-position top-``k`` log-probabilities of raw draft logits.

    ``draft_logits`` [bs, L, V] -> (logprobs [bs, L, k] float32 sorted
    descending, token ids [bs, L, k] int64). As in the paper: ``top_logits -
    logsumexp(logits)``, no temperature.
    """
    k = int(min(k, draft_logits.shape[-1]))
    logits = draft_logits.float()
    top_vals, top_ids = torch.topk(logits, k, dim=-1, largest=True, sorted=True)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    return top_vals - lse, top_ids


# ---------------------------------------------------------------------------
# Tree construction
# ---------------------------------------------------------------------------


# Tie-break keys. A float32 score s <= 0 is widened to float64 and perturbed by
# its global candidate id g: key = s * (1 + g * eps) - (g + 1) * _KEY_TINY.
# The relative perturbation (<= 2**-30) is far below the float32 spacing
# (>= 2**-24 relative), so distinct scores keep their order and the key rounds
# back to exactly s in float32; equal scores are ordered by g (a larger g gives
# a more negative key). The absolute term only matters for s == 0 (it is below
# half a float64 ulp of any nonzero float32). Every key is < 0, so the int64
# view of the key orders candidates (smallest int64 = largest key); topk on
# int64 has no NaN handling and is several times faster on CPU than on floats.
# The int64 view of -0.0, INT64_MIN, is below every key: the root's key when
# looking parents up among the selected keys.
_KEY_TINY = 2.0**-1000
_KEY_ROOT = -(2**63)


class _BuildPlan(NamedTuple):
    depth: int  # depths that can hold a node (<= L)
    survivors: tuple[int, ...]  # sorted survivors depth t exposes to depth t+1
    n_ids: int  # U: candidates scored over all depths (columns of the key buffer)
    counts: tuple[int, ...]  # per depth: its candidates (consecutive columns)
    key_mult0: torch.Tensor  # depth 1: float64 1 + g * eps
    key_neg0: torch.Tensor  # depth 1: float64 -(g + 1) * tiny
    # depths >= 2: (survivor rank per pair, key_neg, key_mult, number of
    # sorted survivors kept for the next depth)
    steps: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int], ...]
    lp_index: torch.Tensor | None  # [U - K] flat t * K + j of each pair, depths >= 1
    lp_splits: tuple[int, ...]
    pair_table: torch.Tensor  # [U, 3] per candidate g: parent survivor-list index, flat token index, depth
    root_key: torch.Tensor  # [1, 1] int64 _KEY_ROOT: the root's entry of the survivor list
    fill: torch.Tensor  # [3, 1, 1] (token, parent, depth) of the root and of padding
    take: int


@functools.lru_cache(maxsize=256)
def _pair_lists(budget: int, k: int, depth_max: int):
    """Pure-Python candidate lists, per depth index t (1-based depth t+1).

    Returns ``(widths, pair_i, pair_j)``: the beam width of every depth that
    can hold a node, and for t >= 1 the admissible (survivor rank, token rank)
    pairs in lexicographic order (t = 0: the root's children, i = 0, j < k).

    A node (i, j) of depth ``d >= 2`` in the final tree brings along its
    ``(i+1)(j+1)`` dominators at depth d (survivor rank <= i, token rank <= j:
    each scores at least as much and comes first under the tie rule), their
    ``i+1`` parents and at least ``d-2`` shallower ancestors, so ``(i+1)(j+2) +
    d - 2 <= budget``; and ``i`` must exist in the previous beam. A node of
    depth d has at most ``budget - d`` same-depth prefixes ahead of it (it
    needs ``d-1`` ancestors too), so the beam of depth d keeps ``budget - d +
    1`` entries (at most the number of candidates).
    """
    widths = [k]
    pis = [(0,) * k]
    pjs = [tuple(range(k))]
    for t in range(1, depth_max):
        lim = budget - t + 1  # budget - d + 2 with d = t + 1
        ii: list = []
        jj: list = []
        for i in range(widths[t - 1]):
            w = min(k, lim // (i + 1) - 1)
            if w <= 0:
                break
            ii.extend([i] * w)
            jj.extend(range(w))
        if not ii:
            break
        pis.append(tuple(ii))
        pjs.append(tuple(jj))
        widths.append(min(budget - t, len(ii)))
    return tuple(widths), tuple(pis), tuple(pjs)


@functools.lru_cache(maxsize=64)
def _build_plan(
    budget: int, k: int, depth_max: int, kmax: int, device: torch.device
) -> _BuildPlan:
    widths, pis, pjs = _pair_lists(budget, k, depth_max)
    depth = len(widths)
    survivors = tuple(
        (max(pis[t + 1]) + 1) if t + 1 < depth else 0 for t in range(depth)
    )
    # global candidate ids g = column in the key buffer, depth-major then pair
    # index (depth 1: g = j)
    base = [0]
    for t in range(1, depth):
        base.append(base[-1] + len(pjs[t - 1]))
    n_ids = base[-1] + len(pjs[-1])
    bits = max(1, math.ceil(math.log2(n_ids + 1)))
    if 30 + bits > 50:  # pragma: no cover - budgets in the millions
        raise ValueError(f"budget {budget} too large for the tie-break keys")
    eps = 2.0 ** -(30 + bits)
    g = torch.arange(n_ids, dtype=torch.float64)
    mult = (1.0 + g * eps).to(device)
    neg = (-(g + 1.0) * _KEY_TINY).to(device)
    # survivor list: [root, survivors of depth 1 (by position), of depth 2, ...]
    sx_off = [1]
    for h in survivors[:-1]:
        sx_off.append(sx_off[-1] + h)
    rows = [[0, j, 1] for j in range(k)]
    for t in range(1, depth):
        rows += [[sx_off[t - 1] + i, t * kmax + j, t + 1] for i, j in zip(pis[t], pjs[t])]
    lp_index = None
    if depth > 1:
        lp_index = torch.cat(
            [torch.tensor(pjs[t], dtype=torch.long) + t * k for t in range(1, depth)]
        ).to(device)
    return _BuildPlan(
        depth=depth,
        survivors=survivors,
        n_ids=n_ids,
        counts=tuple(len(p) for p in pjs),
        key_mult0=mult[:k],
        key_neg0=neg[:k],
        steps=tuple(
            (
                torch.tensor(pis[t], dtype=torch.long).to(device),
                neg[base[t] : base[t] + len(pjs[t])],
                mult[base[t] : base[t] + len(pjs[t])],
                survivors[t],
            )
            for t in range(1, depth)
        ),
        lp_index=lp_index,
        lp_splits=tuple(len(pjs[t]) for t in range(1, depth)),
        pair_table=torch.tensor(rows, dtype=torch.long).to(device),
        root_key=torch.full((1, 1), _KEY_ROOT, dtype=torch.long).to(device),
        fill=torch.tensor([0, -1, 0], dtype=torch.long).view(3, 1, 1).to(device),
        take=min(budget, sum(widths)),
    )


def admissible_pairs(
    budget: int, k: int, depth: int = 2, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (survivor rank ``i``, token rank ``j``) pairs that
    :func:`build_ddtree_tree` scores at ``depth`` (1-based), top-k width ``k``.

    Both ranks are 0-based: survivors (the beam of depth ``depth-1``) sorted by
    score descending, tokens by log-probability descending. A child ``(i, j)``
    is dominated by the ``(i+1)(j+1)`` children ``(i', j')`` with ``i' <= i``
    and ``j' <= j``, which score at least as much and come first under the tie
    rule; with their ``i+1`` parents and ``depth-2`` further ancestors they
    must all fit in the tree, so only ``(i+1)(j+2) <= budget - depth + 2``
    (with ``j < k`` and ``i`` inside the previous beam) is scored. That is a
    subset of ``(i+1)(j+1) <= budget``: at most ``sum_i floor(budget / (i+1))``
    pairs, about ``budget * ln(budget)``, instead of ``budget * k``. Depth 1
    scores the root's ``min(k, budget)`` children (``i = 0``). Returned as
    int64 tensors in lexicographic order; empty when no node of ``depth`` can
    be in a tree of ``budget`` nodes.
    """
    if budget < 1 or k < 1 or depth < 1:
        raise ValueError(f"budget, k and depth must be >= 1, got {budget}, {k}, {depth}")
    dev = torch.device("cpu") if device is None else torch.device(device)
    _, pis, pjs = _pair_lists(int(budget), int(min(k, budget)), int(depth))
    if len(pis) < depth:
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        return empty, empty.clone()
    ii = torch.tensor(pis[depth - 1], dtype=torch.long).to(dev)
    jj = torch.tensor(pjs[depth - 1], dtype=torch.long).to(dev)
    return ii, jj


def build_ddtree_tree(
    draft_logprobs,
    budget: int,
    topk_cap: Optional[int] = None,
    root_tokens: Optional[torch.Tensor] = None,
) -> DDTree:
    """Best-first DDTree: per request the ``budget`` highest-scoring prefixes.

    ``draft_logprobs`` is either a tensor ``[bs, L, V]`` of per-position draft
    log-probabilities, or a pair ``(topk_logprobs [bs, L, K], topk_ids [bs, L,
    K])`` sorted descending along the last dim (from :func:`draft_topk_logprobs`).
    Only the top ``min(topk_cap, budget, K)`` tokens per depth are eligible;
    ``topk_cap=None`` means ``budget`` (the paper's tree). Log-probabilities
    are clamped to ``<= 0`` (so a child never outscores its parent); ``-inf``
    (or NaN) marks an impossible token, which is never a node.

    The result is the paper's heap tree (ties aside: the heap breaks them by
    push order): the first ``budget`` prefixes of the total order below,
    numbered 1..budget in that order, so ``parent < child`` and scores are
    non-increasing. Scores are float32 sums along the path, accumulated root
    first.

    Tie rule (the total order on prefixes): higher score first; on equal score
    the shallower prefix first; at equal depth the prefix whose parent comes
    first in this same order; same parent: the lower token rank (position in
    the given descending top-k list) first. A parent therefore precedes its
    children even when a log-probability is exactly 0.

    Algorithm: static shapes, no host synchronisation (no ``.item()``, no
    boolean indexing, no data-dependent shapes), so it can be captured in a
    CUDA graph once its per-(budget, K, L, top-k width, device) plan is cached
    (any warm-up call does that); the loop runs over depths only. A final-tree
    node of depth ``d`` is a child of one of the best prefixes of depth ``d-1``
    (the *survivors*, sorted) and only the :func:`admissible_pairs` ``(i, j)``
    with ``(i+1)(j+2) <= budget - d + 2`` can be final-tree nodes, about
    ``budget * ln(budget)`` candidates per depth instead of ``budget * K``.
    Each depth scores those (one gather and one add in float32) and writes
    their unique tie-break keys (the order above: score, then depth, then pair
    index, whose lexicographic (i, j) order is parent order then token rank)
    into one key buffer for all depths; one sorted ``topk`` picks its best
    ``(budget - d + 1) // 2`` candidates, the only ones that can have a child
    in the tree, as the next depth's survivors. The tree is the best ``budget``
    candidates of all depths (one ``topk`` over the key buffer): every
    final-tree node is a candidate, every other candidate has at least
    ``budget`` prefixes ahead of it, and the selection is prefix-closed, so
    every parent is selected and comes before its child; a node's parent number
    is the rank of the parent's key among the selected keys (one
    ``searchsorted``).
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if isinstance(draft_logprobs, (tuple, list)):
        top_lp, top_ids = draft_logprobs
        top_lp = top_lp.float()
        top_ids = top_ids.long()
    else:
        cap = budget if topk_cap is None else min(int(topk_cap), budget)
        cap = min(cap, draft_logprobs.shape[-1])
        top_lp, top_ids = torch.topk(
            draft_logprobs.float(), cap, dim=-1, largest=True, sorted=True
        )
    bs, depth_max, kmax = top_lp.shape
    k = kmax if topk_cap is None else min(int(topk_cap), kmax)
    k = min(k, budget)
    if k < 1:
        raise ValueError(f"topk_cap must be >= 1, got {topk_cap}")
    device = top_lp.device
    n = budget + 1
    if depth_max == 0:
        out = torch.zeros(2, bs, n, dtype=torch.long, device=device)
        parents = torch.full((bs, n), -1, dtype=torch.long, device=device)
        scores = torch.full((bs, n), float("-inf"), dtype=torch.float32, device=device)
        scores[:, 0] = 0.0
        if root_tokens is not None:
            out[0, :, 0] = root_tokens.to(device=device, dtype=torch.long).reshape(bs)
        return DDTree(out[0], parents, out[1], scores)

    plan = _build_plan(budget, k, depth_max, kmax, device)
    depth = plan.depth
    lp = top_lp[:, :depth, :k].clamp(max=0.0)  # [bs, D, K] (a copy)
    # tie-break keys of every candidate of every depth, float64 [bs, U] (and
    # its int64 view)
    key_buf = torch.empty(bs, plan.n_ids, dtype=torch.float64, device=device)
    keys = key_buf.view(torch.int64)
    key_cols = key_buf.split(plan.counts, 1)  # per depth
    first = lp[:, 0]
    torch.addcmul(plan.key_neg0, first, plan.key_mult0, out=key_cols[0])
    h = plan.survivors[0]
    surv_keys = [keys[:, :h]]  # per depth: keys of its sorted survivors (depth 1: by position)
    surv = first  # float32 scores of the sorted survivors of the last depth
    lpp = ()
    if depth > 1:
        # log-probability of every pair's token, all depths: [bs, U - K]
        lpp = lp.reshape(bs, depth * k).index_select(1, plan.lp_index).split(plan.lp_splits, 1)
    for (pair_i, key_neg, key_mult, h), lp_t, key in zip(plan.steps, lpp, key_cols[1:]):
        # candidate scores (float32, root first), then their keys
        cand = surv.index_select(1, pair_i).add_(lp_t)
        torch.addcmul(key_neg, cand, key_mult, out=key)
        if h:
            sval = key.view(torch.int64).topk(h, dim=1, largest=False, sorted=True).values
            surv_keys.append(sval)
            surv = sval.view(torch.float64).float()

    take = plan.take
    # the tree: the best `take` candidates of all depths, best first
    sel_keys, sel = keys.topk(take, dim=1, largest=False, sorted=True)
    sel_scores = sel_keys.view(torch.float64).float()
    valid = sel_scores > float("-inf")  # NaN and -inf are not nodes
    # (parent survivor-list index, flat token index, depth) of each node
    row = plan.pair_table.index_select(0, sel.view(-1)).view(bs, take, 3)
    tok = torch.gather(top_ids.reshape(bs, depth_max * kmax), 1, row[..., 1])
    if depth > 1:
        # the parent's key, then its node number: the number of selected keys
        # <= it (root: _KEY_ROOT, below every key, gives 0)
        surv_list = torch.cat([plan.root_key.expand(bs, 1)] + surv_keys, 1)
        par = torch.searchsorted(sel_keys, torch.gather(surv_list, 1, row[..., 0]), right=True)
    else:
        par = row[..., 0]  # all 0: the root
    # (token, parent, depth) rows; padding and the root are (0, -1, 0)
    body = torch.where(valid, torch.stack([tok, par, row[..., 2]]), plan.fill)
    root = plan.fill.expand(3, bs, 1)
    if root_tokens is not None:
        rt = root_tokens.to(device=device, dtype=torch.long).reshape(1, bs, 1)
        root = torch.cat([rt, root[1:]])
    parts = [root, body]
    sc_parts = [sel_scores.new_zeros(bs, 1), torch.where(valid, sel_scores, float("-inf"))]
    if take < budget:
        parts.append(plan.fill.expand(3, bs, budget - take))
        sc_parts.append(sel_scores.new_full((bs, budget - take), float("-inf")))
    out = torch.cat(parts, 2)  # [3, bs, n]: each out[c] is contiguous
    return DDTree(out[0], out[1], out[2], torch.cat(sc_parts, 1))


# ---------------------------------------------------------------------------
# Retrieve encoding (first child / next sibling)
# ---------------------------------------------------------------------------


def compile_ddtree_retrieve(
    parents: torch.Tensor, scores: torch.Tensor
) -> RetrieveEncoding:
    """Parent pointers -> the kernel's first-child/next-sibling encoding.

    Siblings are ordered by descending cumulative score (ties: lower index
    first). Nodes with ``parents < 0`` other than the root are padding and are
    left unlinked (-1 everywhere).
    """
    bs, n = parents.shape
    device = parents.device
    parents = parents.long()
    valid = parents >= 0
    # Group key: the parent; the root and padding each get a group of their own
    # (n + index), so they are never anyone's sibling and sort last.
    group = torch.where(valid, parents, torch.arange(n, 2 * n, device=device))
    # Order by (group asc, score desc, index asc): two stable sorts.
    sc = torch.where(valid, scores.float(), 0.0)
    o1 = torch.sort(sc, dim=1, descending=True, stable=True).indices
    g_sorted, o2 = torch.sort(torch.gather(group, 1, o1), dim=1, stable=True)
    order = torch.gather(o1, 1, o2)  # node ids in (group, -score, index) order
    # same[:, p]: positions p and p + 1 of the order are siblings
    same = g_sorted[:, 1:] == g_sorted[:, :-1]
    next_sibling = torch.full((bs, n), -1, dtype=torch.long, device=device)
    next_sibling.scatter_(1, order[:, :-1], torch.where(same, order[:, 1:], -1))
    # the first of each group is its parent's first child; groups >= n (root,
    # padding) and the non-first (column 2n) land past column n
    first_child = torch.full((bs, 2 * n + 1), -1, dtype=torch.long, device=device)
    first_child.scatter_(1, g_sorted[:, :1], order[:, :1])
    first_child.scatter_(1, torch.where(same, 2 * n, g_sorted[:, 1:]), order[:, 1:])
    retrive_index = torch.arange(bs * n, device=device).view(bs, n)
    # SGLang's kernels (verify_tree_greedy, tree_speculative_sampling_target_only)
    # refuse non-contiguous inputs: the first n columns are copied out of the buffer.
    return RetrieveEncoding(retrive_index, first_child[:, :n].contiguous(), next_sibling)


def decode_retrieve_parents(
    retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor
) -> torch.Tensor:
    """Inverse of the encoding: parents [bs, N] (-1 for root and unlinked).

    Pointer doubling over the sibling chain: ``ceil(log2 N)`` steps.
    """
    bs, n = retrive_next_token.shape
    device = retrive_next_token.device
    nt = retrive_next_token.long()
    ns = retrive_next_sibling.long()
    ar = torch.arange(n, device=device).expand(bs, n)
    # direct parent of first children
    par = torch.full((bs, n + 1), -1, dtype=torch.long, device=device)
    par.scatter_(1, torch.where(nt >= 0, nt, n), torch.where(nt >= 0, ar, -1))
    par = par[:, :n]
    # prev sibling
    prev = torch.full((bs, n + 1), -1, dtype=torch.long, device=device)
    prev.scatter_(1, torch.where(ns >= 0, ns, n), torch.where(ns >= 0, ar, -1))
    prev = prev[:, :n]
    # head of chain: follow prev to the first child (pointer doubling)
    head = torch.where(prev >= 0, prev, ar)
    for _ in range(max(1, math.ceil(math.log2(max(n, 2)))) + 1):
        head = torch.gather(head, 1, head)
    return torch.gather(par, 1, head)


def sibling_ranks(
    retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(parents, rank among siblings) from the encoding, by pointer doubling."""
    bs, n = retrive_next_token.shape
    device = retrive_next_token.device
    ns = retrive_next_sibling.long()
    ar = torch.arange(n, device=device).expand(bs, n)
    prev = torch.full((bs, n + 1), -1, dtype=torch.long, device=device)
    prev.scatter_(1, torch.where(ns >= 0, ns, n), torch.where(ns >= 0, ar, -1))
    prev = prev[:, :n]
    # distance to chain head via doubling: jump[i] = prev^(2^t)(i), dist accum
    jump = torch.where(prev >= 0, prev, ar)
    dist = (prev >= 0).long()
    for _ in range(max(1, math.ceil(math.log2(max(n, 2)))) + 1):
        dist = dist + torch.gather(dist, 1, jump)
        jump = torch.gather(jump, 1, jump)
    parents = decode_retrieve_parents(retrive_next_token, retrive_next_sibling)
    return parents, dist


def children_table(
    retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor
) -> torch.Tensor:
    """[bs, N, N] local child ids by sibling rank (-1 = none): row p lists the
    children of node p in sibling order."""
    bs, n = retrive_next_token.shape
    device = retrive_next_token.device
    parents, rank = sibling_ranks(retrive_next_token, retrive_next_sibling)
    linked = parents >= 0
    table = torch.full((bs, n * n + 1), -1, dtype=torch.long, device=device)
    flat = torch.where(linked, parents * n + rank.clamp(max=n - 1), n * n)
    table.scatter_(1, flat, torch.where(linked, torch.arange(n, device=device).expand(bs, n), -1))
    return table[:, : n * n].view(bs, n, n)


# ---------------------------------------------------------------------------
# Attention mask and positions
# ---------------------------------------------------------------------------


def ddtree_positions(depths: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Position of each node: ``start + depth`` (root at ``start``, which is the
    current sequence length before the root is written, i.e. seq_lens)."""
    return start.long().view(-1, 1) + depths.long()


def ddtree_tree_mask(parents: torch.Tensor, max_depth: Optional[int] = None) -> torch.Tensor:
    """Ancestors-or-self mask [bs, N, N] bool: ``mask[b, i, j]`` = node j is
    node i or one of its ancestors.

    Pointer doubling over the parent links: after step t every row holds the
    ancestors within distance ``2**t`` (``mask[i] |= mask[jump[i]]``, ``jump =
    jump[jump]``), so ``ceil(log2(max_depth))`` steps of three kernels cover the
    tree (4 at depth 15), instead of a loop over depths. ``max_depth`` bounds
    the deepest node (default: ``N - 1``); the root and padding point to
    themselves."""
    bs, n = parents.shape
    device = parents.device
    depth = n - 1 if max_depth is None else int(max_depth)
    ar = torch.arange(n, device=device)
    par = parents.long()
    jump = torch.where(par >= 0, par, ar.expand(bs, n))  # [bs, N]: ancestor at distance 1 (or self)
    eye = ar.view(1, n, 1) == ar.view(1, 1, n)
    mask = eye | (ar.view(1, 1, n) == jump.unsqueeze(2))
    reach = 1
    while reach < depth:
        mask = mask | torch.gather(mask, 1, jump.unsqueeze(2).expand(bs, n, n))
        jump = torch.gather(jump, 1, jump)
        reach *= 2
    return mask


def ddtree_window_mask_index(seq_lens: torch.Tensor, n: int) -> torch.Tensor:
    """Flat positions ``[bs, n, n]`` of the tree-window entries in SGLang's
    FULL_MASK layout: request b's block starts at ``sum_{b'<b} n*(seq_lens[b']
    + n)``, its row i is ``seq_lens[b] + n`` entries long, and the window is
    that row's last ``n`` entries (after the prefix)."""
    seq_lens = seq_lens.long()
    row_len = seq_lens + n
    req_start = torch.cumsum(n * row_len, 0) - n * row_len
    i = torch.arange(n, device=seq_lens.device).view(1, n, 1)
    j = torch.arange(n, device=seq_lens.device).view(1, 1, n)
    return (req_start.view(-1, 1, 1) + i * row_len.view(-1, 1, 1)
            + seq_lens.view(-1, 1, 1) + j)


def ddtree_write_window_mask(
    mask: torch.Tensor, tree_mask: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    """Write only the tree window of the FULL_MASK layout into ``mask`` (1-D,
    bool/uint8, long enough for the batch). The prefix entries are left as they
    are: the triton extend kernel never reads them in TARGET_VERIFY
    (``skip_prefix_custom_mask=True``: every node sees the whole prefix), so
    the per-step cost is ``bs*n*n`` entries instead of ``n*(sum seq_lens) +
    bs*n*n``, and a persistent buffer (the attention backend's verify-mask
    buffer) can be written in place, inside a CUDA graph."""
    bs, n, _ = tree_mask.shape
    flat = ddtree_window_mask_index(seq_lens[:bs].to(tree_mask.device), n)
    mask.view(-1).index_copy_(0, flat.reshape(-1), tree_mask.reshape(-1).to(mask.dtype))


def ddtree_full_mask(
    tree_mask: torch.Tensor, seq_lens: torch.Tensor, seq_lens_sum: int
) -> torch.Tensor:
    """SGLang FULL_MASK layout: for each request b, ``N`` rows of
    ``seq_lens[b] + N`` entries (prefix all True, then the tree mask row),
    flattened and concatenated over the batch. ``seq_lens_sum`` is the host
    value SGLang already tracks (no device->host sync here)."""
    bs, n, _ = tree_mask.shape
    device = tree_mask.device
    seq_lens = seq_lens.long().to(device)
    total = n * int(seq_lens_sum) + bs * n * n
    out = torch.ones(total, dtype=torch.bool, device=device)
    row_len = seq_lens + n  # [bs]
    req_start = torch.cumsum(n * row_len, 0) - n * row_len  # [bs]
    i = torch.arange(n, device=device).view(1, n, 1)
    j = torch.arange(n, device=device).view(1, 1, n)
    flat = (
        req_start.view(bs, 1, 1)
        + i * row_len.view(bs, 1, 1)
        + seq_lens.view(bs, 1, 1)
        + j
    )
    out[flat.reshape(-1)] = tree_mask.reshape(-1)
    return out


# ---------------------------------------------------------------------------
# Verification: greedy
# ---------------------------------------------------------------------------


def _walk_outputs(bs: int, n: int, s: int, device):
    predicts = torch.zeros(bs * n, dtype=torch.int32, device=device)
    accept_index = torch.full((bs, s), -1, dtype=torch.int32, device=device)
    accept_token_num = torch.zeros(bs, dtype=torch.int32, device=device)
    return predicts, accept_index, accept_token_num


def verify_tree_greedy_reference(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy tree verify, in place, same outputs as the sampling kernel:
    follow the child whose token equals the target argmax; ``predicts`` of
    every accepted node (and of the last one: the bonus) is the target argmax
    there. At most ``S - 1`` draft tokens, ``S = accept_index.shape[1]``."""
    bs, n = candidates.shape
    s = accept_index.shape[1]
    device = candidates.device
    table = children_table(retrive_next_token, retrive_next_sibling)  # [bs,N,N]
    target_predict = target_predict.reshape(bs, n).long()
    cand = candidates.long()
    b = torch.arange(bs, device=device)
    cur = torch.zeros(bs, dtype=torch.long, device=device)
    alive = torch.ones(bs, dtype=torch.bool, device=device)
    num = torch.zeros(bs, dtype=torch.long, device=device)
    accept_index[:, 0] = retrive_index[:, 0].to(accept_index.dtype)
    # predicts with one scratch slot at the end: requests that do not write in
    # a step point there, so one index_put never sees conflicting writes.
    pred = torch.cat([predicts, predicts.new_zeros(1)])
    dump = bs * n
    for step in range(1, s):
        kids = table[b, cur]  # [bs, N] children by sibling rank
        kid_tok = torch.gather(cand, 1, kids.clamp(min=0))
        want = target_predict[b, cur]
        hit = (kids >= 0) & (kid_tok == want.unsqueeze(1)) & alive.unsqueeze(1)
        found = hit.any(dim=1)
        first = torch.argmax(hit.int(), dim=1)
        nxt = torch.gather(kids, 1, first.unsqueeze(1)).squeeze(1)
        g_cur = retrive_index[b, cur]
        pred[torch.where(found, g_cur, dump)] = want.to(pred.dtype)
        col = accept_index[:, step]
        accept_index[:, step] = torch.where(
            found, retrive_index[b, nxt.clamp(min=0)].to(col.dtype), col
        )
        num = num + found.long()
        cur = torch.where(found, nxt, cur)
        alive = found
    pred[retrive_index[b, cur]] = target_predict[b, cur].to(pred.dtype)
    predicts.copy_(pred[:dump])
    accept_token_num.copy_(num.to(accept_token_num.dtype))


# ---------------------------------------------------------------------------
# Verification: tree rejection sampling (reference of the CUDA kernel)
# ---------------------------------------------------------------------------


def tree_speculative_sampling_reference(
    predicts: torch.Tensor,  # mutable [bs*N] int32
    accept_index: torch.Tensor,  # mutable [bs, S] int32
    accept_token_num: torch.Tensor,  # mutable [bs] int32
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,  # mutable scratch [bs, N, V]
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """PyTorch version of ``tree_speculative_sampling_target_only``.

    Same arguments, same in-place outputs, including the mutation of
    ``draft_probs`` (rejected siblings get ``draft_probs[row, tok] =
    target_probs[row, tok]``) and the final-sampling rule. Vectorised over the
    batch and over the children of the current node; loops over path steps.
    """
    bs, n = candidates.shape
    s = accept_index.shape[1]
    v = target_probs.shape[-1]
    device = candidates.device
    tp = target_probs.view(bs, n, v)
    dp = draft_probs.view(bs, n, v)
    table = children_table(retrive_next_token, retrive_next_sibling)
    cand = candidates.long()
    coins_all = uniform_samples.view(bs, n).double()
    b = torch.arange(bs, device=device)
    cur = torch.zeros(bs, dtype=torch.long, device=device)
    coin = coins_all[:, 0]
    alive = torch.ones(bs, dtype=torch.bool, device=device)
    num = torch.zeros(bs, dtype=torch.long, device=device)
    accept_index[:, 0] = retrive_index[:, 0].to(accept_index.dtype)
    rank_ar = torch.arange(n, device=device).unsqueeze(0)
    pred = torch.cat([predicts, predicts.new_zeros(1)])
    dump = bs * n
    for step in range(1, s):
        kids = table[b, cur]  # [bs, N] by rank, -1 padded
        has = (kids >= 0) & alive.unsqueeze(1)
        # candidates[b, 0] (the root) is never read
        kid_tok = torch.where(kids >= 0, torch.gather(cand, 1, kids.clamp(min=0)), 0)
        p = tp[b.unsqueeze(1), cur.unsqueeze(1), kid_tok].double()
        p = torch.where(has, p, torch.zeros_like(p))
        acc = torch.cumsum(p, dim=1)
        ok = has & (p > 0) & (
            (coin.unsqueeze(1) < acc / threshold_acc) | (p >= threshold_single)
        )
        found = ok.any(dim=1)
        first = torch.where(found, torch.argmax(ok.int(), dim=1), torch.full_like(cur, n))
        # rejected siblings: every valid child tried before the accepted one
        rejected = has & (rank_ar < first.unsqueeze(1))
        rows_b = b.unsqueeze(1).expand(bs, n)[rejected]
        rows_n = cur.unsqueeze(1).expand(bs, n)[rejected]
        rows_t = kid_tok[rejected]
        dp[rows_b, rows_n, rows_t] = tp[rows_b, rows_n, rows_t]
        nxt = torch.gather(kids, 1, first.clamp(max=n - 1).unsqueeze(1)).squeeze(1)
        tok = torch.gather(kid_tok, 1, first.clamp(max=n - 1).unsqueeze(1)).squeeze(1)
        g_cur = retrive_index[b, cur]
        pred[torch.where(found, g_cur, dump)] = tok.to(pred.dtype)
        col = accept_index[:, step]
        accept_index[:, step] = torch.where(
            found, retrive_index[b, nxt.clamp(min=0)].to(col.dtype), col
        )
        num = num + found.long()
        cur = torch.where(found, nxt, cur)
        coin = torch.where(found, coins_all[b, cur], coin)
        alive = found
    # final sampling at the last accepted node
    q = tp[b, cur].double()
    subtract = (num != (s - 1)).unsqueeze(1)
    q = torch.where(subtract, torch.relu(q - dp[b, cur].double()), q)
    total = q.sum(dim=1, keepdim=True)
    u = uniform_samples_for_final_sampling.view(bs, 1).double() * total
    cdf = torch.cumsum(q, dim=1)
    pos_mass = q > 0
    hit = (cdf > u) & pos_mass
    ar_v = torch.arange(v, device=device).unsqueeze(0)
    first_hit = torch.where(hit, ar_v, v).min(dim=1).values
    last_pos = torch.where(pos_mass, ar_v, -1).max(dim=1).values
    sampled = torch.where(
        first_hit < v, first_hit, torch.where(last_pos >= 0, last_pos, v - 1)
    )
    pred[retrive_index[b, cur]] = sampled.to(pred.dtype)
    predicts.copy_(pred[:dump])
    accept_token_num.copy_(num.to(accept_token_num.dtype))


# ---------------------------------------------------------------------------
# Target probabilities (as SGLang's EAGLE verify path) and the sampling path
# ---------------------------------------------------------------------------


def top_k_renorm_probs(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``top_k`` largest probabilities (ties at the pivot kept),
    renormalise. ``top_k >= V`` or ``<= 0`` keeps the row."""
    v = probs.shape[-1]
    k = top_k.long().view(-1, 1)
    k = torch.where((k <= 0) | (k > v), torch.full_like(k, v), k)
    sorted_p = torch.sort(probs, dim=-1, descending=True).values
    pivot = torch.gather(sorted_p, -1, k - 1)
    kept = torch.where(probs >= pivot, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def top_p_renorm_probs(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest prefix (in descending order) whose mass reaches
    ``top_p``; renormalise."""
    p = top_p.to(probs.dtype).view(-1, 1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep_sorted = before < p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def ddtree_target_probs(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: Optional[torch.Tensor] = None,
    top_ps: Optional[torch.Tensor] = None,
    greedy: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Verify-side target distribution per tree node.

    ``logits`` [bs, N, V]; per-request ``temperatures`` [bs], ``top_ks`` [bs],
    ``top_ps`` [bs], ``greedy`` [bs] bool. Temperature softmax, then top-k
    renorm, then top-p renorm (SGLang's order). Greedy requests get a one-hot
    target on the argmax, so they stay exactly greedy in a sampled batch.
    """
    bs, n, v = logits.shape
    lg = logits.float().reshape(bs * n, v)
    t = temperatures.float().reshape(bs, 1).repeat_interleave(n, dim=0)
    if greedy is not None:
        t = torch.where(greedy.reshape(bs, 1).repeat_interleave(n, 0), torch.ones_like(t), t)
    t = torch.clamp(t, min=1e-6)
    probs = torch.softmax(lg / t, dim=-1)
    if top_ks is not None:
        probs = top_k_renorm_probs(probs, top_ks.reshape(bs).repeat_interleave(n))
    if top_ps is not None:
        probs = top_p_renorm_probs(probs, top_ps.reshape(bs).repeat_interleave(n))
    if greedy is not None:
        onehot = torch.zeros_like(probs).scatter_(
            -1, torch.argmax(lg, dim=-1, keepdim=True), 1.0
        )
        g = greedy.reshape(bs, 1).repeat_interleave(n, 0)
        probs = torch.where(g, onehot, probs)
    return probs.view(bs, n, v)


def _cuda_tree_sampling_kernel():
    try:  # lazy: SGLang kernels need SGLang's full dependency set and CUDA
        from sglang.kernels.ops.speculative.verify_sampling import (
            tree_speculative_sampling_target_only,
        )
    except Exception:
        return None
    return tree_speculative_sampling_target_only


def ddtree_verify_coins(
    bs: int, n: int, device, generator: Optional[torch.Generator] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fresh coins in [0, 1): one per node and one for the final sampling."""
    coins = torch.rand((bs, n), generator=generator, device=device, dtype=torch.float32)
    final = torch.rand((bs,), generator=generator, device=device, dtype=torch.float32)
    return coins.clamp_(max=MAX_COIN), final.clamp_(max=MAX_COIN)


def assert_no_duplicate_siblings(candidates: torch.Tensor, parents: torch.Tensor) -> None:
    """Debug check (syncs with the host): raise if two children of one node
    carry the same token, which breaks losslessness."""
    bs, n = candidates.shape
    linked = parents >= 0
    key = torch.where(linked, parents.long() * (int(candidates.max()) + 1) + candidates.long(), -1 - torch.arange(n, device=candidates.device))
    srt = torch.sort(key, dim=1).values
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    if bool(dup.any()):
        raise ValueError("DDTree: duplicate sibling tokens in the draft tree (not lossless)")


def ddtree_sample_tree_paths(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    retrieve: RetrieveEncoding,
    temperatures: torch.Tensor,
    top_ks: Optional[torch.Tensor] = None,
    top_ps: Optional[torch.Tensor] = None,
    greedy: Optional[torch.Tensor] = None,
    max_accept: Optional[int] = None,
    coins: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    generator: Optional[torch.Generator] = None,
    use_kernel: Optional[bool] = None,
    parents: Optional[torch.Tensor] = None,
    validate: bool = False,
):
    """Sampled tree verify (the original ``_sample_tree_paths``).

    ``logits`` [bs, N, V] target logits at the tree nodes; ``candidates``
    [bs, N] node tokens. Returns ``(predicts [bs*N] int32, accept_index [bs, S]
    int32, accept_token_num [bs] int32)``: the committed tokens of request b are
    ``predicts[accept_index[b, :accept_token_num[b] + 1]]``. ``S`` defaults to
    ``N`` (``max_accept + 1`` otherwise). Uses SGLang's CUDA kernel on CUDA
    tensors when it imports, the reference otherwise. Thresholds are 1.0
    (exact); ``draft_probs`` is a fresh zero tensor every call.
    """
    bs, n, v = logits.shape
    device = logits.device
    s = n if max_accept is None else int(max_accept) + 1
    if validate and parents is not None:
        assert_no_duplicate_siblings(candidates, parents)
    target_probs = ddtree_target_probs(logits, temperatures, top_ks, top_ps, greedy)
    draft_probs = torch.zeros_like(target_probs)
    if coins is None:
        coins = ddtree_verify_coins(bs, n, device, generator)
    u, u_final = coins
    predicts, accept_index, accept_num = _walk_outputs(bs, n, s, device)
    fn = None
    if use_kernel is None:
        use_kernel = device.type == "cuda"
    if use_kernel:
        fn = _cuda_tree_sampling_kernel()
    if fn is None:
        fn = tree_speculative_sampling_reference
    fn(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_num,
        candidates=candidates.long().contiguous(),
        retrive_index=retrieve.retrive_index.contiguous(),
        retrive_next_token=retrieve.retrive_next_token.contiguous(),
        retrive_next_sibling=retrieve.retrive_next_sibling.contiguous(),
        uniform_samples=u.contiguous(),
        uniform_samples_for_final_sampling=u_final.contiguous(),
        target_probs=target_probs.contiguous(),
        draft_probs=draft_probs,
        threshold_single=1.0,
        threshold_acc=1.0,
        deterministic=True,
    )
    return predicts, accept_index, accept_num


def ddtree_verify_greedy(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    retrieve: RetrieveEncoding,
    max_accept: Optional[int] = None,
):
    """Greedy tree verify from target logits [bs, N, V]; same outputs as
    :func:`ddtree_sample_tree_paths`."""
    bs, n, _ = logits.shape
    s = n if max_accept is None else int(max_accept) + 1
    predicts, accept_index, accept_num = _walk_outputs(bs, n, s, logits.device)
    verify_tree_greedy_reference(
        predicts,
        accept_index,
        accept_num,
        candidates,
        retrieve.retrive_index,
        retrieve.retrive_next_token,
        retrieve.retrive_next_sibling,
        torch.argmax(logits, dim=-1),
    )
    return predicts, accept_index, accept_num


def gather_committed(
    predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Committed tokens [bs, S] (padded with -1) and their count
    ``accept_token_num + 1`` (accepted drafts plus the bonus)."""
    idx = accept_index.long()
    toks = torch.where(idx >= 0, predicts.long()[idx.clamp(min=0)], -1)
    return toks, accept_token_num.long() + 1


def expected_accept_length(tree: DDTree, target_probs: torch.Tensor) -> torch.Tensor:
    """Closed form of the mean accepted draft tokens (thresholds 1):
    sum over non-root nodes of the product of target p along the path.
    ``target_probs`` [bs, N, V]; returns [bs] float64."""
    bs, n = tree.parents.shape
    par = tree.parents.long()
    # p of node i's token under its parent's distribution
    row = par.clamp(min=0)
    p_edge = target_probs.double()[
        torch.arange(bs, device=par.device).unsqueeze(1), row, tree.tokens.long()
    ]
    valid = par >= 0
    prob = torch.zeros(bs, n, dtype=torch.float64, device=par.device)
    prob[:, 0] = 1.0
    maxd = int(tree.depths.max()) if tree.depths.numel() else 0
    for d in range(1, maxd + 1):
        at = valid & (tree.depths == d)
        pp = torch.gather(prob, 1, row) * p_edge
        prob = torch.where(at, pp, prob)
    return torch.where(valid, prob, torch.zeros_like(prob)).sum(dim=1)
