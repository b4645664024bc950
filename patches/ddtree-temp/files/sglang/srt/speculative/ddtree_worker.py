"""DDTree worker for SGLang 0.5.23 (ddtree-temp patch set, 2.2 in progress).

One decode step, the way 0.5.23's n-gram worker verifies a tree:

1. **Draft.** The DFlash drafter runs its block ``[bonus, mask, ...]`` exactly as
   ``DFlashWorkerV2`` does (draft CUDA graphs included); instead of the
   argmax, the target's LM head gives per-position top-k log-probs at each
   request's temperature (:func:`ddtree_verify.vocab_parallel_topk_logprobs`:
   exact under TP, only k values per rank are gathered).
2. **Tree.** One graph replay (:class:`ddtree_step.DDTreeStepRunner`, eager
   where graphs are off): the candidates restricted to each request's
   top-k/top-p support, the best-first tree, its retrieve arrays, positions
   ``prefix + depth`` and the tree window of the verify mask, written straight
   into the target attention backend's verify-mask buffer
   (:func:`ddtree_verify.ddtree_tree_step`). A grammar batch queues the tree's
   host copy now, ahead of the verify launch.
3. **Verify.** A :class:`DDTreeVerifyInput` (a ``DFlashVerifyInput`` carrying the
   tree) goes through ``prepare_for_verify`` and the target worker's
   ``forward_batch_generation(is_verify=True)`` in ``TARGET_VERIFY`` mode: the
   model runner's CUDA-graph runner (captured ``budget + 1`` wide with the mask
   path, see the patched spec_info / dflash_utils / triton_backend), the model's
   own logits processor under TP and the triton attention backend (MHA or MLA)
   apply unchanged.
4. **Accept.** A plain greedy batch whose logits came back as vocabulary shards
   (DFLASH's deferred verify gather, a softcapped model under TP) takes
   ``deferred_argmax`` (only each row's maximum crosses TP) and SGLang's greedy
   tree walk on it, broadcasting the prediction once, as DFLASH does. Any other
   batch: the full logits, custom logit processors on every tree row, then
   ``eagle_sample`` (penalties, logit bias, grammar mask, then SGLang's
   ``verify_tree_greedy`` / ``tree_speculative_sampling_target_only`` kernels,
   temperature / top-k / top-p as EAGLE's verify; a sampled walk is broadcast
   from rank 0 inside it, a greedy one once more, packed).
5. **Commit.** ``move_accept_tokens_to_target_kvcache`` puts the accepted
   nodes' target KV at the front of the window (as the n-gram worker does), the
   committed tokens come back in DFlash's ``[bs, block_size]`` layout (with the
   sampling masks of ``return_sampling_mask`` requests, gathered along the
   accepted path), and the accepted path's target hidden states are
   materialised into the DFlash draft KV (DFlash's own
   ``_append_target_hidden_to_draft_kv_by_loc``).

Module level imports only stdlib and torch (the test hosts' stand-in server
imports every ddtree module without SGLang's dependencies); the SGLang classes
are built on first use by :func:`get_ddtree_worker_cls`.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

logger = logging.getLogger(__name__)

_WORKER_CLS: Optional[type] = None


class DDTreeConfig:
    """The tree's static shape: every tensor of a step is sized from these."""

    def __init__(self, budget: int, topk_cap: int, block_size: int, tree_distribution: str = "request"):
        if budget < 1 or not 1 <= topk_cap <= budget or block_size < 2:
            raise ValueError(
                f"invalid DDTree config budget={budget} topk_cap={topk_cap} block_size={block_size}"
            )
        if tree_distribution not in ("request", "raw"):
            raise ValueError(f"invalid DDTree tree distribution {tree_distribution!r}")
        self.budget = int(budget)
        self.topk_cap = int(topk_cap)
        self.block_size = int(block_size)
        # "request": the tree is built from each request's sampling distribution;
        # "raw": from the draft at temperature 1, unrestricted
        self.tree_distribution = tree_distribution

    @property
    def verify_width(self) -> int:
        """W: tokens the target verifies per request (root + budget nodes)."""
        return self.budget + 1

    @property
    def max_depth(self) -> int:
        """Deepest draft node: one per DFlash block position, at most the budget."""
        return min(self.budget, self.block_size - 1)

    @property
    def accept_width(self) -> int:
        """Columns of ``accept_index``: the root plus the deepest path."""
        return self.max_depth + 1

    @classmethod
    def from_server_args(cls, server_args, block_size: int) -> "DDTreeConfig":
        budget = getattr(server_args, "speculative_ddtree_budget", None)
        cap = getattr(server_args, "speculative_ddtree_topk_cap", None)
        if budget is None:
            raise ValueError("DDTree worker needs speculative_ddtree_budget")
        dist = getattr(server_args, "speculative_ddtree_tree_distribution", None) or "request"
        return cls(budget, cap if cap is not None else budget, block_size, dist)


def model_refusals(
    *,
    mamba: bool,
    selector: bool,
    domino: bool,
    quantized_head_tp: bool,
    verify_backend: str = "TritonAttnBackend",
    hip: bool = False,
) -> list:
    """Reasons, known only once the server is built, why DDTREE cannot serve
    it (the server refuses to start with these; options are refused earlier,
    when the arguments are parsed, by ddtree_args). ``verify_backend``: the
    class of the attention backend that runs the target verify, after every
    resolution hook (a model's hook may pick one after the parse check)."""
    why = []
    if verify_backend != "TritonAttnBackend":
        why.append(
            f"the target verify runs on {verify_backend} (chosen after the arguments were "
            "parsed); only the triton backend applies the tree mask: pass --attention-backend triton"
        )
    if hip:
        why.append("ROCm: eagle_sample verifies greedily on HIP, so sampled requests would be served greedy")
    if mamba:
        why.append("the target has mamba/linear-attention state (a tree verify cannot roll it back per branch)")
    if selector:
        why.append("the DFlash draft has a selector/LiLiCorr head (it samples one chain, not per-depth top-k)")
    if domino:
        why.append("the DFlash draft is a Domino rollout (one chain, not per-depth top-k)")
    if quantized_head_tp:
        why.append("the target lm_head is quantised and TP > 1 (no exact sharded top-k)")
    return why


def verify_attention_backend(backend, speculative_attention_mode: Optional[str]):
    """The backend object that runs TARGET_VERIFY: a hybrid (prefill/decode)
    backend routes it to its prefill side unless --speculative-attention-mode
    decode (SGLang's rule)."""
    if hasattr(backend, "prefill_backend") and hasattr(backend, "decode_backend"):
        return backend.decode_backend if speculative_attention_mode == "decode" else backend.prefill_backend
    return backend


def ddtree_memory_line(parts: dict, graphs_bytes: int) -> str:
    """The start-up line with what each DDTree buffer took, per rank."""
    def mib(n: int) -> str:
        return f"{n / (1 << 20):.1f} MiB"

    total = sum(parts.values()) + graphs_bytes
    return (
        "DDTREE memory per rank: verify mask %s, tree-step buffers %s, retrieve index %s, "
        "tree-step graphs %s (pool reserved while capturing); %s in all"
        % (mib(parts["verify_mask"]), mib(parts["step_buffers"]), mib(parts["retrieve_index"]),
           mib(graphs_bytes), mib(total))
    )


def host_prefix_bound(seq_lens_cpu, nxt_kv_lens_cpu, context_len: int, block_size: int) -> torch.Tensor:
    """Host lengths, per request, at least the committed prefix on the device:
    exact when the scheduler mirrored them (``seq_lens_cpu``), else the
    reservation capped at ``context_len + block_size`` (a request's last
    overlapped step can run up to one block past its context, never further).
    They size the FULL_MASK without a device->host sync; offsets inside it come
    from the exact device lengths."""
    if seq_lens_cpu is not None:
        return seq_lens_cpu.to(torch.int64)
    if nxt_kv_lens_cpu is None:
        raise RuntimeError("DDTREE verify needs seq_lens_cpu or the reserved lengths on the host")
    return torch.clamp(nxt_kv_lens_cpu.to(torch.int64), max=int(context_len) + int(block_size))


def tp_all_gather(tp_group, t: torch.Tensor) -> torch.Tensor:
    """``t`` from every rank of ``tp_group``, stacked ``[tp, *t.shape]`` (one all-gather): the
    ``gather`` :func:`ddtree_verify.vocab_parallel_topk_logprobs` takes."""
    tp = int(tp_group.world_size)
    out = torch.empty((tp * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    tp_group.all_gather_into_tensor(out, t.contiguous())
    return out.view((tp,) + tuple(t.shape))


class DDTreeDraftHead:
    """The draft head's per-depth top-k log-probs folded into the draft CUDA graph, as
    ``DFlashWorkerV2`` folds its greedy head (``_DflashDraftSampler``, a draft-runner
    ``capture_tail_hooks`` entry): the LM head matmul, the tempered log-softmax top-k and its
    one packed all-gather run inside the draft graph's replay, into static outputs. Each
    request's inverse temperature is staged before the replay (:meth:`stage`); rows the tree
    scores untempered (greedy requests, ``--speculative-ddtree-tree-distribution raw``) carry
    1.0, which leaves the log-probs bit for bit as the untempered computation gives them."""

    def __init__(self, *, weight, block_size: int, num_org: int, vocab_start: int, k: int,
                 max_bs: int, tp_group=None):
        self.weight = weight
        self.block_size = int(block_size)
        self.num_org, self.vocab_start, self.k = int(num_org), int(vocab_start), int(k)
        self.tp_group = tp_group
        rows = int(max_bs) * (self.block_size - 1)
        device = weight.device
        # -inf / 0 until the first replay: a graph batch's padding rows read them
        self.lp = torch.full((rows, self.k), float("-inf"), dtype=torch.float32, device=device)
        self.ids = torch.zeros((rows, self.k), dtype=torch.int64, device=device)
        self.inv_temperature = torch.ones((int(max_bs),), dtype=torch.float32, device=device)
        self._all_ones = True  # what the staged buffer holds, known on the host

    def stage(self, bs: int, inv_temperature: Optional[torch.Tensor]) -> None:
        """Before the replay: ``inv_temperature`` [bs] (None: untempered), no host read. A
        batch past the graphs' largest runs its draft eagerly, and the eager top-k reads the
        temperatures itself: nothing to stage."""
        if bs > self.inv_temperature.numel():
            return
        if inv_temperature is not None:
            self.inv_temperature[:bs].copy_(inv_temperature)
            self._all_ones = False
        elif not self._all_ones:
            self.inv_temperature.fill_(1.0)
            self._all_ones = True

    def __call__(self, hidden_states, input_ids=None):
        from sglang.srt.speculative.ddtree_verify import vocab_parallel_topk_logprobs

        bs = hidden_states.shape[0] // self.block_size
        hs = hidden_states.view(bs, self.block_size, -1)[:, 1:, :].reshape(-1, hidden_states.shape[-1])
        local = torch.matmul(hs.to(self.weight.dtype), self.weight[: self.num_org].T)
        tp = 1 if self.tp_group is None else int(self.tp_group.world_size)
        lp, ids = vocab_parallel_topk_logprobs(
            local, self.k, vocab_start=self.vocab_start,
            gather=functools.partial(tp_all_gather, self.tp_group) if tp > 1 else None,
            inv_temperature=self.inv_temperature[:bs],
        )
        n = lp.shape[0]
        self.lp[:n].copy_(lp)
        self.ids[:n].copy_(ids)

    def outputs(self, bs: int):
        """The replay's top-k, ``[bs, block_size - 1, k]`` views of the static outputs."""
        n = bs * (self.block_size - 1)
        return (self.lp[:n].view(bs, self.block_size - 1, self.k),
                self.ids[:n].view(bs, self.block_size - 1, self.k))


def _build_worker_cls() -> type:
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
    from sglang.kernels.ops.speculative.dflash import _prepare_dflash_draft_block_unchecked
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.layers.logprob_processor import compute_spec_logprobs
    from sglang.srt.layers.sampler import apply_custom_logit_processor
    from sglang.srt.lora.layers import unwrap_lora_layer
    from sglang.srt.managers.scheduler import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
        enable_num_token_non_padded,
    )
    from sglang.srt.runtime_context import get_exec, get_parallel, get_spec
    from sglang.srt.speculative.ddtree_args import tree_verify_refusals
    from sglang.srt.speculative.ddtree_step import DDTreeStepRunner, cuda_graph_factory
    from sglang.srt.speculative import ddtree_verify
    from sglang.srt.speculative.ddtree_verify import (
        ddtree_commit_step,
        front_rows,
        vocab_parallel_topk_logprobs,
    )
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput
    from sglang.srt.speculative.dflash_utils import is_dense_head_weight
    from sglang.srt.speculative.dflash_worker_v2 import (
        DFlashWorkerV2,
        _resolve_dflash_embedding_module,
    )
    from sglang.srt.speculative import eagle_utils
    from sglang.srt.speculative.eagle_utils import eagle_sample
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_sampling_mask import SpeculativeSamplingMaskCapture
    from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite
    from sglang.srt.speculative.spec_utils import (
        SIMULATE_ACC_LEN,
        GrammarTree,
        build_grammar_vocab_mask,
        draft_tp_context,
    )
    from sglang.srt.utils import is_hip

    class DDTreeVerifyInput(DFlashVerifyInput):
        """A DFlash verify input carrying a draft tree, shaped as 0.5.23's
        ``NgramVerifyInput``: ``draft_token`` in node order (node i of request b
        at row ``b*W + i``), ``positions`` = prefix + depth, ``custom_mask`` in
        FULL_MASK layout and the kernel's retrieve arrays. Being a
        ``DFlashVerifyInput`` (``DFLASH_VERIFY``), it takes the same attention,
        CUDA-graph and logits paths as DFlash's verify; ``generate_attn_arg_prefill``
        and ``filter_batch`` / ``merge_batch`` are DFlash's (the verify input lives
        for one forward, the draft state across steps is DFlash's)."""

        def __init__(
            self,
            *,
            draft_token: torch.Tensor,
            positions: torch.Tensor,
            draft_token_num: int,
            custom_mask: torch.Tensor,
            retrieve_index: torch.Tensor,
            retrieve_next_token: torch.Tensor,
            retrieve_next_sibling: torch.Tensor,
            max_depth: int,
            kv_loc_plan=None,
        ):
            super().__init__(
                draft_token=draft_token,
                positions=positions,
                draft_token_num=int(draft_token_num),
                custom_mask=custom_mask,
                capture_hidden_mode=CaptureHiddenMode.FULL,
                kv_loc_plan=kv_loc_plan,
            )
            self.retrieve_index = retrieve_index
            self.retrieve_next_token = retrieve_next_token
            self.retrieve_next_sibling = retrieve_next_sibling
            self._max_depth = int(max_depth)

        # eagle_sample's view of the tree (as NgramVerifyInput exposes it)
        @property
        def max_tree_depth(self) -> int:
            return self._max_depth + 1

        @property
        def tree_topk(self) -> int:
            return -1  # irregular tree: per-node branching

    class DDTreeWorkerV2(DFlashWorkerV2):
        """DFlash worker whose decode step verifies a DDTree (module docstring)."""

        def __init__(self, server_args, *args, **kwargs):
            super().__init__(server_args, *args, **kwargs)
            self.ddtree_config = DDTreeConfig.from_server_args(server_args, int(self.block_size))
            why = self.ddtree_startup_refusals(server_args)
            if why:
                raise ValueError("--speculative-algorithm DDTREE cannot serve this model: " + "; ".join(why) + ".")
            if int(get_parallel().tp_rank) == 0:
                logger.info(
                    "DDTREE: budget=%d topk_cap=%d block=%d -> verify %d tokens per request "
                    "(max depth %d), tree verify through TARGET_VERIFY.",
                    self.ddtree_config.budget,
                    self.ddtree_config.topk_cap,
                    self.ddtree_config.block_size,
                    self.ddtree_config.verify_width,
                    self.ddtree_config.max_depth,
                )

        def ddtree_startup_refusals(self, server_args) -> list:
            """What only the built server knows: the models (model_refusals), the
            backend that really runs the target verify, the platform, and the
            options as resolved (a model's resolution hook runs after the
            parse-time check and may change the backend, page size or topology)."""
            target_model = self.target_worker.model_runner.model
            lm_head = unwrap_lora_layer(getattr(target_model, "lm_head", None))
            weight = getattr(lm_head, "weight", None)
            dense = is_dense_head_weight(weight)
            verify_backend = verify_attention_backend(
                self.target_worker.model_runner.attn_backend, get_spec().speculative_attention_mode
            )
            why = model_refusals(
                mamba=bool(self._need_mamba_verify_commit),
                selector=self.selector is not None or self.lilicorr is not None,
                domino=bool(self._is_domino),
                quantized_head_tp=(not dense) and int(get_parallel().tp_group.world_size) > 1,
                verify_backend=type(verify_backend).__name__,
                hip=bool(is_hip()),
            )
            return why + tree_verify_refusals(resolved_view(server_args))

        # DFlash's in-graph greedy head, as the tree's top-k head (DDTreeDraftHead):
        # called by DFlashWorkerV2.init_cuda_graphs before the draft graph is
        # captured, the hook it registers runs the head inside the graph.
        def _maybe_build_draft_sampler(self):
            lm_head = unwrap_lora_layer(getattr(self.target_worker.model_runner.model, "lm_head", None))
            weight = getattr(lm_head, "weight", None)
            if not is_dense_head_weight(weight):
                return None  # a quantised head (TP 1): the eager top-k, its own kernel
            tp_group = get_parallel().tp_group
            shard = getattr(lm_head, "shard_indices", None)
            if shard is None and int(tp_group.world_size) != 1:
                return None
            if shard is not None and int(shard.num_added_elements) != 0:
                return None  # added vocabulary: the eager top-k
            num_org = int(shard.num_org_elements) if shard is not None else int(weight.shape[0])
            vocab_start = int(shard.org_vocab_start_index) if shard is not None else 0
            return DDTreeDraftHead(
                weight=weight, block_size=int(self.block_size), num_org=num_org,
                vocab_start=vocab_start, k=self.ddtree_config.topk_cap,
                max_bs=max(get_exec().graph.cuda_graph_config.decode.bs),
                tp_group=tp_group if int(tp_group.world_size) > 1 else None,
            )

        # -- the tree step unit (one CUDA graph per graph batch size) ----------
        def init_cuda_graphs(self):
            super().init_cuda_graphs()
            runner = self.ddtree_tree_runner()
            capture_bs = list(
                getattr(self.target_worker.model_runner, "decode_cuda_graph_capture_bs", None) or []
            )
            graphs = 0
            if capture_bs and torch.device(self.device).type == "cuda":
                before = torch.cuda.memory_reserved(self.device)
                if self._draft_sampler is not None:  # the head in the draft graph feeds the tree graph
                    runner.adopt_top_buffers(self._draft_sampler.lp, self._draft_sampler.ids)
                runner.capture(capture_bs, cuda_graph_factory())
                graphs = torch.cuda.memory_reserved(self.device) - before
                if int(get_parallel().tp_rank) == 0:
                    logger.info("DDTREE: tree step captured for batch sizes %s", runner.capture_bs)
            if int(get_parallel().tp_rank) == 0:
                logger.info(ddtree_memory_line(runner.memory_bytes(), graphs))

        def ddtree_tree_runner(self) -> DDTreeStepRunner:
            """Built on first use: the target attention backend's verify-mask
            buffer exists once the target runner is initialised."""
            runner = self.__dict__.get("_ddtree_runner")
            if runner is None:
                cfg = self.ddtree_config
                vm = getattr(self.target_worker.model_runner.attn_backend, "verify_mask", None)
                runner = DDTreeStepRunner(
                    budget=cfg.budget,
                    topk_cap=cfg.topk_cap,
                    draft_len=int(self.block_size) - 1,
                    device=self.device,
                    mask_buffer=None if vm is None else vm.buffer,
                    mask_bs_limit=0 if vm is None else int(vm.max_bs),
                )
                self._ddtree_runner = runner
            return runner

        def ddtree_warm_jit_modules(self):
            """Load SGLang's JIT modules the tree verify calls (compiling them on a
            first start) while the server starts, not in the first decode after
            /health says ready: ``verify_tree_greedy``'s module, and the tree
            sampler at this vocabulary's vector size as ``eagle_sample`` calls it
            (deterministic). Loading launches nothing."""
            import math

            from sglang.kernels.ops.speculative import sampling, tree

            tree._jit_tree_module()
            sampling._jit_sampling_module(math.gcd(4, int(self.model_config.vocab_size)), True)
            self.ddtree_warm_accept_kernels()

        def ddtree_warm_accept_kernels(self):
            """Compile the accept's two Triton kernels now, at the shapes every step uses
            (the verify width, the walk's depth, the block), not in the first decode: one
            request whose walk accepts nothing, and a move of slot 0 (the pools' dummy
            slot) onto itself, which moves nothing."""
            cfg, device = self.ddtree_config, self.device
            W, S, block = cfg.verify_width, cfg.max_depth + 1, int(self.block_size)
            accept_index = torch.full((1, S), -1, dtype=torch.int32, device=device)
            accept_index[0, 0] = 0
            step = ddtree_commit_step(
                torch.zeros((W,), dtype=torch.int32, device=device), accept_index,
                torch.ones((1,), dtype=torch.int32, device=device),
                torch.zeros((W,), dtype=torch.int64, device=device),
                torch.zeros((1,), dtype=torch.int64, device=device), block,
            )
            if cfg.topk_cap > 1:
                ddtree_verify.move_accepted_kv(
                    self.model_runner.token_to_kv_pool_allocator.get_kvcache(),
                    torch.zeros_like(step.kv_tgt), torch.zeros_like(step.kv_src), S,
                )

        def prewarm_sampling(self):
            """Rehearse the sampled tree verify as upstream rehearses DFLASH's (at
            the largest graph batch, W rows a request, with its out-of-memory
            fallback), so the probability tensors ``eagle_sample`` allocates
            (``[bs, W, V]`` float32: the softmax, its top-p renormalisation, the
            zero draft_probs) are reserved at start-up instead of failing under
            traffic; the tree verify's JIT modules are loaded first."""
            from sglang.kernels.ops.sampling import softmax as sampling_softmax
            from sglang.kernels.ops.sampling.renorm import top_p_renorm_prob
            from sglang.srt.environ import envs
            from sglang.srt.model_executor.model_runner import SamplingPrewarmResult
            from sglang.srt.model_executor.runner_utils.pool import (
                disable_graph_pool_borrow,
                graph_pool_borrow_enabled,
            )
            from sglang.srt.utils import is_cuda

            if not is_cuda():
                return self.model_runner.prewarm_sampling()
            self.ddtree_warm_jit_modules()
            W = self.ddtree_config.verify_width
            vocab = int(self.model_config.vocab_size)
            # Upstream's bound, at W rows per request: the largest graph batch,
            # capped by --max-running-requests (what the graph pool lends for).
            bs = self._prewarm_batch_size(W)
            rows = bs * W
            logits = torch.zeros((rows, vocab), dtype=torch.float32, device=self.device)

            def peak() -> int:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_stats()["allocated_bytes.all.current"]
                probs = sampling_softmax(
                    logits, temperatures=torch.ones((rows, 1), dtype=torch.float32, device=self.device)
                )
                probs = top_p_renorm_prob(
                    probs, torch.full((rows,), 0.95, dtype=torch.float32, device=self.device)
                )
                draft = torch.zeros_like(probs.view(bs, W, vocab))
                del probs, draft
                torch.cuda.synchronize()
                return torch.cuda.memory_stats()["allocated_bytes.all.peak"] - base

            # One unborrowed pass, so a workspace a kernel keeps for the process
            # lands outside graph storage and off the measured peak (upstream's).
            with envs.SGLANG_ENABLE_GRAPH_POOL_BORROW.override(False):
                peak()
            borrowing = graph_pool_borrow_enabled()
            try:
                measured = peak()
            except torch.OutOfMemoryError:
                if not borrowing:
                    raise
                # Upstream's fallback: stop borrowing graph-pool memory and reserve
                # the measured headroom in the post-capture KV sizing instead.
                reason = (
                    "DDTREE sampling rehearsal exhausted graph-pool memory for the "
                    f"{bs}x{W}x{vocab} verify probability matrices"
                )
                logger.warning(
                    "Graph pool %s; disabling borrowing and reserving the measured "
                    "headroom in the post-capture KV sizing instead",
                    reason,
                )
                disable_graph_pool_borrow(reason)
                measured = peak()
            input_bytes = logits.numel() * logits.element_size()
            result = SamplingPrewarmResult(
                sampling_input_bytes=input_bytes, sampling_headroom_bytes=measured + input_bytes
            )
            self.model_runner.sampling_prewarm_result = result
            logger.info(
                "DDTREE sampling pre-warm: borrowing=%s bs=%d width=%d peak=%d B headroom=%d B",
                graph_pool_borrow_enabled(), bs, W, measured, result.sampling_headroom_bytes,
            )
            return result

        def forward_batch_generation(
            self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None
        ):
            if (
                batch.forward_mode.is_extend()
                or batch.is_extend_in_batch
                or batch.forward_mode.is_idle()
            ):
                # Prefill (draft KV of the prompt) and idle ranks: DFlash's own.
                return super().forward_batch_generation(
                    batch,
                    on_publish=on_publish,
                    grammar_barrier=grammar_barrier,
                    pp_proxy_tensors=pp_proxy_tensors,
                )
            return self.ddtree_decode(batch, on_publish=on_publish, grammar_barrier=grammar_barrier)

        # -- one decode step, in runbook order --------------------------------
        def ddtree_decode(self, batch, *, on_publish=None, grammar_barrier=None):
            draft_input = batch.spec_info
            batch.seq_lens.record_stream(torch.get_device_module(self.device).current_stream())
            head = self._draft_sampler
            if head is not None:
                head.stage(len(batch.seq_lens), self.ddtree_inv_temperature(batch.sampling_info))
            draft_hidden, block_plan, in_graph, block_positions = self.ddtree_draft_block(batch, draft_input)
            if head is not None and in_graph:  # the draft graph ran the head
                top_lp, top_ids = head.outputs(len(batch.seq_lens))
            else:
                # The LM head runs in the draft's TP placement, as DFlash's greedy head does.
                with draft_tp_context(self.draft_parallel_layout):
                    top_lp, top_ids = self.ddtree_draft_topk(draft_hidden, batch.sampling_info)
            verify_input = self.ddtree_verify_input(batch, draft_input, top_lp, top_ids)
            # The grammar's host copy of the tree must be queued ahead of the
            # verify launch, so the CPU bitmask overlaps the verify, not waits for it.
            grammar_tree = None
            if batch.has_grammar:
                grammar_tree = GrammarTree.from_device(
                    verify_input.retrieve_next_token,
                    verify_input.retrieve_next_sibling,
                    verify_input.draft_token.view(len(batch.seq_lens), -1),
                )
            target_out, logits_output, target_predict = self.ddtree_target_verify(
                batch, draft_input, verify_input
            )
            return self.ddtree_accept_and_commit(
                batch, verify_input, target_out, logits_output, block_plan,
                draft_input=draft_input, block_positions=block_positions,
                on_publish=on_publish, grammar_barrier=grammar_barrier,
                grammar_tree=grammar_tree, target_predict=target_predict,
            )

        def ddtree_draft_block(self, batch, draft_input):
            """The DFlash draft forward on ``[bonus, mask, ...]`` at positions
            prefix..prefix+block-1 (DFlashWorkerV2's own construction, graphs
            included). Returns the hidden states of block positions 1..L and the
            block window's KV plan (the draft-KV append reuses it)."""
            bs = len(batch.seq_lens)
            device = self.device
            block_size = int(self.block_size)
            prefix_lens = batch.seq_lens
            req_to_token = self.model_runner.req_to_token_pool.req_to_token
            target_model = self.target_worker.model_runner.model

            # DFlash's block kernel sizes its launch from the roots and reads the lengths
            # and pool rows unchecked: a batch whose carried roots do not match it (an
            # unfiltered overlap carry) would read past them. Shapes only: no sync.
            if draft_input.bonus_tokens.numel() != bs or batch.req_pool_indices.numel() != bs:
                raise RuntimeError(
                    f"DDTREE: {draft_input.bonus_tokens.numel()} roots and "
                    f"{batch.req_pool_indices.numel()} pool rows for a batch of {bs}"
                )
            # DFlash's block buffers and its one-launch block kernel (ids, positions,
            # cache locations), with DFlash's eager fallback should the kernel fail.
            self._ensure_draft_block_buffers(bs)
            block_ids = self._draft_block_ids_buf[:bs]
            positions_2d = self._draft_block_positions_buf[:bs]
            block_loc_2d = self._draft_verify_out_cache_loc_buf[:bs]
            if self._use_triton_prepare_block:
                try:
                    _prepare_dflash_draft_block_unchecked(
                        bonus_tokens=draft_input.bonus_tokens.view(-1),
                        prefix_lens=prefix_lens.view(-1),
                        req_pool_indices=batch.req_pool_indices.view(-1),
                        req_to_token=req_to_token,
                        block_ids_out=block_ids,
                        positions_out=positions_2d,
                        cache_loc_out=block_loc_2d,
                        mask_token_id=int(self._mask_token_id),
                    )
                except Exception as e:  # noqa: BLE001 - DFlash's own fallback rule
                    self._use_triton_prepare_block = False
                    logger.warning("DDTREE: DFlash's Triton prepare_block failed; eager from now on: %s", e)
            if not self._use_triton_prepare_block:
                block_ids.fill_(int(self._mask_token_id))
                block_ids[:, 0].copy_(draft_input.bonus_tokens.view(-1))
                torch.add(prefix_lens.unsqueeze(1), self._block_pos_offsets, out=positions_2d)
                block_loc_2d.copy_(
                    assign_extend_cache_locs_func(
                        req_pool_indices=batch.req_pool_indices,
                        req_to_token=req_to_token,
                        start_offset=prefix_lens,
                        end_offset=prefix_lens + block_size,
                        batch_size=bs,
                        draft_token_num=block_size,
                        device=device,
                    ).view(bs, block_size)
                )
            positions = positions_2d.reshape(-1)
            block_loc = block_loc_2d.reshape(-1)
            if self._full_embed_gpu is not None:
                noise = torch.nn.functional.embedding(block_ids, self._full_embed_gpu)
            else:
                embed = unwrap_lora_layer(_resolve_dflash_embedding_module(self.draft_model, target_model))
                noise = embed(block_ids)
            if self._noise_embed_scale != 1.0:
                noise = noise * self._noise_embed_scale

            block_plan = self.target_worker.model_runner.kv_index_translator.plan(
                req_pool_indices=batch.req_pool_indices,
                seq_lens=prefix_lens,
                seq_lens_cpu=(
                    batch.seq_lens_cpu if batch.seq_lens_cpu is not None else draft_input.nxt_kv_lens_cpu
                ),
                write_virtual=block_loc,
                read_extent=block_size,
            )
            if batch.seq_lens_cpu is not None:
                draft_seq_lens_cpu = batch.seq_lens_cpu.to(torch.int64) + block_size
            elif draft_input.nxt_kv_lens_cpu is not None:
                draft_seq_lens_cpu = draft_input.nxt_kv_lens_cpu.to(torch.int64)
            else:
                draft_seq_lens_cpu = torch.tensor(
                    [req.kv.kv_allocated_len for req in batch.reqs], dtype=torch.int64
                )
            forward_batch = ForwardBatch(
                forward_mode=ForwardMode.TARGET_VERIFY,
                batch_size=bs,
                input_ids=block_ids.flatten(),
                req_pool_indices=batch.req_pool_indices,
                seq_lens=prefix_lens,
                out_cache_loc=block_loc,
                seq_lens_sum=int(draft_seq_lens_cpu.sum()),
                seq_lens_cpu=draft_seq_lens_cpu,
                positions=positions,
                input_embeds=noise.view(-1, noise.shape[-1]),
                spec_algorithm=SpeculativeAlgorithm.DFLASH,
                spec_info=self._draft_block_spec_info,
                capture_hidden_mode=CaptureHiddenMode.NULL,
                num_token_non_padded=(
                    torch.full((), bs * block_size, dtype=torch.int32, device=device)
                    if enable_num_token_non_padded()
                    else None
                ),
                global_num_token_non_padded_cpu=bs * block_size,
                can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph,
            )
            block_plan.bind(forward_batch, self.draft_model_runner.kv_index_translator)
            with torch.inference_mode(), draft_tp_context(self.draft_parallel_layout):
                draft_out = self.draft_model_runner.forward(forward_batch)
            hidden = draft_out.logits_output.hidden_states
            if hidden is None:
                raise RuntimeError("DDTREE: the DFlash draft model returned no hidden states.")
            hidden = hidden[: bs * block_size].view(bs, block_size, -1)[:, 1:, :]
            return hidden, block_plan, bool(getattr(draft_out, "can_run_graph", False)), positions

        def ddtree_inv_temperature(self, sampling_info):
            """Per request, the inverse temperature its tree is scored at (None: all
            untempered: greedy rows carry temperature 1, and the raw distribution)."""
            if (
                sampling_info is not None
                and not sampling_info.is_all_greedy
                and self.ddtree_config.tree_distribution == "request"
            ):
                return sampling_info.temperatures.view(-1).float().reciprocal()
            return None

        def ddtree_draft_topk(self, draft_hidden, sampling_info=None):
            """Per-depth top-k log-probs of the draft positions through the
            target's LM head, exact over the whole vocabulary under TP, at each
            request's temperature (greedy rows carry temperature 1: untempered).
            The top-k/top-p restriction runs in the tree step."""
            bs, depth, hidden_size = draft_hidden.shape
            lm_head = unwrap_lora_layer(getattr(self.target_worker.model_runner.model, "lm_head", None))
            shard = getattr(lm_head, "shard_indices", None)
            tp_group = get_parallel().tp_group
            tp_size = int(tp_group.world_size)
            if shard is not None:
                num_org, vocab_start = int(shard.num_org_elements), int(shard.org_vocab_start_index)
            else:
                num_org, vocab_start = int(self.model_runner.model_config.vocab_size), 0
            hs = draft_hidden.reshape(-1, hidden_size)
            weight = getattr(lm_head, "weight", None)
            if is_dense_head_weight(weight):
                local = torch.matmul(hs.to(weight.dtype), weight[:num_org].T)
            else:  # quantised head (TP 1, checked at start-up): the layer's own kernel
                local = lm_head.quant_method.apply(lm_head, hs, None)[:, :num_org]

            lp, ids = vocab_parallel_topk_logprobs(
                local,
                self.ddtree_config.topk_cap,
                vocab_start=vocab_start,
                gather=functools.partial(tp_all_gather, tp_group) if tp_size > 1 else None,
                inv_temperature=self.ddtree_inv_temperature(sampling_info),
            )
            k = lp.shape[-1]
            return lp.view(bs, depth, k), ids.view(bs, depth, k)

        def ddtree_verify_input(self, batch, draft_input, top_lp, top_ids):
            """Tree -> ``DDTreeVerifyInput`` over ``req_to_token[prefix : prefix + W]``
            (the window the patched DFlash reservation covers). The tree work is
            one graph replay (``DDTreeStepRunner``); its mask is the target
            backend's verify-mask buffer with only the tree window written."""
            cfg = self.ddtree_config
            bs = len(batch.seq_lens)
            prefix_lens = batch.seq_lens
            W = cfg.verify_width
            runner = self.ddtree_tree_runner()
            info = batch.sampling_info
            if info is not None and cfg.tree_distribution == "request" and not info.is_all_greedy:
                top_k, top_p = info.top_ks, info.top_ps
            else:  # every row greedy (top-k 1) or the raw distribution: nothing to restrict
                top_k = top_p = None

            def mask_numel() -> int:
                # A batch past the backend's buffer gets a fresh mask, sized from
                # host lengths (no device->host sync): the FULL_MASK bound.
                host_prefix = host_prefix_bound(
                    batch.seq_lens_cpu,
                    getattr(draft_input, "nxt_kv_lens_cpu", None),
                    int(self.model_runner.model_config.context_len),
                    int(self.block_size),
                )
                return W * int(host_prefix.sum()) + bs * W * W

            out, mask = runner.run(
                top_lp, top_ids, top_k, top_p, draft_input.bonus_tokens.view(-1), prefix_lens,
                mask_numel=mask_numel,
            )
            tree_loc = assign_extend_cache_locs_func(
                req_pool_indices=batch.req_pool_indices,
                req_to_token=self.model_runner.req_to_token_pool.req_to_token,
                start_offset=prefix_lens,
                end_offset=prefix_lens + W,
                batch_size=bs,
                draft_token_num=W,
                device=self.device,
            )
            tree_plan = self.target_worker.model_runner.kv_index_translator.plan(
                req_pool_indices=batch.req_pool_indices,
                seq_lens=prefix_lens,
                seq_lens_cpu=(
                    batch.seq_lens_cpu if batch.seq_lens_cpu is not None else draft_input.nxt_kv_lens_cpu
                ),
                write_virtual=tree_loc,
                read_extent=W,
            )
            batch.out_cache_loc = tree_loc
            return DDTreeVerifyInput(
                draft_token=out.draft_token.reshape(bs * W),
                positions=out.positions.reshape(bs * W),
                draft_token_num=W,
                custom_mask=mask,
                retrieve_index=runner.retrieve_index(bs),
                retrieve_next_token=out.retrive_next_token,
                retrieve_next_sibling=out.retrive_next_sibling,
                max_depth=cfg.max_depth,
                kv_loc_plan=tree_plan,
            )

        def ddtree_target_verify(self, batch, draft_input, verify_input):
            """The target forward in TARGET_VERIFY through the target worker
            (CUDA graph when the runner can replay this batch). Under TP the
            logits come back as each rank's vocabulary shard: a plain greedy
            batch takes DFLASH's deferred path (only each row's maximum crosses
            TP, ``deferred_argmax``, and the logits are dropped) and returns the
            target's prediction per node; any other batch gets the full logits
            gathered (sampling, logprobs, grammar, processors need them).
            Returns ``(target_out, logits_output, target_predict or None)``."""
            W = self.ddtree_config.verify_width
            backup = (batch.seq_lens_cpu, batch.seq_lens_sum)
            if batch.seq_lens_cpu is not None:
                verify_host = batch.seq_lens_cpu.to(torch.int64) + W
            else:
                verify_host = draft_input.nxt_kv_lens_cpu
            if verify_host is not None:
                batch.seq_lens_cpu = verify_host
                batch.seq_lens_sum = int(verify_host.sum())
            verify_fb, _ = verify_input.prepare_for_verify(batch, self.target_worker)
            batch.seq_lens_cpu, batch.seq_lens_sum = backup
            target_out = self.target_worker.forward_batch_generation(
                batch=None, forward_batch=verify_fb, is_verify=True, skip_attn_backend_init=True
            )
            logits_output = target_out.logits_output
            target_predict = None
            target_lp = self._target_logits_processor
            if target_lp is not None and target_lp.is_deferred_shard(logits_output.next_token_logits):
                if self._can_skip_verify_logits(batch, batch.sampling_info) and SIMULATE_ACC_LEN <= 0:
                    target_predict = target_lp.deferred_argmax(logits_output.next_token_logits)
                    logits_output.next_token_logits = None
                else:
                    logits_output.next_token_logits = target_lp.finish_deferred_gather(
                        logits_output.next_token_logits
                    )
            return target_out, logits_output, target_predict

        def ddtree_greedy_walk(self, batch, verify_input, target_predict):
            """The greedy tree walk on the target's per-node prediction, as
            ``eagle_sample``'s greedy branch runs it (same kernel, outputs and
            layout), for a batch that has nothing else to apply to the logits.
            The prediction is the one value rank 0 decides (broadcast, as DFLASH
            broadcasts its own); the walk is then the same on every rank."""
            bs, W = len(batch.seq_lens), self.ddtree_config.verify_width
            device = target_predict.device
            target_predict = self._tp_sync.sync(
                SpecTpSyncSite.DFLASH_ACCEPT_GREEDY, target_predict.view(bs, W)
            )
            # Only the accepted nodes' predictions are ever read (the commit
            # kernel), and the walk writes every one of them: no fill.
            predict = torch.empty((bs * W,), dtype=torch.int32, device=device)
            accept_index = torch.full(
                (bs, verify_input.max_tree_depth), -1, dtype=torch.int32, device=device
            )
            num_correct = torch.empty((bs,), dtype=torch.int32, device=device)
            # eagle_sample's own function, looked up as eagle_sample looks it up
            predict, accept_index, num_correct = eagle_utils.verify_tree_greedy_func(
                predicts=predict,
                accept_index=accept_index,
                accept_token_num=num_correct,
                candidates=verify_input.draft_token.reshape(bs, W),
                retrieve_index=verify_input.retrieve_index,
                retrieve_next_token=verify_input.retrieve_next_token,
                retrieve_next_sibling=verify_input.retrieve_next_sibling,
                target_predict=target_predict,
                topk=verify_input.tree_topk,
            )
            return predict, num_correct + 1, accept_index

        def ddtree_accept_and_commit(
            self, batch, verify_input, target_out, logits_output, block_plan, *,
            draft_input, block_positions, on_publish=None, grammar_barrier=None, grammar_tree=None,
            target_predict=None,
        ):
            cfg = self.ddtree_config
            bs = len(batch.seq_lens)
            W = cfg.verify_width
            block_size = int(self.block_size)
            prefix_lens = batch.seq_lens

            if target_predict is not None:  # plain greedy, deferred: no logits were gathered
                predict, accept_lens, accept_index = self.ddtree_greedy_walk(
                    batch, verify_input, target_predict
                )
            else:
                predict, accept_lens, accept_index = self.ddtree_accept_from_logits(
                    batch, verify_input, logits_output, grammar_tree, grammar_barrier
                )

            # One launch for the accept's bookkeeping, as DFLASH's accept is one: the
            # committed block, new lengths, the KV moves and the front rows' indices.
            step = ddtree_commit_step(
                predict, accept_index, accept_lens, batch.out_cache_loc, prefix_lens, block_size
            )
            # Target KV of the accepted nodes to the window front, one move (NGRAM's
            # effect; a node already at its slot moves onto itself). A chain (top-k
            # cap 1: node i is the one node at depth i) accepts nodes 0..n-1, already
            # at the front: no move at all, as in DFLASH.
            if cfg.topk_cap > 1:
                ddtree_verify.move_accepted_kv(
                    self.model_runner.token_to_kv_pool_allocator.get_kvcache(), step.kv_tgt, step.kv_src,
                    accept_index.shape[1],
                )
            if batch.return_logprob:
                compute_spec_logprobs(batch, logits_output, predict, accept_index=accept_index)
            out_tokens, commit_lens, bonus = step.out_tokens, step.commit_lens, step.bonus
            self.ddtree_capture_sampling_mask(
                batch, draft_input, logits_output, accept_index, out_tokens, commit_lens
            )
            new_seq_lens = step.new_seq_lens.to(prefix_lens.dtype)
            if on_publish is not None:
                on_publish(new_seq_lens)

            # Draft KV for the committed tokens, from the accepted nodes' target
            # hidden states, at positions prefix..prefix+commit-1.
            hidden = logits_output.hidden_states
            if hidden is None:
                raise RuntimeError("DDTREE verify requires target hidden states, got None.")
            front = hidden.reshape(bs * W, -1).index_select(0, step.front_index)
            front.masked_fill_(step.front_drop.unsqueeze(1), 0)
            cache_loc = self._draft_write_ids(block_plan)
            self._append_target_hidden_to_draft_kv_by_loc(
                target_hidden=front,
                cache_loc=cache_loc,
                cache_loc_2d=cache_loc.view(bs, block_size),
                positions=block_positions,  # prefix .. prefix + block - 1, from the draft block
                commit_lens=commit_lens,
            )
            logits_output.hidden_states = None
            batch.forward_mode = ForwardMode.DECODE

            return GenerationBatchResult(
                logits_output=logits_output,
                next_token_ids=out_tokens.reshape(-1),
                accept_lens=commit_lens,
                can_run_cuda_graph=bool(target_out.can_run_cuda_graph),
                next_draft_input=self._make_next_draft_input_decode(
                    bonus_tokens=bonus, new_seq_lens=new_seq_lens
                ),
                speculative_num_draft_tokens=block_size,
                new_seq_lens=new_seq_lens,
                routed_experts_output=target_out.routed_experts_output,
                indexer_topk_output=target_out.indexer_topk_output,
            )

        def ddtree_accept_from_logits(self, batch, verify_input, logits_output, grammar_tree, grammar_barrier):
            """Acceptance on the full logits: grammar, custom processors, then
            SGLang's tree acceptance (greedy or sampled), as EAGLE and NGRAM."""
            W = self.ddtree_config.verify_width
            sampling_info = batch.sampling_info
            grammar_mask = None
            if grammar_tree is not None:
                grammar_mask = build_grammar_vocab_mask(
                    reqs=batch.reqs,
                    tree=grammar_tree,
                    sampling_info=sampling_info,
                    device=logits_output.next_token_logits.device,
                    barrier=grammar_barrier,
                )
            # Custom logit processors see every tree row, as DFLASH applies them
            # to every block row in its verify (eagle_sample does not apply them).
            # Each row gets its request's params, so one that reads the request's
            # history would see the root's on every node: those are refused at
            # admission (ddtree_args.reads_request_history).
            if sampling_info is not None and sampling_info.has_custom_logit_processor:
                apply_custom_logit_processor(
                    logits_output.next_token_logits, sampling_info, num_tokens_in_batch=W
                )
            predict, accept_lens, accept_index = eagle_sample(
                verify_input,
                batch,
                logits_output,
                grammar_mask,
                watermark_state=self.model_runner.watermark_state,
            )
            # A sampled walk is broadcast from rank 0 inside eagle_sample. A greedy
            # one on the full logits is the same on every rank; it is broadcast
            # once, packed, as DFLASH broadcasts its greedy prediction.
            if sampling_info is None or sampling_info.is_all_greedy:
                if self._tp_sync.enabled(SpecTpSyncSite.DFLASH_ACCEPT_GREEDY):
                    sizes = (predict.numel(), accept_index.numel(), accept_lens.numel())
                    packed = torch.cat(
                        [predict.view(-1), accept_index.view(-1), accept_lens.view(-1).to(predict.dtype)]
                    )
                    self._tp_sync.sync(SpecTpSyncSite.DFLASH_ACCEPT_GREEDY, packed)
                    p, a, n = packed.split(sizes)
                    predict = p.view_as(predict)
                    accept_index = a.view_as(accept_index)
                    accept_lens = n.to(accept_lens.dtype).view_as(accept_lens)
            return predict, accept_lens, accept_index

        def ddtree_capture_sampling_mask(
            self, batch, draft_input, logits_output, accept_index, out_tokens, commit_lens
        ):
            """``return_sampling_mask`` requests get the distribution each committed
            token was drawn from: the target's verify distribution at the node the
            walk accepted it under (the logits after penalties, bias, grammar and
            custom processors, which eagle_sample applied in place), gathered along
            the accepted path into DFlash's committed-block layout, then
            SGLang's own capture (as DFlash's decode step builds it)."""
            info = batch.sampling_info
            if info is None or info.sampling_mask_batch_indices is None:
                return
            block_size = int(self.block_size)
            path_logits = front_rows(logits_output.next_token_logits, accept_index, block_size)
            capture = SpeculativeSamplingMaskCapture.from_logits(
                info,
                next_token_logits=path_logits,
                draft_input=draft_input,
                draft_token_num=block_size,
                bs=len(batch.seq_lens),
            )
            if capture is not None:
                logits_output.sampling_mask_output = capture.build_output(
                    out_tokens=out_tokens, commit_lens=commit_lens
                )

    DDTreeWorkerV2.DDTreeVerifyInput = DDTreeVerifyInput
    return DDTreeWorkerV2


def get_ddtree_worker_cls() -> type:
    """The worker class, built on first use (imports SGLang's DFlash worker)."""
    global _WORKER_CLS
    if _WORKER_CLS is None:
        _WORKER_CLS = _build_worker_cls()
    return _WORKER_CLS
