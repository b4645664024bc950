"""The DDTree step's pure parts, in the light venv (torch CPU, no SGLang): the sharded top-k,
the committed-block layout, the accepted rows for the draft KV, the host length bound, the
tree's static shape, and the argument refusals."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch


@pytest.fixture(scope="module")
def dv():
    from sglang.srt.speculative import ddtree_verify

    return ddtree_verify


@pytest.fixture(scope="module")
def dw():
    from sglang.srt.speculative import ddtree_worker

    return ddtree_worker


@pytest.fixture(scope="module")
def da():
    from sglang.srt.speculative import ddtree_args

    return ddtree_args


def _run_ranks(dv, logits: torch.Tensor, tp: int, k: int, sent: list | None = None):
    """Each TP rank in its own thread with its vocabulary shard (SGLang's layout: equal padded
    shards, the last one shorter); `gather` is an all-gather through a barrier. ``sent`` gets
    (rank, shape, dtype) of every tensor a rank gathers."""
    vocab = logits.shape[1]
    shard = -(-vocab // tp)
    slots: list = [None] * tp
    barrier = threading.Barrier(tp)
    results: list = [None] * tp

    def rank(r: int) -> None:
        def gather(t: torch.Tensor) -> torch.Tensor:
            if sent is not None:
                sent.append((r, tuple(t.shape), t.dtype))
            slots[r] = t
            barrier.wait()
            out = torch.stack(list(slots))
            barrier.wait()  # everyone has read before the next call overwrites
            return out

        start = min(r * shard, vocab)
        local = logits[:, start:min(start + shard, vocab)]
        results[r] = dv.vocab_parallel_topk_logprobs(
            local, k, vocab_start=start, gather=gather if tp > 1 else None
        )

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


@pytest.mark.parametrize("vocab,tp,k", [(1000, 1, 8), (1000, 2, 8), (1003, 8, 16), (30, 8, 8), (12, 4, 8)])
def test_sharded_topk_equals_the_full_vocabulary_topk_on_every_rank(dv, vocab, tp, k):
    from sglang.srt.speculative.ddtree_utils import draft_topk_logprobs

    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(vocab + tp))
    want_lp, want_ids = draft_topk_logprobs(logits, k)
    results = _run_ranks(dv, logits, tp, k)
    for lp, ids in results:
        assert torch.equal(lp, results[0][0]) and torch.equal(ids, results[0][1])  # same tree everywhere
        n = want_lp.shape[1]
        assert torch.allclose(lp[:, :n], want_lp, atol=1e-5)
        assert torch.equal(ids[:, :n], want_ids)
        assert torch.isneginf(lp[:, n:]).all()  # past a vocabulary smaller than k: never selected


def test_the_sharded_topk_crosses_ranks_in_one_gather(dv):
    """k values, k ids and the log-sum-exp of each row, packed: one collective per draft step,
    not 2.1's three."""
    sent: list = []
    logits = torch.randn(7, 1003, generator=torch.Generator().manual_seed(3))
    _run_ranks(dv, logits, 4, 8, sent)
    assert sorted(sent, key=lambda x: x[0]) == [(r, (7, 2 * 8 + 1), torch.float32) for r in range(4)]


def test_sharded_topk_would_be_wrong_without_the_global_normaliser(dv):
    """The check above can fail: each rank's own log-sum-exp is not the vocabulary's."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    local = dv.vocab_parallel_topk_logprobs(logits[:, :32], 4)[0]
    full = dv.vocab_parallel_topk_logprobs(logits, 4)[0]
    assert not torch.allclose(local, full)


def test_front_rows_put_the_accepted_path_first_and_zero_the_rest(dv):
    W, block = 5, 4
    x = torch.arange(2 * W, dtype=torch.float32).view(-1, 1).repeat(1, 3)
    accept_index = torch.tensor([[0, 3, 4], [5, 7, -1]])
    rows = dv.front_rows(x, accept_index, block).view(2, block, 3)[:, :, 0]
    assert rows.tolist() == [[0, 3, 4, 0], [5, 7, 0, 0]]


def test_host_prefix_bound_is_exact_when_mirrored_else_the_capped_reservation(dw):
    exact = torch.tensor([5, 9], dtype=torch.int32)
    assert dw.host_prefix_bound(exact, torch.tensor([99, 99]), 50, 16).tolist() == [5, 9]
    assert dw.host_prefix_bound(None, torch.tensor([40, 80]), 50, 16).tolist() == [40, 66]
    with pytest.raises(RuntimeError, match="host"):
        dw.host_prefix_bound(None, None, 50, 16)


@pytest.mark.parametrize("budget,block,depth", [(64, 16, 15), (7, 16, 7), (16, 16, 15), (1, 2, 1)])
def test_tree_shape_follows_budget_and_block(dw, budget, block, depth):
    cfg = dw.DDTreeConfig(budget, min(4, budget), block)
    assert (cfg.verify_width, cfg.max_depth, cfg.accept_width) == (budget + 1, depth, depth + 1)
    with pytest.raises(ValueError):
        dw.DDTreeConfig(budget, budget + 1, block)


def test_model_refusals_name_every_reason(dw):
    assert dw.model_refusals(mamba=False, selector=False, domino=False, quantized_head_tp=False) == []
    why = dw.model_refusals(mamba=True, selector=True, domino=True, quantized_head_tp=True,
                            verify_backend="FlashInferAttnBackend", hip=True)
    assert len(why) == 6 and any("mamba" in w for w in why) and any("TP > 1" in w for w in why)
    assert any("FlashInferAttnBackend" in w and "--attention-backend triton" in w for w in why)
    assert any("ROCm" in w for w in why)


def test_the_verify_backend_is_the_hybrid_backends_prefill_side_unless_decode_mode(dw):
    hybrid = SimpleNamespace(prefill_backend="P", decode_backend="D")
    assert dw.verify_attention_backend(hybrid, "prefill") == "P"
    assert dw.verify_attention_backend(hybrid, None) == "P"
    assert dw.verify_attention_backend(hybrid, "decode") == "D"
    assert dw.verify_attention_backend("T", "decode") == "T"


def _args(**kw):
    base = dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=None,
                speculative_ddtree_topk_cap=None, attention_backend=None,
                prefill_attention_backend=None, decode_attention_backend=None,
                speculative_attention_mode="prefill", page_size=None)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("kw,needle", [
    (dict(attention_backend="flashinfer"), "attention backend 'flashinfer'"),
    (dict(attention_backend="trtllm_mla"), "attention backend 'trtllm_mla'"),
    (dict(attention_backend="triton", prefill_attention_backend="fa3"), "attention backend 'fa3'"),
    (dict(attention_backend="triton", decode_attention_backend="fa3", speculative_attention_mode="decode"),
     "attention backend 'fa3'"),
    (dict(page_size=64), "--page-size 64"),
    (dict(enable_dp_attention=True), "DP attention"),
    (dict(attn_dp_size=2), "DP attention"),
    (dict(enable_lora=True), "--enable-lora"),
    (dict(speculative_adaptive=True), "--speculative-adaptive"),
    (dict(speculative_use_block_verification=True), "block-verification"),
    (dict(speculative_accept_threshold_single=0.9), "thresholds below 1"),
    (dict(speculative_draft_window_size=512), "draft-window-size"),
])
def test_options_the_tree_verify_cannot_serve_are_refused_by_name(da, kw, needle):
    with pytest.raises(da.DDTreeArgumentError, match="cannot run with") as e:
        da.normalize_ddtree_server_args(_args(**kw))
    assert needle in str(e.value)


def test_unset_backend_and_page_size_become_the_tree_verify_defaults(da):
    a = _args(speculative_ddtree_budget=16, speculative_ddtree_topk_cap=4)
    da.normalize_ddtree_server_args(a)
    assert (a.speculative_algorithm, a.speculative_ddtree_budget, a.speculative_ddtree_topk_cap) == ("DFLASH", 16, 4)
    assert (a.attention_backend, a.page_size) == ("triton", 1)
    # decode-mode verify with a triton decode backend is served; nothing is overridden
    b = _args(decode_attention_backend="triton", prefill_attention_backend="fa3", speculative_attention_mode="decode")
    da.normalize_ddtree_server_args(b)
    assert b.attention_backend is None and b.speculative_ddtree_budget == 64


def test_other_algorithms_are_left_exactly_as_given(da):
    a = _args(speculative_algorithm="EAGLE", attention_backend="fa3", page_size=64)
    da.normalize_ddtree_server_args(a)
    assert (a.speculative_algorithm, a.attention_backend, a.page_size, a.speculative_ddtree_budget) == (
        "EAGLE", "fa3", 64, None)


def test_verify_tensors_are_contiguous_as_sglangs_kernels_require(dv):
    """verify_tree_greedy / tree_speculative_sampling_target_only refuse strided inputs."""
    g = torch.Generator().manual_seed(3)
    plan = dv.ddtree_prepare_verify(torch.randn(3, 4, 40, generator=g), torch.tensor([1, 2, 3]),
                                    torch.tensor([5, 2, 9]), 8, 3, seq_lens_sum=16)
    for name, t in [("retrive_index", plan.retrieve.retrive_index),
                    ("retrive_next_token", plan.retrieve.retrive_next_token),
                    ("retrive_next_sibling", plan.retrieve.retrive_next_sibling),
                    ("draft_token", plan.draft_token), ("positions", plan.positions),
                    ("custom_mask", plan.custom_mask)]:
        assert t.is_contiguous(), name


# -- custom logit processors that read the request's history ---------------------------------------


class _Base:  # stands in for CustomLogitProcessor: what a subclass inherits is read too
    def __call__(self, logits, custom_param_list=None):
        return logits


class _BansATokenProcessor(_Base):
    def __call__(self, logits, custom_param_list=None):
        logits[..., custom_param_list[0]["token_ids"]] = -float("inf")
        return logits


class _ThinkingBudgetLike(_Base):
    def __call__(self, logits, custom_param_list=None):
        for i, params in enumerate(custom_param_list):
            if len(params.get("__req__").output_ids) > params["budget"]:
                logits[i] = 0.0
        return logits


class _HistoryInANestedHelper(_Base):
    def __call__(self, logits, custom_param_list=None):
        def seen(p):
            return p["r"].origin_input_ids

        return logits if not custom_param_list else logits + 0 * len(seen(custom_param_list[0]))


class _HistoryInAnInheritedHelper(_ThinkingBudgetLike):
    pass


class _HistoryInAProperty(_Base):
    @property
    def fill(self):
        return self.req.fill_ids


def test_a_processor_is_history_reading_when_its_code_names_the_request_or_its_tokens(da):
    assert not da.reads_request_history(_BansATokenProcessor)
    for cls in (_ThinkingBudgetLike, _HistoryInANestedHelper, _HistoryInAnInheritedHelper, _HistoryInAProperty):
        assert da.reads_request_history(cls), cls.__name__



def test_the_commit_step_derives_block_lengths_moves_and_front_rows_from_the_walk(dv):
    """``ddtree_commit_step`` (plain torch here): the committed block and bonus as
    DFlash's committed-block layout, lengths = prefix + commit, one KV move per path entry (the k-th
    accepted node's slot to the k-th window slot, everything else onto itself) and the front
    rows ``front_rows`` gathers."""
    W, block = 5, 4
    # request 0 accepts nodes 0 -> 2 -> 4 (+ bonus at node 4); request 1 only the bonus
    accept_index = torch.tensor([[0, 2, 4], [5, -1, -1]], dtype=torch.int32)
    accept_lens = torch.tensor([3, 1], dtype=torch.int32)
    predict = torch.arange(100, 100 + 2 * W, dtype=torch.int32)
    loc = torch.arange(50, 50 + 2 * W, dtype=torch.int64)
    step = dv.ddtree_commit_step(predict, accept_index, accept_lens, loc, torch.tensor([7, 9]), block,
                                 use_triton=False)
    assert step.out_tokens.tolist() == [[100, 102, 104, 0], [105, 0, 0, 0]]
    assert step.commit_lens.tolist() == [3, 1] and step.commit_lens.dtype == torch.int32
    assert step.bonus.tolist() == [104, 105]
    assert step.new_seq_lens.tolist() == [10, 10]
    assert list(zip(step.kv_tgt.tolist(), step.kv_src.tolist(), strict=True)) == [
        (50, 50), (51, 52), (52, 54), (55, 55), (56, 56), (57, 57)]
    x = torch.arange(2 * W, dtype=torch.float32).view(-1, 1)
    front = x.index_select(0, step.front_index).masked_fill_(step.front_drop.unsqueeze(1), 0)
    assert front.view(-1).tolist() == dv.front_rows(x, accept_index, block).view(-1).tolist()


def test_the_draft_heads_staging_leaves_a_batch_past_the_graphs_to_the_eager_top_k(dw):
    """CT200 serves batches of 9-48 past its largest graph (8): their draft runs eagerly, so the
    in-graph head stages nothing for them (it used to copy 48 temperatures into 8 rows)."""
    head = dw.DDTreeDraftHead(weight=torch.zeros(16, 4), block_size=3, num_org=16, vocab_start=0, k=2,
                              max_bs=2)
    head.stage(5, torch.full((5,), 2.0))  # past the graphs: untouched
    assert head.inv_temperature.tolist() == [1.0, 1.0]
    head.stage(2, torch.tensor([2.0, 0.5]))
    assert head.inv_temperature.tolist() == [2.0, 0.5]
    head.stage(1, None)  # untempered again: every row back to 1
    assert head.inv_temperature.tolist() == [1.0, 1.0]
