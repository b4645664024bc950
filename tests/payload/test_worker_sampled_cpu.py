"""The SAMPLED verify path of the real ``DDTreeWorkerV2`` decode step, on CPU.

Same harness as test_worker_decode_cpu (``worker_fakes.run_case``: one real
``worker.forward_batch_generation`` per step in .venv-sglang with the patch
overlay, real pools / ``ForwardBatch`` / KV move, SGLang's Triton index kernels
in Triton's interpreter), but the batch samples: requests at temperature 0.7 /
top-p 0.9 and temperature 1.0 / top-k 5, interleaved, plus one greedy request,
so ``SamplingBatchInfo.is_all_greedy`` is False and ``eagle_sample`` takes its
sampling branch: SGLang's ``sampling_softmax`` (temperature), top-k / top-p
renormalisation, ``_verify_coins`` (``torch.rand``: fresh coins per step from a
fixed seed), the tree sampler, then the worker's commit.

Replaced, beyond test_worker_decode_cpu's fakes (``worker_fakes._patch_sampling``):

* ``eagle_utils.tree_speculative_sampling_target_only`` (a CUDA JIT kernel,
  ``None`` here) by the payload's ``ddtree_utils.tree_speculative_sampling_reference``
  (same keyword arguments, same in-place outputs), wrapped to count calls.
* ``eagle_utils.top_k_renorm_prob`` / ``top_p_renorm_prob`` (FlashInfer on
  CUDA, ``None`` on this platform) by the payload's PyTorch
  ``ddtree_utils.top_k_renorm_probs`` / ``top_p_renorm_probs`` for the
  statistics steps; in one smaller step by SGLang's own ROCm implementation
  (``renorm_triton``, Triton kernels in the interpreter; only its CUDA/HIP
  tensor check is lifted), each call compared with the PyTorch one. The
  interpreter costs ~5 ms per probability row, too slow for 1000+ samples.
* ``eagle_utils._is_cpu`` is set False: a no-op on this host (it is False unless
  ``SGLANG_USE_CPU_ENGINE=1``; the greedy branch the other test takes comes from
  ``is_all_greedy``), kept so the branch does not depend on the environment.
  ``sampling_softmax`` is SGLang's own (its CPU path is ``torch.softmax(logits /
  T)``); nothing else of ``eagle_sample`` is touched.

Toy target (``worker_fakes.spread_logits``): at every node of a sampled request
the logits put a fixed profile on the draft's candidates for the next depth
interleaved with other tokens, so the first committed token is a tree child
(accepted, the walk goes on) or not (the final sample) about half the time each.
The greedy request sees test_worker_decode_cpu's greedy target.

Checks: the sampler's inputs meet the CUDA kernel's host checks (shape, dtype,
contiguity: ``retrive_next_token`` was once a non-contiguous slice);
every step passes test_worker_decode_cpu's consistency checks (tokens
layout, lengths, draft-KV append, the whole target KV pool) against the walk
the committed tokens describe through the reference tree (every token but the
last a child of the previous node, the last not a child); the greedy request
commits exactly the greedy reference walk; the first committed token of each
sampled request, and the pair of its first two tokens, follow the target's
distribution after temperature / top-k / top-p, computed here in float64 from
the fake target's root (and depth-1) logits: chi-square at ALPHA over 512
samples per setting (4 steps x 128 identical requests, fixed seeds). Controls:
the same samples reject a wrong expectation (temperature ignored, top-k
ignored); a sampler whose coins are zeroed (always accepts the first child) is
rejected (32 requests per setting); one that reuses the root's coin at every node
passes the first-token check and fails the two-token one (64 per setting).
"""

from __future__ import annotations

import math
import pathlib
from collections import Counter

import pytest
from test_worker_decode_cpu import (
    check_calls,
    check_draft_kv_append,
    check_kv,
    check_result,
)

from sglang_env import run_sglang

pytestmark = pytest.mark.sglang

HERE = pathlib.Path(__file__).resolve().parent

ALPHA = 1e-3
CASE = {"budget": 8, "cap": 3, "block": 5, "host_mirror": True}
PREFIX, ROOT = 6, 23  # every request: same prefix length and root (bonus) token
SETTINGS = {"t0.7-p0.9": {"temperature": 0.7, "top_p": 0.9},
            "t1.0-k5": {"temperature": 1.0, "top_k": 5}}
GREEDY_RANKS = [0, 0, 0, 0]  # the greedy request's target follows the draft: full depth
N_PER_STEP = 128  # requests per setting per statistics step
SEEDS = (11, 12, 13, 14)
# ddtree_utils.compile_ddtree_retrieve returns retrive_next_token as first_child[:, :n],
# a column slice of a [bs, 2n+1] buffer: not contiguous for bs >= 2.
KNOWN_VIOLATION = "retrive_next_token:"


def _batch(n: int) -> list:
    """``n`` requests per setting, interleaved, the greedy one in the middle."""
    rows = [dict(SETTINGS[name]) for _ in range(n) for name in SETTINGS]
    rows.insert(n, {"temperature": 0.0})
    return rows


def _setting_of(row: dict):
    return next((name for name, s in SETTINGS.items() if s == row), None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sglang_overlay):
    """One subprocess: the statistics steps, one step with SGLang's Triton
    renorm, one step each with the mutated samplers. SGLang's Triton index
    kernels (cache locations) run in Triton's interpreter in the three smaller
    steps, each launch compared with their PyTorch versions
    (``worker_fakes._patch_index_kernels``); the two steps of 257 requests use
    the PyTorch versions: interpreted, those kernels were about 80 % of this
    fixture (63 of 76 s under cProfile; the fixture took 90-139 s of a whole run)."""
    code = f"""
    sys.path.insert(0, {str(HERE)!r})
    import worker_fakes  # first: sets TRITON_INTERPRET / SGLANG_NATIVE_MOVE_KV_CACHE
    import torch

    def step(seed, sampling, **kw):
        torch.manual_seed(seed)
        bs = len(sampling)
        ranks = [[0]] * bs
        ranks[[s.get("temperature") for s in sampling].index(0.0)] = {GREEDY_RANKS!r}
        out = worker_fakes.run_case(model=MODEL, prefixes=[{PREFIX}] * bs, bonus=[{ROOT}] * bs,
                                    ranks=ranks, sampling=sampling, **{CASE!r}, **kw)
        out["sampling"] = sampling
        return out

    OUT["stats"] = [step(seed, {_batch(N_PER_STEP)!r}, index_kernels="torch") for seed in {SEEDS!r}]
    OUT["triton"] = step(7, {_batch(8)!r}, renorm="triton", index_kernels="checked")
    OUT["mutant"] = step(8, {_batch(32)!r}, mutation="first_child", index_kernels="checked")
    OUT["reused_coin"] = step(9, {_batch(64)!r}, mutation="reused_coin", index_kernels="checked")
    OUT["coin_tree"] = step(10, {_batch(N_PER_STEP)!r}, mutation="coin_tree", index_kernels="torch")
    """
    return run_sglang(code, tmp_path_factory.mktemp("sampled"), sglang_overlay, timeout=600, triton_interpret=True)


# -- the independent expectation (float64, pure Python) --------------------------

def target_dist(logits, temperature: float, top_k: int | None = None, top_p: float | None = None) -> dict:
    """Token -> probability after temperature, then top-k, then top-p (the
    smallest most-likely set whose mass reaches ``top_p``), renormalised."""
    z = [x / temperature for x in logits]
    m = max(z)
    w = {t: math.exp(x - m) for t, x in enumerate(z)}
    order = sorted(w, key=lambda t: -w[t])
    if top_k is not None:
        order = order[:top_k]
    total = sum(w[t] for t in order)
    if top_p is not None:
        kept, mass = [], 0.0
        for t in order:
            kept.append(t)
            mass += w[t] / total
            if mass >= top_p:
                break
        order = kept
    total = sum(w[t] for t in order)
    return {t: w[t] / total for t in order}


def chi_square(samples, probs: dict, min_expected: float = 5.0):
    """Goodness of fit of ``samples`` to ``probs`` (categories with expected
    count < ``min_expected`` pooled). A sample outside the support: p = 0."""
    n = len(samples)
    counts = Counter(samples)
    if any(probs.get(k, 0.0) <= 0.0 for k in counts):
        return math.inf, 0, 0.0
    cats = sorted(probs, key=lambda k: -probs[k])
    big = [k for k in cats if n * probs[k] >= min_expected]
    small = [k for k in cats if n * probs[k] < min_expected]
    obs = [counts[k] for k in big]
    exp = [n * probs[k] for k in big]
    if small:
        obs.append(sum(counts[k] for k in small))
        exp.append(n * sum(probs[k] for k in small))
        if exp[-1] < min_expected and len(exp) > 2:  # fold a tiny pool into the last bin
            obs[-2:] = [obs[-2] + obs[-1]]
            exp[-2:] = [exp[-2] + exp[-1]]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    df = len(obs) - 1
    from scipy.stats import chi2  # here, not at collection: scipy.stats costs every xdist worker 0.7 s

    return stat, df, float(chi2.sf(stat, df)) if df > 0 else 1.0


def samples_of(outs: list, setting: str):
    """(first tokens, first-two-token keys) of the setting's requests, and the
    logits its fake target produced at the root and the root's children."""
    first, pairs, node_logits = [], [], None
    for out in outs:
        children = {p[0] for p in out["expect"]["trees"][0] if len(p) == 1}
        for b, row in enumerate(out["sampling"]):
            if _setting_of(row) != setting:
                continue
            toks = out["expect"]["out"][b]
            first.append(toks[0])
            pairs.append(tuple(toks[:2]) if toks[0] in children else (toks[0],))
            logits = {tuple(k): v for k, v in out["result"]["node_logits"][b]}
            assert node_logits in (None, logits), "identical requests see identical logits"
            node_logits = logits
    return first, pairs, node_logits, children


def expected_pairs(node_logits: dict, children: set, params: dict) -> dict:
    """Law of the first two committed tokens: the second exists when the first
    is a root child (accepted; the next token is drawn at that node)."""
    root = target_dist(node_logits[()], **params)
    out = {}
    for t, p in root.items():
        if t in children:
            for u, q in target_dist(node_logits[(t,)], **params).items():
                out[(t, u)] = p * q
        else:
            out[(t,)] = p
    return out


# -- tests ------------------------------------------------------------------------

def check_step(out: dict) -> None:
    """One sampled step: the sampling branch ran, the committed tokens are a
    valid tree walk, the worker's outputs / draft KV / target KV pool agree
    with it, the greedy request commits the greedy reference walk."""
    res, exp = out["result"], out["expect"]
    k = res["kernels"]
    assert not res["is_all_greedy"]
    assert k["tree_sampling"] == 1 and k["greedy_verify"] == 0, k
    assert k["is_cpu_before"] is False, "this host's eagle_utils._is_cpu"
    bs, W = out["config"]["bs"], out["config"]["W"]
    assert k["sampling_args"] == {"threshold_single": 1.0, "threshold_acc": 1.0, "deterministic": True,
                                  "target_probs": [bs, W, out["config"]["V"]],
                                  "accept_index": [bs, out["config"]["D"] + 1], "draft_probs_zero": True}
    # what the CUDA kernel's host checks would refuse: only the known finding
    # (test_sampler_inputs_meet_the_cuda_kernel_contract), nothing new
    assert all(v.startswith(KNOWN_VIOLATION) for v in k["contract_violations"]), k["contract_violations"]
    assert [r.split(":")[0] for r in k["renorm"]] == ["top_k", "top_p"]
    # SGLang's cache-location kernel ran for the verify's locations (the draft block's come from
    # DFlash's block kernel), and the accepted-KV move once (the commit kernel made its lists)
    assert k["index"]["assign_extend_cache_locs"] >= 1 and k["index"]["kv_moves"] == 1, k["index"]
    assert all(exp["walk_valid"]), [b for b, ok in enumerate(exp["walk_valid"]) if not ok]
    check_calls(out)
    check_result(out)
    check_draft_kv_append(out)
    check_kv(out)
    g = [b for b, row in enumerate(out["sampling"]) if row["temperature"] == 0.0]
    assert len(g) == 1
    assert exp["out"][g[0]] == exp["greedy_out"][g[0]], (exp["out"][g[0]], exp["greedy_out"][g[0]])
    assert len(exp["greedy_out"][g[0]]) == out["config"]["block"], "the greedy walk goes to full depth"


@pytest.mark.parametrize("which", ["stats", "triton", "mutant", "reused_coin"])
def test_sampled_step_commits_a_consistent_walk(runs, which):
    outs = runs[which] if which == "stats" else [runs[which]]
    for out in outs:
        check_step(out)
    for out in outs:  # in the smaller steps, SGLang's Triton index kernels against their PyTorch versions
        k = out["result"]["kernels"]["index"]
        if which == "stats":
            assert not any(":" in name for name in k), k  # the PyTorch versions alone
        else:
            assert k["assign_extend_cache_locs:checked"] == k["assign_extend_cache_locs"], k
            assert not any(name.endswith(":differed") for name in k), k
    if which == "triton":  # SGLang's ROCm renorm, interpreted, against the PyTorch one
        k = outs[0]["result"]["kernels"]
        assert k["renorm"] == ["top_k:triton", "top_p:triton"]
        assert k["renorm_max_diff"] < 1e-6, k["renorm_max_diff"]
    if which == "stats":  # the data exercise acceptance at every depth and rejection at the root
        lens = Counter(n for out in outs for n in out["result"]["accept_lens"])
        assert set(lens) == set(range(1, CASE["block"] + 1)), lens
        assert lens[1] >= 100 and lens[CASE["block"]] >= 10, lens


def test_sampler_inputs_meet_the_cuda_kernel_contract(runs):
    """The tree sampler's inputs as ``tree_speculative_sampling_target_only``'s
    host checks want them (``jit/csrc/speculative/sampling.cuh``: shapes,
    dtypes, contiguity; ``verify_tree_greedy`` checks the same retrieve arrays
    the same way). The reference sampler does not care, the CUDA kernel does."""
    for out in runs["stats"] + [runs["triton"], runs["mutant"], runs["reused_coin"], runs["coin_tree"]]:
        assert out["result"]["kernels"]["contract_violations"] == []


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_first_tokens_follow_the_target_distribution(runs, setting):
    first, pairs, logits, children = samples_of(runs["stats"], setting)
    params = SETTINGS[setting]
    assert len(first) == N_PER_STEP * len(SEEDS)
    p1 = target_dist(logits[()], **params)
    assert set(first) <= set(p1), set(first) - set(p1)
    assert len(p1) == 5 and 1 <= len(children & set(p1)) < len(p1), (p1, children)
    stat, df, pval = chi_square(first, p1)
    assert pval > ALPHA, (setting, stat, df, pval, sorted(Counter(first).items()))
    p2 = expected_pairs(logits, children, params)
    stat2, df2, pval2 = chi_square(pairs, p2)
    assert df2 >= 6, df2
    assert pval2 > ALPHA, (setting, stat2, df2, pval2)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_distribution_check_rejects_a_wrong_expectation(runs, setting):
    """Controls on the same samples: the expectation of a sampler that ignores
    the temperature (T = 1 for the 0.7 / top-p setting) or top-k (for the
    top-k setting) must be rejected."""
    first, pairs, logits, children = samples_of(runs["stats"], setting)
    params = SETTINGS[setting]
    if "top_p" in params:
        wrong = dict(params, temperature=1.0)
    else:
        wrong = {k: v for k, v in params.items() if k != "top_k"}
    stat, df, pval = chi_square(first, target_dist(logits[()], **wrong))
    assert pval < ALPHA, (setting, wrong, stat, df, pval)
    stat2, df2, pval2 = chi_square(pairs, expected_pairs(logits, children, wrong))
    assert pval2 < ALPHA, (setting, wrong, stat2, df2, pval2)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_distribution_check_rejects_the_first_child_sampler(runs, setting):
    """Mutation: the tree sampler with zeroed coins (always accepts the first
    child with non-zero probability) commits valid walks (checked above) of
    the wrong law."""
    first, _, logits, _ = samples_of([runs["mutant"]], setting)
    p1 = target_dist(logits[()], **SETTINGS[setting])
    stat, df, pval = chi_square(first, p1)
    assert pval < ALPHA, (setting, stat, df, pval, sorted(Counter(first).items()))


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_pair_check_rejects_a_reused_coin(runs, setting):
    """Mutation: every node of a request reuses the root's coin. The first token
    stays exact (the first-token check passes), the second is biased: only the
    first-two-token check sees it."""
    first, pairs, logits, children = samples_of([runs["reused_coin"]], setting)
    params = SETTINGS[setting]
    assert chi_square(first, target_dist(logits[()], **params))[2] > ALPHA
    stat, df, pval = chi_square(pairs, expected_pairs(logits, children, params))
    assert pval < ALPHA, (setting, stat, df, pval)


def test_each_request_is_verified_on_the_tree_of_its_own_distribution(runs):
    """The tempered tree: the fake target checks, node by node, that the worker
    verified the reference tree built from the draft at the request's
    temperature, top-k and top-p; here, that this differs from the T = 1,
    unrestricted tree where it should (temperature 0.7, top-p 0.9) and not where
    it cannot (temperature 1 with a top-k above the candidates: the same
    scores), and that the greedy request keeps the untempered tree."""
    out = runs["stats"][0]
    exp = out["expect"]
    by_setting = {}
    for b, row in enumerate(out["sampling"]):
        by_setting.setdefault(_setting_of(row) or "greedy", b)
    tempered = by_setting["t0.7-p0.9"]
    assert exp["trees"][tempered] != exp["untempered_trees"][tempered]
    for name in ("t1.0-k5", "greedy"):
        b = by_setting[name]
        assert exp["trees"][b] == exp["untempered_trees"][b], name


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_distribution_check_rejects_a_tree_chosen_with_the_coins(runs, setting):
    """Control for the tempered tree's losslessness: the tree may depend on
    anything but the acceptance coins. A tree that drops the root's first child
    exactly when the root's coin would accept it has the wrong law (its walks
    may end in a token of the reference tree, so only the law is checked)."""
    first, _, logits, _ = samples_of([runs["coin_tree"]], setting)
    p1 = target_dist(logits[()], **SETTINGS[setting])
    stat, df, pval = chi_square(first, p1)
    assert pval < ALPHA, (setting, stat, df, pval, sorted(Counter(first).items()))
