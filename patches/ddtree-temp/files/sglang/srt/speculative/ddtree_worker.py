"""DDTree worker for SGLang 0.5.23 (ddtree-temp patch set).

Module level imports only stdlib, torch and the other ddtree modules; the
DFlash worker (and through it SGLang's scheduler, kernels and model code) is
imported by :func:`get_ddtree_worker_cls` on first use, the way SGLang's spec
registry imports workers lazily.

STATUS (see patches/ddtree-temp/README.md): version 1.1.0 adds the tree
verify step (``DDTreeWorkerV2._ddtree_decode``): DFlash draft block (eager) ->
top-k draft log-probs -> DDTree -> ``DDTreeVerifyInput`` (a DFlashVerifyInput
with node-order tokens, positions prefix + depth, FULL_MASK custom mask, width
budget + 1, eager) -> tree greedy verify / sampling path -> accepted path
committed in path order, its target KV moved to the window front (EAGLE's
topk > 1 scheme), its hidden states compacted and materialised into the draft
KV. The pure parts are in ddtree_verify and proven on CPU; the GPU step has
NOT been executed. It runs only with ``--speculative-ddtree-tree-verify`` and
when :func:`tree_verify_blockers` finds nothing; otherwise DDTree decodes with
DFlash's own chain verify, which is lossless at every temperature.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sglang.srt.speculative.ddtree_utils import (
    DDTree,
    RetrieveEncoding,
    build_ddtree_tree,
    compile_ddtree_retrieve,
    ddtree_positions,
    ddtree_tree_mask,
    draft_topk_logprobs,
)

logger = logging.getLogger(__name__)

_WORKER_CLS: Optional[type] = None


class DDTreeConfig:
    def __init__(self, budget: int, topk_cap: int, debug_metrics: bool = False):
        if budget < 1 or not 1 <= topk_cap <= budget:
            raise ValueError(f"invalid DDTree config budget={budget} topk_cap={topk_cap}")
        self.budget = int(budget)
        self.topk_cap = int(topk_cap)
        self.debug_metrics = bool(debug_metrics)

    @property
    def verify_width(self) -> int:
        return self.budget + 1

    @classmethod
    def from_server_args(cls, server_args) -> "DDTreeConfig":
        budget = getattr(server_args, "speculative_ddtree_budget", None)
        cap = getattr(server_args, "speculative_ddtree_topk_cap", None)
        if budget is None:
            raise ValueError("DDTree worker needs speculative_ddtree_budget")
        return cls(budget, cap if cap is not None else budget,
                   getattr(server_args, "speculative_ddtree_debug_metrics", False))


class DDTreePlan:
    """Everything the target verify forward needs for one step."""

    def __init__(self, tree: DDTree, retrieve: RetrieveEncoding, positions: torch.Tensor, tree_mask: torch.Tensor):
        self.tree = tree
        self.retrieve = retrieve
        self.positions = positions
        self.tree_mask = tree_mask


def plan_ddtree_step(
    draft_logits: torch.Tensor,
    root_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    config: DDTreeConfig,
) -> DDTreePlan:
    """Draft logits [bs, L, V] of the DFlash block (positions 1..L) -> tree,
    kernel encoding, positions (seq_lens + depth) and ancestor mask."""
    k = min(config.topk_cap, config.budget, draft_logits.shape[-1])
    top = draft_topk_logprobs(draft_logits, k)
    tree = build_ddtree_tree(top, config.budget, config.topk_cap, root_tokens=root_tokens)
    retrieve = compile_ddtree_retrieve(tree.parents, tree.scores)
    positions = ddtree_positions(tree.depths, seq_lens)
    mask = ddtree_tree_mask(tree.parents, max_depth=draft_logits.shape[1])
    return DDTreePlan(tree, retrieve, positions, mask)


# Attention backends whose *eager* TARGET_VERIFY honours
# DFlashVerifyInput.custom_mask in 0.5.23 (flashinfer_backend.py: the
# DFLASH_VERIFY branch of the prefill indices updater passes
# generate_attn_arg_prefill's mask to plan(); triton_backend.py:
# init_forward_metadata's target-verify branch reads spec_info.custom_mask with
# mask_indptr = W * (seq_lens + W)). Other backends gate tree masks on topk > 1
# or ignore the mask: they would verify a tree with a causal mask (wrong).
MASK_BACKENDS = ("FlashInferAttnBackend", "TritonAttnBackend")


def tree_verify_blockers(
    *,
    enabled: bool,
    attn_backend: str,
    page_size: int,
    head_tp_size: int,
    attn_dp: bool,
    compact_draft_cache: bool,
    mamba: bool,
    selector: bool,
    domino: bool,
    simulate_acc: bool,
    ragged_verify: bool,
) -> list:
    """Static reasons the tree verify cannot run (empty list = it may).
    Any reason keeps DDTree on DFlash's chain verify (lossless)."""
    why = []
    if not enabled:
        why.append("--speculative-ddtree-tree-verify is off")
    if attn_backend not in MASK_BACKENDS:
        why.append(f"attention backend {attn_backend} does not apply a custom verify mask")
    if page_size != 1:
        why.append(f"page size {page_size} != 1 (window KV moves assume token pages)")
    if head_tp_size != 1:
        why.append("vocab-parallel draft head (TP > 1): top-k needs gathered logits")
    if attn_dp:
        why.append("DP attention")
    if compact_draft_cache:
        why.append("sliding-window (compact) draft cache")
    if mamba:
        why.append("mamba/hybrid target state")
    if selector:
        why.append("selector/LiLiCorr draft head")
    if domino:
        why.append("Domino draft rollout")
    if simulate_acc:
        why.append("simulated acceptance")
    if ragged_verify:
        why.append("ragged verify layout")
    return why


def batch_blockers(*, has_grammar: bool, return_logprob: bool) -> list:
    """Per-batch reasons (these batches use the chain verify for that step)."""
    why = []
    if has_grammar:
        why.append("grammar")
    if return_logprob:
        why.append("return_logprob")
    return why


def _build_worker_cls() -> type:
    from sglang.srt.lora.layers import unwrap_lora_layer
    from sglang.srt.managers.scheduler import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
        enable_num_token_non_padded,
    )
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
    from sglang.srt.runtime_context import get_parallel, get_schedule
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput
    from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments
    from sglang.srt.speculative.dflash_worker_v2 import (
        DFlashWorkerV2,
        _resolve_dflash_embedding_module,
    )
    from sglang.srt.speculative.dspark_components.dspark_draft import resolve_greedy_mask
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite
    from sglang.srt.speculative.spec_utils import SIMULATE_ACC_LEN, draft_tp_context
    from sglang.srt.speculative.ddtree_verify import (
        accept_kv_moves,
        compact_to_front,
        ddtree_accept,
        ddtree_commit,
        ddtree_prepare_verify,
        front_positions,
    )

    class DDTreeVerifyInput(DFlashVerifyInput):
        """DFlash verify input carrying a draft tree: ``draft_token`` in node
        order, ``positions`` = prefix + depth, ``custom_mask`` FULL_MASK,
        ``draft_token_num`` = W = budget + 1. Always eager: the captured
        target-verify graphs are block_size wide and causal (flashinfer
        asserts capture and replay agree on the custom mask)."""

        def prepare_for_verify(self, batch, target_worker, *, defer_metadata_init=False):
            batch.input_ids = self.draft_token
            batch.spec_info = self
            batch.forward_mode = ForwardMode.TARGET_VERIFY
            fb = ForwardBatch.init_new(
                batch,
                target_worker.model_runner,
                capture_hidden_mode=self.capture_hidden_mode,
                return_hidden_states_before_norm=False,
                kv_loc_plan=self.kv_loc_plan,
                write_cols=self.kv_loc_cols,
            )
            fb.can_run_decode_cuda_graph = False
            target_worker.model_runner.attn_backend.init_forward_metadata(fb)
            return fb, False

    class DDTreeWorkerV2(DFlashWorkerV2):
        """DFlash worker that verifies a DDTree draft tree (see module docstring).

        Chain verify (DFlash's own forward) is used whenever
        :func:`tree_verify_blockers` or :func:`batch_blockers` name a reason;
        the reasons are logged once at start-up.
        """

        def __init__(self, server_args, *args, **kwargs):
            super().__init__(server_args, *args, **kwargs)
            self.ddtree_config = DDTreeConfig.from_server_args(server_args)
            self._ddtree_blockers = None
            self._ddtree_enabled = bool(
                getattr(server_args, "speculative_ddtree_tree_verify", False)
            )

        def _ddtree_static_blockers(self) -> list:
            if self._ddtree_blockers is None:
                import os

                target_model = self.target_worker.model_runner.model
                lm_head = unwrap_lora_layer(getattr(target_model, "lm_head", None))
                head_tp = int(getattr(lm_head, "tp_size", 1) or 1)
                if getattr(lm_head, "weight", None) is None or getattr(
                    getattr(lm_head, "quant_method", None), "__class__", type(None)
                ).__name__ not in ("UnquantizedEmbeddingMethod", "NoneType"):
                    head_tp = max(head_tp, 2)  # quantised head: no plain matmul
                self._ddtree_blockers = tree_verify_blockers(
                    enabled=self._ddtree_enabled,
                    attn_backend=type(self.target_worker.model_runner.attn_backend).__name__,
                    page_size=int(get_schedule().page_size),
                    head_tp_size=head_tp,
                    attn_dp=bool(get_parallel().attn_dp_enabled),
                    compact_draft_cache=bool(self.use_compact_draft_cache),
                    mamba=bool(self._need_mamba_verify_commit),
                    selector=self.selector is not None or self.lilicorr is not None,
                    domino=bool(self._is_domino),
                    simulate_acc=SIMULATE_ACC_LEN > 0,
                    ragged_verify=bool(os.environ.get("SGLANG_RAGGED_VERIFY_MODE")),
                )
                if self._ddtree_blockers:
                    logger.warning(
                        "DDTREE budget=%d topk_cap=%d: tree verify disabled (%s); "
                        "decoding uses DFlash's lossless chain verify.",
                        self.ddtree_config.budget,
                        self.ddtree_config.topk_cap,
                        "; ".join(self._ddtree_blockers),
                    )
                else:
                    logger.warning(
                        "DDTREE budget=%d topk_cap=%d: EXPERIMENTAL tree verify on "
                        "(eager target verify, %d tokens per request).",
                        self.ddtree_config.budget,
                        self.ddtree_config.topk_cap,
                        self.ddtree_config.verify_width,
                    )
            return self._ddtree_blockers

        def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None,
                                     pp_proxy_tensors=None):
            if (
                batch.forward_mode.is_extend()
                or batch.is_extend_in_batch
                or batch.forward_mode.is_idle()
                or self._ddtree_static_blockers()
                or batch_blockers(
                    has_grammar=bool(batch.has_grammar),
                    return_logprob=bool(batch.return_logprob),
                )
            ):
                return super().forward_batch_generation(
                    batch,
                    on_publish=on_publish,
                    grammar_barrier=grammar_barrier,
                    pp_proxy_tensors=pp_proxy_tensors,
                )
            return self._ddtree_decode(batch, on_publish)

        # -- the tree decode step (NOT EXECUTED: needs a GPU) -----------------
        def _ddtree_decode(self, batch, on_publish):
            cfg = self.ddtree_config
            draft_input = batch.spec_info
            batch.seq_lens.record_stream(
                torch.get_device_module(self.device).current_stream()
            )
            bs = len(batch.seq_lens)
            device = self.device
            block_size = int(self.block_size)
            W = cfg.verify_width
            runner = self.target_worker.model_runner
            req_to_token = self.model_runner.req_to_token_pool.req_to_token
            prefix_lens = batch.seq_lens

            # 1) DFlash draft block, as DFlashWorkerV2 (eager path), eager draft
            target_model = runner.model
            embed_module = unwrap_lora_layer(
                _resolve_dflash_embedding_module(self.draft_model, target_model)
            )
            lm_head = unwrap_lora_layer(getattr(target_model, "lm_head", None))
            block_ids = torch.full(
                (bs, block_size), int(self._mask_token_id), dtype=torch.long, device=device
            )
            block_ids[:, 0].copy_(draft_input.bonus_tokens)
            block_positions = (
                prefix_lens.unsqueeze(1).to(torch.int64) + self._block_pos_offsets
            ).reshape(-1)
            block_loc = assign_extend_cache_locs_func(
                req_pool_indices=batch.req_pool_indices,
                req_to_token=req_to_token,
                start_offset=prefix_lens,
                end_offset=prefix_lens + block_size,
                batch_size=bs,
                draft_token_num=block_size,
                device=device,
            )
            if self._full_embed_gpu is not None:
                noise = torch.nn.functional.embedding(block_ids, self._full_embed_gpu)
            else:
                noise = embed_module(block_ids)
            if self._noise_embed_scale != 1.0:
                noise = noise * self._noise_embed_scale
            seq_lens_cpu_bound = (
                batch.seq_lens_cpu
                if batch.seq_lens_cpu is not None
                else draft_input.nxt_kv_lens_cpu
            )
            block_plan = runner.kv_index_translator.plan(
                req_pool_indices=batch.req_pool_indices,
                seq_lens=prefix_lens,
                seq_lens_cpu=seq_lens_cpu_bound,
                write_virtual=block_loc,
                read_extent=block_size,
            )
            # Exact host lengths (one sync; the tree path is eager anyway).
            prefix_cpu = prefix_lens.to("cpu", dtype=torch.int64)
            prefix_sum = int(prefix_cpu.sum())
            draft_fb = ForwardBatch(
                forward_mode=ForwardMode.TARGET_VERIFY,
                batch_size=bs,
                input_ids=block_ids.flatten(),
                req_pool_indices=batch.req_pool_indices,
                seq_lens=prefix_lens,
                out_cache_loc=block_loc,
                seq_lens_sum=prefix_sum + bs * block_size,
                seq_lens_cpu=prefix_cpu + block_size,
                positions=block_positions,
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
                can_run_decode_cuda_graph=False,  # keep hidden states (no in-graph argmax)
            )
            block_plan.bind(draft_fb, self.draft_model_runner.kv_index_translator)
            with torch.inference_mode(), draft_tp_context(self.draft_parallel_layout):
                draft_out = self.draft_model_runner.forward(draft_fb)
            draft_hidden = draft_out.logits_output.hidden_states
            if draft_hidden is None:
                raise RuntimeError("DDTREE: DFLASH draft model returned no hidden states.")
            draft_hidden = draft_hidden.view(bs, block_size, -1)[:, 1:, :]
            shard = getattr(lm_head, "shard_indices", None)
            vocab = (
                int(shard.num_org_elements)
                if shard is not None
                else int(runner.model_config.vocab_size)
            )
            weight = lm_head.weight[:vocab]  # TP 1: rows are token ids 0..vocab-1
            draft_logits = torch.matmul(draft_hidden.to(weight.dtype), weight.T)

            # 2) tree, retrieve arrays, FULL_MASK, positions (ddtree_verify)
            plan = ddtree_prepare_verify(
                draft_logits,
                draft_input.bonus_tokens.view(-1),
                prefix_lens,
                cfg.budget,
                cfg.topk_cap,
                seq_lens_sum=prefix_sum,
            )
            tree_loc = assign_extend_cache_locs_func(
                req_pool_indices=batch.req_pool_indices,
                req_to_token=req_to_token,
                start_offset=prefix_lens,
                end_offset=prefix_lens + W,
                batch_size=bs,
                draft_token_num=W,
                device=device,
            )
            tree_plan = runner.kv_index_translator.plan(
                req_pool_indices=batch.req_pool_indices,
                seq_lens=prefix_lens,
                seq_lens_cpu=seq_lens_cpu_bound,
                write_virtual=tree_loc,
                read_extent=W,
            )
            verify_input = DDTreeVerifyInput(
                draft_token=plan.draft_token,
                positions=plan.positions,
                draft_token_num=W,
                custom_mask=plan.custom_mask,
                capture_hidden_mode=CaptureHiddenMode.FULL,
                kv_loc_plan=tree_plan,
            )
            batch.out_cache_loc = tree_loc
            sampling_info = batch.sampling_info
            backup = (batch.seq_lens_cpu, batch.seq_lens_sum)
            batch.seq_lens_cpu = prefix_cpu + W
            batch.seq_lens_sum = prefix_sum + bs * W
            verify_fb, _ = verify_input.prepare_for_verify(batch, self.target_worker)
            batch.seq_lens_cpu, batch.seq_lens_sum = backup

            # 3) target verify forward over bs * W tokens
            target_out = self.target_worker.forward_batch_generation(
                batch=None,
                forward_batch=verify_fb,
                is_verify=True,
                skip_attn_backend_init=True,
            )
            logits_output = target_out.logits_output
            target_lp = self._target_logits_processor
            if target_lp is not None and target_lp.is_deferred_shard(
                logits_output.next_token_logits
            ):
                logits_output.next_token_logits = target_lp.finish_deferred_gather(
                    logits_output.next_token_logits
                )
            logits = logits_output.next_token_logits
            all_greedy = sampling_info is None or sampling_info.is_all_greedy
            if sampling_info is not None:
                apply_dflash_verify_logits_adjustments(
                    next_token_logits=logits,
                    sampling_info=sampling_info,
                    draft_token_num=W,
                )

            # 4) accept: tree greedy verify or the sampling path
            if all_greedy:
                predicts, accept_index, accept_num = ddtree_accept(logits, plan)
                site = SpecTpSyncSite.DFLASH_ACCEPT_GREEDY
            else:
                predicts, accept_index, accept_num = ddtree_accept(
                    logits,
                    plan,
                    temperatures=sampling_info.temperatures.view(-1),
                    top_ks=sampling_info.top_ks.view(-1),
                    top_ps=sampling_info.top_ps.view(-1),
                    greedy=resolve_greedy_mask(bs=bs, sampling_info=sampling_info, device=device),
                    all_greedy=False,
                )
                site = SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE
            self._tp_sync.sync(site, predicts)
            self._tp_sync.sync(site, accept_index)
            self._tp_sync.sync(site, accept_num)

            # 5) commit the accepted path: tokens, target KV moved to the
            #    window front (EAGLE topk > 1), hidden states compacted
            commit = ddtree_commit(predicts, accept_index, accept_num, W)
            tgt, src = accept_kv_moves(tree_loc, accept_index, accept_num)
            # same pool call as EAGLE's move_accept_tokens_to_target_kvcache
            runner.token_to_kv_pool.move_kv_cache(tgt, src)
            new_seq_lens = prefix_lens + commit.commit_lens.to(prefix_lens.dtype)
            if on_publish is not None:
                on_publish(new_seq_lens)

            # 6) draft KV for the committed tokens (DFlash materialisation)
            hidden = logits_output.hidden_states
            if hidden is None:
                raise RuntimeError("DDTREE verify requires target hidden states, got None.")
            hidden = compact_to_front(hidden.reshape(bs * W, -1), accept_index, bs, W)
            cache_loc = self._draft_write_ids(tree_plan)
            self._append_target_hidden_to_draft_kv_by_loc(
                target_hidden=hidden,
                cache_loc=cache_loc,
                cache_loc_2d=cache_loc.view(bs, W),
                positions=front_positions(prefix_lens, W),
                commit_lens=commit.commit_lens,
            )
            logits_output.hidden_states = None
            logits_output.next_token_logits = compact_to_front(logits, accept_index, bs, W)

            next_draft_input = self._make_next_draft_input_decode(
                bonus_tokens=commit.bonus, new_seq_lens=new_seq_lens
            )
            return GenerationBatchResult(
                logits_output=logits_output,
                next_token_ids=commit.out_tokens.reshape(-1),
                accept_lens=commit.commit_lens,
                can_run_cuda_graph=False,
                next_draft_input=next_draft_input,
                speculative_num_draft_tokens=W,
                speculative_output_stride=W,
                new_seq_lens=new_seq_lens,
                routed_experts_output=target_out.routed_experts_output,
                indexer_topk_output=target_out.indexer_topk_output,
            )

    DDTreeWorkerV2.DDTreeVerifyInput = DDTreeVerifyInput
    return DDTreeWorkerV2


def get_ddtree_worker_cls() -> type:
    """The worker class, built on first use (imports SGLang's DFlash worker)."""
    global _WORKER_CLS
    if _WORKER_CLS is None:
        _WORKER_CLS = _build_worker_cls()
    return _WORKER_CLS
