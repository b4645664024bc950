"""The real ``DDTreeWorkerV2`` driven by SGLang 0.5.23's OVERLAP scheduler loop on CPU.

Imported only in .venv-sglang (sglang 0.5.23 + the patch overlay), inside the
subprocess of test_worker_overlap_cpu; it imports ``worker_fakes`` first (its
environment switches are read at import time). :func:`run_overlap` returns plain
lists; the test asserts on them.

Real (SGLang 0.5.23 + patch set), called by 0.5.23's own ``event_loop_overlap``
in its order: ``get_next_batch_to_run`` (``filter_batch``) ->
``update_running_batch`` (``_reqs_finishing_inflight``, ``check_decode_mem``) ->
``ScheduleBatch.prepare_for_decode`` -> ``spec_prepare_for_decode`` -> the patched
``DFlashDraftInputV2.prepare_for_decode`` (reservation from the LAGGED host
``kv_committed_len``, real allocator and ``alloc_for_spec_decode``);
``is_disable_overlap_for_batch``; ``run_batch``'s overlap branch
(``FutureMap.resolve_seq_lens_cpu``, ``resolve_forward_inputs`` ->
``FutureMap._resolve_spec_extras``, ``_forward_isolation`` /
``record_batch_in_overlap``, ``on_publish`` = ``FutureMap.publish``,
``_relay_forward_payload`` -> ``FutureMap.stash``, ``_copy_result_to_cpu`` ->
``GenerationBatchResult.copy_to_cpu``, the next draft input's
``future_indices``); ``batch.copy()`` into the result queue; the one-step-late
``process_batch_result`` -> ``SchedulerBatchResultProcessor.process_batch_result_decode``
(``copy_done``, ``_resolve_spec_v2_tokens``: ``kv_committed_len += accept``,
``output_ids``, ``update_finish_state``, ``release_kv_cache`` of a finished
request); ``launch_batch_sample_if_needed``. The FutureMap is
``SpeculativeAlgorithm.DFLASH.create_future_map``'s, with its CI checks
(``SGLANG_IS_IN_CI``: poisoned buffers, consume-once publish) on in the main
runs; their compiled helper runs eagerly. The worker step and everything below
it as in test_worker_chained_cpu (``worker_fakes``).

Faked (cannot run here, or telemetry): the models (:class:`ToyPair`: the toy
LM of test_worker_chained_cpu, imported, reading its context from the real KV
pool); CUDA streams and events (``torch.cpu``'s Stream / Event: the CPU runs
every op when it is issued, so this proves the ORDER of the overlap loop, not GPU
asynchrony; ``async_d2h`` returns the device tensor itself on the CPU, so a
result the next step overwrote before it was processed shows up as wrong
tokens); ``Tensor.record_stream`` (no CPU kernel: :class:`ModelWorkerShim` hands
the worker a ``StreamRecordedTensor``); request intake (``ingest_requests``: after
``steps`` launches it parks the running batch, so the loop processes the last
result and exits); prefill admission (``get_new_batch_prefill``: the waiting
queue is empty); metrics, load publishing, output streaming, trace hooks. The
prefill is not run: its effect on the overlap state is set up by the real calls
its ``run_batch`` makes (``FutureMap.publish`` of the prompt lengths,
``_relay_forward_payload`` of its next draft input).
"""

from __future__ import annotations

import traceback
from array import array
from types import SimpleNamespace

import worker_fakes as wf  # isort: skip (first: it sets TRITON_INTERPRET / SGLANG_NATIVE_MOVE_KV_CACHE)

import torch
from test_worker_chained_cpu import marker, seq_hash, toy_next

MUTATIONS = (
    "stale_seq_lens",  # run_batch skips FutureMap.resolve_seq_lens_cpu: last step's device lengths
    "lagged_host_lens",  # device lengths resolved, host mirror left at prepare_for_decode's lagged seed
    "no_relay_stash",  # the next root is never stashed: the resolve hands the worker a stale root
    "skipped_resolve",  # run_batch skips FutureMap._resolve_spec_extras: the carried, unfiltered root
    "upstream_reserve",  # DFlash's own 2 * block reservation: no room for the lag + the tree width
)


def _noop(*a, **k):
    return None


def draft_rank(tokens, d):
    """Where the toy draft puts the true token at depth d: 0, 1 or None
    (outside its top-k), so steps accept 1..block tokens and non-first siblings."""
    r = (seq_hash(tokens) + 5 * d) % 6
    return 0 if r < 3 else (1 if r < 5 else None)


class ToyPair:
    """The toy target and draft forwards over the real pools. Both read a
    request's context from layer-0 K column 0 of its prefix slots: the whole
    prefix (in TARGET_VERIFY the triton kernel shows every node all of it), the
    tree from the window part of each FULL_MASK block (blocks at offsets from
    the exact device lengths). The target writes ``marker(token, position,
    hash of the sequence)`` as each node's KV through the pool's write door."""

    def __init__(self, *, W, block, cap, kv_pool, req_to_token, log):
        self.W, self.block, self.cap = W, block, cap
        self.kv_pool, self.req_to_token, self.log = kv_pool, req_to_token, log

    def context(self, row, p):
        slots = self.req_to_token[row, :p].long()
        return [int(round(x)) for x in self.kv_pool.k_buffer[0][slots, 0, 0].tolist()]

    def target(self, batch=None, forward_batch=None, is_verify=False, **kw):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.utils import GenerationBatchResult
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        fb, W = forward_batch, self.W
        assert is_verify and fb.forward_mode == ForwardMode.TARGET_VERIFY
        bs, layers = fb.batch_size, len(self.kv_pool.k_buffer)
        logits = torch.full((bs * W, wf.V), -2.0)
        new_k = torch.zeros(layers, bs * W, 1, wf.HEAD_DIM)
        new_v = torch.zeros(layers, bs * W, 1, wf.HEAD_DIM)
        prefix = [int(x) for x in fb.seq_lens.tolist()]
        self.log["verify"].append({"host": [int(x) for x in fb.seq_lens_cpu.tolist()], "prefix": prefix})
        mask, off = fb.spec_info.custom_mask, 0
        for b, p in enumerate(prefix):
            anc = mask[off:off + W * (p + W)].view(W, p + W)[:, p:].bool()
            off += W * (p + W)
            toks = fb.input_ids[b * W:(b + 1) * W].tolist()
            depth = (anc.sum(dim=1) - 1).tolist()
            ctx = self.context(int(fb.req_pool_indices[b]), p)
            for i in range(W):
                chain = sorted((j for j in range(W) if anc[i, j]), key=lambda j: depth[j])
                seq = ctx + [toks[c] for c in chain]
                pos = int(fb.positions[b * W + i])
                logits[b * W + i, toy_next(seq, pos)] = 3.0
                for layer in range(layers):
                    k, v = marker(toks[i], pos, seq_hash(seq), layer)
                    new_k[layer, b * W + i, 0] = torch.tensor(k)
                    new_v[layer, b * W + i, 0] = torch.tensor(v)
        for layer in range(layers):
            self.kv_pool.set_kv_buffer(SimpleNamespace(layer_id=layer), KVWriteLoc.for_batch(fb),
                                       new_k[layer], new_v[layer])
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=logits, hidden_states=torch.zeros(bs * W, 4)),
            can_run_cuda_graph=False,
        )

    def draft(self, fb):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.model_executor.model_runner import ModelRunnerOutput

        bs, block, cap = fb.batch_size, self.block, self.cap
        ids, pos = fb.input_ids.view(bs, block), fb.positions.view(bs, block)
        hs = torch.zeros(bs, block, wf.V)
        for b in range(bs):
            seq = self.context(int(fb.req_pool_indices[b]), int(fb.seq_lens[b])) + [int(ids[b, 0])]
            for d in range(1, block):
                true = toy_next(seq, int(pos[b, d - 1]))
                rank = draft_rank(seq, d)
                others = [t for t in sorted(range(wf.V - 1), key=lambda t: (t * 7919 + seq_hash(seq) + d) % 997)
                          if t != true][:cap]
                cand = others[:rank] + [true] + others[rank:] if rank is not None else others
                for r, t in enumerate(cand[:cap]):
                    hs[b, d, t] = 5.0 - r * (1.3 + 0.05 * d)
                seq = seq + [true]
        return ModelRunnerOutput(
            logits_output=LogitsProcessorOutput(next_token_logits=None, hidden_states=hs.view(bs * block, wf.V)),
            can_run_graph=False,
        )


class ModelWorkerShim:
    """The scheduler's ``model_worker``: calls the real worker. Torch has no CPU
    kernel for ``record_stream`` (the worker's first line), so ``batch.seq_lens``
    (the FutureMap's gather) is viewed as a ``StreamRecordedTensor``. Records
    what the worker is handed (after the scheduler's resolves) and returns."""

    def __init__(self, worker, *, req_to_token, allocator, W, log):
        self.worker, self.req_to_token, self.allocator, self.W, self.log = worker, req_to_token, allocator, W, log

    def window_ok(self, batch, prefix):
        """Every request's verify window ``req_to_token[row, p : p + W]`` is
        distinct, allocated slots inside its own reservation."""
        free = set(self.allocator.free_pages.tolist()) | set(self.allocator.release_pages.tolist())
        rows = [int(x) for x in batch.req_pool_indices.tolist()]
        flat = [s for r, p in zip(rows, prefix, strict=True) for s in self.req_to_token[r, p:p + self.W].tolist()]
        inside = all(p + self.W <= r.kv.kv_allocated_len for p, r in zip(prefix, batch.reqs, strict=True))
        return len(flat) == len(set(flat)) and 0 not in flat and not (set(flat) & free) and inside

    def forward_batch_generation(self, batch, **kw):
        prefix = [int(x) for x in batch.seq_lens.tolist()]
        spec = batch.spec_info
        self.log["launch"].append({
            "rids": [r.rid for r in batch.reqs], "prefix": prefix,
            "committed": [r.kv.kv_committed_len for r in batch.reqs],
            "seq_lens_cpu": None if batch.seq_lens_cpu is None else [int(x) for x in batch.seq_lens_cpu],
            "nxt_kv_lens_cpu": None if spec.nxt_kv_lens_cpu is None else [int(x) for x in spec.nxt_kv_lens_cpu],
            "root": [int(x) for x in spec.bonus_tokens.tolist()],
            "window_ok": self.window_ok(batch, prefix), "kwargs": sorted(kw),
        })
        batch.seq_lens = wf.stream_recorded(batch.seq_lens)
        result = self.worker.forward_batch_generation(batch, **kw)
        self.log["returned"].append({
            "next_token_ids": result.next_token_ids.clone(), "accept_lens": result.accept_lens.clone(),
            "new_seq_lens": [int(x) for x in result.new_seq_lens.tolist()],
            "next_root": [int(x) for x in result.next_draft_input.bonus_tokens.tolist()],
        })
        return result


def _scheduler_cls():
    """A class whose scheduling methods ARE 0.5.23's ``Scheduler`` functions
    (the same function objects), plus the faked intake and telemetry."""
    from sglang.srt.managers.schedule_batch import NextBatchPlan, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

    real = ("event_loop_overlap", "get_next_batch_to_run", "update_running_batch",
            "_reqs_finishing_inflight", "is_disable_overlap_for_batch", "run_batch",
            "_forward_isolation", "record_batch_in_overlap", "_relay_forward_payload",
            "_copy_result_to_cpu", "launch_batch_sample_if_needed", "process_batch_result",
            "_apply_war_barrier", "_advance_pending_grammar", "process_pending_chunked_abort",
            "_process_hicache_events", "_should_defer_prefill", "_arm_prefill_decode_interval",
            "publish_load_snapshot", "_maybe_report_active_ranks", "_maybe_clear_mm_inputs",
            "maybe_send_health_check_signal")
    methods = {name: Scheduler.__dict__[name] for name in real}

    def ingest_requests(self, stop_at_pause=False):
        if self.launched >= self.steps and not self.running_batch.is_empty():
            self.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)  # the client stops
        elif self.launched >= self.steps and self.last_batch is None:
            self.gracefully_exit = True  # every result processed
        return []

    def get_new_batch_prefill(self, running_batch):
        return NextBatchPlan(batch_to_run=None, running_batch=running_batch)

    methods.update(ingest_requests=ingest_requests, get_new_batch_prefill=get_new_batch_prefill,
                   on_idle=_noop, _record_step_counters=_noop)
    return type("OverlapScheduler", (), methods)


def _result_processor(*, allocator, tree_cache, req_pool, model_config, worker):
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )

    metrics = SimpleNamespace(snapshot_spec_decode_metrics=_noop, update_spec_metrics=_noop,
                              report_decode_stats=_noop, num_generated_tokens=0, forward_ct_decode=0)
    return SchedulerBatchResultProcessor(
        is_generation=True, disaggregation_mode=DisaggregationMode.NULL, enable_overlap=True,
        enable_overlap_mlx=False, model_config=model_config, token_to_kv_pool_allocator=allocator,
        tree_cache=tree_cache, hisparse_coordinator=None, req_to_token_pool=req_pool,
        decode_offload_manager=None, metrics_collector=None, metrics_reporter=metrics,
        draft_worker=worker, model_worker=worker, logprob_result_processor=None,
        output_streamer=SimpleNamespace(stream_output=_noop), beam_coordinator=None, abort_request=_noop,
    )


def _scheduler(*, steps, batch, future_map, tree_cache, model_worker, result_processor):
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    streams = {name: torch.cpu.Stream() for name in ("schedule", "forward", "copy")}
    ns = SimpleNamespace
    sched = _scheduler_cls()()
    sched.__dict__.update(
        steps=steps, launched=0, scheduler_stage_metrics=None, gracefully_exit=False, _engine_paused=False,
        running_batch=batch, last_batch=None, require_mlp_sync=False, enable_overlap=True,
        enable_unified_memory=False, is_generation=True, _sched_idled=False, forward_ct=0,
        processed_tokens_counter=0, scripted_scheduler_hook=None, forward_sleep_time=None,
        profiler_manager=ns(_profile_batch_predicate=_noop), disaggregation_mode=DisaggregationMode.NULL,
        future_map=future_map, _confidence_budget_prepare=None, device_module=torch.cpu,
        schedule_stream=streams["schedule"], forward_stream=streams["forward"], copy_stream=streams["copy"],
        forward_stream_ctx=torch.cpu.stream(streams["forward"]), copy_stream_ctx=torch.cpu.stream(streams["copy"]),
        batch_record_buf=[None, None], batch_record_ct=0, enable_async_d2h_copy=False, async_d2h_worker=None,
        enable_unified_cache_external_linker=False, attn_dp_enabled=False,
        spec_algorithm=SpeculativeAlgorithm.DFLASH, beam_coordinator=ns(maybe_select_and_relay=_noop),
        enable_pdmux=False, _war_barrier_enabled=False, tree_cache=tree_cache,
        metrics_reporter=ns(record_scheduler_active=_noop, log_batch_result_stats=_noop,
                            update_device_timer=_noop),
        return_health_check_ipcs=[], enable_fpm=False, load_snapshot_writer=None,
        load_publisher=ns(publish_load_stat=_noop), load_inquirer=ns(get_loads=_noop),
        _pending_chunked_abort_req=None, enable_hierarchical_cache=False, enable_hicache_storage=False,
        enable_lmcache=False, dllm_config=None, chunked_req=None, enable_hisparse=False,
        prefill_decode_interval=0, _prefill_decode_interval_remaining=0, is_mixed_chunk=False,
        dp_attn_adapter=ns(maybe_prepare_mlp_sync_batch=lambda b, need_sync=False: b,
                           maybe_convert_decode_to_extend=lambda b: b),
        ngram_embedding_manager=ns(prepare_for_forward=lambda b, chunked_req=None: b),
        new_token_ratio_tracker=ns(decay_step=_noop), decode_offload_manager=None,
        model_worker=model_worker, batch_result_processor=result_processor,
    )
    return sched


def _committed_kv(req, n, *, kv_pool, req_to_token):
    """(k rows, v rows) per layer of a request's first ``n`` positions."""
    slots = req_to_token[req.kv.req_pool_idx, :n].long()
    return ([kv_pool.k_buffer[layer][slots, 0].tolist() for layer in range(len(kv_pool.k_buffer))],
            [kv_pool.v_buffer[layer][slots, 0].tolist() for layer in range(len(kv_pool.v_buffer))])


def _instrument(sched, log, *, kv_pool, req_to_token):
    """Record the loop's order (prepare / launch / process): wrappers on the
    instance that call the real methods unchanged. Before a result is processed,
    the KV each live request is about to commit is read (those positions are
    final: the step already in flight writes past them)."""
    update, run, process = sched.update_running_batch, sched.run_batch, sched.process_batch_result

    def update_running_batch(batch):
        out = update(batch)
        if out is not None and not out.is_empty():
            log["order"].append(["prepare", len(log["prepared"])])
            log["prepared"].append({"committed": [r.kv.kv_committed_len for r in out.reqs],
                                    "nxt_kv_lens_cpu": [int(x) for x in out.spec_info.nxt_kv_lens_cpu]})
        return out

    def run_batch(batch, pp_proxy_tensors=None):
        log["order"].append(["launch", sched.launched])
        sched.launched += 1
        return run(batch)

    def process_batch_result(batch, result):
        n = len(log["processed"])
        log["order"].append(["process", n])
        kv = {}
        for req, a in zip(batch.reqs, result.accept_lens.tolist(), strict=True):
            if not req.finished():
                n_commit = req.kv.kv_committed_len + int(a)
                kv[req.rid] = [n_commit, *_committed_kv(req, n_commit, kv_pool=kv_pool, req_to_token=req_to_token)]
        ret = log["returned"][n]
        log["processed"].append({
            "rids": [r.rid for r in batch.reqs], "kv": kv, "copy_done": result.copy_done is not None,
            "result_unchanged": (torch.equal(result.next_token_ids, ret["next_token_ids"])
                                 and torch.equal(result.accept_lens, ret["accept_lens"])),
        })
        return process(batch, result)

    sched.update_running_batch = update_running_batch
    sched.run_batch = run_batch
    sched.process_batch_result = process_batch_result


def _apply_mutation(mutation, *, future_map):
    """Install a control's fault; returns the undo of module-level patches."""
    from sglang.srt.speculative import dflash_info_v2

    if mutation == "stale_seq_lens":
        future_map.resolve_seq_lens_cpu = _noop
    elif mutation == "lagged_host_lens":
        resolve = future_map.resolve_seq_lens_cpu

        def device_only(batch, stream_ordered=False):
            lagged = (batch.seq_lens_cpu, batch.seq_lens_sum)
            resolve(batch, stream_ordered=stream_ordered)
            batch.seq_lens_cpu, batch.seq_lens_sum = lagged

        future_map.resolve_seq_lens_cpu = device_only
    elif mutation == "no_relay_stash":
        future_map.stash = _noop
    elif mutation == "skipped_resolve":
        future_map._resolve_spec_extras = _noop
    elif mutation == "upstream_reserve":
        real = dflash_info_v2.ddtree_decode_reserve
        dflash_info_v2.ddtree_decode_reserve = lambda block, budget: 2 * int(block)
        return lambda: setattr(dflash_info_v2, "ddtree_decode_reserve", real)
    elif mutation is not None:
        raise ValueError(mutation)
    return _noop


def _debug_future_map(enabled):
    """FutureMap's CI checks (``SGLANG_IS_IN_CI``): poisoned buffers,
    consume-once publish. Their fused helper is ``torch.compile``d: run eagerly."""
    from sglang.srt.managers import overlap_utils

    overlap_utils._DEBUG_ASSERT = bool(enabled)
    fn = overlap_utils._assert_nonneg_and_invalidate
    overlap_utils._assert_nonneg_and_invalidate = getattr(fn, "_torchdynamo_orig_callable", fn)


def _prefilled_requests(*, prefixes, max_new_tokens, pools):
    """Requests right after their prefill: prompt KV (the toy target's markers)
    in randomly placed slots, exact allocation, the sampled root in output_ids."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    V, req_pool, kv_pool = wf.V, pools.req_pool, pools.kv_pool
    prompts = [[(5 * b + 3 * j + 1) % (V - 1) for j in range(n)] for b, n in enumerate(prefixes)]
    roots = [toy_next(p, len(p) - 1) for p in prompts]
    reqs = []
    for b, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens[b])
        params.normalize(None)  # as the tokenizer manager does (no stop strings)
        reqs.append(Req(f"o{b}", "", array("q", prompt), params, vocab_size=V))
    rows = list(reversed(req_pool.alloc(list(reversed(reqs)))))
    for b, (req, row, prompt) in enumerate(zip(reqs, rows, prompts, strict=True)):
        n = len(prompt)
        slots = pools.allocator.alloc(n)[torch.randperm(n, generator=torch.Generator().manual_seed(b))]
        req_pool.write((row, slice(0, n)), slots.to(torch.int32))
        req.kv.kv_committed_len = req.kv.kv_allocated_len = n
        req.output_ids.append(roots[b])
        for j, s in enumerate(slots.tolist()):
            for layer in range(wf.TARGET_LAYERS):
                k, v = marker(prompt[j], j, seq_hash(prompt[: j + 1]), layer)
                kv_pool.k_buffer[layer][s, 0] = torch.tensor(k)
                kv_pool.v_buffer[layer][s, 0] = torch.tensor(v)
    return reqs, rows, prompts, roots


def _decode_batch(reqs, rows, *, pools, tree_cache, model_config):
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    rpi = torch.tensor(rows, dtype=torch.int64)
    lens = torch.tensor([r.kv.kv_committed_len for r in reqs], dtype=torch.int64)
    batch = ScheduleBatch(
        reqs=reqs, req_to_token_pool=pools.req_pool, token_to_kv_pool_allocator=pools.allocator,
        tree_cache=tree_cache, model_config=model_config, device="cpu", forward_mode=ForwardMode.DECODE,
        req_pool_indices=rpi, req_pool_indices_cpu=rpi.clone(), seq_lens=lens.clone(),
        orig_seq_lens=lens.to(torch.int32), seq_lens_cpu=lens.clone(), seq_lens_sum=int(lens.sum()),
        spec_algorithm=SpeculativeAlgorithm.DFLASH, enable_overlap=True,
    )
    batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, wf.V)
    return batch


def _seed_prefill_relay(sched, batch, roots):
    """The overlap state a prefill's ``run_batch`` leaves: its lengths published
    (``on_publish``), its next draft input stashed in the relay and carried by
    future index."""
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

    rpi, lens = batch.req_pool_indices, batch.seq_lens.clone()
    sched.future_map.publish(rpi, lens)
    prefill_input = make_draft_input_v2(bonus_tokens=torch.tensor(roots), new_seq_lens=lens)
    sched._relay_forward_payload(batch, rpi, GenerationBatchResult(next_draft_input=prefill_input))
    batch.spec_info = prefill_input
    batch.spec_info.future_indices = rpi


def _cache(pools):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    params = CacheInitParams(disable=True, req_to_token_pool=pools.req_pool,
                             token_to_kv_pool_allocator=pools.allocator, page_size=1)
    params.tree_components = (ComponentType.FULL,)
    return UnifiedRadixCache(params)


def _worker(*, budget, cap, block, pools, model_config, toy, log):
    from sglang.srt.speculative import ddtree_worker
    from sglang.srt.speculative.ddtree_worker import DDTreeConfig, get_ddtree_worker_cls

    class AttnBackend:
        needs_cpu_seq_lens = False  # triton's (the DDTREE verify backend)

        def init_forward_metadata(self, fb):
            pass

    def append_draft_kv(**kw):
        log["append"].append({"positions": kw["positions"].tolist(), "commit_lens": kw["commit_lens"].tolist()})

    ddtree_worker._WORKER_CLS = None
    return wf.make_worker(
        get_ddtree_worker_cls(), cfg=DDTreeConfig(budget, cap, block), block=block, mask_id=wf.MASK_ID, dev="cpu",
        lm_weight=torch.eye(wf.V), embed=wf.embed_table().float(), model_config=model_config,
        req_pool=pools.req_pool, allocator=pools.allocator, kv_pool=pools.kv_pool,
        target_translator=pools.target_translator, draft_translator=pools.draft_translator,
        draft_pool=pools.draft_pool, attn_backend=AttnBackend(), target_forward=toy.target,
        draft_forward=toy.draft, append_draft_kv=append_draft_kv,
    )


def run_overlap(*, model, budget, cap, block, prefixes, max_new_tokens, steps, needs_cpu_seq_lens,
                mutation=None, debug_future_map=True):
    """``steps`` launches of 0.5.23's overlap loop over requests with these
    prompt lengths and ``max_new_tokens`` (a finishing request leaves the batch
    the overlap way: a step already in flight, then ``filter_batch``), then the
    loop drains. ``needs_cpu_seq_lens``: the FutureMap's host-mirror switch
    (False with DDTREE's triton backends: the worker sees ``seq_lens_cpu=None``)."""
    from sglang.srt.runtime_context import get_schedule
    from sglang.srt.speculative.ddtree_kv import ddtree_decode_reserve
    from sglang.srt.speculative.ddtree_worker import DDTreeConfig
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    wf._setup_runtime(budget, cap, block, model)
    wf._patch_kernels(False)
    accepted = []
    wf.record_accepts(accepted)
    _debug_future_map(debug_future_map)
    W = DDTreeConfig(budget, cap, block).verify_width
    log = {"launch": [], "returned": [], "processed": [], "prepared": [], "verify": [], "append": [],
           "order": []}

    pools = wf.make_pools(rows=len(prefixes) + 2, slots=512, context=wf.CONTEXT, head_dim=wf.HEAD_DIM,
                          target_layers=wf.TARGET_LAYERS, dev="cpu")
    tree_cache = _cache(pools)
    model_config = SimpleNamespace(
        context_len=wf.CONTEXT, vocab_size=wf.V, model_is_mrope=False, hidden_size=wf.V, is_matryoshka=False,
        requires_mm_token_modalities=False, is_encoder_decoder=False, self_opened_think_start_ids=None,
        think_end_ids=None)
    reqs, rows, prompts, roots = _prefilled_requests(prefixes=prefixes, max_new_tokens=max_new_tokens, pools=pools)
    batch = _decode_batch(reqs, rows, pools=pools, tree_cache=tree_cache, model_config=model_config)
    toy = ToyPair(W=W, block=block, cap=cap, kv_pool=pools.kv_pool, req_to_token=pools.req_pool.req_to_token,
                  log=log)
    worker = _worker(budget=budget, cap=cap, block=block, pools=pools, model_config=model_config, toy=toy, log=log)
    future_map = SpeculativeAlgorithm.DFLASH.create_future_map("cpu", pools.req_pool,
                                                               needs_cpu_seq_lens=needs_cpu_seq_lens)
    sched = _scheduler(
        steps=steps, batch=batch, future_map=future_map, tree_cache=tree_cache,
        model_worker=ModelWorkerShim(worker, req_to_token=pools.req_pool.req_to_token, allocator=pools.allocator,
                                     W=W, log=log),
        result_processor=_result_processor(allocator=pools.allocator, tree_cache=tree_cache,
                                           req_pool=pools.req_pool, model_config=model_config, worker=worker),
    )
    _instrument(sched, log, kv_pool=pools.kv_pool, req_to_token=pools.req_pool.req_to_token)
    _seed_prefill_relay(sched, batch, roots)

    error = None
    undo = _apply_mutation(mutation, future_map=future_map)
    try:
        sched.event_loop_overlap()
    except Exception as e:  # a control may break the step itself
        error = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    finally:
        undo()

    returned = [{**r, "next_token_ids": r["next_token_ids"].tolist(), "accept_lens": r["accept_lens"].tolist()}
                for r in log["returned"]]
    return {
        **log, "returned": returned, "error": error, "W": W, "reserve": ddtree_decode_reserve(block, budget),
        "overlap_default": not get_schedule().disable_overlap_schedule,
        "rids": [r.rid for r in reqs], "prompts": prompts, "first_roots": roots,
        "output_ids": [list(r.output_ids) for r in reqs], "finished_len": [r.finished_len for r in reqs],
        "final_committed": [r.kv.kv_committed_len for r in reqs],
        "accepted": [[[i - b * W for i in row if i >= 0] for b, row in enumerate(a)] for a in accepted],
    }
