"""End to end: DDTree speculative decoding with a tiny causal transformer.

The target is a random 2-layer transformer (float64, no downloads) whose
attention takes an explicit boolean mask and explicit positions, so the tree
verify forward feeds it the DDTree ancestors-or-self mask and start + depth
positions exactly as SGLang's verify does. The drafter is a perturbed copy run
DFlash style on ``[seq..., MASK * L]``. No KV cache: every forward recomputes
the prefix, which keeps the harness simple and exact.
"""

from __future__ import annotations

import itertools

import pytest
import torch

ALPHA = 1e-3
V = 8
MASK = V  # drafter's mask token


class Tiny(torch.nn.Module):
    def __init__(self, vocab, seed, d=32, heads=2, layers=2, max_pos=64, extra_tokens=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
        self.h, self.d = heads, d
        self.emb = r(vocab + extra_tokens, d)
        self.pos = r(max_pos, d) * 0.5
        self.layers = [
            dict(q=r(d, d) / d**0.5, k=r(d, d) / d**0.5, v=r(d, d) / d**0.5, o=r(d, d) / d**0.5,
                 f1=r(d, 2 * d) / d**0.5, f2=r(2 * d, d) / (2 * d) ** 0.5)
            for _ in range(layers)
        ]
        self.out = r(d, vocab) * 0.2

    def perturbed(self, seed, scale):
        g = torch.Generator().manual_seed(seed)
        other = Tiny.__new__(Tiny)
        torch.nn.Module.__init__(other)
        other.h, other.d = self.h, self.d
        n = lambda t: t + scale * torch.randn(t.shape, generator=g, dtype=t.dtype) * t.std()  # noqa: E731
        other.emb = torch.cat([n(self.emb), torch.randn(1, self.d, generator=g, dtype=torch.float64)])
        other.pos = n(self.pos)
        other.layers = [{k: n(v) for k, v in lay.items()} for lay in self.layers]
        other.out = n(self.out)
        return other

    def forward(self, tokens, positions, mask):
        """Logits at every position; rows with the same tokens, positions and mask (3000 trials of
        one prompt share most of theirs) are computed once: each row's output depends on that row
        alone, and the batched float64 matmuls were most of the sampled test's time."""
        bs, T = tokens.shape
        key = torch.cat([tokens, positions, mask.reshape(bs, T * T).long()], 1)
        rows, inverse = torch.unique(key, dim=0, return_inverse=True)
        if len(rows) < bs:
            return self._forward(rows[:, :T], rows[:, T:2 * T], rows[:, 2 * T:].bool().view(-1, T, T))[inverse]
        return self._forward(tokens, positions, mask)

    def _forward(self, tokens, positions, mask):
        bs, T = tokens.shape
        x = self.emb[tokens] + self.pos[positions]
        hd = self.d // self.h
        for lay in self.layers:
            q = (x @ lay["q"]).view(bs, T, self.h, hd).transpose(1, 2)
            k = (x @ lay["k"]).view(bs, T, self.h, hd).transpose(1, 2)
            v = (x @ lay["v"]).view(bs, T, self.h, hd).transpose(1, 2)
            att = (q @ k.transpose(-1, -2)) / hd**0.5
            att = att.masked_fill(~mask.unsqueeze(1), float("-inf")).softmax(-1)
            x = x + (att @ v).transpose(1, 2).reshape(bs, T, self.d) @ lay["o"]
            x = x + torch.tanh(x @ lay["f1"]) @ lay["f2"]
        x = x / x.norm(dim=-1, keepdim=True) * self.d**0.5  # final norm
        return x @ self.out


def causal_logits(model, seqs):
    """Next-token logits after each (equal-length) sequence."""
    seqs = torch.as_tensor(seqs)
    bs, T = seqs.shape
    pos = torch.arange(T).expand(bs, T)
    mask = torch.ones(T, T, dtype=torch.bool).tril().expand(bs, T, T)
    return model(seqs, pos, mask)[:, -1]


def draft_logits(drafter, seqs, L):
    """DFlash-style block draft: [seq..., MASK*L], causal, positions len..len+L-1."""
    bs = len(seqs)
    lens = torch.tensor([len(s) for s in seqs])
    S = int(lens.max())
    T = S + L
    tok = torch.full((bs, T), MASK, dtype=torch.long)
    for b, s in enumerate(seqs):
        tok[b, : len(s)] = torch.tensor(s)
    col = torch.arange(T)
    pos = torch.where(col < S, col, lens.view(-1, 1) + (col - S)).expand(bs, T).clone()
    pos = torch.where((col < S) & (col >= lens.view(-1, 1)), 0, pos)
    valid = (col < lens.view(-1, 1)) | (col >= S)
    key_ok = valid.unsqueeze(1) & (pos.unsqueeze(1) <= pos.unsqueeze(2))
    mask = key_ok | torch.eye(T, dtype=torch.bool)
    out = drafter(tok, pos, mask)
    # the block input is [bonus(root)=seq[-1], MASK...]: mask slot j predicts depth j+1
    return out[:, S:]


def tree_verify_logits(model, seqs, tree, du):
    """Target logits at every tree node: prefix causal, tree ancestors-or-self,
    positions start + depth (start = len - 1: the root is the last token)."""
    bs, N = tree.tokens.shape
    pl = torch.tensor([len(s) - 1 for s in seqs])
    P = int(pl.max())
    T = P + N
    tok = torch.zeros(bs, T, dtype=torch.long)
    for b, s in enumerate(seqs):
        if len(s) > 1:
            tok[b, : len(s) - 1] = torch.tensor(s[:-1])
    roots = torch.tensor([s[-1] for s in seqs])
    ttok = tree.tokens.clone()
    ttok[:, 0] = roots
    tok[:, P:] = ttok
    col = torch.arange(P)
    pos = torch.zeros(bs, T, dtype=torch.long)
    pos[:, :P] = col
    pos[:, P:] = du.ddtree_positions(tree.depths, pl)
    prefix_valid = col.view(1, -1) < pl.view(-1, 1)  # [bs, P]
    mask = torch.zeros(bs, T, T, dtype=torch.bool)
    causal = torch.ones(P, P, dtype=torch.bool).tril()
    mask[:, :P, :P] = causal & prefix_valid.unsqueeze(1)
    mask[:, P:, :P] = prefix_valid.unsqueeze(1)
    mask[:, P:, P:] = du.ddtree_tree_mask(tree.parents)
    mask |= torch.eye(T, dtype=torch.bool)
    return model(tok, pos, mask)[:, P:], ttok


def ddtree_generate(du, model, drafter, prompts, n_new, budget, cap, L, sampling=None, seed=0):
    seqs = [list(p) for p in prompts]
    start = [len(p) for p in prompts]
    gen = torch.Generator().manual_seed(seed)
    steps = 0
    accepted = 0
    while min(len(s) - st for s, st in zip(seqs, start, strict=False)) < n_new:
        dl = draft_logits(drafter, seqs, L)
        lp = torch.log_softmax(dl.float(), -1)
        tree = du.build_ddtree_tree(lp, budget, cap)
        enc = du.compile_ddtree_retrieve(tree.parents, tree.scores)
        logits, cand = tree_verify_logits(model, seqs, tree, du)
        if sampling is None:
            out = du.ddtree_verify_greedy(logits, cand, enc)
        else:
            bs = len(seqs)
            t, k, p = sampling
            out = du.ddtree_sample_tree_paths(
                logits.float(), cand, enc, torch.full((bs,), t),
                torch.full((bs,), k) if k else None, torch.full((bs,), p) if p < 1 else None,
                generator=gen,
            )
        toks, cnt = du.gather_committed(*out)
        for b in range(len(seqs)):
            seqs[b].extend(toks[b, : int(cnt[b])].tolist())
        accepted += int((cnt - 1).sum())
        steps += 1
    return [s[st : st + n_new] for s, st in zip(seqs, start, strict=False)], steps, accepted


@pytest.fixture(scope="module")
def models():
    target = Tiny(V, seed=1)
    return target, target.perturbed(seed=2, scale=0.15)


def ar_greedy(model, prompts, n_new):
    seqs = torch.tensor(prompts)
    for _ in range(n_new):
        nxt = causal_logits(model, seqs).argmax(-1, keepdim=True)
        seqs = torch.cat([seqs, nxt], 1)
    return seqs[:, len(prompts[0]):].tolist()


@pytest.mark.parametrize("budget,cap,L", [(1, 1, 1), (6, 2, 4), (16, 4, 6), (40, 40, 8)])
def test_greedy_ddtree_equals_autoregressive(du, models, budget, cap, L):
    target, drafter = models
    g = torch.Generator().manual_seed(budget)
    prompts = torch.randint(0, V, (6, 5), generator=g).tolist()
    want = ar_greedy(target, prompts, 20)
    got, steps, accepted = ddtree_generate(du, target, drafter, prompts, 20, budget, cap, L)
    assert got == want
    if budget >= 6:
        assert accepted > 0  # speculation actually happened
        assert steps < 20


def _processed(du, logits, t, k, p):
    return du.ddtree_target_probs(
        logits.float().unsqueeze(1), torch.full((logits.shape[0],), t),
        torch.full((logits.shape[0],), k) if k else None,
        torch.full((logits.shape[0],), p) if p < 1 else None,
    )[:, 0].double()


@pytest.mark.parametrize("sampling", [(0.9, 5, 0.9), (1.2, 0, 1.0)], ids=["t0.9_k5_p0.9", "t1.2"])
def test_sampled_ddtree_matches_autoregressive_distribution(du, models, sampling):
    target, drafter = models
    prompt = [3, 1, 4, 1, 5]
    n_new, trials = 3, 3000
    t, k, p = sampling
    # exact AR distribution of the first 3 new tokens, by enumeration
    seqs = [prompt + list(c) for c in itertools.product(range(V), repeat=2)]
    p1 = _processed(du, causal_logits(target, [prompt]), t, k, p)[0]
    p2 = _processed(du, causal_logits(target, [prompt + [a] for a in range(V)]), t, k, p)
    p3 = _processed(du, causal_logits(target, seqs), t, k, p).view(V, V, V)
    joint = p1.view(V, 1, 1) * p2.view(V, V, 1) * p3
    got, _, accepted = ddtree_generate(
        du, target, drafter, [prompt] * trials, n_new, 12, 3, 4, sampling=sampling, seed=7
    )
    assert accepted > 0
    idx = torch.tensor([a * V * V + b * V + c for a, b, c in got])
    obs = torch.bincount(idx, minlength=V**3).double()
    exp = joint.flatten()
    assert float(obs[exp == 0].sum()) == 0
    keep = exp > 0
    o, e = obs[keep], exp[keep] * trials
    small = e < 5
    if small.any():
        o = torch.cat([o[~small], o[small].sum().view(1)])
        e = torch.cat([e[~small], e[small].sum().view(1)])
    e = e / e.sum() * o.sum()
    assert o.numel() >= 10  # a distribution with enough cells to test
    from scipy.stats import chisquare  # here, not at collection: scipy.stats costs every xdist worker 0.7 s

    assert float(chisquare(o.numpy(), e.numpy()).pvalue) > ALPHA
