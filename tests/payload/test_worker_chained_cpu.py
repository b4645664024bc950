"""Consecutive decode steps of the real ``DDTreeWorkerV2`` on CPU: the step CHAINS.

test_worker_decode_cpu proves one step; this file runs STEPS greedy steps in a row
for a batch of three requests (different prefix lengths), in .venv-sglang with the
patch overlay (one subprocess), and feeds each result into the next step as the
non-overlap scheduler does: ``batch.seq_lens = result.new_seq_lens``,
``batch.spec_info = result.next_draft_input`` (its ``bonus_tokens`` are the next
root), ``req.kv.kv_committed_len += accept_lens``, then the scheduler's own
``ScheduleBatch.prepare_for_decode`` -> ``spec_prepare_for_decode`` -> the patched
``DFlashDraftInputV2.prepare_for_decode`` -> ``alloc_for_spec_decode`` (real
allocator, ``assign_req_to_token_pool`` in Triton's interpreter) reserves the next
window.

Real: as test_worker_decode_cpu (pools, allocator, translators, ``ForwardBatch``,
``prepare_for_verify``, SGLang's index kernels in Triton's interpreter,
``eagle_sample``'s greedy path, the KV move) plus the reservation above and a
disabled ``UnifiedRadixCache`` as the batch's tree cache. Faked: the same objects
as there (``worker_fakes`` helpers: runtime, kernel patches, ``record_stream``),
with a different toy pair defined here:

* toy LM: ``toy_next(tokens, pos)`` = a rolling hash of the WHOLE sequence and
  the position of its last token. The fake target reads each node's context from
  the real KV pool (layer-0 K column 0 of ``req_to_token[row, j]`` for every
  prefix slot the node's custom-mask row attends to) and its path from the mask,
  and writes ``marker(token, position, hash of the sequence up to it)`` as the
  node's KV through the pool's write door. So a wrong KV move, a wrong root or a
  wrong position in an earlier step changes every later token.
* toy draft: reads the same context, follows the toy LM's true chain from the
  root and puts the true token at rank 0, rank 1 or outside its top-k (a hash),
  so steps accept 1..block tokens and accept non-first siblings (a non-trivial
  KV move). ``lm_head`` is the identity: draft hidden states are its logits.

Reference (here, independent of the worker): plain autoregressive greedy
decoding of the toy LM from prompt + first root. Asserts: the committed tokens
over all steps equal it, lengths add up (accept_lens, new_seq_lens,
kv_committed_len, next root = last committed token), the pool holds the marker of
the reference token at every committed position, each reservation covers the next
verify window. Controls: a worker whose next draft input carries the previous
root instead of the new bonus, and one whose KV move is a no-op, break the
equality.
"""

from __future__ import annotations

import inspect
import pathlib

import pytest

from sglang_env import run_sglang

pytestmark = pytest.mark.sglang

HERE = pathlib.Path(__file__).resolve().parent

STEPS = 5
PREFIXES = [7, 12, 4]
CASE = {"budget": 8, "cap": 3, "block": 5}


# -- the toy LM (its source is also pasted into the subprocess) -----------------

def seq_hash(tokens) -> int:
    h = 17
    for t in tokens:
        h = (h * 131 + int(t) + 1) % 999_983
    return h


def toy_next(tokens, pos) -> int:
    """Greedy next token of the toy LM after ``tokens`` whose last one sits at
    ``pos`` (== len(tokens) - 1 when the positions are right); never MASK_ID (49)."""
    return (seq_hash(tokens) * 7 + 31 * int(pos) + 3) % 49


def marker(token, pos, h, layer):
    """The toy target's KV of a token: (k row, v row)."""
    k = [float(token), float(pos), float(h), float(layer + 1)]
    v = [-float(token), float(pos), -float(h), float(layer + 2)]
    return k, v


TOY = "\n\n".join(inspect.getsource(f) for f in (seq_hash, toy_next, marker))


def reference(prompt, root, n):
    seq = list(prompt) + [root]
    while len(seq) < len(prompt) + 1 + n:
        seq.append(toy_next(seq, len(seq) - 1))
    return seq


HARNESS = r'''
sys.path.insert(0, HERE)
import worker_fakes as wf  # first: TRITON_INTERPRET / SGLANG_NATIVE_MOVE_KV_CACHE
from array import array
from types import SimpleNamespace

import torch

''' + TOY + r'''

def draft_rank(tokens, d):
    """Where the toy draft puts the true token at depth d: 0, 1 or None."""
    r = (seq_hash(tokens) + 5 * d) % 6
    return 0 if r < 3 else (1 if r < 5 else None)


def run_chain(*, budget, cap, block, prefixes, steps, mutation=None):
    from sglang.kernels.ops.speculative import cache_locs  # noqa: F401
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunnerOutput
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative import ddtree_worker
    from sglang.srt.speculative.ddtree_kv import ddtree_decode_reserve
    from sglang.srt.speculative.ddtree_worker import DDTreeConfig, get_ddtree_worker_cls
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    V, MASK, L, HD = wf.V, wf.MASK_ID, wf.TARGET_LAYERS, wf.HEAD_DIM
    wf._setup_runtime(budget, cap, block, MODEL)
    wf._patch_kernels(mutation == "no_kv_move")  # the mutation: the accepted-KV move skipped
    accepted = []  # per step: accept_index rows (global node ids, -1 padded)
    wf.record_accepts(accepted)

    ddtree_worker._WORKER_CLS = None
    cls = get_ddtree_worker_cls()

    cfg = DDTreeConfig(budget, cap, block)
    W = cfg.verify_width
    bs = len(prefixes)
    dev = "cpu"
    reserve = ddtree_decode_reserve(block, budget)

    # -- pools, cache, requests after their prefill ------------------------------
    pool_slots = 512
    pools = wf.make_pools(rows=bs + 2, slots=pool_slots, context=wf.CONTEXT, head_dim=HD,
                          target_layers=L, dev=dev)
    req_pool, kv_pool, draft_pool, allocator = pools.req_pool, pools.kv_pool, pools.draft_pool, pools.allocator
    params = CacheInitParams(disable=True, req_to_token_pool=req_pool,
                             token_to_kv_pool_allocator=allocator, page_size=1)
    params.tree_components = (ComponentType.FULL,)
    tree_cache = UnifiedRadixCache(params)
    target_translator, draft_translator = pools.target_translator, pools.draft_translator

    prompts = [[(5 * b + 3 * j + 1) % (V - 1) for j in range(n)] for b, n in enumerate(prefixes)]
    roots = [toy_next(p, len(p) - 1) for p in prompts]  # the prefill's sampled token
    reqs = [Req(f"c{b}", "", array("i", prompts[b]),
                SamplingParams(temperature=0.0, max_new_tokens=64), vocab_size=V)
            for b in range(bs)]
    rows = req_pool.alloc(list(reversed(reqs)))
    rows = list(reversed(rows))
    for b, (r, row) in enumerate(zip(reqs, rows)):  # prefill: prompt KV, exact allocation
        n = prefixes[b]
        slots = allocator.alloc(n)
        slots = slots[torch.randperm(n, generator=torch.Generator().manual_seed(b))]
        req_pool.write((row, slice(0, n)), slots.to(torch.int32))
        r.kv.kv_committed_len = r.kv.kv_allocated_len = n
        for j, s in enumerate(slots.tolist()):
            for layer in range(L):
                k, v = marker(prompts[b][j], j, seq_hash(prompts[b][: j + 1]), layer)
                kv_pool.k_buffer[layer][s, 0] = torch.tensor(k)
                kv_pool.v_buffer[layer][s, 0] = torch.tensor(v)
    req_to_token = req_pool.req_to_token
    rpi = torch.tensor(rows, dtype=torch.int64)
    prefix_t = torch.tensor(prefixes, dtype=torch.int64)

    batch = ScheduleBatch(
        reqs=reqs, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator,
        tree_cache=tree_cache, device=dev, forward_mode=ForwardMode.DECODE,
        req_pool_indices=rpi, seq_lens=wf.stream_recorded(prefix_t.clone()),
        orig_seq_lens=prefix_t.to(torch.int32), seq_lens_cpu=prefix_t.clone(),
        seq_lens_sum=int(prefix_t.sum()), spec_algorithm=SpeculativeAlgorithm.DFLASH,
        spec_info=make_draft_input_v2(bonus_tokens=torch.tensor(roots), new_seq_lens=prefix_t.clone()),
    )
    batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, V)

    # -- the toy pair --------------------------------------------------------------
    eye = torch.eye(V)
    calls = {"append": [], "target": 0, "draft": 0}
    model_config = SimpleNamespace(context_len=wf.CONTEXT, vocab_size=V, model_is_mrope=False,
                                   hidden_size=V, is_matryoshka=False,
                                   requires_mm_token_modalities=False)

    class AttnBackend:
        def init_forward_metadata(self, fb):
            pass

    def context(row, slots_mask):
        slots = req_to_token[row, : slots_mask.numel()].long()[slots_mask]
        return [int(round(x)) for x in kv_pool.k_buffer[0][slots, 0, 0].tolist()]

    def target_forward(batch=None, forward_batch=None, is_verify=False, **kw):
        fb = forward_batch
        assert is_verify and fb.forward_mode == ForwardMode.TARGET_VERIFY
        calls["target"] += 1
        mask = fb.spec_info.custom_mask
        logits = torch.full((bs * W, V), -2.0)
        new_k = torch.zeros(L, bs * W, 1, HD)
        new_v = torch.zeros(L, bs * W, 1, HD)
        seqs = fb.seq_lens_cpu.tolist()  # verify host lengths: prefix + W (mirrored)
        off = 0
        for b in range(bs):
            p = int(fb.seq_lens[b])
            assert seqs[b] == p + W, (seqs, p)
            m = mask[off:off + W * (p + W)].view(W, p + W)
            off += W * (p + W)
            toks = fb.input_ids[b * W:(b + 1) * W].tolist()
            anc = m[:, p:]
            depth = (anc.sum(dim=1) - 1).tolist()
            row = int(fb.req_pool_indices[b])
            for i in range(W):
                chain = sorted((j for j in range(W) if anc[i, j]), key=lambda j: depth[j])
                # every node sees the whole prefix: the worker writes only the mask's
                # tree window (the kernel never reads the prefix part)
                seq = context(row, torch.ones(p, dtype=torch.bool)) + [toks[c] for c in chain]
                pos = int(fb.positions[b * W + i])
                logits[b * W + i, toy_next(seq, pos)] = 3.0
                for layer in range(L):
                    k, v = marker(toks[i], pos, seq_hash(seq), layer)
                    new_k[layer, b * W + i, 0] = torch.tensor(k)
                    new_v[layer, b * W + i, 0] = torch.tensor(v)
        for layer in range(L):
            kv_pool.set_kv_buffer(SimpleNamespace(layer_id=layer), KVWriteLoc.for_batch(fb),
                                  new_k[layer], new_v[layer])
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=logits,
                                                hidden_states=torch.zeros(bs * W, 4)),
            can_run_cuda_graph=False,
        )

    def draft_forward(fb):
        calls["draft"] += 1
        ids = fb.input_ids.view(bs, block)
        pos = fb.positions.view(bs, block)
        hs = torch.zeros(bs, block, V)
        for b in range(bs):
            p = int(fb.seq_lens[b])
            seq = context(int(fb.req_pool_indices[b]), torch.ones(p, dtype=torch.bool)) + [int(ids[b, 0])]
            for d in range(1, block):
                true = toy_next(seq, int(pos[b, d - 1]))
                rank = draft_rank(seq, d)
                others = [t for t in sorted(range(V - 1), key=lambda t: (t * 7919 + seq_hash(seq) + d) % 997)
                          if t != true][:cap]
                cand = others[:rank] + [true] + others[rank:] if rank is not None else others
                for r, t in enumerate(cand[:cap]):
                    hs[b, d, t] = 5.0 - r * (1.3 + 0.05 * d)
                seq = seq + [true]
        return ModelRunnerOutput(
            logits_output=LogitsProcessorOutput(next_token_logits=None, hidden_states=hs.view(bs * block, V)),
            can_run_graph=False,
        )

    def append_draft_kv(**kw):
        calls["append"].append({"positions": kw["positions"].tolist(),
                                "commit_lens": kw["commit_lens"].tolist()})

    worker = wf.make_worker(
        cls, cfg=cfg, block=block, mask_id=MASK, dev=dev, lm_weight=eye, embed=wf.embed_table().float(),
        model_config=model_config, req_pool=req_pool, allocator=allocator, kv_pool=kv_pool,
        target_translator=target_translator, draft_translator=draft_translator, draft_pool=draft_pool,
        attn_backend=AttnBackend(), target_forward=target_forward, draft_forward=draft_forward,
        append_draft_kv=append_draft_kv,
    )
    state = {}  # the running step's root (batch.spec_info is the verify input by the commit)
    if mutation == "stale_root":  # next draft input carries this step's root, not the bonus
        make_next = worker._make_next_draft_input_decode

        def stale(*, bonus_tokens, new_seq_lens):
            return make_next(bonus_tokens=state["root"].clone(), new_seq_lens=new_seq_lens)

        worker._make_next_draft_input_decode = stale
    elif mutation not in (None, "no_kv_move"):
        raise ValueError(mutation)

    # -- the chain (non-overlap scheduler order) -------------------------------------
    log = {"tokens": [], "accept_lens": [], "new_seq_lens": [], "next_bonus": [], "committed": [],
           "allocated": [], "seq_lens_cpu": [], "window_ok": [], "roots": []}
    for step in range(steps):
        batch.prepare_for_decode()  # the scheduler's: spec_info.prepare_for_decode (reservation)
        log["allocated"].append([r.kv.kv_allocated_len for r in reqs])
        log["seq_lens_cpu"].append(batch.seq_lens_cpu.tolist())
        free = set(allocator.free_pages.tolist()) | set(allocator.release_pages.tolist())
        wins = [req_to_token[rows[b], : int(batch.seq_lens[b]) + W].tolist() for b in range(bs)]
        flat = [s for w in wins for s in w]
        log["window_ok"].append(len(flat) == len(set(flat)) and not (set(flat) & free))
        log["roots"].append(batch.spec_info.bonus_tokens.tolist())
        state["root"] = batch.spec_info.bonus_tokens
        result = worker.forward_batch_generation(batch)
        acc = result.accept_lens.tolist()
        toks = result.next_token_ids.view(bs, block).tolist()
        log["tokens"].append([toks[b][: acc[b]] for b in range(bs)])
        log["accept_lens"].append(acc)
        log["new_seq_lens"].append(result.new_seq_lens.tolist())
        log["next_bonus"].append(result.next_draft_input.bonus_tokens.tolist())
        # process_batch_result (non-overlap): commit, then the next step's inputs
        for r, a in zip(reqs, acc):
            r.kv.kv_committed_len += int(a)
        log["committed"].append([r.kv.kv_committed_len for r in reqs])
        batch.seq_lens = wf.stream_recorded(result.new_seq_lens.clone())
        batch.spec_info = result.next_draft_input

    final = [int(x) for x in batch.seq_lens.tolist()]
    kv = [[[kv_pool.k_buffer[layer][s, 0].tolist() for s in req_to_token[rows[b], :final[b]].tolist()]
           for layer in range(L)] for b in range(bs)]
    kvv = [[[kv_pool.v_buffer[layer][s, 0].tolist() for s in req_to_token[rows[b], :final[b]].tolist()]
            for layer in range(L)] for b in range(bs)]
    log.update(prompts=prompts, first_roots=roots, final_seq_lens=final, kv_k=kv, kv_v=kvv,
               accepted=[[[i - b * W for i in row if i >= 0] for b, row in enumerate(a)] for a in accepted],
               append=calls["append"], target_calls=calls["target"], draft_calls=calls["draft"],
               W=W, reserve=reserve)
    return log


import time
T0 = time.time()
OUT["ok"] = run_chain(**CASE, prefixes=PREFIXES, steps=STEPS)
OUT["stale_root"] = run_chain(**CASE, prefixes=PREFIXES, steps=STEPS, mutation="stale_root")
OUT["no_kv_move"] = run_chain(**CASE, prefixes=PREFIXES, steps=STEPS, mutation="no_kv_move")
OUT["seconds"] = round(time.time() - T0, 1)
'''


@pytest.fixture(scope="module")
def chains(tmp_path_factory, sglang_overlay):  # noqa: F811
    code = (f"HERE = {str(HERE)!r}\nCASE = {CASE!r}\nPREFIXES = {PREFIXES!r}\nSTEPS = {STEPS}\n"
            + HARNESS)
    out = run_sglang(code, tmp_path_factory.mktemp("chained"), sglang_overlay, timeout=300, triton_interpret=True)
    print(f"chained harness: {out['seconds']} s")
    return out


def committed_tokens(log) -> list:
    return [[t for step in log["tokens"] for t in step[b]] for b in range(len(PREFIXES))]


def check_chain(log) -> None:
    """Every assertion of the chain against the independent reference."""
    bs = len(PREFIXES)
    got = committed_tokens(log)
    for b in range(bs):
        n = len(got[b])
        ref = reference(log["prompts"][b], log["first_roots"][b], n)
        assert got[b] == ref[PREFIXES[b] + 1:], f"request {b}: committed tokens != greedy reference"


def check_bookkeeping(log) -> None:
    block, W = CASE["block"], log["W"]
    seq = list(PREFIXES)
    for step in range(STEPS):
        acc = log["accept_lens"][step]
        assert log["seq_lens_cpu"][step] == seq, "prepare_for_decode mirrors the committed lengths"
        assert all(a >= seq[b] + log["reserve"] for b, a in enumerate(log["allocated"][step]))
        assert log["window_ok"][step], "verify windows: distinct, allocated slots"
        assert all(1 <= a <= block for a in acc)
        assert [len(t) for t in log["tokens"][step]] == acc
        seq = [s + a for s, a in zip(seq, acc, strict=True)]
        assert log["new_seq_lens"][step] == seq and log["committed"][step] == seq
        assert log["next_bonus"][step] == [t[-1] for t in log["tokens"][step]], "next root = last token"
        if step + 1 < STEPS:
            assert log["roots"][step + 1] == log["next_bonus"][step]
        app = log["append"][step]
        assert app["commit_lens"] == acc
        prev = log["new_seq_lens"][step - 1] if step else list(PREFIXES)
        assert app["positions"] == [p + j for p in prev for j in range(block)]
        assert all(s + W <= 96 for s in seq), "the context is never reached"
    assert log["final_seq_lens"] == seq
    assert log["target_calls"] == STEPS and log["draft_calls"] == STEPS


def check_kv(log) -> None:
    """At every committed position q of every request: the marker of the
    reference token at q (token, position, hash of the sequence up to it)."""
    bad = []
    for b in range(len(PREFIXES)):
        n = log["final_seq_lens"][b]
        ref = reference(log["prompts"][b], log["first_roots"][b], n - PREFIXES[b])
        for layer in range(2):
            for q in range(n):
                k, v = marker(ref[q], q, seq_hash(ref[: q + 1]), layer)
                if log["kv_k"][b][layer][q] != k or log["kv_v"][b][layer][q] != v:
                    bad.append((b, layer, q, log["kv_k"][b][layer][q], k))
    assert not bad, f"{len(bad)} KV rows differ, first: {bad[:3]}"


def test_chain_scenario_exercises_the_step(chains):
    """The data cover what the chain checks are for."""
    log = chains["ok"]
    lens = {a for step in log["accept_lens"] for a in step}
    assert 1 in lens and CASE["block"] in lens and len(lens) >= 4, lens
    # a step whose k-th accepted node is not node k: the KV move is not a no-op
    assert any(i != k for step in log["accepted"] for row in step for k, i in enumerate(row))
    assert len(set(PREFIXES)) == len(PREFIXES)


def test_greedy_chain_matches_autoregressive_reference(chains):
    log = chains["ok"]
    check_bookkeeping(log)
    check_chain(log)
    check_kv(log)


@pytest.mark.parametrize("mutation", ["stale_root", "no_kv_move"])
def test_mutations_break_the_chain(chains, mutation):
    log = chains[mutation]
    with pytest.raises(AssertionError, match="greedy reference"):
        check_chain(log)
