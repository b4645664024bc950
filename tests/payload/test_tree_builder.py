"""DDTree builder and retrieve encoding against an independent heap oracle."""

from __future__ import annotations

import heapq
import itertools

import pytest
import torch


def heap_tree(logprobs: torch.Tensor, budget: int, cap):
    """The paper's best-first heap over rank tuples, one request, plain Python.

    ``logprobs`` [L, V] float32. Scores are summed in float32 along the path in
    the same order as a prefix sum (so equal inputs give bit-equal scores).
    Returns (tokens, parents, depths, scores) lists incl. the root.
    """
    L, V = logprobs.shape
    K = min(budget, V if cap is None else min(cap, V))
    vals, ids = torch.topk(logprobs, K, dim=-1)
    vals = vals.tolist()
    ids = ids.tolist()

    def score(ranks):
        s = torch.tensor(0.0, dtype=torch.float32)
        for d, r in enumerate(ranks):
            s = s + torch.tensor(vals[d][r], dtype=torch.float32)
        return float(s)

    tok, par, dep, sc = [0], [-1], [0], [0.0]
    counter = itertools.count()
    heap = [(-score((0,)), next(counter), (0,), 0)]
    while heap and len(tok) - 1 < budget:
        neg, _, ranks, parent = heapq.heappop(heap)
        if neg == float("inf"):
            break
        idx = len(tok)
        d = len(ranks)
        tok.append(ids[d - 1][ranks[-1]])
        par.append(parent)
        dep.append(d)
        sc.append(-neg)
        if ranks[-1] + 1 < K:
            sib = ranks[:-1] + (ranks[-1] + 1,)
            heapq.heappush(heap, (-score(sib), next(counter), sib, parent))
        if d < L:
            child = ranks + (0,)
            heapq.heappush(heap, (-score(child), next(counter), child, idx))
    return tok, par, dep, sc


def _cases():
    rng = torch.Generator().manual_seed(1234)
    cases = []
    budgets = [1, 2, 3, 5, 8, 13, 16, 31, 64, 100, 128]
    for i in range(44):
        budget = budgets[i % len(budgets)]
        depth = 1 + int(torch.randint(0, 15, (1,), generator=rng))
        cap = [None, 1, 2, 4, 8, budget][i % 6]
        vocab = [7, 40, 300][i % 3]
        cases.append((i, budget, depth, cap, vocab))
    # edge: tiny vocab and cap 1 exhaust the tree (padding slots)
    cases += [(100, 20, 3, 1, 50), (101, 64, 2, None, 5), (102, 128, 15, 2, 3)]
    return cases


@pytest.mark.parametrize("seed,budget,depth,cap,vocab", _cases())
def test_builder_matches_heap(du, seed, budget, depth, cap, vocab):
    g = torch.Generator().manual_seed(seed)
    bs = 3
    logits = torch.randn(bs, depth, vocab, generator=g) * 3.0
    lp = torch.log_softmax(logits, dim=-1).float()
    tree = du.build_ddtree_tree(lp, budget, cap)
    n = budget + 1
    for t in (tree.tokens, tree.parents, tree.depths, tree.scores):
        assert t.shape == (bs, n)
    for b in range(bs):
        tok, par, dep, sc = heap_tree(lp[b], budget, cap)
        m = len(tok)
        # ties avoided: fail loudly if the seed produced an exact tie
        assert len(set(sc[1:])) == len(sc[1:]), "tie in oracle scores; change seed"
        assert tree.tokens[b, 1:m].tolist() == tok[1:]
        assert tree.parents[b, :m].tolist() == par
        assert tree.depths[b, :m].tolist() == dep
        assert torch.allclose(tree.scores[b, :m], torch.tensor(sc, dtype=torch.float32))
        # padding beyond the available prefixes
        assert (tree.parents[b, m:] == -1).all()
        assert torch.isinf(tree.scores[b, m:]).all()


def test_builder_accepts_topk_pairs_and_roots(du):
    g = torch.Generator().manual_seed(7)
    lp = torch.log_softmax(torch.randn(2, 6, 90, generator=g), -1)
    full = du.build_ddtree_tree(lp, 24, 5)
    top = du.draft_topk_logprobs(torch.log_softmax(torch.randn(1, 1, 3), -1), 2)
    assert top[0].shape == (1, 1, 2)
    pair = torch.topk(lp, 5, dim=-1)
    from_pair = du.build_ddtree_tree((pair.values, pair.indices), 24, 5, root_tokens=torch.tensor([11, 12]))
    assert torch.equal(full.parents, from_pair.parents)
    assert torch.equal(full.tokens[:, 1:], from_pair.tokens[:, 1:])
    assert from_pair.tokens[:, 0].tolist() == [11, 12]


def test_builder_prefix_closed_with_exact_zero_logprob(du):
    # logprob exactly 0 makes child score == parent score: parent must still
    # come first (prefix closure), for every budget.
    lp = torch.full((1, 4, 6), -30.0)
    lp[0, :, 2] = 0.0
    for budget in range(1, 12):
        tree = du.build_ddtree_tree(lp, budget, None)
        par = tree.parents[0]
        for i in range(1, budget + 1):
            if par[i] >= 0:
                assert par[i] < i


def test_builder_rejects_bad_args(du):
    with pytest.raises(ValueError):
        du.build_ddtree_tree(torch.zeros(1, 2, 3), 0, 1)
    with pytest.raises(ValueError):
        du.build_ddtree_tree(torch.zeros(1, 2, 3), 4, 0)


def _random_trees(du, seeds=range(12)):
    for seed in seeds:
        g = torch.Generator().manual_seed(100 + seed)
        budget = [1, 4, 9, 32, 77, 128][seed % 6]
        depth = 1 + seed % 15
        cap = [None, 2, 3][seed % 3]
        lp = torch.log_softmax(torch.randn(4, depth, 64, generator=g) * 2, -1)
        yield du.build_ddtree_tree(lp, budget, cap)


def test_retrieve_encoding_properties(du):
    for tree in _random_trees(du):
        enc = du.compile_ddtree_retrieve(tree.parents, tree.scores)
        bs, n = tree.parents.shape
        assert enc.retrive_index.dtype == torch.int64
        assert enc.retrive_index.tolist() == [[b * n + i for i in range(n)] for b in range(bs)]
        for b in range(bs):
            par = tree.parents[b].tolist()
            sc = tree.scores[b].tolist()
            nt = enc.retrive_next_token[b].tolist()
            ns = enc.retrive_next_sibling[b].tolist()
            valid = [i == 0 or par[i] >= 0 for i in range(n)]
            # walk from the root: every valid node exactly once, no padding
            seen = []
            stack = [0]
            while stack:
                u = stack.pop()
                seen.append(u)
                c = nt[u]
                kids = []
                while c != -1:
                    kids.append(c)
                    c = ns[c]
                # sibling order: descending score, parent < child, parent matches
                for a, z in zip(kids, kids[1:]):
                    assert sc[a] > sc[z] or (sc[a] == sc[z] and a < z)
                for c in kids:
                    assert u < c and par[c] == u
                stack.extend(kids)
            assert sorted(seen) == [i for i in range(n) if valid[i]]
            assert len(seen) == len(set(seen))
        dec = du.decode_retrieve_parents(enc.retrive_next_token, enc.retrive_next_sibling)
        assert torch.equal(dec, tree.parents)


def test_tree_mask_positions_and_full_mask(du):
    for tree in _random_trees(du, range(6)):
        bs, n = tree.parents.shape
        mask = du.ddtree_tree_mask(tree.parents)
        for b in range(bs):
            for i in range(n):
                anc = {i}
                u = i
                while tree.parents[b, u] >= 0:
                    u = int(tree.parents[b, u])
                    anc.add(u)
                assert set(torch.nonzero(mask[b, i]).flatten().tolist()) == anc
        seq_lens = torch.arange(bs) * 3 + 5
        pos = du.ddtree_positions(tree.depths, seq_lens)
        assert torch.equal(pos, seq_lens.view(-1, 1) + tree.depths)
        full = du.ddtree_full_mask(mask, seq_lens, int(seq_lens.sum()))
        ref = []
        for b in range(bs):
            rows = torch.cat([torch.ones(n, int(seq_lens[b]), dtype=torch.bool), mask[b]], 1)
            ref.append(rows.flatten())
        assert torch.equal(full, torch.cat(ref))
