"""One decode step of the real ``DDTreeWorkerV2`` on CPU, against sglang 0.5.23.

Each test runs ``worker.forward_batch_generation(decode batch)`` (-> ``ddtree_decode``:
draft block -> draft top-k -> ``DDTreeVerifyInput`` -> TARGET_VERIFY forward ->
``eagle_sample`` -> KV move -> commit) in .venv-sglang with the patch overlay, in
one subprocess (``worker_fakes.run_case``), and asserts here on what comes back.

What runs for real: the published runtime context, ``Req`` / ``ScheduleBatch`` /
``SamplingBatchInfo``, ``ReqToTokenPool``, ``TokenToKVPoolAllocator``,
``MHATokenToKVPool`` (target and draft), ``KVIndexTranslator``, ``ForwardBatch``,
``DDTreeVerifyInput.prepare_for_verify`` -> ``ForwardBatch.init_new``,
``assign_extend_cache_locs_func`` / ``fill_front_out_cache_loc_func`` /
``fill_accept_out_cache_loc_func`` (SGLang's Triton kernels, in Triton's CPU
interpreter), ``eagle_sample``'s greedy path, ``move_accept_tokens_to_target_kvcache``
-> ``move_kv_cache`` (the pool's native torch move), ``compute_spec_logprobs``,
``make_draft_input_v2``, ``GenerationBatchResult`` and the whole worker step.

Replaced or faked (details in ``worker_fakes``): ``verify_tree_greedy_func`` (a
CUDA kernel / ``sgl_kernel`` CPU op, absent here) by the payload's
``ddtree_utils.verify_tree_greedy_reference``; the target worker's
``forward_batch_generation`` and the draft runner's ``forward`` (toy models that
assert the batches they get); the attention backend (records
``init_forward_metadata``); model config / model objects (the fields read);
the TP group (world size 1); ``_append_target_hidden_to_draft_kv_by_loc`` (a
recorder: it writes draft-model KV); ``batch.seq_lens.record_stream`` (torch has
no CPU kernel for it: recorded). The worker itself is ``object.__new__`` plus the
attributes its ``__init__`` would set (that loads models and captures graphs).

Expectations come from an independent reference (``worker_fakes``): the
best-first tree of the draft's per-depth top-k in float64, the toy target's
greedy walk over it, and the KV pool that walk implies.
"""

from __future__ import annotations

import math
import pathlib

import pytest

from sglang_env import run_sglang

pytestmark = pytest.mark.sglang

HERE = pathlib.Path(__file__).resolve().parent

CASES = {
    # B=8, cap 3, block 5 (max depth 4); the scheduler mirrored seq_lens on the host.
    "b8-cap3-block5": {
        "budget": 8, "cap": 3, "block": 5, "prefixes": [7, 11, 3, 19],
        "ranks": [[0, 0, 0, 0], [0, 1, 0, None], [None], [0, 0, 2]],
        "host_mirror": True,
    },
    # B=20, cap 4, block 8 (max depth 7); overlap: only the reservation is on the
    # host (seq_lens_cpu None); logprobs requested (compute_spec_logprobs).
    "b20-cap4-block8": {
        "budget": 20, "cap": 4, "block": 8, "prefixes": [5, 17, 10, 30],
        "ranks": [[0] * 7, [0, 0, 0, 1, 1, 0, 1], [None], [1, 0, None]],
        "host_mirror": False, "return_logprob": True,
    },
}


def _run(tmp_path, overlay, case: dict, *, no_kv_move: bool = False) -> dict:
    code = f"""
    sys.path.insert(0, {str(HERE)!r})
    import worker_fakes  # first: sets TRITON_INTERPRET / SGLANG_NATIVE_MOVE_KV_CACHE
    OUT.update(worker_fakes.run_case(model=MODEL, no_kv_move={no_kv_move!r}, **{case!r}))
    """
    return run_sglang(code, tmp_path, overlay, timeout=300, triton_interpret=True)


# -- checks (each raises AssertionError) ----------------------------------------

def check_calls(out: dict) -> None:
    cfg, calls = out["config"], out["calls"]
    assert calls["draft_tokens"] == [cfg["bs"] * cfg["block"]], "one draft forward, bs*block tokens"
    assert calls["target"] == 1, "exactly one target forward"
    assert calls["target_kwargs"] == [["skip_attn_backend_init"]]
    assert calls["attn_init"] == 1, "prepare_for_verify planned attention once"
    assert out["result"]["record_stream"] == ["Stream"]


def check_result(out: dict) -> None:
    cfg, res, exp = out["config"], out["result"], out["expect"]
    bs, block = cfg["bs"], cfg["block"]
    lens = [len(o) for o in exp["out"]]
    assert res["type"] == "GenerationBatchResult"
    assert res["accept_lens"] == lens
    assert len(res["next_token_ids"]) == bs * block
    rows = [res["next_token_ids"][b * block:(b + 1) * block] for b in range(bs)]
    assert rows == [o + [0] * (block - len(o)) for o in exp["out"]], "DFlash layout [bs, block]"
    assert res["new_seq_lens"] == [p + n for p, n in zip(cfg["prefixes"], lens, strict=False)]
    assert res["num_draft_tokens"] == block
    assert res["next_draft_type"] == "DFlashDraftInputV2"
    assert res["next_bonus"] == [o[-1] for o in exp["out"]]
    assert res["next_seq_lens"] == res["new_seq_lens"]
    assert out["calls"]["publish"] == [res["new_seq_lens"]], "on_publish once, new lengths"
    assert res["hidden_dropped"] and res["batch_mode"] == "DECODE"
    assert res["can_run_cuda_graph"] is False


def check_logprobs(out: dict) -> None:
    lp, exp = out["result"]["next_token_logprobs"], out["expect"]["out"]
    # toy target logits: -2 everywhere, 3 at its greedy token
    want = 3.0 - math.log(math.exp(3.0) + (out["config"]["V"] - 1) * math.exp(-2.0))
    for b, o in enumerate(exp):
        assert len(lp[b]) == out["config"]["D"] + 1
        assert all(abs(x - want) < 1e-5 for x in lp[b][:len(o)]), (b, lp[b])


def check_draft_kv_append(out: dict) -> None:
    cfg, exp, rec = out["config"], out["expect"], out["calls"]["append"]
    bs, block = cfg["bs"], cfg["block"]
    assert len(rec) == 1, "draft KV appended once"
    rec = rec[0]
    lens = [len(o) for o in exp["out"]]
    assert rec["commit_lens"] == lens
    assert rec["positions"] == [p + j for p in cfg["prefixes"] for j in range(block)]
    loc = [out["slots"]["rows"][b][p:p + block] for b, p in enumerate(cfg["prefixes"])]
    assert rec["cache_loc"] == [s for row in loc for s in row] and rec["cache_loc_2d"] == loc
    h = len(rec["target_hidden"][0])
    for b in range(bs):
        for k in range(block):
            row = rec["target_hidden"][b * block + k]
            if k < lens[b]:  # the k-th accepted node's target hidden state
                want = [exp["codes"][b][k], exp["depths"][b][k], b] + list(range(h - 3))
            else:
                want = [0.0] * h
            assert row == want, (b, k, row)


def check_kv(out: dict) -> None:
    """The whole target KV pool equals the reference's: accepted nodes' KV at the
    front of each window, the rest of the window as the target wrote it, every
    other slot (prefixes, reservation tails, the bystander request, free slots)
    as before the step."""
    kv = out["kv"]
    bad = []
    for name in ("k", "v"):
        for layer, (got, want) in enumerate(zip(kv[name], kv[name + "_expected"], strict=False)):
            bad += [(name, layer, s, g, w) for s, (g, w) in enumerate(zip(got, want, strict=False)) if g != w]
    assert not bad, f"{len(bad)} KV rows differ, first: {bad[:4]}"


def check_scenario(out: dict) -> None:
    """The data exercise what the checks are for."""
    cfg, exp = out["config"], out["expect"]
    lens = sorted({len(o) for o in exp["out"]})
    assert lens[0] == 1 and lens[-1] == cfg["block"] and len(lens) >= 3, lens
    # a path whose k-th node is not node k: the KV check sees a missing move
    assert any(i != k for ids in exp["ids"] for k, i in enumerate(ids)), exp["ids"]
    # float32 (worker) and float64 (reference) order the tree the same
    assert exp["min_score_gap"] > 1e-4, exp["min_score_gap"]
    # the reference pool differs from the pool before the step at the moved slots
    assert out["kv"]["k_expected"] != out["kv"]["k_before"]


@pytest.mark.parametrize("name", list(CASES))
def test_ddtree_decode_step_real_pools(name, tmp_path, sglang_overlay):  # noqa: F811
    case = CASES[name]
    out = _run(tmp_path, sglang_overlay, case)
    assert out["result"]["triton_block"], "DFlash's Triton block kernel ran (no fallback)"
    check_scenario(out)
    check_calls(out)
    check_result(out)
    check_draft_kv_append(out)
    check_kv(out)
    if case.get("return_logprob"):
        check_logprobs(out)
    else:
        assert out["result"]["next_token_logprobs"] is None


def test_kv_check_catches_a_skipped_move(tmp_path, sglang_overlay):  # noqa: F811
    """Mutation: the same step with ``move_accept_tokens_to_target_kvcache`` a
    no-op commits the same tokens, and only the KV check notices."""
    out = _run(tmp_path, sglang_overlay, CASES["b8-cap3-block5"], no_kv_move=True)
    check_result(out)
    with pytest.raises(AssertionError, match="KV rows differ"):
        check_kv(out)


# -- the deferred verify gather (DFLASH's, under TP) ------------------------------------------


def _run_deferred(tmp_path, overlay, case: dict) -> dict:
    code = f"""
    sys.path.insert(0, {str(HERE)!r})
    import worker_fakes  # first: sets TRITON_INTERPRET / SGLANG_NATIVE_MOVE_KV_CACHE
    OUT["deferred"] = worker_fakes.run_case(model=MODEL, deferred_gather=True, **{case!r})
    """
    return run_sglang(code, tmp_path, overlay, timeout=300, triton_interpret=True)["deferred"]


def test_a_plain_greedy_step_gathers_only_row_maxima_and_commits_the_same(tmp_path, sglang_overlay):  # noqa: F811
    """With the target's logits as vocabulary shards (DFLASH's deferred verify gather), a plain
    greedy batch takes SGLang's ``deferred_argmax`` (each row's maximum crosses TP, not the
    vocabulary) and the greedy tree walk on it: the same tokens, lengths, draft KV and target KV
    as the full-logits step, and never the full gather."""
    out = _run_deferred(tmp_path, sglang_overlay, CASES["b8-cap3-block5"])
    assert out["result"]["verify_gathers"] == {"full": 0, "row_maxima": 1}
    check_scenario(out)
    check_calls(out)
    check_result(out)
    check_draft_kv_append(out)
    check_kv(out)


def test_a_step_that_needs_the_logits_still_gathers_them_whole(tmp_path, sglang_overlay):  # noqa: F811
    """Control: logprobs read the full distribution, so that batch gathers the vocabulary (once)
    and takes eagle_sample's path; the result is the full-logits step's."""
    out = _run_deferred(tmp_path, sglang_overlay, CASES["b20-cap4-block8"])
    assert out["result"]["verify_gathers"] == {"full": 1, "row_maxima": 0}
    check_result(out)
    check_kv(out)
    check_logprobs(out)


CHAIN = {"budget": 6, "cap": 1, "block": 5, "prefixes": [7, 11, 3, 19],
         "ranks": [[0, 0, 0, 0], [0, 0, None], [None], [0]], "host_mirror": True}


def test_a_chain_moves_no_kv_and_leaves_every_accepted_node_in_place(tmp_path, sglang_overlay):  # noqa: F811
    """Top-k cap 1: node i is the one node at depth i, so the accepted nodes are the window's
    first ones and the KV move (61 layers of index copies on Kimi) is skipped: the fill kernel of
    the move never runs, and the whole KV pool is still the reference's."""
    code = f"""
    sys.path.insert(0, {str(HERE)!r})
    import worker_fakes  # first: sets TRITON_INTERPRET / SGLANG_NATIVE_MOVE_KV_CACHE
    OUT.update(worker_fakes.run_case(model=MODEL, index_kernels="checked", triton_block=False, **{CHAIN!r}))
    """
    out = run_sglang(code, tmp_path, sglang_overlay, timeout=300, triton_interpret=True)
    lens = sorted({len(o) for o in out["expect"]["out"]})
    assert lens[0] == 1 and lens[-1] == CHAIN["block"], lens  # rejected at the root and accepted whole
    assert all(ids == list(range(len(ids))) for ids in out["expect"]["ids"]), out["expect"]["ids"]
    assert out["result"]["triton_block"] is False  # DFlash's eager block fallback, here
    index = out["result"]["kernels"]["index"]
    assert index.get("kv_moves", 0) == 0 and index.get("assign_extend_cache_locs"), index
    check_result(out)
    check_draft_kv_append(out)
    check_kv(out)


# -- the draft head's top-k inside the draft graph ----------------------------------------------


def test_the_top_k_head_in_the_draft_graph_builds_the_eager_heads_trees(tmp_path, sglang_overlay):  # noqa: F811
    """The worker's ``_maybe_build_draft_sampler`` (the head DFlashWorkerV2 folds into the draft
    graph) run where the graph runs it: a greedy batch and a tempered one commit what the
    reference walk commits on the reference trees, which the fake target checks node by node
    (the tempered tree at each request's temperature, the greedy one untempered)."""
    # test_worker_sampled_cpu's nucleus setting (its tree loses nodes) and a temperature that
    # reorders the best-first tree: both differ from the untempered tree the greedy row keeps
    sampled = {"budget": 8, "cap": 3, "block": 5, "host_mirror": True, "prefixes": [6] * 3, "bonus": [23] * 3,
               "ranks": [[0]] * 3, "sampling": [{"temperature": 0.7, "top_p": 0.9}, {}, {"temperature": 2.5}]}
    past = dict(sampled, prefixes=[6] * 6, bonus=[23] * 6, ranks=[[0]] * 6,
                sampling=sampled["sampling"] * 2, extra_args=("--cuda-graph-max-bs-decode", "4"))
    code = f"""
    sys.path.insert(0, {str(HERE)!r})
    import worker_fakes  # first: sets TRITON_INTERPRET / SGLANG_NATIVE_MOVE_KV_CACHE
    OUT["greedy"] = worker_fakes.run_case(model=MODEL, draft_graph=True, **{CASES["b8-cap3-block5"]!r})
    OUT["sampled"] = worker_fakes.run_case(model=MODEL, draft_graph=True, **{sampled!r})
    # past the largest graph (4): the draft runs eagerly and so does the top-k
    OUT["past"] = worker_fakes.run_case(model=MODEL, draft_graph=True, **{past!r})
    """
    out = run_sglang(code, tmp_path, sglang_overlay, timeout=300, triton_interpret=True)
    assert out["greedy"]["calls"]["draft_head"] == out["sampled"]["calls"]["draft_head"] == 1
    assert out["past"]["calls"]["draft_head"] == 0 and all(out["past"]["expect"]["walk_valid"])
    assert out["past"]["expect"]["trees"][2] != out["past"]["expect"]["untempered_trees"][2]
    check_kv(out["past"])
    check_scenario(out["greedy"])
    check_result(out["greedy"])
    check_kv(out["greedy"])
    exp = out["sampled"]["expect"]
    assert exp["trees"][1] == exp["untempered_trees"][1]
    assert exp["trees"][0] != exp["untempered_trees"][0] and exp["trees"][2] != exp["untempered_trees"][2]
    assert out["sampled"]["calls"]["target"] == 1 and all(exp["walk_valid"]), exp["walk_valid"]
    check_kv(out["sampled"])
