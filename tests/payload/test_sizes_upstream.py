"""No side effects outside DDTREE, and DDTREE's sizes as formulas.

Every size SGLang 0.5.23 derives from the speculative settings is computed twice, in
.venv-sglang: pristine (no overlay) and with the patch set's overlay, for no
speculative decoding, EAGLE (top-k 1, top-k 4, top-k 4 at page size 16), STANDALONE,
DFLASH (page size 1 and 16) and NGRAM; every value must be equal. Then DDTREE
(budget 64, top-k cap 4, block 16; and budgets 7 and 256) must give the formulas of
the patch set's README.

Sizes, and how each is read (real SGLang functions unless stated):

* ``max_speculative_num_draft_tokens()`` (the published bag) and
  ``SpeculativeAlgorithm.resolve_max_speculative_num_draft_tokens(server_args)``;
* ``get_num_tokens_per_req_for_target_verify(n, is_draft_worker)`` for the target and
  the draft runner, at ``n`` = the max draft-token count and at
  ``speculative_num_draft_tokens``;
* ``allocation_sizing.get_alloc_len_per_decode``, ``get_alloc_reserve_per_decode``,
  ``get_req_to_token_extra_context_len``;
* the DFlash decode reserve: ``DFlashDraftInputV2.prepare_for_decode`` run on one request
  (real pool, allocator, tree cache), read back as ``kv_allocated_len - kv_committed_len``;
* logits-buffer rows: ``ModelRunner.max_decode_logits_rows`` (and the
  ``decode_num_tokens_per_req`` it calls) on a FAKE runner: a plain object carrying
  ``server_args``, ``spec_algorithm``, ``is_draft_worker``, a req_to_token pool of
  ``FAKE_POOL_ROWS`` rows, and ``decode_graph_gather_requirements() -> (False,
  False)`` (TP 1, no DP attention: no gathered buffers), since a real ModelRunner
  needs a GPU and weights; ``get_batch_sizes_to_capture`` is real;
* the DFlash sampling pre-warm batch: ``_prewarm_batch_size`` of the class
  ``create_worker`` returns (``DFlashWorkerV2``; ``DDTreeWorkerV2`` under DDTREE), on an
  instance made with ``object.__new__`` carrying only that fake runner (and, for
  DDTree, its real ``DDTreeConfig``);
* the warm-up / autotune dummy verify input: ``create_dummy_verify_input`` for the
  target and the draft runner (its width and whether it takes the mask buffer).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_env import run_sglang

pytestmark = pytest.mark.sglang

FAKE_POOL_ROWS = 48

UPSTREAM_CASES = {
    "none": [],
    "eagle_topk1": ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                    "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
    "eagle_topk4": ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                    "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"],
    "eagle_topk4_page16": ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                           "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens",
                           "8", "--page-size", "16"],
    "standalone": ["--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "3",
                   "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
    "dflash": ["--speculative-algorithm", "DFLASH"],
    "dflash_page16": ["--speculative-algorithm", "DFLASH", "--page-size", "16"],
    "ngram": ["--speculative-algorithm", "NGRAM"],
}
DDTREE_CASES = {
    f"ddtree_b{b}": ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", str(b),
                     "--speculative-ddtree-topk-cap", str(min(4, b))]
    for b in (64, 7, 256)
}
# CT200's shape: graphs up to batch 8, while up to max-running-requests (48) run eagerly
DDTREE_CASES["ddtree_b16_graph8"] = ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget",
                                     "16", "--speculative-ddtree-topk-cap", "4",
                                     "--cuda-graph-max-bs-decode", "8"]

SIZES = r'''
import os
os.environ["TRITON_INTERPRET"] = "1"
import types

import torch

from sglang.srt import runtime_context as rc
from sglang.srt.mem_cache import allocation_sizing as AS
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import prepare_server_args
from sglang.srt.speculative import dflash_info_v2
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm, create_dummy_verify_input


class FakeRunner:
    """FAKE: what ModelRunner.max_decode_logits_rows reads of a model runner."""

    decode_num_tokens_per_req = ModelRunner.decode_num_tokens_per_req
    max_decode_logits_rows = ModelRunner.max_decode_logits_rows

    def __init__(self, server_args, algo, is_draft):
        self.server_args = server_args
        self.spec_algorithm = algo
        self.is_draft_worker = is_draft
        self.req_to_token_pool = types.SimpleNamespace(size=FAKE_POOL_ROWS)
        # resolved, as the real runner has it (DFLASH's hook declares 48 when unset)
        self.max_running_requests = rc.get_schedule().max_running_requests

    def decode_graph_gather_requirements(self):
        return (False, False)


def dflash_decode_reserve():
    """What DFlashDraftInputV2.prepare_for_decode reserves past kv_committed_len."""
    ps = rc.get_schedule().page_size
    pool = ReqToTokenPool(size=4, max_context_len=4096, device="cpu", enable_memory_saver=False)
    alloc = (TokenToKVPoolAllocator(8192, torch.float16, "cpu", None, False) if ps == 1 else
             PagedTokenToKVPoolAllocator(8192, ps, torch.float16, "cpu", None, False))
    params = CacheInitParams(disable=True, req_to_token_pool=pool,
                             token_to_kv_pool_allocator=alloc, page_size=ps)
    params.tree_components = (ComponentType.FULL,)
    committed = 96  # a multiple of every page size used here
    req = types.SimpleNamespace(
        kv=types.SimpleNamespace(kv_committed_len=committed, kv_allocated_len=committed,
                                 req_pool_idx=1),
        sampling_params=types.SimpleNamespace(top_k=1), decode_batch_idx=0)
    batch = types.SimpleNamespace(
        device="cpu", reqs=[req], req_to_token_pool=pool, token_to_kv_pool_allocator=alloc,
        tree_cache=UnifiedRadixCache(params), req_pool_indices=torch.tensor([1]),
        hisparse_coordinator=None, batch_size=lambda: 1, maybe_evict_swa=lambda: None)
    draft_input = dflash_info_v2.DFlashDraftInputV2.create_idle_input(torch.device("cpu"))
    draft_input.prepare_for_decode(batch)
    return req.kv.kv_allocated_len - committed


def sizes(args):
    server_args = prepare_server_args(["--model-path", MODEL, "--device", "cuda"] + args)
    rc.publish(server_args, role="scheduler")
    spec = rc.get_spec()
    algo = SpeculativeAlgorithm.from_string(spec.speculative_algorithm)
    n = spec.speculative_num_draft_tokens
    out = {
        "algorithm": spec.speculative_algorithm,
        "num_draft_tokens": n,
        "num_steps": spec.speculative_num_steps,
        "eagle_topk": spec.speculative_eagle_topk,
        "page_size": rc.get_schedule().page_size,
        "max_running_requests": rc.get_schedule().max_running_requests,
        "cuda_graph_decode_bs": sorted(rc.get_exec().graph.cuda_graph_config.decode.bs),
        "max_speculative_num_draft_tokens": rc.max_speculative_num_draft_tokens(),
        "resolve_max_speculative_num_draft_tokens":
            algo.resolve_max_speculative_num_draft_tokens(server_args),
        "alloc_len_per_decode": AS.get_alloc_len_per_decode(),
        "alloc_reserve_per_decode": AS.get_alloc_reserve_per_decode(),
        "req_to_token_extra_context_len": AS.get_req_to_token_extra_context_len(),
        "logits_rows_target": FakeRunner(server_args, algo, False).max_decode_logits_rows(),
        "logits_rows_draft": FakeRunner(server_args, algo, True).max_decode_logits_rows(),
    }
    if getattr(spec, "speculative_ddtree_budget", None) is not None:
        out["ddtree_budget"] = spec.speculative_ddtree_budget
        out["ddtree_topk_cap"] = spec.speculative_ddtree_topk_cap
    if n is not None:
        mx = rc.max_speculative_num_draft_tokens()
        out["verify_tokens_target"] = algo.get_num_tokens_per_req_for_target_verify(mx, False)
        out["verify_tokens_draft"] = algo.get_num_tokens_per_req_for_target_verify(mx, True)
        out["verify_tokens_target_at_n"] = algo.get_num_tokens_per_req_for_target_verify(n, False)
        out["verify_tokens_draft_at_n"] = algo.get_num_tokens_per_req_for_target_verify(n, True)
        out["dflash_decode_reserve"] = dflash_decode_reserve()
        cls = algo.create_worker(server_args) if algo.is_dflash() else DFlashWorkerV2
        worker = object.__new__(cls)
        worker._target_worker = types.SimpleNamespace()  # no __getattr__ delegation loop
        worker.model_runner = FakeRunner(server_args, algo, False)
        if cls is not DFlashWorkerV2:
            from sglang.srt.speculative import ddtree_worker
            try:
                worker.ddtree_config = ddtree_worker.DDTreeConfig.from_server_args(server_args, n)
            except TypeError:
                worker.ddtree_config = ddtree_worker.DDTreeConfig.from_server_args(server_args)
        out["worker_cls"] = cls.__name__
        # what each worker's prewarm_sampling asks for: rows of the block (DFLASH), of the tree (DDTREE)
        rows = worker.ddtree_config.verify_width if cls is not DFlashWorkerV2 else n
        out["prewarm_batch_size"] = cls._prewarm_batch_size(worker, rows)
        mask = torch.ones(8, dtype=torch.bool)
        for role, is_draft in (("target", False), ("draft", True)):
            width = algo.get_num_tokens_per_req_for_target_verify(mx, is_draft)
            try:
                si = create_dummy_verify_input(algo, mask, width, is_draft)
            except RuntimeError as e:
                out["dummy_" + role] = "raises: " + str(e)
            else:
                out["dummy_" + role] = None if si is None else [
                    type(si).__name__, si.draft_token_num, si.custom_mask is mask]
    return out


D = ["--speculative-draft-model-path", MODEL]
for name, args in CASES.items():
    OUT[name] = sizes(args + (D if args and "NGRAM" not in args else []))
'''


@pytest.fixture(scope="module")
def both(tmp_path_factory, sglang_overlay):  # noqa: F811
    """Pristine and patched sizes, the two interpreters run side by side."""
    jobs = {"pristine": (None, UPSTREAM_CASES),
            "patched": (sglang_overlay, {**UPSTREAM_CASES, **DDTREE_CASES})}

    def one(name):
        overlay, cases = jobs[name]
        code = f"FAKE_POOL_ROWS = {FAKE_POOL_ROWS}\nCASES = {cases!r}\n" + SIZES
        return run_sglang(code, tmp_path_factory.mktemp(f"sizes-{name}"), overlay, triton_interpret=True)

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(one, name) for name in jobs}
        return {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="module")
def pristine(both):
    return both["pristine"]


@pytest.fixture(scope="module")
def patched(both):
    return both["patched"]


@pytest.mark.parametrize("case", list(UPSTREAM_CASES))
def test_upstream_sizes_unchanged(pristine, patched, case):
    assert patched[case] == pristine[case]


def test_upstream_cases_cover_what_they_claim(pristine):
    assert pristine["none"]["algorithm"] is None
    assert pristine["eagle_topk4"]["eagle_topk"] == 4
    assert pristine["eagle_topk4_page16"]["page_size"] == 16
    assert pristine["dflash"]["num_draft_tokens"] == 16
    assert pristine["dflash"]["dflash_decode_reserve"] == 32
    assert pristine["dflash"]["worker_cls"] == "DFlashWorkerV2"
    assert pristine["dflash"]["dummy_target"] == ["DFlashVerifyInput", 16, False]
    assert pristine["ngram"]["algorithm"] == "NGRAM"
    assert pristine["standalone"]["algorithm"] == "STANDALONE"


def max_capture_bs(sizes: dict) -> int:
    """get_batch_sizes_to_capture at TP 1: the decode graph sizes, clamped to the
    req_to_token pool (which is then captured itself)."""
    return min(max(sizes["cuda_graph_decode_bs"]), FAKE_POOL_ROWS)


@pytest.mark.parametrize("budget", [64, 7, 256])
def test_ddtree_sizes_formulas(patched, budget):
    s = patched[f"ddtree_b{budget}"]
    dflash = patched["dflash"]
    block, W, ps = 16, budget + 1, 1
    assert (s["algorithm"], s["ddtree_budget"], s["ddtree_topk_cap"]) == ("DFLASH", budget, min(4, budget))
    assert (s["num_draft_tokens"], s["num_steps"], s["eagle_topk"], s["page_size"]) == (block, 1, 1, ps)
    width = max(block, W)                       # widest per-request verify
    reserve = block + max(W, block)             # ddtree_decode_reserve
    assert s["max_speculative_num_draft_tokens"] == width
    assert s["resolve_max_speculative_num_draft_tokens"] == width
    assert s["verify_tokens_target"] == s["verify_tokens_target_at_n"] == W
    assert s["verify_tokens_draft"] == s["verify_tokens_draft_at_n"] == block
    assert s["alloc_len_per_decode"] == width    # max(steps * topk, max draft tokens)
    assert s["alloc_reserve_per_decode"] == 2 * width
    assert s["alloc_reserve_per_decode"] >= reserve  # the retract/admit estimate covers it
    assert s["dflash_decode_reserve"] == reserve
    assert s["req_to_token_extra_context_len"] == max(4 + width, reserve + ps - 1) == reserve
    bs = max_capture_bs(s)
    assert bs == max_capture_bs(dflash)
    assert s["logits_rows_target"] == bs * W
    assert s["logits_rows_draft"] == bs * block == dflash["logits_rows_target"]
    assert s["worker_cls"] == "DDTreeWorkerV2"
    # upstream's bound at the tree's width: the largest graph batch, capped by max-running-requests
    assert s["prewarm_batch_size"] == min(s["logits_rows_target"] // W, s["max_running_requests"]) == 48
    # warm-up and autotune verify W tokens per request through the mask, as serving does
    assert s["dummy_target"] == ["DFlashVerifyInput", W, True]
    assert s["dummy_draft"] == dflash["dummy_draft"] == ["DFlashVerifyInput", block, False]


def test_ddtree_prewarms_as_upstream_bounds_it_at_the_tree_width(patched):
    """CT200's shape: graphs up to 8 requests, eager batches up to 48. The sampled verify is
    rehearsed as upstream bounds its own (the largest graph batch: what the graph pool lends
    for), at W = 17 rows a request: 8, not 2.1's 48 (max-running-requests, 6x the probability
    matrices reserved at start-up)."""
    s = patched["ddtree_b16_graph8"]
    assert s["cuda_graph_decode_bs"][-1] == 8 and s["logits_rows_target"] == 8 * 17
    assert s["max_running_requests"] == 48
    assert s["prewarm_batch_size"] == s["logits_rows_target"] // 17 == 8


def test_ddtree_b64_numbers(patched):
    """The README's numbers for budget 64, top-k cap 4, block 16, page size 1."""
    s = patched["ddtree_b64"]
    assert s["verify_tokens_target"] == 65 and s["verify_tokens_draft"] == 16
    assert s["max_speculative_num_draft_tokens"] == 65
    assert s["dflash_decode_reserve"] == 81
    assert s["req_to_token_extra_context_len"] == 81  # upstream DFLASH: 20
    assert s["alloc_len_per_decode"] == 65 and s["alloc_reserve_per_decode"] == 130
    assert s["logits_rows_target"] == max_capture_bs(s) * 65 == 48 * 65
    assert s["logits_rows_draft"] == 48 * 16
    assert s["prewarm_batch_size"] == 48
