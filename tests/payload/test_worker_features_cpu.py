"""Request features in the real ``DDTreeWorkerV2`` decode step, on CPU.

Same harness as test_worker_decode_cpu (``worker_fakes.run_case``: one real
``worker.forward_batch_generation`` per step in .venv-sglang with the patch
overlay, real pools / ``SamplingBatchInfo`` / ``eagle_sample`` / KV move, the toy
target and draft), one subprocess for every case:

* ``return_sampling_mask``: a DDTREE server admits it (DDTREE is stored as
  DFLASH). The 2.0 step built no capture and the scheduler's
  ``add_sampling_mask_return_values`` then indexed ``None``: a ``TypeError`` in
  the scheduler, i.e. one request could take the server down. The step now
  captures the target's verify distribution at every committed token's node,
  gathered along the accepted path; the scheduler's own materialisation runs
  on the result here. Expectation: the support and log-probability of each
  committed token under the toy target's distribution at that node (float64,
  from the fake target's logits).
* Custom logit processors: SGLang's own ``DisallowedTokensLogitsProcessor``
  (``--enable-custom-logit-processor``) bans, in a greedy request, the token the
  target would pick at the second node of its walk, a token the tree proposes.
  It must not be committed: the processor applies to every tree row, as DFLASH
  applies it to every block row.
* Grammar: the tree's host copy (``GrammarTree.from_device``) is queued before
  the verify launch, so the CPU bitmask never waits for the verify.

Controls: the 2.0 step without the capture (the scheduler raises the
``TypeError``), a capture read in node order instead of path order (rejected by
the same check), a processor applied to the root rows only (commits the banned
token), the 2.0 grammar order (rejected by the order check).
"""

from __future__ import annotations

import math
import pathlib

import pytest
from test_worker_decode_cpu import check_calls, check_draft_kv_append, check_kv, check_result
from test_worker_sampled_cpu import target_dist

from sglang_env import run_sglang

pytestmark = pytest.mark.sglang

HERE = pathlib.Path(__file__).resolve().parent

CASE = {"budget": 8, "cap": 3, "block": 5, "host_mirror": True,
        "extra_args": ["--enable-custom-logit-processor"]}
SAMPLED = {"temperature": 0.7, "top_k": 5}
# the mask batch: 0 greedy, 1 sampled, 2 greedy through a rank-1 child (its k-th
# accepted node is not node k), all asking for masks, and 3 a greedy bystander
MASK_BATCH = {"prefixes": [7, 11, 5, 19], "bonus": [11, 28, 13, 40],
              "ranks": [[0, 0, 0, 0], [0], [0, 1, 0], [0, 0]],
              "sampling": [{"temperature": 0.0}, SAMPLED, {"temperature": 0.0}, {"temperature": 0.0}],
              "req_kwargs": [{"return_sampling_mask": True}] * 3 + [{}]}
MASKED = (0, 1, 2)
# the processor batch (all greedy): request 1 bans the token its walk would take second
PROC_PREFIXES, PROC_BONUS, PROC_RANKS = [7, 3], [11, 45], [[0, 0, 0, 0], [0, 0, 0, 0]]
BANNED_REQ = 1


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sglang_overlay):
    code = f"""
    sys.path.insert(0, {str(HERE)!r})
    import worker_fakes as wf  # first: sets TRITON_INTERPRET / SGLANG_NATIVE_MOVE_KV_CACHE
    import torch
    from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

    case = {CASE!r}
    torch.manual_seed(3)
    OUT["features"] = wf.run_case(model=MODEL, **case, **{MASK_BATCH!r})
    OUT["no_capture"] = wf.run_case(model=MODEL, **case, **{MASK_BATCH!r}, worker_mutation="no_mask_capture")

    b, ranks = {BANNED_REQ}, {PROC_RANKS!r}
    prefixes, bonus = {PROC_PREFIXES!r}, {PROC_BONUS!r}
    plan = wf.make_plan(wf.draft_topk(bonus[b], prefixes[b], case["block"], case["cap"]), ranks[b])
    ban = plan[1]  # the target's greedy token at the walk's second node
    sampling = [{{"temperature": 0.0}}, {{"temperature": 0.0, "custom_params": {{"token_ids": [ban]}}}}]
    req_kwargs = [{{}}, {{"custom_logit_processor": DisallowedTokensLogitsProcessor.to_str()}}]
    for name, mutation in (("processor", None), ("roots_only", "processor_roots_only")):
        OUT[name] = wf.run_case(model=MODEL, **case, prefixes=prefixes, bonus=bonus, ranks=ranks,
                                sampling=sampling, req_kwargs=req_kwargs, worker_mutation=mutation)
        OUT[name].update(ban=ban, plan=plan)
    raw = {{"budget": 8, "cap": 3, "block": 5, "host_mirror": True, "prefixes": [6, 6], "bonus": [23, 23],
           "ranks": [[0], [0, 0, 0, 0]], "sampling": [{{"temperature": 0.7, "top_p": 0.9}}, {{"temperature": 0.0}}]}}
    OUT["raw_tree"] = wf.run_case(model=MODEL, **raw, extra_args=["--speculative-ddtree-tree-distribution", "raw"])
    OUT["request_tree"] = wf.run_case(model=MODEL, **raw)
    OUT["grammar"] = wf.run_case(model=MODEL, budget=8, cap=3, block=5, prefixes=[7, 11],
                                 ranks=[[0, 0, 0, 0], [1, 0]], host_mirror=True, grammar_probe=True)
    """
    return run_sglang(code, tmp_path_factory.mktemp("features"), sglang_overlay, timeout=600, triton_interpret=True)


# -- expectations ---------------------------------------------------------------

def expected_masks(out: dict, b: int, node_of) -> dict:
    """The sampling mask of request ``b``: per committed token, the support of
    the target's verify distribution at ``node_of(k)`` (top-k by probability;
    greedy: the argmax) and the token's log-probability there."""
    params = out["sampling"][b] if "sampling" in out else None
    params = params or {"temperature": 0.0}
    logits = {tuple(p): v for p, v in out["result"]["node_logits"][b]}
    masks, logprobs = [], []
    for k, tok in enumerate(out["expect"]["out"][b]):
        row = logits[tuple(node_of(k))]
        if params.get("temperature", 0.0) > 0:
            dist = target_dist(row, params["temperature"], top_k=params.get("top_k"))
        else:
            dist = {max(range(len(row)), key=lambda t: (row[t], -t)): 1.0}
        masks.append(sorted(dist))
        logprobs.append(math.log(dist[tok]) if dist.get(tok, 0.0) > 0 else -math.inf)
    return {"masks": masks, "logprobs": logprobs}


def check_masks(out: dict, node_of_request) -> None:
    got = out["result"]["sampling_mask"]
    assert got is not None and "error" not in got, got
    assert sorted(got) == [str(b) for b in MASKED], sorted(got)
    for b in MASKED:
        want = expected_masks(out, b, node_of_request(out, b))
        row = got[str(b)]
        assert [sorted(m) for m in row["masks"]] == want["masks"], (b, row["masks"], want["masks"])
        assert len(row["logprobs"]) == len(want["logprobs"])
        for g, w in zip(row["logprobs"], want["logprobs"], strict=True):
            assert (g == w == -math.inf) or abs(g - w) < 1e-5, (b, row["logprobs"], want["logprobs"])


def path_nodes(out, b):
    """The k-th committed token was drawn at the k-th node of the accepted path."""
    paths = out["expect"]["paths"][b]
    return lambda k: paths[k]



def node_order(out, b):
    """A capture that reads the verify rows in node order (row k = node k)."""
    nodes = [()] + [tuple(p) for p in out["expect"]["trees"][b]]
    return lambda k: nodes[k]


def with_sampling(out: dict) -> dict:
    out["sampling"] = MASK_BATCH["sampling"]
    return out


# -- tests ------------------------------------------------------------------------

def test_feature_step_stays_consistent(runs):
    """The feature batch passes every check of the plain step: tokens, lengths,
    draft-KV append and the whole target KV pool against the reference walk."""
    out = runs["features"]
    assert all(out["expect"]["walk_valid"]), out["expect"]["walk_valid"]
    check_calls(out)
    check_result(out)
    check_draft_kv_append(out)
    check_kv(out)


def test_return_sampling_mask_request_gets_its_mask_from_the_accepted_path(runs):
    out = with_sampling(runs["features"])
    check_masks(out, path_nodes)
    # the data make a node-order capture wrong: request 2's walk leaves node order
    ids = out["expect"]["ids"][2]
    assert any(i != k for k, i in enumerate(ids)), ids
    with pytest.raises(AssertionError):
        check_masks(out, node_order)


def test_without_the_capture_the_scheduler_raises(runs):
    """The 2.0 step (no capture): the scheduler's own result processing raises
    the ``TypeError`` that took the server down."""
    got = runs["no_capture"]["result"]["sampling_mask"]
    assert got is not None and got.get("error", "").startswith("TypeError"), got


def test_custom_logit_processor_bans_a_token_the_tree_proposes(runs):
    out = runs["processor"]
    b, ban, plan = BANNED_REQ, out["ban"], out["plan"]
    tree = [tuple(p) for p in out["expect"]["trees"][b]]
    assert (plan[0], ban) in tree, "the tree proposes the banned token at the walk's second node"
    toks = out["expect"]["out"][b]  # the greedy walk with the token banned
    assert toks[0] == plan[0] and ban not in toks, toks
    check_result(out)  # the step committed exactly that walk
    check_kv(out)


def test_a_processor_applied_to_the_root_rows_only_commits_the_banned_token(runs):
    out = runs["roots_only"]
    b = BANNED_REQ
    block = out["config"]["block"]
    committed = out["result"]["next_token_ids"][b * block:(b + 1) * block][: out["result"]["accept_lens"][b]]
    assert out["ban"] in committed, committed
    with pytest.raises(AssertionError):
        check_result(out)


def tree_copied_before_verify(log: list) -> None:
    """The tree's host copy is queued before the verify, the bitmask built
    after it from the copied tree, which is the tree the verify read."""
    names = [e[0] for e in log]
    assert names == ["tree_copied", "verify", "mask_built"], names
    assert log[0][1:] == log[1][1:] == log[2][1:], "the copied tree is the verified one"


def test_grammar_tree_reaches_the_host_before_the_verify_launch(runs):
    out = runs["grammar"]
    tree_copied_before_verify(out["result"]["grammar_log"])
    check_result(out)
    # the 2.0 order (copy after the verify) is what this check refuses
    log = out["result"]["grammar_log"]
    with pytest.raises(AssertionError):
        tree_copied_before_verify([log[1], log[0], log[2]])


def test_the_raw_tree_distribution_verifies_the_untempered_tree(runs):
    """``--speculative-ddtree-tree-distribution raw``: a sampled request's tree is
    the draft's at temperature 1, unrestricted (the fake target checks the
    verified tree node by node against the reference the harness expects);
    by default the same request gets its own tempered tree, which differs."""
    raw, default = runs["raw_tree"], runs["request_tree"]
    assert raw["expect"]["trees"][0] == raw["expect"]["untempered_trees"][0]
    assert default["expect"]["trees"][0] != default["expect"]["untempered_trees"][0]
    assert raw["expect"]["trees"][1] == default["expect"]["trees"][1], "greedy rows: untempered either way"
    for out in (raw, default):
        assert all(out["expect"]["walk_valid"]), out["expect"]["walk_valid"]
        check_kv(out)
