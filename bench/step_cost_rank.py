"""One tensor-parallel rank of bench/bench_step_cost.py: real decode steps of SGLang 0.5.23's
DFLASH worker (pristine wheel) or of the patch set's DDTREE worker, on toy models, counted.

    .venv-sglang/bin/python bench/step_cost_rank.py SPEC.json OUT.json   (the driver starts it)

The process joins a gloo group of ``tp`` ranks on 127.0.0.1 and builds SGLang's own parallel
groups on it (``init_distributed_environment`` + ``initialize_model_parallel``; the CPU branch of
``GroupCoordinator``, no NCCL), so every collective of the step is a real one between processes.
For each case (batch, temperature) it runs ``steps`` decode steps through
``forward_batch_generation`` and counts every step but the first (``step_counters``).

Real: the worker's whole decode step (DFLASH: ``DFlashWorkerV2.forward_batch_generation`` of
the wheel; DDTREE: the patched class), SGLang's pools, translators, ``ScheduleBatch``,
``SamplingBatchInfo``, ``LogitsProcessor.deferred_argmax`` / ``finish_deferred_gather``, DFLASH's
in-graph draft head ``_DflashDraftSampler`` and its Triton block/accept kernels (Triton's
interpreter), DDTREE's tree step and its graph runner (replayed through ``ReplayedCall``),
``eagle_sample``, the parallel groups. Stand-ins, the same for both algorithms: the target and
draft forwards (a toy language, below; each one graph replay), the draft-KV append (one graph
replay: DFLASH's fused KV materialisation), and the single GPU kernels this host lacks (PyTorch
references, one launch each: the greedy and sampled tree verify, the softcap kernels, the
probability renormalisation).

The toy language: token ``t`` is followed by ``succ(t)``; the target's logits put 4.0 on it and
3.4 / 3.0 on two alternatives (-10 elsewhere, softcapped at 30 as SGLang's deferred verify gather
requires), over a vocabulary of 8,192 split over the ranks. The draft proposes, for block
position j, three tokens whose order depends on a hash of (bonus, j): the chain's token first
about 65 % of the time, second or third otherwise, so a tree accepts more than a chain.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import sys
from array import array
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"
os.environ["SGLANG_NATIVE_MOVE_KV_CACHE"] = "1"

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "payload"))
sys.dont_write_bytecode = True

import step_counters as sc  # noqa: E402
import torch  # noqa: E402

V = 8192  # vocabulary: a full-vocabulary gather shows against a row-maxima one
H = 128  # hidden size
BLOCK = 16  # DFlash block (CT200's)
MASK_ID = V - 1
LAYERS = 2
HEAD_DIM = 8
CONTEXT = 512
SOFTCAP = 30.0
GRAPH_BS = (1, 2, 4, 8)  # the graph batches (CT200's --cuda-graph-max-bs 8)
PLACEMENT: list = [None]  # the active Placement, for the one-kernel wrappers
# worker methods whose launches are also counted apart (bench results: "by phase")
PHASES = ("ddtree_draft_block", "ddtree_draft_topk", "ddtree_verify_input", "ddtree_target_verify",
          "ddtree_greedy_walk", "ddtree_accept_from_logits", "ddtree_capture_sampling_mask",
          "_accept_block", "_make_next_draft_input_decode", "_draft_write_ids")


def succ(t: int) -> int:
    return (7 * t + 13) % (V - 1)


def alternatives(t: int) -> list[int]:
    s = succ(t)
    return [(s + 101) % (V - 1), (s + 202) % (V - 1)]


def target_row(t: int) -> torch.Tensor:
    row = torch.full((V,), -10.0)
    nxt = [succ(t)] + alternatives(t)
    row[nxt] = torch.tensor([4.0, 3.4, 3.0])
    return row


def draft_guesses(bonus: int, j: int, chain_token: int) -> list[int]:
    wrong = [(chain_token + 37 * k + 1) % (V - 1) for k in (1, 2)]
    h = ((bonus * 1000003 + j * 7919) % 1000) / 1000
    if h < 0.65:
        return [chain_token] + wrong
    if h < 0.9:
        return [wrong[0], chain_token, wrong[1]]
    return wrong + [chain_token]


def lm_head_full() -> torch.Tensor:
    w = torch.randn(V, H, generator=torch.Generator().manual_seed(1))
    return w / w.norm(dim=1, keepdim=True)


# -- process set-up ---------------------------------------------------------------------------

def init_parallel(spec: dict):
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", spec["model"], "--speculative-draft-model-path", spec["model"],
            "--device", "cuda", "--tp", str(spec["tp"]),
            "--speculative-num-draft-tokens", str(BLOCK), "--cuda-graph-max-bs-decode", str(max(GRAPH_BS))]
    if spec["algorithm"] == "DFLASH":
        argv += ["--speculative-algorithm", "DFLASH"]
    else:
        argv += ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", str(spec["budget"]),
                 "--speculative-ddtree-topk-cap", str(spec["topk_cap"])]
    args = prepare_server_args(argv)
    reset_context()
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=spec["rank"]))

    # The CPU branches of SGLang's groups: gloo, no NCCL communicators.
    real = ps.init_model_parallel_group

    def cpu_group(*a, **k):
        k.update(use_pynccl=False, use_custom_allreduce=False, use_mscclpp=False,
                 use_torch_symm_mem_allreduce=False)
        return real(*a, **k)

    ps.init_model_parallel_group = cpu_group
    ps._is_cpu = True
    ps.init_distributed_environment(world_size=spec["tp"], rank=spec["rank"], local_rank=spec["rank"],
                                    distributed_init_method=f"tcp://127.0.0.1:{spec['port']}",
                                    backend="gloo", timeout=120)
    ps.initialize_model_parallel()
    return args


def reference_kernels():
    """The payload's PyTorch references of the CUDA kernels this host lacks (loaded from the
    patch set's file by path in the pristine process: torch only)."""
    import importlib.util

    path = ROOT / "patches/ddtree-temp/files/sglang/srt/speculative/ddtree_utils.py"
    spec = importlib.util.spec_from_file_location("ddtree_utils_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def patch_platform(refs, pristine: bool) -> None:
    """Each GPU kernel the step launches, runnable here and counted as one launch."""
    import sglang.srt.layers.logits_processor as lp_module
    from sglang.kernels.ops.speculative import cache_locs
    from sglang.srt.speculative import dflash_utils, eagle_utils
    from triton.runtime.interpreter import InterpretedFunction

    import worker_fakes as wf

    ref = lambda: PLACEMENT[0]  # noqa: E731
    cache_locs._is_xpu = True  # assign_extend_cache_locs_func's Triton branch (interpreted)
    real_run = InterpretedFunction.run
    InterpretedFunction.run = sc.one_kernel(real_run, ref)

    def verify_tree_greedy_func(*, predicts, accept_index, accept_token_num, candidates, retrieve_index,
                                retrieve_next_token, retrieve_next_sibling, target_predict, topk=-1):
        refs.verify_tree_greedy_reference(predicts, accept_index, accept_token_num, candidates,
                                          retrieve_index, retrieve_next_token, retrieve_next_sibling,
                                          target_predict)
        return predicts, accept_index, accept_token_num

    eagle_utils.verify_tree_greedy_func = sc.one_kernel(verify_tree_greedy_func, ref)
    eagle_utils._is_cpu = False  # eagle_sample's sampling branch, with the kernels below
    eagle_utils.top_k_renorm_prob = sc.one_kernel(refs.top_k_renorm_probs, ref)
    eagle_utils.top_p_renorm_prob = sc.one_kernel(refs.top_p_renorm_probs, ref)
    sampling = sc.one_kernel(lambda **kw: refs.tree_speculative_sampling_reference(**kw), ref)
    eagle_utils.tree_speculative_sampling_target_only = sampling
    dflash_utils.tree_speculative_sampling_target_only = sampling
    dflash_utils._DFLASH_SAMPLING_VERIFY_AVAILABLE = True

    def gathered_softcap(gathered, cap, output):
        world, n, shard = gathered.shape
        full = gathered.permute(1, 0, 2).reshape(n, world * shard)[:, :output.shape[1]]
        return output.copy_(torch.tanh(full / cap) * cap)

    # phases of the accept (bound when the DDTREE class is built, after this)
    from sglang.srt.speculative import spec_utils

    spec_utils.move_accept_tokens_to_target_kvcache = sc.phase(
        "kv_move", spec_utils.move_accept_tokens_to_target_kvcache)
    if not pristine:
        from sglang.srt.speculative import ddtree_verify

        for name in ("ddtree_commit_tokens", "front_rows"):  # the accept before 2.2 (the control)
            if hasattr(ddtree_verify, name):
                setattr(ddtree_verify, name, sc.phase(name.removeprefix("ddtree_"), getattr(ddtree_verify, name)))
    lp_module.softcap_row_argmax = sc.one_kernel(wf._softcap_row_argmax_torch, ref)
    lp_module.gathered_softcap_logits = sc.one_kernel(gathered_softcap, ref)


# -- one case ---------------------------------------------------------------------------------

def run_case(args, spec: dict, case: dict, placement: sc.Placement, collectives: sc.Collectives) -> dict:
    import launch_count
    import sglang.srt.layers.logits_processor as lp_module
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunnerOutput
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2, _DflashDraftSampler
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    import worker_fakes as wf

    dev = sc.DEVICE
    tp_group = get_parallel().tp_group
    rank, tp = tp_group.rank_in_group, tp_group.world_size
    shard_w = V // tp
    bs, temperature, steps = case["batch"], case["temperature"], spec["steps"]
    is_tree = spec["algorithm"] != "DFLASH"
    if is_tree:
        from sglang.srt.speculative.ddtree_kv import ddtree_decode_reserve
        from sglang.srt.speculative.ddtree_worker import DDTreeConfig, get_ddtree_worker_cls

        cls = get_ddtree_worker_cls()
        cfg = DDTreeConfig.from_server_args(args, BLOCK)
        W, reserve = cfg.verify_width, ddtree_decode_reserve(BLOCK, cfg.budget)
    else:
        cls, cfg, W, reserve = DFlashWorkerV2, None, BLOCK, 2 * BLOCK

    torch.manual_seed(0)
    full_w = lm_head_full()
    weight = full_w[rank * shard_w:(rank + 1) * shard_w].to(torch.bfloat16).contiguous()
    embed = torch.randn(V, H, generator=torch.Generator().manual_seed(2))
    prefixes = [24 + 5 * b for b in range(bs)]
    slots_needed = [p + steps * BLOCK + reserve + W for p in prefixes]
    pools = wf.make_pools(rows=bs + 1, slots=sum(slots_needed) + 64, context=CONTEXT, head_dim=HEAD_DIM,
                          target_layers=LAYERS, dev=dev)
    reqs = []
    for i, n in enumerate(prefixes):
        params = {"temperature": temperature, "max_new_tokens": 1024}
        reqs.append(Req(f"r{i}", "", array("i", [(3 * i + j) % (V - 1) for j in range(n)]),
                        SamplingParams(**params), vocab_size=V))
    rows = pools.req_pool.alloc(reqs)
    flat = pools.allocator.alloc(sum(slots_needed))
    at = 0
    for r, row, n, p in zip(reqs, rows, slots_needed, prefixes, strict=True):
        pools.req_pool.write((row, slice(0, n)), flat[at:at + n].to(torch.int32))
        at += n
        r.kv.kv_committed_len, r.kv.kv_allocated_len = p, n

    # -- stand-ins for the models (each a graph replay on the GPU) --------------------------
    def target_forward(batch=None, forward_batch=None, is_verify=False, **kw):
        fb = forward_batch
        with sc.graph_region(PLACEMENT[0], collectives):
            toks = fb.input_ids.tolist()
            full = torch.stack([target_row(t) for t in toks])
            hidden = embed[fb.input_ids.long()]
            k = hidden[:, :HEAD_DIM].reshape(-1, 1, HEAD_DIM)
            for layer in range(LAYERS):
                pools.kv_pool.set_kv_buffer(SimpleNamespace(layer_id=layer), KVWriteLoc.for_batch(fb), k, k)
            logits = full[:, rank * shard_w:(rank + 1) * shard_w].contiguous()
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden),
            can_run_cuda_graph=True)

    def draft_forward(fb):
        with sc.graph_region(PLACEMENT[0], collectives):
            ids = fb.input_ids.view(-1, BLOCK).tolist()
            hs = torch.zeros(len(ids) * BLOCK, H)
            for b, row in enumerate(ids):
                t = row[0]
                for j in range(1, BLOCK):
                    t = succ(t)
                    g = draft_guesses(row[0], j, t)
                    hs[b * BLOCK + j] = 4.0 * full_w[g[0]] + 2.5 * full_w[g[1]] + 1.5 * full_w[g[2]]
            if worker._draft_sampler is not None:  # the head folded into the draft graph
                worker._draft_sampler(hs, fb.input_ids)
        return ModelRunnerOutput(logits_output=LogitsProcessorOutput(next_token_logits=None, hidden_states=hs),
                                 can_run_graph=True)

    def append_draft_kv(**kw):
        with sc.graph_region(PLACEMENT[0], collectives):
            loc = kw["cache_loc"].long()
            k = kw["target_hidden"][: loc.numel(), :HEAD_DIM].reshape(-1, 1, HEAD_DIM)
            pools.draft_pool.k_buffer[0][loc] = k
            pools.draft_pool.v_buffer[0][loc] = k

    class AttnBackend:  # the triton backend's persistent verify mask, as under CUDA graphs
        verify_mask = SimpleNamespace(
            buffer=torch.zeros(max(GRAPH_BS) * W * (CONTEXT + BLOCK + W), dtype=torch.uint8),
            max_bs=max(GRAPH_BS))

        def init_forward_metadata(self, fb):
            pass

    model_config = SimpleNamespace(context_len=CONTEXT, vocab_size=V, model_is_mrope=False, hidden_size=H,
                                   is_matryoshka=False, requires_mm_token_modalities=False)
    lm_head = SimpleNamespace(weight=weight, shard_indices=SimpleNamespace(
        num_org_elements=shard_w, org_vocab_start_index=rank * shard_w, num_org_elements_padded=shard_w,
        num_added_elements=0, added_vocab_start_index=V))
    worker = wf.make_worker(
        cls, cfg=cfg, block=BLOCK, mask_id=MASK_ID, dev=dev, lm_weight=weight, embed=embed,
        model_config=model_config, req_pool=pools.req_pool, allocator=pools.allocator,
        kv_pool=pools.kv_pool, target_translator=pools.target_translator,
        draft_translator=pools.draft_translator, draft_pool=pools.draft_pool, attn_backend=AttnBackend(),
        target_forward=target_forward, draft_forward=draft_forward, append_draft_kv=append_draft_kv)
    worker.model_runner.model = SimpleNamespace(lm_head=lm_head, get_input_embeddings=lambda: None)
    # DFlashWorkerV2.__init__'s decode state (its GPU defaults: Triton block prep and accept,
    # the greedy draft head folded into the draft graph)
    worker.__dict__.update(
        _draft_block_ids_buf=None, _draft_block_positions_buf=None, _draft_block_tokens_buf=None,
        _draft_verify_out_cache_loc_buf=None, _draft_block_end_buf=None, _draft_seq_lens_cpu_buf=None,
        _use_triton_prepare_block=True, _use_triton_accept_bonus=True, _use_triton_compact_rebuild=True,
        use_compact_draft_cache=False, _accept_bonus_buffer_cap=0, _accept_bonus_buffer_slot=0,
        _accept_len_buf=None, _commit_lens_bufs=[], _bonus_id_bufs=[], _out_tokens_bufs=[],
        _new_seq_lens_bufs=[], _selector_sampling_enabled=False, _lilicorr_sampling_enabled=False,
        _warned_sampling_fallback=False, _warned_lilicorr_eager=False, _target_tp_rank=rank,
        draft_model=SimpleNamespace(), _tp_sync=type(worker._tp_sync)(tp_group),
        _draft_sampler=None if is_tree else _DflashDraftSampler(
            weight=weight, block_size=BLOCK, num_org=shard_w, org_vocab_start=rank * shard_w,
            max_bs=max(GRAPH_BS), tp_group=tp_group if tp > 1 else None),
    )
    processor = lp_module.LogitsProcessor.__new__(lp_module.LogitsProcessor)
    torch.nn.Module.__init__(processor)
    processor.defer_verify_gather, processor.vocab_size = True, V
    processor.final_logit_softcapping = SOFTCAP
    worker._target_logits_processor = processor
    if is_tree:  # as DDTreeWorkerV2.init_cuda_graphs: the draft graph's head, then the tree graphs
        worker._draft_sampler = worker._maybe_build_draft_sampler() if spec.get("draft_head", True) else None
        runner = worker.ddtree_tree_runner()
        if worker._draft_sampler is not None:
            runner.adopt_top_buffers(worker._draft_sampler.lp, worker._draft_sampler.ids)
        runner.capture(GRAPH_BS, launch_count.ReplayedCall)
    for name in PHASES:
        if hasattr(worker, name):
            setattr(worker, name, sc.phase(name.strip("_"), getattr(worker, name)))

    # -- the steps --------------------------------------------------------------------------
    rpi = torch.tensor(rows, dtype=torch.int64)
    prefix = torch.tensor(prefixes, dtype=torch.int64)
    bonus = torch.tensor([(11 + 17 * b) % (V - 1) for b in range(bs)], dtype=torch.int64)
    batch = None
    committed, counts = [], []
    for step in range(steps):
        draft_input = make_draft_input_v2(bonus_tokens=bonus, new_seq_lens=prefix)
        draft_input.max_top_k, draft_input.uniform_top_k_value = 1, 1
        seq_lens_cpu = prefix.clone()
        if batch is None:
            batch = ScheduleBatch(
                reqs=reqs, req_to_token_pool=pools.req_pool, token_to_kv_pool_allocator=pools.allocator,
                device=dev, forward_mode=ForwardMode.DECODE, req_pool_indices=rpi,
                seq_lens=wf.stream_recorded(prefix.clone()), orig_seq_lens=prefix.to(torch.int32),
                seq_lens_cpu=seq_lens_cpu, seq_lens_sum=int(prefix.sum()),
                spec_algorithm=SpeculativeAlgorithm.DFLASH, spec_info=draft_input)
            batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, V)
        batch.forward_mode = ForwardMode.DECODE
        batch.seq_lens = wf.stream_recorded(prefix.clone())
        batch.seq_lens_cpu, batch.seq_lens_sum, batch.spec_info = seq_lens_cpu, int(prefix.sum()), draft_input
        placement.mark_host(seq_lens_cpu)
        torch.manual_seed(1000 + step)  # the same coins on every rank (rank 0's are used)
        result, n = sc.count_step(functools.partial(worker.forward_batch_generation, batch), placement, collectives)
        if step:
            counts.append(n)
        out = result.next_token_ids.view(bs, BLOCK).tolist()
        lens = result.accept_lens.tolist()
        committed.append([o[:k] for o, k in zip(out, lens, strict=True)])
        prefix = result.new_seq_lens.clone().to(torch.int64)
        bonus = result.next_draft_input.bonus_tokens.clone()
    if not is_tree:
        assert worker._use_triton_prepare_block and worker._use_triton_accept_bonus, \
            "DFLASH fell back from its Triton kernels"
    return {"counts": counts, "committed": committed, "verify_width": W}


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(pathlib.Path(spec_path).read_text())
    args = init_parallel(spec)
    patch_platform(reference_kernels(), spec["algorithm"] == "DFLASH")
    placement = sc.Placement()
    PLACEMENT[0] = placement
    collectives = sc.Collectives().install()
    out = {"rank": spec["rank"], "cases": []}
    try:
        for case in spec["cases"]:
            out["cases"].append(dict(case, **run_case(args, spec, case, placement, collectives)))
    finally:
        collectives.uninstall()
        from sglang.srt.distributed import parallel_state as ps

        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
    pathlib.Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
