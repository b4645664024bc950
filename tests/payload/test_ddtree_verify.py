"""ddtree_verify against the tiny transformer, with a paged KV cache like SGLang's.

The target keeps per-layer K/V in a slot pool indexed through a per-request
``req_to_token`` row of shuffled slots. One DDTree step is run the way the
worker runs it: the verify tokens in node order, positions prefix + depth and
the FULL_MASK custom mask go through a cached forward that writes the window's
KV; then accept, move the accepted nodes' KV to the front of the window
(``accept_kv_moves``), and decode on. Everything is compared with recomputing
from scratch (no cache, causal): next-step logits, committed tokens, the
compacted hidden rows that feed the draft KV, and whole greedy generations.
"""

from __future__ import annotations

import pytest
import torch
from test_e2e_tiny_model import Tiny, V, ar_greedy, causal_logits, draft_logits


@pytest.fixture(scope="module")
def dv():
    from sglang.srt.speculative import ddtree_verify

    return ddtree_verify


@pytest.fixture(scope="module")
def models():
    target = Tiny(V, seed=1)
    return target, target.perturbed(seed=2, scale=0.15)


class Pool:
    """Per-layer K/V slot pool + req_to_token rows (shuffled slots)."""

    def __init__(self, model, bs, max_len, seed=0):
        g = torch.Generator().manual_seed(seed)
        n_slots = bs * max_len + 1
        self.k = [torch.zeros(n_slots, model.d, dtype=torch.float64) for _ in model.layers]
        self.v = [torch.zeros(n_slots, model.d, dtype=torch.float64) for _ in model.layers]
        perm = torch.randperm(n_slots - 1, generator=g) + 1  # slot 0 reserved
        self.req_to_token = perm.view(bs, max_len)

    def buffers(self):
        return self.k + self.v


def cached_forward(model, pool, tokens, positions, write_loc, read_loc, mask, hidden=False):
    """One request: new tokens [T] write KV at write_loc; queries attend to
    read_loc [K] (which includes write_loc) under mask [T, K]."""
    x = model.emb[tokens] + model.pos[positions]
    T = tokens.shape[0]
    h, hd = model.h, model.d // model.h
    for li, lay in enumerate(model.layers):
        q = (x @ lay["q"]).view(T, h, hd).transpose(0, 1)
        pool.k[li][write_loc] = x @ lay["k"]
        pool.v[li][write_loc] = x @ lay["v"]
        k = pool.k[li][read_loc].view(-1, h, hd).transpose(0, 1)
        v = pool.v[li][read_loc].view(-1, h, hd).transpose(0, 1)
        att = (q @ k.transpose(-1, -2)) / hd**0.5
        att = att.masked_fill(~mask.unsqueeze(0), float("-inf")).softmax(-1)
        x = x + (att @ v).transpose(0, 1).reshape(T, model.d) @ lay["o"]
        x = x + torch.tanh(x @ lay["f1"]) @ lay["f2"]
    x = x / x.norm(dim=-1, keepdim=True) * model.d**0.5
    return (x @ model.out, x) if hidden else x @ model.out


def prefill(model, pool, seqs):
    """Cache every token but the last (the last is the first root)."""
    for b, s in enumerate(seqs):
        n = len(s) - 1
        if n == 0:
            continue
        loc = pool.req_to_token[b, :n]
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        cached_forward(model, pool, torch.tensor(s[:-1]), torch.arange(n), loc, loc, mask)


def full_mask_rows(custom, prefix_lens, w, b):
    """Decode request b's rows out of the flat FULL_MASK buffer."""
    off = 0
    for i in range(b):
        off += w * (int(prefix_lens[i]) + w)
    row = int(prefix_lens[b]) + w
    return custom[off : off + w * row].view(w, row)


def verify_step(model, pool, plan, prefix_lens):
    """The TARGET_VERIFY forward: node tokens, positions, FULL_MASK custom mask;
    writes the window KV. Returns logits [bs*W, V] and hidden [bs*W, d]."""
    w = plan.width
    bs = prefix_lens.shape[0]
    logits, hid = [], []
    for b in range(bs):
        p = int(prefix_lens[b])
        window = pool.req_to_token[b, p : p + w]
        read = pool.req_to_token[b, : p + w]
        rows = slice(b * w, (b + 1) * w)
        lg, hs = cached_forward(
            model, pool, plan.draft_token[rows], plan.positions[rows], window, read,
            full_mask_rows(plan.custom_mask, prefix_lens, w, b), hidden=True,
        )
        logits.append(lg)
        hid.append(hs)
    return torch.cat(logits), torch.cat(hid)


def out_cache_loc(pool, prefix_lens, w):
    return torch.cat([pool.req_to_token[b, int(p) : int(p) + w] for b, p in enumerate(prefix_lens)])


def next_logits_cached(model, pool, seqs):
    """Decode the last token of each seq against the cache of the others."""
    out = []
    for b, s in enumerate(seqs):
        n = len(s) - 1
        loc = pool.req_to_token[b, : n + 1]
        out.append(cached_forward(
            model, pool, torch.tensor(s[-1:]), torch.tensor([n]), loc[n:], loc,
            torch.ones(1, n + 1, dtype=torch.bool),
        )[-1])
    return torch.stack(out)


def _prompts(seed, bs, lens):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (lens[b],), generator=g).tolist() for b in range(bs)]


@pytest.mark.parametrize("budget,cap,L", [(1, 1, 1), (5, 2, 3), (12, 3, 5), (24, 24, 6)])
def test_verify_logits_equal_autoregressive(dv, models, budget, cap, L):
    """Node tokens + positions + FULL_MASK through the cached forward give, at
    every valid node, the causal logits of prefix + path-to-node."""
    target, drafter = models
    seqs = _prompts(budget, 3, [4, 6, 5])
    pool = Pool(target, 3, 64)
    prefill(target, pool, seqs)
    prefix = torch.tensor([len(s) - 1 for s in seqs])
    dl = draft_logits(drafter, seqs, L)
    plan = dv.ddtree_prepare_verify(dl, torch.tensor([s[-1] for s in seqs]), prefix, budget, cap,
                                    seq_lens_sum=int(prefix.sum()))
    assert plan.draft_token.shape == (3 * (budget + 1),)
    logits, _ = verify_step(target, pool, plan, prefix)
    tree = plan.tree
    w = plan.width
    checked = 0
    for b, s in enumerate(seqs):
        for i in range(w):
            if i > 0 and int(tree.parents[b, i]) < 0:
                continue
            path, j = [], i
            while j > 0:
                path.append(int(tree.tokens[b, j]))
                j = int(tree.parents[b, j])
            seq = s + path[::-1]
            want = causal_logits(target, [seq])[0]
            assert torch.allclose(logits[b * w + i], want, atol=1e-9), (b, i)
            assert int(plan.positions[b * w + i]) == len(seq) - 1
            checked += 1
    assert checked > 3


def _one_step(dv, target, drafter, pool, seqs, budget, cap, L, sampled=False, gen=None):
    bs = len(seqs)
    prefix = torch.tensor([len(s) - 1 for s in seqs])
    plan = dv.ddtree_prepare_verify(draft_logits(drafter, seqs, L), torch.tensor([s[-1] for s in seqs]),
                                    prefix, budget, cap, seq_lens_sum=int(prefix.sum()))
    logits, hidden = verify_step(target, pool, plan, prefix)
    if sampled:
        out = dv.ddtree_accept(logits.float(), plan, temperatures=torch.full((bs,), 0.8),
                               all_greedy=False, generator=gen)
    else:
        out = dv.ddtree_accept(logits, plan)
    predicts, accept_index, accept_num = out
    commit = dv.ddtree_commit(predicts, accept_index, accept_num, plan.width)
    loc = out_cache_loc(pool, prefix, plan.width)
    tgt, src = dv.accept_kv_moves(loc, accept_index, accept_num)
    dv.apply_kv_moves(pool.buffers(), tgt, src)
    hid_front = dv.compact_to_front(hidden, accept_index, bs, plan.width)
    logit_front = dv.compact_to_front(logits, accept_index, bs, plan.width)
    return plan, commit, hid_front, logit_front, prefix


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_commit_kv_compaction_next_step(dv, models, sampled):
    """After accept + KV moves, the cache holds exactly the committed sequence:
    the next decode step from the cache equals recomputation from scratch, and
    the compacted rows (what DFlash writes into the draft KV) are the causal
    rows at positions prefix + k."""
    target, drafter = models
    seqs = _prompts(11, 4, [5, 3, 7, 4])
    pool = Pool(target, 4, 80, seed=3)
    prefill(target, pool, seqs)
    gen = torch.Generator().manual_seed(5)
    total_acc = 0
    for _ in range(3):
        plan, commit, _, logit_front, prefix = _one_step(
            dv, target, drafter, pool, seqs, 12, 3, 5, sampled=sampled, gen=gen)
        w = plan.width
        for b in range(len(seqs)):
            n = int(commit.commit_lens[b])
            new = commit.out_tokens[b, :n].tolist()
            assert int(commit.bonus[b]) == new[-1]
            # compacted rows k < n: the root and accepted nodes, in path order
            for k in range(n):
                seq = seqs[b] + new[:k]
                want = causal_logits(target, [seq])[0]
                assert torch.allclose(logit_front[b * w + k], want, atol=1e-9)
            seqs[b] = seqs[b] + new
            total_acc += n - 1
        got = next_logits_cached(target, pool, seqs)
        want = causal_logits_list(target, seqs)
        assert torch.allclose(got, want, atol=1e-9)
    assert total_acc > 0


def causal_logits_list(model, seqs):
    return torch.stack([causal_logits(model, [s])[0] for s in seqs])


@pytest.mark.parametrize("budget,cap,L", [(4, 2, 3), (16, 4, 6)])
def test_greedy_kv_cached_ddtree_equals_autoregressive(dv, models, budget, cap, L):
    """Whole greedy generations through prepare/verify/accept/commit/KV-move
    with the cache reused across steps == autoregressive greedy."""
    target, drafter = models
    g = torch.Generator().manual_seed(budget + 100)
    prompts = torch.randint(0, V, (4, 5), generator=g).tolist()
    want = ar_greedy(target, prompts, 16)
    seqs = [list(p) for p in prompts]
    pool = Pool(target, 4, 64, seed=budget)
    prefill(target, pool, seqs)
    steps = 0
    while min(len(s) for s in seqs) < 5 + 16:
        _, commit, _, _, _ = _one_step(dv, target, drafter, pool, seqs, budget, cap, L)
        for b in range(4):
            seqs[b] += commit.out_tokens[b, : int(commit.commit_lens[b])].tolist()
        steps += 1
    assert [s[5:21] for s in seqs] == want
    assert steps < 16


def test_commit_layout_and_moves_static(dv):
    """Hand-made tree: path order, -1 padding, self-moves past the path."""
    predicts = torch.tensor([7, 0, 9, 0, 5, 0, 0, 0], dtype=torch.int32)
    # request 0: root(0) -> node 2 -> bonus ; request 1: nothing accepted
    accept_index = torch.tensor([[0, 2, -1, -1], [4, -1, -1, -1]], dtype=torch.int32)
    accept_num = torch.tensor([1, 0], dtype=torch.int32)
    c = dv.ddtree_commit(predicts, accept_index, accept_num, 4)
    assert c.out_tokens.tolist() == [[7, 9, 0, 0], [5, 0, 0, 0]]
    assert c.commit_lens.tolist() == [2, 1]
    assert c.bonus.tolist() == [9, 5]
    assert c.path.tolist() == [[0, 2, -1, -1], [0, -1, -1, -1]]
    loc = torch.tensor([10, 11, 12, 13, 20, 21, 22, 23])
    tgt, src = dv.accept_kv_moves(loc, accept_index, accept_num)
    assert tgt.tolist() == [10, 11, 12, 13, 20, 21, 22, 23]
    assert src.tolist() == [10, 12, 12, 13, 20, 21, 22, 23]

