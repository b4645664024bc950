"""The temperature-aware draft scores (``restrict_draft_logprobs`` on the tempered top-M of
``vocab_parallel_topk_logprobs``) against an independent float64 brute force over the whole
vocabulary: temperature softmax, top-k renormalisation, top-p renormalisation (SGLang's verify
order). Exact where the support is decided among the M candidates, within the docstring's
bound where it is not; greedy rows untouched. Controls: the same comparison rejects a
reference that ignores top-p and one that cuts top-p before top-k."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

V = 64  # vocabulary
M = 6  # candidates per depth (the worker's top-K)
TEMPS = (0.3, 0.7, 1.0, 1.6)
# none (0), inside the candidates (1, 3, M), above them (M + 5), the whole vocabulary (V)
TOP_KS = (0, 1, 3, M, M + 5, V)
TOP_PS = (1.0, 0.95, 0.8, 0.5, 0.2)
SCALES = (0.5, 1.5, 3.0, 6.0)  # one per depth: flat to peaked rows
# float32 (the function) and float64 (the reference) may cut a nucleus differently only where
# the mass before a token is this close to top_p
CUT_TOL = 1e-4
ATOL = 1e-4
# top_p 1 is cut in float32 too (``before < 1.0``): a candidate whose preceding mass rounds
# to 1.0 is dropped, so only candidates below this probability may lose their score there
F32_NEGLIGIBLE = 1e-6


@pytest.fixture(scope="module")
def dv():
    from sglang.srt.speculative import ddtree_verify

    return ddtree_verify


def _no_top_k(k: int) -> bool:
    return k <= 0 or k >= V


def reference(logits, temp, top_k, top_p, *, use_top_p=True, top_p_first=False):
    """Full-vocabulary verify distribution of one row in float64. Returns (log-probs [V] by
    token id, -inf outside the support; then by descending rank: the token ids, the mass
    ahead of each token when the top-p cut is made, the probabilities at temperature).
    top_p 1 keeps everything."""
    p = torch.softmax(logits.double() / temp, -1)
    p_sorted, order = torch.sort(p, descending=True)
    rank = torch.arange(V)
    q = p_sorted.clone()
    in_k = torch.ones(V, dtype=torch.bool) if _no_top_k(top_k) else rank < top_k
    if not top_p_first:
        q = torch.where(in_k, q, 0.0)
        q = q / q.sum()
    before = torch.cumsum(q, 0) - q
    keep = (before < top_p) | (rank == 0) | (top_p >= 1.0) | (not use_top_p)
    q = torch.where(keep & in_k, q, 0.0)
    q = q / q.sum()
    lp = torch.full((V,), float("-inf"), dtype=torch.float64)
    lp[order] = torch.where(q > 0, torch.log(q), float("-inf"))
    return lp, order, before, p_sorted


class Case:
    """One batch of rows (one per sampling setting) and depths, through the payload."""

    def __init__(self, dv, sampled=None, seed=0):
        grid = list(itertools.product(TEMPS, TOP_KS, TOP_PS))
        self.bs, self.depth = len(grid), len(SCALES)
        g = torch.Generator().manual_seed(seed)
        scale = torch.tensor(SCALES).view(1, -1, 1)
        self.logits = torch.randn(self.bs, self.depth, V, generator=g, dtype=torch.float64) * scale
        self.temp = torch.tensor([t for t, _, _ in grid], dtype=torch.float64)
        self.top_k = torch.tensor([k for _, k, _ in grid])
        self.top_p = torch.tensor([p for _, _, p in grid], dtype=torch.float32)
        self.sampled = torch.ones(self.bs, dtype=torch.bool) if sampled is None else sampled
        inv = (1.0 / self.temp).float()  # per request: its depths are consecutive rows
        lp, ids = dv.vocab_parallel_topk_logprobs(
            self.logits.float().reshape(-1, V), M, inv_temperature=inv
        )
        self.top_lp = lp.view(self.bs, self.depth, M)
        self.ids = ids.view(self.bs, self.depth, M)
        self.out = dv.restrict_draft_logprobs(self.top_lp, self.top_k, self.top_p, self.sampled)

    def rows(self):
        return itertools.product(range(self.bs), range(self.depth))

    def ref(self, b, d, **kw):
        temp, k, p = float(self.temp[b]), int(self.top_k[b]), float(self.top_p[b])
        return reference(self.logits[b, d], temp, k, p, **kw)

    def kind(self, b, d):
        """'exact': the support is decided among the candidates (a top-k of at most M, or no
        top-k and a nucleus that ends inside them); 'open': no top-k, the nucleus runs past
        the candidates; 'k_above_m': a top-k between M and the vocabulary."""
        k, p = int(self.top_k[b]), float(self.top_p[b])
        if 1 <= k <= M:
            return "exact"
        if not _no_top_k(k):
            return "k_above_m"
        lp, _, _, _ = self.ref(b, d)
        return "exact" if int(torch.isfinite(lp).sum()) <= M and p < 1.0 else "open"

    def near_cut(self, b, d, before):
        """Candidate ranks inside the top-k whose top-p cut float32 may decide differently
        from float64 (the mass ahead of them within CUT_TOL of top_p < 1)."""
        k, p = int(self.top_k[b]), float(self.top_p[b])
        in_k = torch.ones(M, dtype=torch.bool) if _no_top_k(k) else torch.arange(M) < k
        return ((before[:M] - p).abs() < CUT_TOL) & in_k & (p < 1.0)


def negligible_at_top_p_one(p_cand, top_p):
    """Candidates float32 may cut at top_p 1: probability below F32_NEGLIGIBLE."""
    return (p_cand < F32_NEGLIGIBLE) & (top_p >= 1.0)


def finite_or_negligible(got, p_cand, top_p):
    return torch.isfinite(got) | negligible_at_top_p_one(p_cand, top_p)


def exact_mismatches(case, **ref_kw):
    """Rows of kind 'exact' whose scores differ from the brute force: another support among
    the candidates (outside a float32-ambiguous cut) or another value inside it."""
    bad = []
    for b, d in case.rows():
        if case.kind(b, d) != "exact":
            continue
        lp, _, before, _ = case.ref(b, d, **ref_kw)
        want = lp[case.ids[b, d]]
        got = case.out[b, d].double()
        tolerated = case.near_cut(b, d, before) | negligible_at_top_p_one(want.exp(), float(case.top_p[b]))
        differ = torch.isfinite(want) != torch.isfinite(got)
        if bool((differ & ~tolerated).any()):
            bad.append((b, d))
            continue
        both = torch.isfinite(want) & torch.isfinite(got)
        if not torch.allclose(got[both], want[both], atol=ATOL, rtol=1e-5):
            bad.append((b, d))
    return bad


def test_restrict_equals_brute_force_where_the_support_is_decided_among_candidates(dv):
    case = Case(dv)
    kinds = [case.kind(b, d) for b, d in case.rows()]
    assert kinds.count("exact") >= 100  # the grid exercises it
    assert exact_mismatches(case) == []
    # -inf outside the support is exercised: exact rows that cut inside the candidates
    cut = sum(
        1 for (b, d), k in zip(case.rows(), kinds, strict=True)
        if k == "exact" and not bool(torch.isfinite(case.out[b, d]).all())
    )
    assert cut >= 50


@pytest.mark.parametrize(
    "wrong", [{"use_top_p": False}, {"top_p_first": True}], ids=["ignores_top_p", "top_p_before_top_k"]
)
def test_comparison_rejects_a_wrong_reference(dv, wrong):
    # the check above would pass a broken function if it could not tell these apart
    assert len(exact_mismatches(Case(dv), **wrong)) >= 10


def open_violations(case, scores):
    """Rows with no top-k whose nucleus runs past the candidates, and of those the ones
    outside the docstring's bound: a candidate losing its score (unless negligible at
    top_p 1), or a score off by more than log(true nucleus mass / top_p), which lies in
    [0, log(1 + p_(M+1) / top_p))."""
    rows, bad = 0, 0
    for b, d in case.rows():
        if case.kind(b, d) != "open":
            continue
        rows += 1
        lp, _, _, p_sorted = case.ref(b, d)
        got, p = scores[b, d].double(), float(case.top_p[b])
        fin = torch.isfinite(got)
        diff = got[fin] - lp[case.ids[b, d]][fin]
        bad += not (
            bool(finite_or_negligible(got, p_sorted[:M], p).all())
            and float(diff.min()) >= -ATOL
            and float(diff.max()) <= math.log1p(float(p_sorted[M]) / p) + ATOL
        )
    return rows, bad


def k_above_violations(case, scores):
    """Rows with M < top_k < V, and of those the ones outside the docstring's behaviour: a
    candidate of the true support losing its score (unless negligible at top_p 1); with
    top_p 1, scores other than the full-vocabulary log-probs, off from the brute force by
    log Z_k in [log(candidates' mass), 0]."""
    rows, bad = 0, 0
    for b, d in case.rows():
        if case.kind(b, d) != "k_above_m":
            continue
        rows += 1
        lp, _, _, p_sorted = case.ref(b, d)
        want, got, p = lp[case.ids[b, d]], scores[b, d].double(), float(case.top_p[b])
        ok = bool(finite_or_negligible(got, p_sorted[:M], p)[torch.isfinite(want)].all())
        if ok and p == 1.0:
            fin = torch.isfinite(got)
            gap = want[fin] - got[fin]
            ok = (
                torch.allclose(got[fin], case.top_lp[b, d].double()[fin], atol=ATOL, rtol=0)
                and float(gap.min()) >= -ATOL
                and float(gap.max()) <= -math.log(float(p_sorted[:M].sum())) + ATOL
            )
        bad += not ok
    return rows, bad


def candidates_renormalised(case):
    """The tempting wrong normalisation: over the M candidates alone (ignores the unseen
    tail), used as a control for both bounds."""
    return case.top_lp - torch.logsumexp(case.top_lp, dim=-1, keepdim=True)


def test_open_nucleus_is_normalised_by_top_p_within_the_documented_bound(dv):
    case = Case(dv)
    rows, bad = open_violations(case, case.out)
    assert rows >= 40 and bad == 0
    # control: the bound rejects normalising over the candidates alone
    assert open_violations(case, candidates_renormalised(case))[1] >= 10


def test_top_k_above_candidates_keeps_the_full_vocabulary_normaliser(dv):
    case = Case(dv)
    rows, bad = k_above_violations(case, case.out)
    assert rows >= 50 and bad == 0
    assert k_above_violations(case, candidates_renormalised(case))[1] >= 10


def test_scores_keep_the_order_inside_a_depth(dv):
    """The support is a prefix of the descending candidates, and its scores stay descending
    log-probabilities (<= 0), so the builder sees the same ranking inside a depth."""
    case = Case(dv)
    fin = torch.isfinite(case.out)
    assert bool((fin[..., 1:] <= fin[..., :-1]).all())  # no finite entry after a -inf
    assert bool(fin[..., 0].all())  # the top candidate always survives
    vals = torch.where(fin, case.out, -1e30)
    assert bool((vals[..., 1:] <= vals[..., :-1] + 1e-6).all())
    assert bool((case.out <= 0).all())


def test_greedy_rows_keep_their_untempered_scores(dv):
    g = torch.Generator().manual_seed(1)
    bs = len(TEMPS) * len(TOP_KS) * len(TOP_PS)
    sampled = torch.rand(bs, generator=g) < 0.5
    case = Case(dv, sampled=sampled)
    assert torch.equal(case.out[~sampled], case.top_lp[~sampled])
    # control: the same rows, sampled, are restricted (so the equality above is not vacuous)
    full = Case(dv)
    assert not torch.equal(full.out[~sampled], full.top_lp[~sampled])
