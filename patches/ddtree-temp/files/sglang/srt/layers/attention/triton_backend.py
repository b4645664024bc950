from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

import torch
import triton

from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton
from sglang.kernels.ops.attention.mla_kv_pack_quantize_fp8 import (
    mla_kv_pack_quantize_fp8,
)
from sglang.srt.configs.hybrid_arch import mambaish_config
from sglang.srt.configs.model_config import (
    AttentionArch,
    is_dspark_draft,
    is_kimi_k3,
    is_qwen3_5,
)
from sglang.srt.distributed.device_communicators.pynccl_allocator import (
    use_symmetric_memory,
)
from sglang.srt.environ import envs
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.verify_mask import VerifyMask, maybe_create_verify_mask
from sglang.srt.layers.dcp import (
    cp_lse_ag_out_rs_mha,
    create_triton_kv_indices_for_dcp_triton,
    get_dcp_lens,
)
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool
from sglang.srt.mem_cache.kv_loc_plan import IdSpaceKind
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.model_executor.cuda_graph_config import (
    Backend,
    Phase,
    check_cuda_graph_backend,
    cuda_graph_fully_disabled,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.runtime_context import get_exec, get_parallel, get_schedule, get_spec
from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc
from sglang.srt.speculative.spec_utils import (
    draft_kv_indices_buffer_width,
    draft_kv_indices_used_len,
    generate_draft_decode_kv_indices,
    generate_draft_decode_window_kv_indices,
    resolve_draft_decode_window,
)
from sglang.srt.utils import (
    get_bool_env_var,
    get_device_core_count,
    get_int_env_var,
    is_cuda,
    is_gfx95_supported,
    is_gfx942_supported,
    is_hip,
    is_xpu,
    next_power_of_2,
)

_is_cuda = is_cuda()
_is_hip = is_hip()
_is_gfx942 = is_gfx942_supported()
_is_xpu = is_xpu()

if _is_cuda:
    from sgl_kernel.utils import is_arch_support_pdl

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.kv_loc_plan import KVLocPlan
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative.spec_info import SpecInput


_MLA_DECODE_MIN_BLOCK_KV = 32


def _mla_decode_kv_splits_cap(
    base_max_kv_splits: int, sm_count: int, max_context_len: int
) -> int:
    if sm_count <= 0:
        return base_max_kv_splits
    sm_cap = next_power_of_2(sm_count)
    ctx_cap = next_power_of_2(triton.cdiv(max_context_len, _MLA_DECODE_MIN_BLOCK_KV))
    return max(base_max_kv_splits, min(sm_cap, ctx_cap))


def _should_use_verify_shared_kv(model_config, topk, use_mla, use_verify_splitkv):
    if not is_gfx95_supported() or topk != 1:
        return False
    if use_mla:
        return is_kimi_k3(model_config.hf_config)
    if is_dspark_draft(model_config.hf_config):
        return use_verify_splitkv
    return (
        use_verify_splitkv
        and is_qwen3_5(model_config.hf_config)
        and model_config.get_num_kv_heads(
            get_parallel().attn_tp_size, get_parallel().attn_dcp_size
        )
        == 1
    )


def logit_capping_mod(logit_capping_method, logit_cap):
    # positive logit_cap -> tanh cap
    if logit_capping_method == "tanh":
        return logit_cap
    else:
        raise ValueError()


@dataclass
class ForwardMetadata:
    attn_logits: torch.Tensor
    attn_lse: torch.Tensor
    max_extend_len: int
    num_kv_splits: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    qo_indptr: torch.Tensor
    custom_mask: torch.Tensor
    mask_indptr: torch.Tensor
    # Sliding window
    window_kv_indptr: torch.Tensor
    window_kv_indices: torch.Tensor
    window_num_kv_splits: torch.Tensor
    window_kv_offsets: torch.Tensor
    # Separate attn_logits for SWA layers when v_head_dim differs
    swa_attn_logits: Optional[torch.Tensor] = None
    # full->SWA translated out_cache_loc (SWA KV-store write target)
    swa_out_cache_loc: Optional[torch.Tensor] = None
    # Deterministic extend: window KV lists padded to absolute tile boundaries
    aligned_window_kv_indptr: Optional[torch.Tensor] = None
    aligned_window_kv_indices: Optional[torch.Tensor] = None
    # Lean decode (persistent-grid partial-result buffers)
    lean_Mp: Optional[torch.Tensor] = None
    lean_Lp: Optional[torch.Tensor] = None
    lean_Op: Optional[torch.Tensor] = None
    lean_locks: Optional[torch.Tensor] = None
    # One int32, set by get_num_kv_splits when the decode seq lens are uneven
    uneven_batch: Optional[torch.Tensor] = None


class TritonAttnBackend(AttentionBackend):
    # CUDA-graph replay rebuilds metadata from preallocated kv_indptr/kv_indices
    # buffers; it never reads seq_lens_cpu / seq_lens_sum.
    needs_cpu_seq_lens: bool = False

    # kv_indptr/qo_indptr are preallocated at (req pool + 1); an extend batch
    # can never carry more seqs than the pool.
    extend_dummy_seqs_capped_by_req_pool: bool = True

    def __init__(
        self,
        model_runner: ModelRunner,
        skip_prefill: bool = False,
        kv_indptr_buf: Optional[torch.Tensor] = None,
        *,
        dllm_fa4: bool = False,
    ):
        # Lazy import to avoid the initialization of cuda context
        from sglang.kernels.ops.attention.decode_attention import (
            _LEAN_BLOCK_M,
            _lean_decode_launch_params,
            decode_attention_fwd,
            lean_capture_policy,
            lean_decode_seqlen_gate,
        )
        from sglang.kernels.ops.attention.extend_attention import (
            align_window_kv_to_tiles,
            build_unified_kv_indices,
            can_use_dense_prefill_fp8,
            dense_prefill_attention_fwd,
            extend_attention_fwd,
            extend_attention_fwd_unified,
        )
        from sglang.kernels.ops.attention.verify_mla import verify_shared_kv_fwd
        from sglang.kernels.ops.attention.verify_splitkv import verify_splitkv_fwd

        super().__init__()

        self.decode_attention_fwd = torch.compiler.disable(decode_attention_fwd)
        # Work-Centric (Lean) Attention activation. None => auto-gate from host-side
        # seqlen metadata in forward_decode; True/False => explicit override.
        self.enable_lean_attention = get_exec().kernel.enable_lean_attention
        self._lean_decode_seqlen_gate = lean_decode_seqlen_gate
        self._lean_capture_policy = lean_capture_policy
        self.extend_attention_fwd = torch.compiler.disable(extend_attention_fwd)
        self.extend_attention_fwd_unified = torch.compiler.disable(
            extend_attention_fwd_unified
        )
        self.build_unified_kv_indices = torch.compiler.disable(build_unified_kv_indices)
        self.align_window_kv_to_tiles = torch.compiler.disable(align_window_kv_to_tiles)
        # Dense (non-absorbed) MLA prefill over a materialized prefix; see
        # handle_attention_triton for when the dispatcher selects it.
        self.dense_prefill_attention_fwd = torch.compiler.disable(
            dense_prefill_attention_fwd
        )
        self.can_use_dense_prefill_fp8 = can_use_dense_prefill_fp8
        # Cumulative full sequence lengths addressing the one-shot K/V; built
        # on first use per forward and reset by init_forward_metadata.
        self._dense_one_shot_kv_indptr = None
        # Split-KV EAGLE-verify kernel; enabled below once topk is known (valid only at topk == 1).
        self.verify_splitkv_fwd = torch.compiler.disable(verify_splitkv_fwd)
        # Grouped-head split-KV verify kernel for MLA or one shared local KV head.
        self.verify_shared_kv_fwd = torch.compiler.disable(verify_shared_kv_fwd)

        # Parse args
        self.skip_prefill = skip_prefill
        max_bs = model_runner.req_to_token_pool.size
        self.sliding_window_size = model_runner.sliding_window_size
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool_allocator = model_runner.token_to_kv_pool_allocator
        self.use_sliding_window_kv_pool = isinstance(self.token_to_kv_pool, SWAKVPool)
        # Lets the Triton wrappers specialize on PAGE_SIZE; page_size=1 is
        # byte-identical to the slot-based envelope.
        self.page_size = getattr(model_runner, "page_size", 1) or 1
        self.kv_index_translator = model_runner.kv_index_translator
        self.num_draft_tokens = get_spec().speculative_num_draft_tokens
        self.dllm_block_size = (
            model_runner.decode_num_tokens_per_req()
            if get_exec().dllm.dllm_algorithm is not None
            else None
        )
        self.target_verify_num_tokens_per_req = model_runner.decode_num_tokens_per_req()
        self.speculative_num_steps = get_spec().speculative_num_steps
        self.topk = get_spec().speculative_eagle_topk or 0
        # Split-KV verify is bit-equivalent only for a pure-causal chain (topk==1)
        # and is gfx95-only; else fall back to extend_attention_fwd.
        self.use_verify_splitkv = (
            is_gfx95_supported()
            and envs.SGLANG_ENABLE_SPLITKV_VERIFY.get()
            and self.topk == 1
        )
        self.use_mla = model_runner.model_config.attention_arch == AttentionArch.MLA
        # The grouped-head verify kernel is tuned for Kimi-K3 MLA and Qwen3.5
        # GQA with exactly one TP-local KV head.
        self.use_verify_shared_kv = _should_use_verify_shared_kv(
            model_runner.model_config,
            self.topk,
            self.use_mla,
            self.use_verify_splitkv,
        )
        # TODO: this logic should be fixed in non-hip platform
        self.is_hip_dspark_draft = (
            _is_hip
            and model_runner.is_draft_worker
            and model_runner.spec_algorithm.is_dspark()
        )
        if self.is_hip_dspark_draft:
            # Drafts never join the dcp group so we ignore it
            self.dcp_size = 1
            self.dcp_rank = 0
        else:
            self.dcp_size = get_parallel().attn_dcp_size
            self.dcp_rank = get_parallel().attn_dcp_rank
        self.num_head = (
            model_runner.model_config.get_max_num_attention_heads()
            // get_parallel().attn_tp_size
        ) * self.dcp_size
        self.num_kv_head = model_runner.model_config.get_num_kv_heads(
            get_parallel().attn_tp_size, get_parallel().attn_dcp_size
        )
        mla_config = model_runner.model_config
        self.use_dense_fp8_chunked_prefill = (
            self.use_mla
            and is_gfx95_supported()
            and envs.SGLANG_TRITON_DENSE_PREFILL_ATTN.get()
            and envs.SGLANG_TRITON_FP8_PREFILL_ATTN.get()
            and model_runner.kv_cache_dtype == torch.float8_e4m3fn
            and self.num_head == 12
            and mla_config.qk_nope_head_dim + mla_config.qk_rope_head_dim == 192
            and mla_config.v_head_dim == 128
            and mla_config.kv_lora_rank == 512
        )
        # forward_mha discovers these hooks dynamically. Hiding them when the
        # exact Kimi-K3 FP8 configuration is absent keeps all other models on
        # their existing code paths.
        if not self.use_dense_fp8_chunked_prefill:
            self.prepare_chunked_prefill_qkv = None
            self.pack_prefix_chunk_kv = None
        # The decode kernel's "// Lv" stride trick requires attn_logits.shape[-1]
        # to exactly match the layer's v_head_dim, so hybrid SWA models with
        # differing SWA/full v_head_dim need a second buffer for SWA layers.
        full_v_head_dim = model_runner.model_config.v_head_dim
        swa_v_head_dim = model_runner.model_config.swa_v_head_dim
        if self.sliding_window_size is not None and swa_v_head_dim != full_v_head_dim:
            self.v_head_dim = full_v_head_dim
            self.swa_v_head_dim = swa_v_head_dim
        elif mambaish_config(model_runner.model_config) is not None:
            # For hybrid linear models, layer_id = 0 may not be full attention
            # (e.g. NemotronH's full-attn layers are [5,12,19,...]). mambaish_config
            # unions mamba2 (NemotronH/FalconH1/...), hybrid-GDN, kimi-linear, and
            # linear-attn specs, so we ask get_v_head_dim() instead of indexing
            # layer 0, which is not guaranteed to be a full-attention layer.
            self.v_head_dim = model_runner.token_to_kv_pool.get_v_head_dim()
            self.swa_v_head_dim = None
        else:
            # Use start_layer instead of 0 to handle pipeline parallelism.
            # In PP, start_layer may be > 0, so layer 0 isn't in this stage's buffer.
            self.v_head_dim = model_runner.token_to_kv_pool.get_value_buffer(
                model_runner.token_to_kv_pool.start_layer
            ).shape[-1]
            self.swa_v_head_dim = None
        self.max_context_len = model_runner.model_config.context_len
        self.device = model_runner.device
        self.device_core_count = get_device_core_count(model_runner.gpu_id)
        # Lean decode persistent-grid size (depends only on head architecture).
        kv_group_num = self.num_head // self.num_kv_head
        self.lean_total_programs, _, _ = _lean_decode_launch_params(
            self.num_kv_head, kv_group_num
        )
        # BLOCK_M for Lean partial-result buffers; kept as an attribute so the
        # cuda-graph / eager buffer allocators (separate methods) can size them.
        self.lean_block_m = _LEAN_BLOCK_M
        self.static_kv_splits = get_bool_env_var(
            "SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS", "false"
        )
        self.max_kv_splits = get_exec().kernel.triton_attention_num_kv_splits
        if self.use_mla and not _is_xpu:
            self.max_kv_splits = _mla_decode_kv_splits_cap(
                self.max_kv_splits,
                self.device_core_count,
                self.max_context_len,
            )
            if _is_gfx942:
                # gfx942's 304 CUs round up to 512 splits, doubling the persistent
                # fp32 attn_logits buffer to ~4 GiB on Kimi-K2.6 and faulting in
                # ROCm graph replay; pin to 256 to match validated gfx950 behavior.
                self.max_kv_splits = min(self.max_kv_splits, 256)
        if _is_cuda:
            self.use_pdl = is_arch_support_pdl()
        else:
            self.use_pdl = False

        self.allow_bidirectional_attention_in_extend = (
            # BCG captures one complete prefill forward. It is therefore safe
            # for encoder-style attention, unlike the other CUDA graph modes
            # that can split or pad requests. Eager prefill remains supported
            # as before.
            (
                cuda_graph_fully_disabled()
                or check_cuda_graph_backend(Phase.PREFILL, Backend.BREAKABLE)
            )
            and get_schedule().chunked_prefill_size == -1
        )

        self.enable_deterministic = (
            get_exec().deterministic.enable_deterministic_inference
        )

        if self.enable_deterministic:
            # Fixed split tile size for batch invariance
            self.split_tile_size = get_int_env_var(
                "SGLANG_TRITON_DECODE_SPLIT_TILE_SIZE", 256
            )
            self.static_kv_splits = False
        else:
            self.split_tile_size = get_exec().kernel.triton_attention_split_tile_size

        if self.split_tile_size is not None:
            self.max_kv_splits = (
                self.max_context_len + self.split_tile_size - 1
            ) // self.split_tile_size

        assert not (
            model_runner.sliding_window_size is not None
            and model_runner.model_config.is_encoder_decoder
        ), "Sliding window and cross attention are not supported together"

        # TODO(Jianan Ji): verify behavior when kv_indptr_buf is provided and sliding window is enabled
        if kv_indptr_buf is None:
            self.kv_indptr = torch.zeros(
                (max_bs + 1,), dtype=torch.int32, device=model_runner.device
            )
        else:
            self.kv_indptr = kv_indptr_buf

        # Sliding window may need a second buffer for interleaved attention types
        self.window_kv_indptr = None
        if self.sliding_window_size is not None and self.sliding_window_size > 0:
            if kv_indptr_buf is None:
                self.window_kv_indptr = torch.zeros(
                    (max_bs + 1,), dtype=torch.int32, device=model_runner.device
                )
            else:
                self.window_kv_indptr = torch.zeros_like(kv_indptr_buf)

        if not self.skip_prefill:
            self.qo_indptr = torch.zeros(
                (max_bs + 1,),
                dtype=torch.int32 if dllm_fa4 else torch.int64,
                device=model_runner.device,
            )

            self.mask_indptr = torch.zeros(
                (max_bs + 1,), dtype=torch.int64, device=model_runner.device
            )

        self.forward_metadata: ForwardMetadata = None
        self._verify_mask = None
        # Tree-mask scratch is fetched from the target backend only.
        self.is_draft_runner = model_runner.is_draft_worker

        # Auto-detect BLOCK_M that extend_attention kernel will use for this model.
        # This is used by the scheduler's tile-budget admission logic to match
        # the kernel's actual tile size.
        head_dim = model_runner.model_config.head_dim
        from sglang.kernels.ops.attention.extend_attention import (
            _get_block_sizes_for_extend_attention,
        )

        _, _, _, block_m, _, _ = _get_block_sizes_for_extend_attention(
            Lq=head_dim, Lv=head_dim
        )
        self.extend_attention_block_m = block_m
        if dllm_fa4:
            from sglang.srt.dllm.attention import DllmFlashAttention

            self.dllm_attention = DllmFlashAttention(self)
            self.supports_prefill_cuda_graph_max_context_size = True

    def get_num_kv_splits(
        self,
        num_kv_splits: torch.Tensor,
        seq_lens: torch.Tensor,
        uneven_batch: Optional[torch.Tensor] = None,
    ):
        num_token, num_seq = num_kv_splits.shape[0], seq_lens.shape[0]
        # NOTE(alcanderian): Considering speculative_decodeing,
        # num_kv_splits.shape[0] will be topk * real_num_token.
        # And the real_num_token is num_seq in decoding phase.
        num_group = num_token // num_seq

        assert num_group * num_seq == num_token, (
            f"num_seq({num_seq}), num_token({num_token}), something goes wrong!"
        )

        if (
            self.static_kv_splits or self.device_core_count <= 0
        ) and not self.enable_deterministic:
            num_kv_splits.fill_(self.max_kv_splits)
            return

        if self.split_tile_size is not None and self.enable_deterministic:
            if num_group > 1:
                expanded_seq_lens = seq_lens.repeat_interleave(num_group)
            else:
                expanded_seq_lens = seq_lens

            num_kv_splits[:] = (
                expanded_seq_lens + self.split_tile_size - 1
            ) // self.split_tile_size
            return

        if num_seq < 256:
            SCHEDULE_SEQ = 256
        else:
            SCHEDULE_SEQ = triton.next_power_of_2(num_seq)

        get_num_kv_splits_triton[(1,)](
            num_kv_splits,
            seq_lens,
            num_seq,
            num_group,
            self.num_head,
            self.num_kv_head,
            self.max_kv_splits,
            self.device_core_count,
            MAX_NUM_SEQ=SCHEDULE_SEQ,
            uneven_batch_ptr=uneven_batch,
        )

    def _dcp_lens(self, lens: torch.Tensor, start: Optional[torch.Tensor] = None):
        return get_dcp_lens(lens, self.dcp_size, self.dcp_rank, start)

    def _dcp_kv_indices(
        self,
        req_pool_indices: torch.Tensor,
        lens: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: Optional[torch.Tensor] = None,
        kv_start_idx: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Build per-DCP-rank sharded KV indptr/indices. eager passes kv_indices=None
        # (fresh tensor); cuda-graph passes an address-stable buffer to fill in place.
        dcp_lens = self._dcp_lens(lens, kv_start_idx)
        kv_indptr[1 : len(req_pool_indices) + 1] = torch.cumsum(dcp_lens, dim=0)
        kv_indptr = kv_indptr[: len(req_pool_indices) + 1]
        if kv_indices is None:
            kv_indices = torch.empty(
                int(dcp_lens.sum().item()), dtype=torch.int64, device=self.device
            )
        create_triton_kv_indices_for_dcp_triton[(len(req_pool_indices),)](
            self.req_to_token,
            req_pool_indices,
            dcp_lens,
            kv_indptr,
            kv_start_idx,
            kv_indices,
            self.req_to_token.stride(0),
            self.dcp_size,
            self.dcp_rank,
        )
        return kv_indptr, kv_indices, dcp_lens

    def _fill_kv_indptr_and_indices(
        self,
        plan: KVLocPlan,
        bs: int,
        seq_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_indptr: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if kv_indptr is None:
            kv_indptr = self.kv_indptr[: bs + 1]
        kv_indptr[1:] = torch.cumsum(seq_lens, dim=0)
        self.kv_index_translator.pack_read_stream(
            plan,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens[:bs],
            indptr=kv_indptr,
            out=kv_indices,
        )
        return kv_indptr

    def _update_decode_kv_buffers(
        self,
        plan: KVLocPlan,
        bs: int,
        seq_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
    ):
        """Fill KV (and SWA) cuda-graph buffers for decode/idle mode.

        Returns ``(kv_indptr, window_kv_indptr, window_kv_lens, num_kv_splits_lens)``
        where ``window_kv_lens`` is ``None`` when sliding-window is disabled and
        ``num_kv_splits_lens`` is the per-request length used to size kv splits
        (per-DCP-rank length clamped to >=1 when DCP is enabled, full seq_lens
        otherwise).
        """
        seq_lens = seq_lens[:bs]
        req_pool_indices = req_pool_indices[:bs]
        if self.dcp_size > 1:
            # DCP: per-rank sharded; write into the same cuda-graph buffers
            # _build_cuda_graph_forward_metadata reads back.
            _, _, dcp_seq_lens = self._dcp_kv_indices(
                req_pool_indices,
                seq_lens,
                self.kv_indptr,
                self.cuda_graph_kv_indices,
                None,
            )
            kv_indptr = self.kv_indptr[: bs + 1]
            num_kv_splits_lens = dcp_seq_lens.clamp_min(1)
        else:
            kv_indptr = self._fill_kv_indptr_and_indices(
                plan, bs, seq_lens, req_pool_indices, self.cuda_graph_kv_indices
            )
            num_kv_splits_lens = seq_lens
        window_kv_indptr = self.window_kv_indptr
        window_kv_lens = None
        if self.sliding_window_size is not None and self.sliding_window_size > 0:
            window_kv_indptr, _, window_kv_lens, _ = update_sliding_window_buffer(
                self.window_kv_indptr,
                self.kv_index_translator,
                plan,
                req_pool_indices,
                self.sliding_window_size,
                seq_lens,
                bs,
                token_to_kv_pool=self.token_to_kv_pool,
                window_kv_indices=self.cuda_graph_window_kv_indices,
            )
        return kv_indptr, window_kv_indptr, window_kv_lens, num_kv_splits_lens

    def _target_verify_num_tokens_per_req(self, spec_info: Optional[SpecInput]) -> int:
        # Runtime metadata may vary by step; nonpositive means use capture width.
        if spec_info is None or spec_info.num_tokens_per_req <= 0:
            return self.target_verify_num_tokens_per_req
        return spec_info.num_tokens_per_req

    def _update_target_verify_buffers(
        self,
        plan: KVLocPlan,
        bs: int,
        seq_lens: torch.Tensor,
        spec_info,
        req_pool_indices: torch.Tensor,
    ):
        """Fill all cuda-graph buffers for target_verify mode."""
        num_tokens_per_req = self._target_verify_num_tokens_per_req(spec_info)
        qo_indptr = self.qo_indptr[: bs + 1]
        qo_indptr[: bs + 1] = torch.arange(
            0,
            (1 + bs) * num_tokens_per_req,
            step=num_tokens_per_req,
            dtype=torch.int32,
            device=self.device,
        )
        kv_indptr = self._fill_kv_indptr_and_indices(
            plan, bs, seq_lens, req_pool_indices, self.cuda_graph_kv_indices
        )
        window_kv_indptr = self.window_kv_indptr
        window_kv_indices = None
        window_num_kv_splits = None
        window_kv_offsets = None
        if self.sliding_window_size is not None and self.sliding_window_size > 0:
            window_kv_indices = self.cuda_graph_window_kv_indices
            window_num_kv_splits = self.cuda_graph_window_num_kv_splits
            window_kv_offsets = self.cuda_graph_window_kv_offsets
            window_kv_indptr, window_kv_indices, _, window_kv_offsets[:bs] = (
                update_sliding_window_buffer(
                    self.window_kv_indptr,
                    self.kv_index_translator,
                    plan,
                    req_pool_indices,
                    self.sliding_window_size,
                    seq_lens[:bs],
                    bs,
                    token_to_kv_pool=self.token_to_kv_pool,
                    window_kv_indices=window_kv_indices,
                )
            )
        custom_mask = (
            self._verify_mask.buffer if self._verify_mask is not None else None
        )
        if spec_info is not None and spec_info.custom_mask is not None:
            # ddtree-temp: the DDTree step writes its tree window straight into
            # this buffer (the prefix part is never read); copying the buffer
            # onto itself would move the whole FULL_MASK span every replay.
            if not (
                getattr(get_spec(), "speculative_ddtree_budget", None) is not None
                and spec_info.custom_mask.data_ptr() == custom_mask.data_ptr()
            ):
                custom_mask[: spec_info.custom_mask.shape[0]] = spec_info.custom_mask
        else:
            custom_mask = None
        seq_mask_len = num_tokens_per_req * (seq_lens + num_tokens_per_req)
        mask_indptr = self.mask_indptr[: bs + 1]
        mask_indptr[1 : bs + 1] = torch.cumsum(seq_mask_len, dim=0)
        return (
            qo_indptr,
            kv_indptr,
            custom_mask,
            mask_indptr,
            window_kv_indptr,
            window_kv_indices,
            window_num_kv_splits,
            window_kv_offsets,
        )

    def _update_dllm_buffers(
        self,
        plan: KVLocPlan,
        bs: int,
        seq_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
    ):
        # The current canvas is passed as dense K/V to extend attention. The
        # paged read stream must contain only the already encoded context.
        block_size = self.dllm_block_size
        prefix_lens = (seq_lens[:bs] - block_size).clamp_min(0)
        self.qo_indptr[: bs + 1] = torch.arange(
            0,
            (bs + 1) * block_size,
            block_size,
            dtype=torch.int32,
            device=self.device,
        )
        self._fill_kv_indptr_and_indices(
            plan, bs, prefix_lens, req_pool_indices, self.cuda_graph_kv_indices
        )
        if self.sliding_window_size is not None and self.sliding_window_size > 0:
            update_sliding_window_buffer(
                self.window_kv_indptr,
                self.kv_index_translator,
                plan,
                req_pool_indices,
                self.sliding_window_size,
                prefix_lens,
                bs,
                token_to_kv_pool=self.token_to_kv_pool,
                window_kv_indices=self.cuda_graph_window_kv_indices,
            )

    def _update_draft_extend_buffers(
        self,
        plan: KVLocPlan,
        bs: int,
        seq_lens: torch.Tensor,
        forward_mode: ForwardMode,
        spec_info: Optional[SpecInput],
        req_pool_indices: torch.Tensor,
    ):
        """Fill QO + KV cuda-graph buffers for draft_extend mode."""
        seq_lens = seq_lens[:bs]
        # V2 draft-extend fills num_draft_tokens per req; num_steps+1 only equals
        # that when topk == 1.
        num_tokens_per_req = (
            self.num_draft_tokens
            if forward_mode.is_draft_extend_v2()
            else self.speculative_num_steps + 1
        )
        qo_indptr = self.qo_indptr[: bs + 1]
        qo_indptr[: bs + 1] = torch.arange(
            0,
            bs * num_tokens_per_req + 1,
            step=num_tokens_per_req,
            dtype=torch.int32,
            device=self.device,
        )
        # DRAFT_EXTEND_V2: kv_indptr/kv_indices cover only the prefix (extend K/V go
        # separately). Capture warmup lacks extend_seq_lens_tensor -> fall back to
        # zeros; clamp at 0 so padded rows (seq_lens==fill 1) don't go negative.
        if (
            spec_info is not None
            and getattr(spec_info, "extend_seq_lens_tensor", None) is not None
        ):
            extend_seq_lens = spec_info.extend_seq_lens_tensor[:bs].to(torch.int32)
        else:
            extend_seq_lens = torch.zeros(bs, dtype=torch.int32, device=seq_lens.device)
        kv_lens = torch.clamp(seq_lens - extend_seq_lens, min=0).to(torch.int32)
        kv_indptr = self._fill_kv_indptr_and_indices(
            plan, bs, kv_lens, req_pool_indices, self.cuda_graph_kv_indices
        )
        if self.sliding_window_size is not None and self.sliding_window_size > 0:
            # A window layer reads the window-clipped prefix, as the eager
            # draft-extend path builds it.
            _, _, _, self.cuda_graph_window_kv_offsets[:bs] = (
                update_sliding_window_buffer(
                    self.window_kv_indptr,
                    self.kv_index_translator,
                    plan,
                    req_pool_indices,
                    self.sliding_window_size,
                    kv_lens,
                    bs,
                    token_to_kv_pool=self.token_to_kv_pool,
                    window_kv_indices=self.cuda_graph_window_kv_indices,
                )
            )
        return qo_indptr, kv_indptr, num_tokens_per_req

    def init_forward_metadata_out_graph(
        self,
        forward_batch: ForwardBatch,
        in_capture: bool = False,
    ):
        if self.dllm_attention is not None:
            return self.dllm_attention.init_forward_metadata_out_graph(
                forward_batch, in_capture
            )
        self._init_forward_metadata_out_graph(forward_batch, in_capture)

    def _init_forward_metadata_out_graph(self, forward_batch, in_capture):
        bs = forward_batch.batch_size
        req_pool_indices = forward_batch.req_pool_indices
        seq_lens = forward_batch.seq_lens
        forward_mode = forward_batch.forward_mode
        spec_info = forward_batch.spec_info

        if in_capture:
            assert forward_batch.encoder_lens is None, "Not supported"
            # Multi-step spec decode: kv buffers come from spec_info, not the
            # cuda-graph pool, so replay is not involved.
            if forward_mode.is_decode_or_idle() and spec_info is not None:
                # This step's swa write ids, in the buffer the multi-step
                # backend refills from the step's columns before replay.
                swa_out_cache_loc = self._fill_cuda_graph_swa_out_cache_loc(
                    forward_batch, in_capture=True
                )
                assert not (
                    self.use_sliding_window_kv_pool and swa_out_cache_loc is None
                ), (
                    "multi-step spec decode on a sliding-window KV pool could "
                    "not derive swa_out_cache_loc; the window layers' writes "
                    "have no target. The per-step out_cache_loc must fit "
                    "cuda_graph_swa_out_cache_loc."
                )
                self.forward_metadata = ForwardMetadata(
                    attn_logits=self.cuda_graph_attn_logits,
                    attn_lse=self.cuda_graph_attn_lse,
                    max_extend_len=None,
                    num_kv_splits=self.cuda_graph_num_kv_splits,
                    kv_indptr=spec_info.kv_indptr,
                    kv_indices=spec_info.kv_indices,
                    qo_indptr=None,
                    custom_mask=None,
                    mask_indptr=None,
                    # The per-step window rail lives in the multi-step
                    # backend's persistent buffers, refilled before replay.
                    window_kv_indptr=(
                        spec_info.window_kv_indptr
                        if spec_info.window_kv_indices is not None
                        else self.window_kv_indptr
                    ),
                    window_kv_indices=spec_info.window_kv_indices,
                    window_num_kv_splits=None,
                    window_kv_offsets=None,
                    swa_attn_logits=self.cuda_graph_swa_attn_logits,
                    swa_out_cache_loc=swa_out_cache_loc,
                    lean_Mp=self.cuda_graph_lean_Mp,
                    lean_Lp=self.cuda_graph_lean_Lp,
                    lean_Op=self.cuda_graph_lean_Op,
                    lean_locks=self.cuda_graph_lean_locks,
                )
                return

            self._apply_cuda_graph_metadata(
                plan=forward_batch.kv_loc_plan,
                bs=bs,
                req_pool_indices=req_pool_indices,
                seq_lens=seq_lens,
                forward_mode=forward_mode,
                spec_info=spec_info,
            )
            swa_out_cache_loc = self._fill_cuda_graph_swa_out_cache_loc(
                forward_batch, in_capture=True
            )
            self.forward_metadata = self._build_cuda_graph_forward_metadata(
                bs,
                forward_mode,
                spec_info,
                swa_out_cache_loc,
            )
        else:
            self._apply_cuda_graph_metadata(
                plan=forward_batch.kv_loc_plan,
                bs=bs,
                req_pool_indices=req_pool_indices,
                seq_lens=seq_lens,
                forward_mode=forward_mode,
                spec_info=spec_info,
            )
            # Metadata view is reused from capture; the write loc is the
            # runner's slot, so only the swa twin needs refilling.
            self._fill_cuda_graph_swa_out_cache_loc(forward_batch)

    def _fill_cuda_graph_swa_out_cache_loc(
        self, forward_batch: ForwardBatch, in_capture: bool = False
    ) -> Optional[torch.Tensor]:
        """Refill the SWA write-target buffer with the batch's write ids in the
        sliding-window sub-pool, returning the [:n] view (None for non-SWA) so
        the captured store reads fresh slots on replay. A multi-step draft step
        hands in a batch bound to its own columns of the window.
        """
        if not self.use_sliding_window_kv_pool:
            return None
        out_cache_loc = forward_batch.out_cache_loc
        if (
            out_cache_loc is None
            or out_cache_loc.shape[0] > self.cuda_graph_swa_out_cache_loc.shape[0]
        ):
            return None
        n = out_cache_loc.shape[0]
        self.cuda_graph_swa_out_cache_loc[n:].zero_()
        if in_capture:
            self.cuda_graph_swa_out_cache_loc[:n].zero_()
        else:
            self.cuda_graph_swa_out_cache_loc[:n].copy_(
                self.kv_index_translator.write_ids(
                    forward_batch, IdSpaceKind.SLIDING_WINDOW
                )
            )
        return self.cuda_graph_swa_out_cache_loc[:n]

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Init auxiliary variables for triton attention backend."""

        if self.dllm_attention is not None:
            self.dllm_attention.graph_mode = False
        self._dense_one_shot_kv_indptr = None
        bs = forward_batch.batch_size
        window_kv_indptr = self.window_kv_indptr
        window_kv_indices = None
        window_num_kv_splits = None
        window_kv_offsets = None
        aligned_window_kv_indptr = None
        aligned_window_kv_indices = None
        swa_attn_logits = None
        spec_info = forward_batch.spec_info
        # Lean decode buffers are only allocated on the decode path below; default
        # to None so the shared ForwardMetadata constructor works for extend/verify.
        lean_Mp = lean_Lp = lean_Op = lean_locks = None
        uneven_batch = None

        if forward_batch.forward_mode.is_decode_or_idle():
            if spec_info is None or spec_info.kv_indptr is None:
                # kv_indptr is None for draft-extend's idle batch; build from seq_lens.
                if self.dcp_size > 1:
                    # DCP: per-rank sharded KV indices, else each rank reads the
                    # whole KV instead of its owner shard.
                    kv_indptr, kv_indices, _ = self._dcp_kv_indices(
                        forward_batch.req_pool_indices,
                        forward_batch.seq_lens,
                        self.kv_indptr,
                    )
                else:
                    # gpu_only: seq_lens_sum may be None; over-allocate is safe (ragged write).
                    seq_lens_sum = forward_batch.seq_lens_sum
                    if seq_lens_sum is None:
                        seq_lens_sum = bs * self.max_context_len
                    kv_indices = torch.empty(
                        seq_lens_sum, dtype=torch.int64, device=self.device
                    )
                    kv_indptr = self._fill_kv_indptr_and_indices(
                        forward_batch.kv_loc_plan,
                        bs,
                        forward_batch.seq_lens,
                        forward_batch.req_pool_indices,
                        kv_indices,
                    )
                if (
                    self.sliding_window_size is not None
                    and self.sliding_window_size > 0
                ):
                    window_kv_indptr, window_kv_indices, window_kv_lens, _ = (
                        update_sliding_window_buffer(
                            self.window_kv_indptr,
                            self.kv_index_translator,
                            forward_batch.kv_loc_plan,
                            forward_batch.req_pool_indices,
                            self.sliding_window_size,
                            forward_batch.seq_lens,
                            bs,
                            self.device,
                            self.token_to_kv_pool,
                        )
                    )
                    window_num_kv_splits = torch.empty(
                        (bs,), dtype=torch.int32, device=self.device
                    )
                    self.get_num_kv_splits(window_num_kv_splits, window_kv_lens)
            else:
                kv_indptr, kv_indices = spec_info.kv_indptr, spec_info.kv_indices
                bs = kv_indptr.shape[0] - 1
                if spec_info.window_kv_indices is not None:
                    # The multi-step draft backend built the per-step window
                    # rail (the draft's own chain, window-clipped).
                    window_kv_indptr = spec_info.window_kv_indptr
                    window_kv_indices = spec_info.window_kv_indices
                    window_num_kv_splits = torch.empty(
                        (bs,), dtype=torch.int32, device=self.device
                    )
                    self.get_num_kv_splits(
                        window_num_kv_splits,
                        window_kv_indptr[1 : bs + 1] - window_kv_indptr[:bs],
                    )

            attn_logits = torch.empty(
                (bs, self.num_head, self.max_kv_splits, self.v_head_dim),
                dtype=torch.float32,
                device=self.device,
            )
            if self.swa_v_head_dim is not None:
                swa_attn_logits = torch.empty(
                    (bs, self.num_head, self.max_kv_splits, self.swa_v_head_dim),
                    dtype=torch.float32,
                    device=self.device,
                )
            else:
                swa_attn_logits = None
            attn_lse = torch.empty(
                (bs, self.num_head, self.max_kv_splits),
                dtype=torch.float32,
                device=self.device,
            )
            num_kv_splits = torch.empty((bs,), dtype=torch.int32, device=self.device)
            uneven_batch = torch.zeros((1,), dtype=torch.int32, device=self.device)
            self.get_num_kv_splits(
                num_kv_splits,
                (
                    self._dcp_lens(forward_batch.seq_lens).clamp_min(1)
                    if self.dcp_size > 1
                    else forward_batch.seq_lens
                ),
                uneven_batch,
            )

            # Lean decode persistent-grid partial-result buffers.
            lean_Mp = torch.empty(
                (self.lean_total_programs, self.lean_block_m),
                dtype=torch.float32,
                device=self.device,
            )
            lean_Lp = torch.empty(
                (self.lean_total_programs, self.lean_block_m),
                dtype=torch.float32,
                device=self.device,
            )
            lean_Op = torch.empty(
                (self.lean_total_programs, self.lean_block_m, self.v_head_dim),
                dtype=torch.float32,
                device=self.device,
            )
            lean_locks = torch.zeros(
                (self.lean_total_programs,), dtype=torch.int32, device=self.device
            )

            qo_indptr = None
            custom_mask = None
            mask_indptr = None
            max_extend_len = None
        elif forward_batch.forward_mode.is_target_verify():
            bs = len(forward_batch.req_pool_indices)
            num_tokens_per_req = self._target_verify_num_tokens_per_req(spec_info)
            qo_indptr = torch.arange(
                0,
                (1 + bs) * num_tokens_per_req,
                step=num_tokens_per_req,
                dtype=torch.int32,
                device=self.device,
            )
            # gpu_only: seq_lens_sum may be None; over-allocate is safe (ragged write).
            seq_lens_sum = forward_batch.seq_lens_sum
            if seq_lens_sum is None:
                seq_lens_sum = bs * self.max_context_len
            kv_indices = torch.empty(
                seq_lens_sum, dtype=torch.int64, device=self.device
            )
            kv_indptr = self._fill_kv_indptr_and_indices(
                forward_batch.kv_loc_plan,
                bs,
                forward_batch.seq_lens,
                forward_batch.req_pool_indices,
                kv_indices,
            )

            if self.sliding_window_size is not None and self.sliding_window_size > 0:
                # window_kv_offsets gives the start position in custom mask
                (
                    window_kv_indptr,
                    window_kv_indices,
                    window_kv_lens,
                    window_kv_offsets,
                ) = update_sliding_window_buffer(
                    self.window_kv_indptr,
                    self.kv_index_translator,
                    forward_batch.kv_loc_plan,
                    forward_batch.req_pool_indices,
                    self.sliding_window_size,
                    forward_batch.seq_lens,
                    bs,
                    self.device,
                    self.token_to_kv_pool,
                )

            custom_mask = spec_info.custom_mask
            seq_mask_len = num_tokens_per_req * (
                forward_batch.seq_lens + num_tokens_per_req
            )
            mask_indptr = self.mask_indptr
            mask_indptr[1 : bs + 1] = torch.cumsum(seq_mask_len[:bs], dim=0)
            mask_indptr = mask_indptr[: bs + 1]
            max_extend_len = num_tokens_per_req
            num_kv_splits = None
            attn_logits = None
            attn_lse = None

        else:
            if self.dcp_size > 1:
                kv_indptr, kv_indices, _ = self._dcp_kv_indices(
                    forward_batch.req_pool_indices,
                    forward_batch.extend_prefix_lens,
                    self.kv_indptr,
                )
            else:
                # gpu_only leaves _cpu unset; over-allocate is safe (ragged write).
                if forward_batch.extend_prefix_lens_cpu is not None:
                    kv_indices_len = sum(forward_batch.extend_prefix_lens_cpu)
                else:
                    kv_indices_len = bs * self.max_context_len
                kv_indices = torch.empty(
                    kv_indices_len,
                    dtype=torch.int64,
                    device=self.device,
                )
                kv_indptr = self._fill_kv_indptr_and_indices(
                    forward_batch.kv_loc_plan,
                    bs,
                    forward_batch.extend_prefix_lens,
                    forward_batch.req_pool_indices,
                    kv_indices,
                )
            if self.sliding_window_size is not None and self.sliding_window_size > 0:
                (
                    window_kv_indptr,
                    window_kv_indices,
                    window_kv_lens,
                    window_kv_offsets,
                ) = update_sliding_window_buffer(
                    self.window_kv_indptr,
                    self.kv_index_translator,
                    forward_batch.kv_loc_plan,
                    forward_batch.req_pool_indices,
                    self.sliding_window_size,
                    forward_batch.extend_prefix_lens,
                    bs,
                    self.device,
                    self.token_to_kv_pool,
                )
                if self.enable_deterministic:
                    aligned_window_kv_indptr, aligned_window_kv_indices = (
                        self.align_window_kv_to_tiles(
                            window_kv_indptr,
                            window_kv_indices,
                            forward_batch.extend_prefix_lens[:bs] - window_kv_lens,
                            bs,
                        )
                    )

            qo_indptr = self.qo_indptr
            qo_indptr[1 : bs + 1] = torch.cumsum(forward_batch.extend_seq_lens, dim=0)
            qo_indptr = qo_indptr[: bs + 1]
            custom_mask = None
            mask_indptr = None
            attn_logits = None
            attn_lse = None
            # Defensive GPU-max fallback when extend_seq_lens_cpu is absent.
            if forward_batch.extend_seq_lens_cpu is not None:
                max_extend_len = max(forward_batch.extend_seq_lens_cpu)
            else:
                max_extend_len = int(forward_batch.extend_seq_lens.max())
            num_kv_splits = None

        swa_out_cache_loc = None
        if self.use_sliding_window_kv_pool and forward_batch.out_cache_loc is not None:
            swa_out_cache_loc = self.kv_index_translator.write_ids(
                forward_batch, IdSpaceKind.SLIDING_WINDOW
            )

        self.forward_metadata = ForwardMetadata(
            attn_logits,
            attn_lse,
            max_extend_len,
            num_kv_splits,
            kv_indptr,
            kv_indices,
            qo_indptr,
            custom_mask,
            mask_indptr,
            window_kv_indptr,
            window_kv_indices,
            window_num_kv_splits,
            window_kv_offsets,
            swa_attn_logits=swa_attn_logits,
            swa_out_cache_loc=swa_out_cache_loc,
            aligned_window_kv_indptr=aligned_window_kv_indptr,
            aligned_window_kv_indices=aligned_window_kv_indices,
            lean_Mp=lean_Mp,
            lean_Lp=lean_Lp,
            lean_Op=lean_Op,
            lean_locks=lean_locks,
            uneven_batch=uneven_batch,
        )

    def init_cuda_graph_state(
        self,
        max_bs: int,
        max_num_tokens: int,
        kv_indices_buf: Optional[torch.Tensor] = None,
        cuda_graph_num_kv_splits_buf: Optional[torch.Tensor] = None,
    ):
        if self.dllm_attention is not None:
            self.dllm_attention.init_graph_state(max_bs, max_num_tokens)
        self.cuda_graph_attn_logits = torch.zeros(
            (max_num_tokens, self.num_head, self.max_kv_splits, self.v_head_dim),
            dtype=torch.float32,
            device=self.device,
        )
        if self.swa_v_head_dim is not None:
            self.cuda_graph_swa_attn_logits = torch.zeros(
                (
                    max_num_tokens,
                    self.num_head,
                    self.max_kv_splits,
                    self.swa_v_head_dim,
                ),
                dtype=torch.float32,
                device=self.device,
            )
        else:
            self.cuda_graph_swa_attn_logits = None
        self.cuda_graph_attn_lse = torch.zeros(
            (max_num_tokens, self.num_head, self.max_kv_splits),
            dtype=torch.float32,
            device=self.device,
        )

        # Lean decode persistent-grid partial-result buffers (shared across all layers).
        self.cuda_graph_lean_Mp = torch.zeros(
            (self.lean_total_programs, self.lean_block_m),
            dtype=torch.float32,
            device=self.device,
        )
        self.cuda_graph_lean_Lp = torch.zeros(
            (self.lean_total_programs, self.lean_block_m),
            dtype=torch.float32,
            device=self.device,
        )
        self.cuda_graph_lean_Op = torch.zeros(
            (self.lean_total_programs, self.lean_block_m, self.v_head_dim),
            dtype=torch.float32,
            device=self.device,
        )
        self.cuda_graph_lean_locks = torch.zeros(
            (self.lean_total_programs,), dtype=torch.int32, device=self.device
        )

        if cuda_graph_num_kv_splits_buf is None:
            self.cuda_graph_num_kv_splits = torch.full(
                (max_num_tokens,),
                self.max_kv_splits,
                dtype=torch.int32,
                device=self.device,
            )
        else:
            self.cuda_graph_num_kv_splits = cuda_graph_num_kv_splits_buf
        self.cuda_graph_uneven_batch = torch.zeros(
            (1,), dtype=torch.int32, device=self.device
        )

        if kv_indices_buf is None:
            self.cuda_graph_kv_indices = torch.zeros(
                (max_num_tokens * self.max_context_len),
                dtype=torch.int64,
                device=self.device,
            )
        else:
            self.cuda_graph_kv_indices = kv_indices_buf

        # Layout is draft * (seq_len + draft) per request (seq_mask_len cumsum
        # below) -- the same bound the shared sizing covers. Read as uint8.
        # ddtree-temp: under DDTREE the target verifies a tree of budget + 1
        # tokens per request (not the DFlash block), so the mask is that wide;
        # a request's last overlapped step may start up to one block past its
        # context, so the rows are a block longer too.
        verify_mask_width = self.num_draft_tokens
        verify_mask_context = self.max_context_len
        if (
            getattr(get_spec(), "speculative_ddtree_budget", None) is not None
            and not self.is_draft_runner
        ):
            verify_mask_width = self.target_verify_num_tokens_per_req
            verify_mask_context = self.max_context_len + int(
                get_spec().speculative_num_draft_tokens
            )
        self._verify_mask = maybe_create_verify_mask(
            is_draft_runner=self.is_draft_runner,
            skip_prefill=self.skip_prefill,
            max_bs=max_bs,
            max_context_len=verify_mask_context,
            num_draft_tokens=verify_mask_width,
            device=self.device,
            is_read=True,
            dtype=torch.uint8,
        )

        if self.sliding_window_size is not None and self.sliding_window_size > 0:
            if kv_indices_buf is None:
                self.cuda_graph_window_kv_indices = torch.zeros(
                    (max_num_tokens * self.sliding_window_size),
                    dtype=torch.int64,
                    device=self.device,
                )
            else:
                self.cuda_graph_window_kv_indices = torch.zeros_like(kv_indices_buf)

            self.cuda_graph_window_num_kv_splits = torch.full(
                (max_num_tokens,),
                self.max_kv_splits,
                dtype=torch.int32,
                device=self.device,
            )

            self.cuda_graph_window_kv_offsets = torch.zeros(
                (max_bs,),
                dtype=torch.int32,
                device=self.device,
            )

        if self.use_sliding_window_kv_pool:
            # SWA write-target buffer; refilled at replay from out_cache_loc.
            self.cuda_graph_swa_out_cache_loc = torch.zeros(
                (max_num_tokens,),
                dtype=torch.int64,
                device=self.device,
            )

    def _build_cuda_graph_forward_metadata(
        self,
        bs: int,
        forward_mode: ForwardMode,
        spec_info: Optional[SpecInput],
        swa_out_cache_loc: Optional[torch.Tensor] = None,
    ) -> ForwardMetadata:
        """Construct ForwardMetadata from the current cuda-graph buffer state.

        Called by capture after the buffer-update helpers have already run
        (either via replay or directly).  All fields reference the same
        self.cuda_graph_* tensors that the captured graph kernels will
        read — the Python object is rebuilt each capture, but the underlying
        GPU memory addresses are stable. ``swa_out_cache_loc`` is the
        pre-allocated SWA write-target buffer view (or None for non-SWA).
        """
        swa = self.sliding_window_size is not None and self.sliding_window_size > 0
        if forward_mode.is_decode_or_idle():
            return ForwardMetadata(
                attn_logits=self.cuda_graph_attn_logits,
                attn_lse=self.cuda_graph_attn_lse,
                max_extend_len=None,
                num_kv_splits=self.cuda_graph_num_kv_splits,
                kv_indptr=self.kv_indptr[: bs + 1],
                kv_indices=self.cuda_graph_kv_indices,
                qo_indptr=None,
                custom_mask=None,
                mask_indptr=None,
                window_kv_indptr=self.window_kv_indptr[: bs + 1] if swa else None,
                window_kv_indices=self.cuda_graph_window_kv_indices if swa else None,
                window_num_kv_splits=(
                    self.cuda_graph_window_num_kv_splits if swa else None
                ),
                window_kv_offsets=None,
                swa_attn_logits=self.cuda_graph_swa_attn_logits,
                swa_out_cache_loc=swa_out_cache_loc,
                lean_Mp=self.cuda_graph_lean_Mp,
                lean_Lp=self.cuda_graph_lean_Lp,
                lean_Op=self.cuda_graph_lean_Op,
                lean_locks=self.cuda_graph_lean_locks,
                uneven_batch=self.cuda_graph_uneven_batch,
            )
        elif forward_mode.is_target_verify():
            custom_mask = (
                self._verify_mask.buffer
                if self._verify_mask is not None
                and spec_info is not None
                and spec_info.custom_mask is not None
                else None
            )
            max_extend_len = self._target_verify_num_tokens_per_req(spec_info)
            return ForwardMetadata(
                attn_logits=None,
                attn_lse=None,
                max_extend_len=max_extend_len,
                num_kv_splits=None,
                kv_indptr=self.kv_indptr[: bs + 1],
                kv_indices=self.cuda_graph_kv_indices,
                qo_indptr=self.qo_indptr[: bs + 1],
                custom_mask=custom_mask,
                mask_indptr=self.mask_indptr[: bs + 1],
                window_kv_indptr=self.window_kv_indptr[: bs + 1] if swa else None,
                window_kv_indices=self.cuda_graph_window_kv_indices if swa else None,
                window_num_kv_splits=(
                    self.cuda_graph_window_num_kv_splits if swa else None
                ),
                window_kv_offsets=self.cuda_graph_window_kv_offsets if swa else None,
                swa_out_cache_loc=swa_out_cache_loc,
            )
        elif forward_mode.is_dllm_extend():
            return ForwardMetadata(
                attn_logits=None,
                attn_lse=None,
                max_extend_len=self.dllm_block_size,
                num_kv_splits=None,
                kv_indptr=self.kv_indptr[: bs + 1],
                kv_indices=self.cuda_graph_kv_indices,
                qo_indptr=self.qo_indptr[: bs + 1],
                custom_mask=None,
                mask_indptr=None,
                window_kv_indptr=self.window_kv_indptr[: bs + 1] if swa else None,
                window_kv_indices=self.cuda_graph_window_kv_indices if swa else None,
                window_num_kv_splits=None,
                window_kv_offsets=None,
                swa_out_cache_loc=swa_out_cache_loc,
            )
        elif forward_mode.is_draft_extend_v2():
            return ForwardMetadata(
                attn_logits=None,
                attn_lse=None,
                # Must match the per-req query count (num_tokens_per_req) used to
                # build qo_indptr above, else the extend kernel grid is too small
                # for topk > 1 (num_draft_tokens > num_steps+1) and drops query
                # blocks.
                max_extend_len=(
                    self.num_draft_tokens
                    if forward_mode.is_draft_extend_v2()
                    else self.speculative_num_steps + 1
                ),
                num_kv_splits=None,
                kv_indptr=self.kv_indptr[: bs + 1],
                kv_indices=self.cuda_graph_kv_indices,
                qo_indptr=self.qo_indptr[: bs + 1],
                custom_mask=None,
                mask_indptr=None,
                window_kv_indptr=(
                    self.window_kv_indptr[: bs + 1] if swa else self.window_kv_indptr
                ),
                window_kv_indices=self.cuda_graph_window_kv_indices if swa else None,
                # Extend reads through qo_indptr, never through kv splits.
                window_num_kv_splits=None,
                window_kv_offsets=self.cuda_graph_window_kv_offsets if swa else None,
                swa_out_cache_loc=swa_out_cache_loc,
            )
        else:
            raise ValueError(f"Invalid forward mode: {forward_mode=} for CUDA Graph.")

    def _apply_cuda_graph_metadata(
        self,
        plan: KVLocPlan,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        forward_mode: ForwardMode,
        spec_info: Optional[SpecInput],
    ) -> None:
        """Shared capture+replay body for the cuda-graph init path.

        Public entry: :py:meth:`init_forward_metadata_out_graph`.
        """
        # NOTE: encoder_lens expected to be zeros or None
        if forward_mode.is_decode_or_idle():
            assert spec_info is None, "Multi-step cuda graph init is not done here."
            _, _, window_kv_lens, num_kv_splits_lens = self._update_decode_kv_buffers(
                plan, bs, seq_lens, req_pool_indices
            )
            self.get_num_kv_splits(
                self.cuda_graph_num_kv_splits[:bs],
                num_kv_splits_lens[:bs],
                self.cuda_graph_uneven_batch,
            )
            if window_kv_lens is not None:
                self.get_num_kv_splits(
                    self.cuda_graph_window_num_kv_splits[:bs], window_kv_lens[:bs]
                )
        elif forward_mode.is_target_verify():
            bs = len(req_pool_indices)
            self._update_target_verify_buffers(
                plan, bs, seq_lens, spec_info, req_pool_indices
            )
        elif forward_mode.is_dllm_extend():
            self._update_dllm_buffers(plan, bs, seq_lens, req_pool_indices)
        elif forward_mode.is_draft_extend_v2():
            self._update_draft_extend_buffers(
                plan, bs, seq_lens, forward_mode, spec_info, req_pool_indices
            )
        else:
            raise ValueError(
                f"Invalid forward mode: {forward_mode=} for CUDA Graph replay."
            )

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    @property
    def verify_mask(self) -> Optional[VerifyMask]:
        return self._verify_mask

    def update_verify_buffers_to_fill_after_draft(
        self, spec_info: SpecInput, cuda_graph_bs: Optional[int]
    ):
        pass

    @property
    def pack_all_prefix_chunks(self) -> bool:
        """Pack every prefix chunk into one FP8 buffer when capacity allows."""
        return self.use_dense_fp8_chunked_prefill

    @property
    def fuse_prefix_into_extend(self) -> bool:
        """Attend the packed prefix and current chunk in one launch."""
        return self.use_dense_fp8_chunked_prefill

    def prepare_chunked_prefill_qkv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convert the current dense MHA chunk once and reuse Q for prefix passes."""
        fp8_dtype = torch.float8_e4m3fn
        output_dtype = q.dtype
        if output_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            output_dtype = torch.bfloat16
        forward_batch._triton_dense_fp8_output_dtype = output_dtype

        if q.dtype != fp8_dtype:
            q = q.to(fp8_dtype)
        if k.dtype != fp8_dtype:
            k = k.to(fp8_dtype)
        if v.dtype != fp8_dtype:
            v = v.to(fp8_dtype)
        return q.contiguous(), k.contiguous(), v.contiguous()

    def pack_prefix_chunk_kv(
        self,
        k_nope: torch.Tensor,
        k_pe: torch.Tensor,
        v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pack a materialized dense prefix directly into unit-scale FP8 K/V."""
        return mla_kv_pack_quantize_fp8(
            k_nope,
            k_pe,
            v,
            fp8_dtype=torch.float8_e4m3fn,
            enable_pdl=False,
        )

    def _can_run_dense_fp8_chunked_mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> bool:
        return (
            self.use_dense_fp8_chunked_prefill
            and forward_batch.attn_attend_prefix_cache is not None
            and self.forward_metadata.custom_mask is None
            and q.dtype == torch.float8_e4m3fn
            and k.dtype == torch.float8_e4m3fn
            and v.dtype == torch.float8_e4m3fn
            and layer.tp_q_head_num == 12
            and layer.tp_k_head_num == 12
            and layer.qk_head_dim == 192
            and layer.v_head_dim == 128
            and (layer.sliding_window_size is None or layer.sliding_window_size <= -1)
            and layer.logit_cap <= 0
        )

    def _forward_dense_fp8_chunked_mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ):
        """Run current or cached dense FP8 K/V through Triton extend attention."""
        output_dtype = getattr(
            forward_batch, "_triton_dense_fp8_output_dtype", torch.bfloat16
        )
        output = torch.empty(
            (q.shape[0], layer.tp_q_head_num, layer.v_head_dim),
            dtype=output_dtype,
            device=q.device,
        )

        prefix_k = getattr(forward_batch, "fused_prefix_k", None)
        if prefix_k is not None:
            # Prefix is non-causal while the current chunk is causal. The
            # extend kernel already implements precisely that two-stage mask.
            prefix_v = forward_batch.fused_prefix_v
            self.extend_attention_fwd(
                q,
                k,
                v,
                output,
                prefix_k,
                prefix_v,
                self.forward_metadata.qo_indptr,
                forward_batch.prefix_chunk_cu_seq_lens[0],
                forward_batch.prefix_dense_kv_indices[: prefix_k.shape[0]],
                None,
                True,
                None,
                self.forward_metadata.max_extend_len,
                1.0,
                1.0,
                sm_scale=layer.scaling,
                page_size=1,
                extend_seq_lens_cpu=forward_batch.extend_seq_lens_cpu,
                identity_kv_indices=True,
            )
            return output

        lse = torch.empty(
            (q.shape[0], layer.tp_q_head_num),
            dtype=torch.float32,
            device=q.device,
        )

        if forward_batch.attn_attend_prefix_cache:
            chunk_idx = forward_batch.prefix_chunk_idx
            assert chunk_idx is not None and chunk_idx >= 0
            kv_indptr = forward_batch.prefix_chunk_cu_seq_lens[chunk_idx]
            kv_indices = forward_batch.prefix_dense_kv_indices[: k.shape[0]]
            self.extend_attention_fwd(
                q,
                k[:0],
                v[:0],
                output,
                k,
                v,
                self.forward_metadata.qo_indptr,
                kv_indptr,
                kv_indices,
                None,
                False,
                None,
                self.forward_metadata.max_extend_len,
                1.0,
                1.0,
                sm_scale=layer.scaling,
                lse_extend=lse,
                skip_extend=True,
                page_size=1,
                extend_seq_lens_cpu=forward_batch.extend_seq_lens_cpu,
                identity_kv_indices=True,
            )
            # Empty ragged rows are returned as output=0, LSE=-inf, so the
            # portable merge_state operation ignores them exactly.
        else:
            self.extend_attention_fwd(
                q,
                k,
                v,
                output,
                k[:0],
                v[:0],
                self.forward_metadata.qo_indptr,
                forward_batch.mha_empty_kv_indptr,
                self.forward_metadata.kv_indices[:0],
                None,
                True,
                None,
                self.forward_metadata.max_extend_len,
                1.0,
                1.0,
                sm_scale=layer.scaling,
                lse_extend=lse,
                skip_prefix=True,
                page_size=1,
                extend_seq_lens_cpu=forward_batch.extend_seq_lens_cpu,
            )

        if forward_batch.mha_return_lse:
            return output, lse
        return output

    def _set_kv_buffer(
        self,
        forward_batch: ForwardBatch,
        layer: RadixAttention,
        loc_info,
        k: torch.Tensor,
        v: torch.Tensor,
        k_scale=None,
        v_scale=None,
    ) -> None:
        # DCP writes to the local physical shard (loc = out_cache_loc //
        # dcp_size) through the masked path so each rank only stores the tokens
        # it owns. Non-DCP keeps the original write loc and plain set_kv_buffer.
        if self.dcp_size > 1:
            # The rank-local slot of a physical loc is physical.
            loc = KVWriteLoc(
                forward_batch.out_cache_loc // self.dcp_size,
                physical=forward_batch.out_cache_loc_is_physical,
            )
            if (
                forward_batch.positions is not None
                and forward_batch.positions.numel() == loc.loc.numel()
            ):
                dcp_kv_mask = forward_batch.positions % self.dcp_size == self.dcp_rank
            else:
                dcp_kv_mask = forward_batch.dcp_kv_mask
            kwargs = {"dcp_kv_mask": dcp_kv_mask}
        else:
            loc = loc_info
            kwargs = {}
        if k_scale is None and v_scale is None:
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v, **kwargs)
        else:
            self.token_to_kv_pool.set_kv_buffer(
                layer, loc, k, v, k_scale, v_scale, **kwargs
            )

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache=True,
        sinks=None,
        score_mod=None,
        aux_tensors=None,
    ):
        if (
            k is not None
            and v is not None
            and sinks is None
            and score_mod is None
            and aux_tensors is None
            and self._can_run_dense_fp8_chunked_mha(q, k, v, layer, forward_batch)
        ):
            return self._forward_dense_fp8_chunked_mha(q, k, v, layer, forward_batch)

        # TODO: reuse the buffer across layers
        attn_out = getattr(forward_batch, "_attn_output", None)
        if attn_out is not None:
            o = attn_out
        elif layer.qk_head_dim != layer.v_head_dim:
            o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        else:
            o = torch.empty_like(q)

        if k is None and v is None:
            pool = self.token_to_kv_pool
            cache_loc = forward_batch.out_cache_loc
            if isinstance(pool, SWAKVPool) and pool.layers_mapping[layer.layer_id][1]:
                assert self.forward_metadata.swa_out_cache_loc is not None, (
                    "window-layer read-back before the metadata carried a "
                    "sliding-window write loc"
                )
                cache_loc = self.forward_metadata.swa_out_cache_loc
            k_buffer, v_buffer = pool.get_kv_buffer(layer.layer_id)
            k = k_buffer[cache_loc]
            v = v_buffer[cache_loc]
        elif k is None or v is None:
            raise ValueError("Both k and v should be None or not None")
        else:
            # Save KV cache first (must do this before unified kernel)
            if save_kv_cache:
                loc_info = KVWriteLoc.for_batch(
                    forward_batch,
                    swa_loc=self.forward_metadata.swa_out_cache_loc,
                )
                if layer.k_scale is None:
                    self._set_kv_buffer(forward_batch, layer, loc_info, k, v)
                elif self.use_mla:
                    # For MLA, scale K manually before storing since MLATokenToKVPool
                    # doesn't accept scale parameters. Clone to protect k from mutation
                    # since it's used later in the attention kernel.
                    k_scaled = k.clone().div_(layer.k_scale)
                    self.token_to_kv_pool.set_kv_buffer(
                        layer,
                        loc_info,
                        k_scaled,
                        v,
                    )
                else:
                    self._set_kv_buffer(
                        forward_batch,
                        layer,
                        loc_info,
                        k.clone(),  # cloned to protect k,v from in-place mutation in set_kv_buffer
                        v.clone(),
                        layer.k_scale,
                        layer.v_scale,
                    )

        logits_soft_cap = logit_capping_mod(layer.logit_capping_method, layer.logit_cap)

        causal = True
        if (
            layer.is_cross_attention
            or layer.attn_type == AttentionType.ENCODER_ONLY
            or (
                layer.attn_type == AttentionType.DECODER_BIDIRECTIONAL
                and (
                    self.allow_bidirectional_attention_in_extend
                    # A DLLM graph contains complete, fixed-width canvases;
                    # padding adds requests, never tokens inside a canvas.
                    or forward_batch.forward_mode.is_dllm_extend()
                )
            )
        ):
            causal = False

        # Dense one-shot MLA prefill (AttnForwardMethod.MHA_ONE_SHOT): k/v were
        # up-projected out of the latent cache and span prefix + current chunk,
        # so they no longer line up row-for-row with q the way
        # extend_attention_fwd requires. Route to the single-loop dense kernel.
        # A prefix-chunk phase (attn_attend_prefix_cache) also carries a longer
        # k/v, but the dispatcher never hands Triton MHA_CHUNKED_KV.
        if (
            forward_batch.mha_one_shot
            and not forward_batch.attn_attend_prefix_cache
            and k is not None
            and k.shape[0] != q.shape[0]
        ):
            return self._forward_extend_dense_one_shot(
                q,
                k,
                v,
                o,
                layer,
                forward_batch,
                causal,
                logits_soft_cap,
                sinks=sinks,
                score_mod=score_mod,
            )

        if self.dcp_size > 1:
            if score_mod is not None:
                raise NotImplementedError(
                    "DCP Triton extend does not support score_mod"
                )
            return self._forward_extend_dcp(
                q, k, v, layer, forward_batch, causal, logits_soft_cap, sinks
            )

        # Deterministic mode: use unified 1-stage kernel
        if self.enable_deterministic:
            return self._forward_extend_unified(
                q,
                o,
                layer,
                forward_batch,
                causal,
                logits_soft_cap,
                sinks,
                score_mod=score_mod,
                aux_tensors=aux_tensors,
            )

        # Normal mode: use original 2-stage kernel
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            bidirectional_extend = (
                layer.attn_type == AttentionType.DECODER_BIDIRECTIONAL
            )
            sliding_window_size = (
                -1 if bidirectional_extend else layer.sliding_window_size
            )
            kv_indptr = self.forward_metadata.window_kv_indptr
            kv_indices = self.forward_metadata.window_kv_indices
            window_kv_offsets = self.forward_metadata.window_kv_offsets
            # A null read rail reaches Triton as `None + offsets` and fails as
            # an unreadable IR-build error; say what is actually missing.
            assert kv_indices is not None, (
                f"layer {layer.layer_id} is a sliding-window layer but this "
                "extend forward built no window_kv_indices; every mode that "
                "reaches forward_extend must fill the window rail."
            )
        else:
            sliding_window_size = -1
            kv_indptr = self.forward_metadata.kv_indptr
            kv_indices = self.forward_metadata.kv_indices
            window_kv_offsets = None

        if layer.k_scale is not None and layer.v_scale is not None:
            k_descale = layer.k_scale_float
            v_descale = layer.v_scale_float
        else:
            k_descale = 1.0
            v_descale = 1.0

        # Split-KV EAGLE-verify fast path (ROCm/Triton). On target-verify
        # (topk=1 causal chain), run the bandwidth-efficient split-KV kernel
        # instead of the serial-prefix extend kernel. verify_splitkv_fwd()
        # returns True if it ran (o written), or False for any case it cannot
        # serve bit-equivalently (its can_handle() gates on non-causal / sinks /
        # sliding-window / ragged / topk>1), so we fall through to
        # extend_attention_fwd below. Correctness is never at risk.
        # Route target-verify to the grouped-head kernel when eligible, else the
        # per-head split-KV kernel.
        if self.use_verify_shared_kv:
            verify_fwd = self.verify_shared_kv_fwd
        elif self.use_verify_splitkv:
            verify_fwd = self.verify_splitkv_fwd
        else:
            verify_fwd = None
        if (
            verify_fwd is not None
            and score_mod is None
            and forward_batch.forward_mode.is_target_verify()
            and verify_fwd(
                q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
                k.contiguous(),
                v.contiguous(),
                o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                self.forward_metadata.qo_indptr,
                kv_indptr,
                kv_indices,
                self.forward_metadata.custom_mask,
                causal,
                self.forward_metadata.mask_indptr,
                self.forward_metadata.max_extend_len,
                k_descale,
                v_descale,
                layer.scaling,
                logit_cap=logits_soft_cap,
                sliding_window_size=sliding_window_size,
                sinks=sinks,
                window_kv_offsets=window_kv_offsets,
                xai_temperature_len=layer.xai_temperature_len,
                max_bs=self.req_to_token_pool.size,
            )
        ):
            return o

        self._forward_extend_kernel(
            layer,
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
            k.contiguous() if self.dllm_attention is None else k,
            v.contiguous() if self.dllm_attention is None else v,
            o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.forward_metadata.qo_indptr,
            kv_indptr,
            kv_indices,
            self.forward_metadata.custom_mask,
            causal,
            self.forward_metadata.mask_indptr,
            self.forward_metadata.max_extend_len,
            k_descale,
            v_descale,
            layer.scaling,
            logit_cap=logits_soft_cap,
            sliding_window_size=sliding_window_size,
            sinks=sinks,
            window_kv_offsets=window_kv_offsets,
            xai_temperature_len=layer.xai_temperature_len,
            page_size=self.page_size,
            score_mod=score_mod,
            aux_tensors=aux_tensors,
            extend_seq_lens_cpu=forward_batch.extend_seq_lens_cpu,
        )
        return o

    def _forward_extend_kernel(self, layer, *args, **kwargs):
        if self.dllm_attention is not None:
            return self.dllm_attention.forward_extend(layer, *args, **kwargs)
        return self.extend_attention_fwd(*args, **kwargs)

    def _dense_one_shot_kv_indptr_for(self, forward_batch: ForwardBatch):
        """Cumulative full sequence lengths addressing the one-shot K/V rows.

        The MHA one-shot K/V is gathered with fetch_mha_one_shot_kv_indices(),
        which lays sequences out back to back at their full seq_len -- so the
        row offsets are cumsum(seq_lens), not the prefix-only kv_indptr that
        forward_metadata carries for the paged extend path.
        """
        if self._dense_one_shot_kv_indptr is None:
            bs = forward_batch.batch_size
            kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=self.device)
            kv_indptr[1:] = torch.cumsum(forward_batch.seq_lens[:bs], dim=0)
            self._dense_one_shot_kv_indptr = kv_indptr
        return self._dense_one_shot_kv_indptr

    def _forward_extend_dense_one_shot(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        o: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        causal: bool,
        logits_soft_cap: float,
        sinks: Optional[torch.Tensor] = None,
        score_mod=None,
    ):
        # Guarded rather than silently fallen back on: dropping to
        # extend_attention_fwd with a longer-than-q k/v would read the wrong
        # rows and quietly return wrong numbers.
        if sinks is not None or score_mod is not None:
            raise NotImplementedError(
                "Triton dense one-shot prefill does not support sinks/score_mod"
            )
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            raise NotImplementedError(
                "Triton dense one-shot prefill does not support sliding windows"
            )
        if layer.k_scale is not None or layer.v_scale is not None:
            raise NotImplementedError(
                "Triton dense one-shot prefill does not support KV descales"
            )
        if layer.xai_temperature_len is not None and layer.xai_temperature_len > 0:
            raise NotImplementedError(
                "Triton dense one-shot prefill does not support xai temperature"
            )

        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        k = k.view(-1, layer.tp_k_head_num, layer.qk_head_dim)
        v = v.view(-1, layer.tp_k_head_num, layer.v_head_dim)

        if self.can_use_dense_prefill_fp8(
            q, k, v, is_causal=causal, logit_cap=logits_soft_cap
        ):
            # Cast Q, K and V separately, matching the zero-prefix FP8 gate in
            # extend_attention_fwd (and Aiter's opt-in behavior).
            q = q.to(torch.float8_e4m3fn)
            k = k.to(torch.float8_e4m3fn)
            v = v.to(torch.float8_e4m3fn)

        self.dense_prefill_attention_fwd(
            q,
            k.contiguous(),
            v.contiguous(),
            o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
            self.forward_metadata.qo_indptr,
            self._dense_one_shot_kv_indptr_for(forward_batch),
            self.forward_metadata.max_extend_len,
            sm_scale=layer.scaling,
            logit_cap=logits_soft_cap,
            is_causal=causal,
        )
        return o

    def _forward_extend_dcp(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        causal: bool,
        logits_soft_cap: float,
        sinks: Optional[torch.Tensor],
    ):
        if sinks is not None:
            raise NotImplementedError("DCP Triton extend does not support sinks")
        if self.forward_metadata.custom_mask is not None:
            raise NotImplementedError("DCP Triton extend does not support custom masks")
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            raise NotImplementedError(
                "DCP Triton extend does not support sliding window"
            )

        group = get_parallel().dcp_group
        q_local = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim).contiguous()
        total_tokens, local_heads, _ = q_local.shape

        kv_indptr = self.forward_metadata.kv_indptr
        kv_indices = self.forward_metadata.kv_indices
        max_extend_len = self.forward_metadata.max_extend_len

        if layer.k_scale is not None and layer.v_scale is not None:
            k_descale = layer.k_scale_float
            v_descale = layer.v_scale_float
        else:
            k_descale = 1.0
            v_descale = 1.0

        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buffer = self.token_to_kv_pool.get_value_buffer(layer.layer_id)

        current_out = torch.zeros(
            (total_tokens, local_heads, layer.v_head_dim),
            device=q.device,
            dtype=torch.float32,
        )
        current_lse = torch.full(
            (total_tokens, local_heads),
            -float("inf"),
            device=q.device,
            dtype=torch.float32,
        )

        # Select the replicated K/V heads matching this rank's Q shard.
        if k.numel() > 0:
            if layer.tp_k_head_num > 1:
                kv_head_start = (
                    group.rank_in_group * layer.tp_k_head_num // group.world_size
                )
                kv_head_end = max(
                    (group.rank_in_group + 1) * layer.tp_k_head_num // group.world_size,
                    kv_head_start + 1,
                )
                k = k[:, kv_head_start:kv_head_end]
                v = v[:, kv_head_start:kv_head_end]

            empty_kv_indptr = torch.zeros_like(kv_indptr)
            self.extend_attention_fwd(
                q_local,
                k.contiguous(),
                v.contiguous(),
                current_out,
                k_buffer,
                v_buffer,
                self.forward_metadata.qo_indptr,
                empty_kv_indptr,
                kv_indices[:0],
                None,
                causal,
                None,
                max_extend_len,
                1.0,
                1.0,
                sm_scale=layer.scaling,
                logit_cap=logits_soft_cap,
                xai_temperature_len=layer.xai_temperature_len,
                lse_extend=current_lse,
                skip_prefix=True,
            )

        if kv_indices.numel() == 0:
            return current_out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim).to(
                q.dtype
            )

        # Prefix KV is sharded across DCP ranks, so compute each rank's
        # partial attention with all gathered query heads and merge by LSE.
        q_all = group.all_gather(q_local, dim=1).contiguous()
        total_heads = q_all.shape[1]
        prefix_out = torch.zeros(
            (total_tokens, total_heads, layer.v_head_dim),
            device=q.device,
            dtype=torch.float32,
        )
        prefix_lse = torch.full(
            (total_tokens, total_heads),
            -float("inf"),
            device=q.device,
            dtype=torch.float32,
        )
        empty_k = k[:0].contiguous()
        empty_v = v[:0].contiguous()
        self.extend_attention_fwd(
            q_all,
            empty_k,
            empty_v,
            prefix_out,
            k_buffer,
            v_buffer,
            self.forward_metadata.qo_indptr,
            kv_indptr,
            kv_indices,
            None,
            False,
            None,
            max_extend_len,
            k_descale,
            v_descale,
            sm_scale=layer.scaling,
            logit_cap=logits_soft_cap,
            xai_temperature_len=layer.xai_temperature_len,
            lse_extend=prefix_lse,
            skip_extend=True,
        )

        prefix_out, prefix_lse = cp_lse_ag_out_rs_mha(
            prefix_out, prefix_lse, group, return_lse=True
        )
        final_lse = torch.logaddexp(prefix_lse, current_lse)
        prefix_scale = torch.exp(prefix_lse - final_lse).unsqueeze(-1)
        current_scale = torch.exp(current_lse - final_lse).unsqueeze(-1)
        prefix_scale = torch.nan_to_num(prefix_scale, nan=0.0, posinf=0.0, neginf=0.0)
        current_scale = torch.nan_to_num(current_scale, nan=0.0, posinf=0.0, neginf=0.0)
        out = prefix_out * prefix_scale + current_out * current_scale
        return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim).to(q.dtype)

    def _forward_extend_unified(
        self,
        q: torch.Tensor,
        o: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        causal: bool,
        logits_soft_cap: float,
        sinks: Optional[torch.Tensor],
        score_mod=None,
        aux_tensors=None,
    ):
        """
        Unified 1-stage extend attention for deterministic inference.
        Both prefix and extend KV are accessed through unified kv_indices.
        """
        bs = forward_batch.batch_size

        # Determine sliding window settings
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            bidirectional_extend = (
                layer.attn_type == AttentionType.DECODER_BIDIRECTIONAL
            )
            sliding_window_size = (
                -1 if bidirectional_extend else layer.sliding_window_size
            )
            # Note: for unified kernel, we use full kv_indptr (not window)
            prefix_kv_indptr = self.forward_metadata.window_kv_indptr
            prefix_kv_indices = self.forward_metadata.window_kv_indices
            # Compute window start positions (absolute position of first key in window)
            # window_start_pos = seq_len - window_len
            window_kv_lens = prefix_kv_indptr[1 : bs + 1] - prefix_kv_indptr[:bs]
            if forward_batch.extend_prefix_lens is not None:
                window_start_pos = (
                    forward_batch.extend_prefix_lens[:bs] - window_kv_lens
                )
            elif forward_batch.forward_mode.is_target_verify():
                window_start_pos = forward_batch.seq_lens[:bs] - window_kv_lens
            else:
                window_start_pos = None
            # The padding is masked only by the sliding-window mask, so a layer
            # that attends bidirectionally keeps the unpadded list.
            if (
                sliding_window_size > 0
                and self.forward_metadata.aligned_window_kv_indptr is not None
            ):
                prefix_kv_indptr = self.forward_metadata.aligned_window_kv_indptr
                prefix_kv_indices = self.forward_metadata.aligned_window_kv_indices
                window_start_pos = forward_batch.extend_prefix_lens[:bs] - (
                    prefix_kv_indptr[1 : bs + 1] - prefix_kv_indptr[:bs]
                )
        else:
            sliding_window_size = -1
            prefix_kv_indptr = self.forward_metadata.kv_indptr
            prefix_kv_indices = self.forward_metadata.kv_indices
            window_start_pos = None

        extend_kv_indices = forward_batch.out_cache_loc
        pool = self.token_to_kv_pool
        if (
            layer.sliding_window_size is not None
            and layer.sliding_window_size > -1
            and isinstance(pool, SWAKVPool)
            and pool.layers_mapping[layer.layer_id][1]
        ):
            extend_kv_indices = self.forward_metadata.swa_out_cache_loc
            assert extend_kv_indices is not None, (
                "window-layer extend before the metadata carried a "
                "sliding-window write loc"
            )

        # Capture batches may not have a spec_info, so use the attention
        # metadata's resolved uniform verify width when extend lengths are absent.
        if forward_batch.extend_seq_lens is None:
            if not forward_batch.forward_mode.is_target_verify():
                raise RuntimeError(
                    "extend_seq_lens is None outside TARGET_VERIFY mode."
                )
            extend_seq_lens = torch.full(
                (bs,),
                self.forward_metadata.max_extend_len,
                dtype=torch.int32,
                device=self.device,
            )
        else:
            extend_seq_lens = forward_batch.extend_seq_lens

        if forward_batch.extend_start_loc is None:
            extend_start_loc = torch.cat(
                [
                    torch.zeros(1, dtype=torch.int32, device=self.device),
                    torch.cumsum(extend_seq_lens[:-1], dim=0),
                ]
            )
        else:
            extend_start_loc = forward_batch.extend_start_loc

        unified_kv_indptr, unified_kv_indices, prefix_lens = (
            self.build_unified_kv_indices(
                prefix_kv_indptr,
                prefix_kv_indices,
                extend_start_loc,
                extend_seq_lens,
                extend_kv_indices,
                bs,
            )
        )

        # Convert prefix_lens to int32 for the kernel
        prefix_lens = prefix_lens.to(torch.int32)

        if layer.k_scale is not None and layer.v_scale is not None:
            k_descale = layer.k_scale_float
            v_descale = layer.v_scale_float
        else:
            k_descale = 1.0
            v_descale = 1.0

        # Call unified kernel
        self.extend_attention_fwd_unified(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
            o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            k_descale,
            v_descale,
            self.forward_metadata.qo_indptr,
            unified_kv_indptr,
            unified_kv_indices,
            prefix_lens,
            self.forward_metadata.max_extend_len,
            custom_mask=self.forward_metadata.custom_mask,
            mask_indptr=self.forward_metadata.mask_indptr,
            sm_scale=layer.scaling,
            logit_cap=logits_soft_cap,
            is_causal=causal,
            sliding_window_size=sliding_window_size,
            sinks=sinks,
            window_start_pos=window_start_pos,
            xai_temperature_len=layer.xai_temperature_len,
            page_size=self.page_size,
            score_mod=score_mod,
            aux_tensors=aux_tensors,
        )

        return o

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache=True,
        sinks=None,
        score_mod=None,
        aux_tensors=None,
    ):
        # During torch.compile, there is a bug in rotary_emb that causes the
        # output value to have a 3D tensor shape. This reshapes the output correctly.
        q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)

        # TODO: reuse the buffer across layers
        if layer.qk_head_dim != layer.v_head_dim:
            o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        else:
            o = torch.empty_like(q)

        logits_soft_cap = logit_capping_mod(layer.logit_capping_method, layer.logit_cap)

        if save_kv_cache:
            swa_loc = self.forward_metadata.swa_out_cache_loc
            if (
                self.is_draft_runner
                and forward_batch.spec_info is not None
                and swa_loc is not None
            ):
                # KVWriteLoc keeps a longer swa_loc's prefix, but a draft step's
                # slice of the window is not a prefix of it.
                assert swa_loc.shape[0] == forward_batch.out_cache_loc.shape[0], (
                    f"draft step swa_out_cache_loc has {swa_loc.shape[0]} "
                    f"entries for {forward_batch.out_cache_loc.shape[0]} tokens"
                )
            if self.use_mla:
                if layer.k_scale is not None:
                    # MLATokenToKVPool doesn't accept scale parameters; k is unused
                    # after this point in decode, so scale in place.
                    k.div_(layer.k_scale)
                self.token_to_kv_pool.set_kv_buffer(
                    layer,
                    KVWriteLoc.for_batch(
                        forward_batch,
                        swa_loc=self.forward_metadata.swa_out_cache_loc,
                    ),
                    k,
                    v,
                )
            else:
                self._set_kv_buffer(
                    forward_batch,
                    layer,
                    KVWriteLoc.for_batch(
                        forward_batch,
                        swa_loc=self.forward_metadata.swa_out_cache_loc,
                    ),
                    k,
                    v,
                    layer.k_scale,
                    layer.v_scale,
                )

        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            kv_indptr = self.forward_metadata.window_kv_indptr
            kv_indices = self.forward_metadata.window_kv_indices
            # A null read rail reaches Triton as `None + offsets` and fails as
            # an unreadable IR-build error; say what is actually missing.
            assert kv_indices is not None, (
                f"layer {layer.layer_id} is a sliding-window layer but this "
                "forward built no window_kv_indices; a multi-step draft gets the "
                "per-step window rail whenever its model has a window "
                "(TritonMultiStepDraftBackend.window_rail)."
            )
        else:
            kv_indptr = self.forward_metadata.kv_indptr
            kv_indices = self.forward_metadata.kv_indices

        if layer.k_scale is not None and layer.v_scale is not None:
            k_descale = layer.k_scale_float
            v_descale = layer.v_scale_float
        else:
            k_descale = 1.0
            v_descale = 1.0

        # Select the correctly-sized attn_logits buffer for this layer.
        # The triton kernel's // Lv stride trick requires attn_logits.shape[-1]
        # to exactly match the layer's v_head_dim.
        attn_logits = self.forward_metadata.attn_logits
        if (
            self.forward_metadata.swa_attn_logits is not None
            and layer.v_head_dim == self.swa_v_head_dim
        ):
            attn_logits = self.forward_metadata.swa_attn_logits

        # Resolve Work-Centric (Lean) Attention activation. In auto mode (None) the decision
        # depends on whether this forward is a CUDA-graph capture: during capture seq_lens are
        # the fill value (1), so the seq-len gate would always bake the standard kernel and Lean
        # would never activate on the default path. There we key the bake on capture-time-known
        # signals (batch, head-tiles, is_mla) via lean_capture_policy -- Lean's fixed persistent
        # grid still adapts to raggedness on-device at replay. In eager decode, real seq_lens
        # are known, so lean_decode_seqlen_gate uses them. Deterministic inference requires
        # the batch-invariant standard path; the SGLANG_DISABLE_LEAN_ATTENTION kill-switch
        # also forces that path. Otherwise, an explicit True/False override is respected.
        from sglang.srt.environ import envs
        from sglang.srt.model_executor.runner_utils.capture_mode import (
            get_is_capture_mode,
        )

        if self.enable_deterministic or envs.SGLANG_DISABLE_LEAN_ATTENTION.get():
            enable_lean = False
        else:
            enable_lean = self.enable_lean_attention
            if enable_lean is None:
                kv_group_num = layer.tp_q_head_num // layer.tp_k_head_num
                is_mla = layer.qk_head_dim != layer.v_head_dim
                if get_is_capture_mode():
                    enable_lean = self._lean_capture_policy(
                        layer.tp_q_head_num,
                        kv_group_num,
                        forward_batch.batch_size,
                        is_mla,
                    )
                else:
                    enable_lean = self._lean_decode_seqlen_gate(
                        layer.tp_q_head_num,
                        kv_group_num,
                        forward_batch.batch_size,
                        forward_batch.seq_lens_sum,
                        is_mla,
                    )

        if self.dcp_size > 1:
            if score_mod is not None:
                raise NotImplementedError(
                    "DCP Triton decode does not support score_mod"
                )
            group = get_parallel().dcp_group
            with use_symmetric_memory(group):
                q_for_decode = q.view(
                    -1, layer.tp_q_head_num, layer.qk_head_dim
                ).contiguous()
            q_for_decode = group.all_gather(q_for_decode, dim=1).contiguous()
            o_for_decode = torch.empty(
                (q_for_decode.shape[0], q_for_decode.shape[1], layer.v_head_dim),
                dtype=torch.float32,
                device=q.device,
            )
            self.forward_metadata.attn_lse.fill_(-float("inf"))
            self.decode_attention_fwd(
                q_for_decode,
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                o_for_decode,
                kv_indptr,
                kv_indices,
                attn_logits,
                self.forward_metadata.attn_lse,
                self.forward_metadata.num_kv_splits,
                self.max_kv_splits,
                layer.scaling,
                k_descale,
                v_descale,
                logit_cap=logits_soft_cap,
                sinks=sinks,
                xai_temperature_len=layer.xai_temperature_len,
                enable_lean=enable_lean,
                lean_Mp=self.forward_metadata.lean_Mp,
                lean_Lp=self.forward_metadata.lean_Lp,
                lean_Op=self.forward_metadata.lean_Op,
                lean_locks=self.forward_metadata.lean_locks,
                uneven_batch=self.forward_metadata.uneven_batch,
            )
            local_lse = torch.logsumexp(
                self.forward_metadata.attn_lse[
                    : q_for_decode.shape[0], : q_for_decode.shape[1], :
                ],
                dim=-1,
            )
            o = cp_lse_ag_out_rs_mha(o_for_decode, local_lse, group)
            return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim).to(q.dtype)

        self.decode_attention_fwd(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
            kv_indptr,
            kv_indices,
            attn_logits,
            self.forward_metadata.attn_lse,
            self.forward_metadata.num_kv_splits,
            self.max_kv_splits,
            layer.scaling,
            k_descale,
            v_descale,
            logit_cap=logits_soft_cap,
            sinks=sinks,
            xai_temperature_len=layer.xai_temperature_len,
            has_mla=self.use_mla,
            use_pdl=self.use_pdl,
            page_size=self.page_size,
            score_mod=score_mod,
            aux_tensors=aux_tensors,
            enable_lean=enable_lean,
            lean_Mp=self.forward_metadata.lean_Mp,
            lean_Lp=self.forward_metadata.lean_Lp,
            lean_Op=self.forward_metadata.lean_Op,
            lean_locks=self.forward_metadata.lean_locks,
            uneven_batch=self.forward_metadata.uneven_batch,
        )
        return o


class TritonMultiStepDraftBackend:
    """
    Wrap multiple triton attention backends as one for multiple consecutive
    draft decoding steps.
    """

    needs_cpu_seq_lens: bool = False

    def __init__(
        self,
        model_runner: ModelRunner,
        topk: int,
        speculative_num_steps: int,
    ):
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        max_bs = model_runner.req_to_token_pool.size * self.topk
        self.kv_indptr = torch.zeros(
            (
                self.speculative_num_steps,
                max_bs + 1,
            ),
            dtype=torch.int32,
            device=model_runner.device,
        )
        self.attn_backends: List[TritonAttnBackend] = []
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends.append(
                TritonAttnBackend(
                    model_runner,
                    skip_prefill=True,
                    kv_indptr_buf=self.kv_indptr[i],
                )
            )
        self.max_context_len = self.attn_backends[0].max_context_len
        self.num_head = (
            model_runner.model_config.get_max_num_attention_heads()
            // get_parallel().attn_tp_size
        )
        self.device = model_runner.device
        # Cached variables for generate_draft_decode_kv_indices
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.pool_len = model_runner.req_to_token_pool.req_to_token.shape[1]
        self.page_size = get_schedule().page_size
        self.draft_window_size, self.draft_sink_size = resolve_draft_decode_window(
            model_runner
        )
        self.kv_index_translator = model_runner.kv_index_translator
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        # Each draft step's window layers read a window-clipped rail of their
        # own: the draft's chain is not part of the committed prefix yet.
        self.sliding_window_size = model_runner.sliding_window_size
        self.window_rail = (
            self.sliding_window_size is not None and self.sliding_window_size > 0
        )
        self.window_kv_indptr = (
            torch.zeros(
                (self.speculative_num_steps, max_bs + 1),
                dtype=torch.int32,
                device=model_runner.device,
            )
            if self.window_rail
            else None
        )
        self.cuda_graph_window_kv_indices = None

    def common_template(
        self,
        forward_batch: ForwardBatch,
        kv_indices_buffer: Optional[torch.Tensor],
        call_fn: int,
        window_kv_indices_buffer: Optional[torch.Tensor] = None,
    ):
        if kv_indices_buffer is None:
            kv_indices_buffer = self.cuda_graph_kv_indices
        if window_kv_indices_buffer is None:
            window_kv_indices_buffer = self.cuda_graph_window_kv_indices

        num_seqs = forward_batch.batch_size
        bs = self.topk * num_seqs
        seq_lens_sum = forward_batch.seq_lens_sum
        if seq_lens_sum is None:
            # seq_lens_sum here only slice-clamps a preallocated kv_indices buffer;
            # over-estimate is safe. Use a static UB to skip the per-iter .sum().item() D2H.
            seq_lens_sum = num_seqs * self.max_context_len

        src = self.kv_index_translator.read_source(
            forward_batch.kv_loc_plan,
            req_pool_indices=forward_batch.req_pool_indices,
            bs=num_seqs,
        )
        generate_draft_decode_kv_indices[
            (self.speculative_num_steps, num_seqs, self.topk)
        ](
            src.row_ids,
            src.ids,
            forward_batch.seq_lens,
            kv_indices_buffer,
            self.kv_indptr,
            forward_batch.positions,
            src.row_stride,
            kv_indices_buffer.shape[1],
            self.kv_indptr.shape[1],
            next_power_of_2(num_seqs),
            next_power_of_2(self.speculative_num_steps),
            next_power_of_2(bs),
            self.page_size,
            self.draft_window_size,
            self.draft_sink_size,
            ENTRY_PAGE_SIZE=src.entry_page_size,
            v2p=src.v2p,
            TRANSLATE=src.v2p is not None,
        )
        if self.window_rail:
            self._fill_window_rail(forward_batch, window_kv_indices_buffer, bs)

        if call_fn is None:
            return

        for i in range(self.speculative_num_steps - 1):
            forward_batch.spec_info.kv_indptr = self.kv_indptr[i, : bs + 1]
            forward_batch.spec_info.kv_indices = kv_indices_buffer[i][
                : draft_kv_indices_used_len(seq_lens_sum, self.topk, bs, i + 1)
            ]
            if self.window_rail:
                forward_batch.spec_info.window_kv_indptr = self.window_kv_indptr[
                    i, : bs + 1
                ]
                forward_batch.spec_info.window_kv_indices = window_kv_indices_buffer[i][
                    : bs * self.sliding_window_size
                ]
            call_fn(i, forward_batch)

    @contextlib.contextmanager
    def _step_writes(self, forward_batch, step: int):
        """Bind draft step ``step``'s slice of the batch's write ids, as
        `EagleWorkerV2.draft_forward` slices them, and its columns of the
        iteration's write window, while a per-step backend derives its write
        targets (the swa ids included) from the batch."""
        loc, cols = forward_batch.out_cache_loc, forward_batch.kv_loc_cols
        if loc is None or not self.attn_backends[step].use_sliding_window_kv_pool:
            yield
            return
        num_steps = self.speculative_num_steps
        if cols is None:
            # The draft's own window, each row laid out (topk, num_steps).
            step_cols = slice(step, None, num_steps)
        else:
            # A chain draft writes the leading columns of the verify window.
            assert self.topk == 1 and isinstance(cols, slice) and cols.step is None
            step_cols = slice(cols.start + step, cols.start + step + 1)
        forward_batch.out_cache_loc = per_step_draft_out_cache_loc(
            loc, forward_batch.batch_size, self.topk, num_steps
        )[step]
        forward_batch.kv_loc_cols = step_cols
        try:
            yield
        finally:
            forward_batch.out_cache_loc, forward_batch.kv_loc_cols = loc, cols

    def _fill_window_rail(
        self,
        forward_batch: ForwardBatch,
        window_kv_indices_buffer: torch.Tensor,
        bs: int,
    ) -> None:
        """Emit every step's window-clipped read ids into the per-step rows
        of ``window_kv_indices_buffer`` and their indptr into
        ``self.window_kv_indptr``. The reader selects FULL or SWA storage;
        the layer's window determines which positions to gather."""
        num_seqs = forward_batch.batch_size
        width = bs * self.sliding_window_size
        assert window_kv_indices_buffer.shape[1] >= width, (
            f"window rail row {window_kv_indices_buffer.shape[1]} < "
            f"{bs} branch(es) x window {self.sliding_window_size}"
        )
        src = self.kv_index_translator.read_source(
            forward_batch.kv_loc_plan,
            req_pool_indices=forward_batch.req_pool_indices,
            bs=num_seqs,
            kind=self.kv_index_translator.window_kv_kind,
        )
        generate_draft_decode_window_kv_indices[
            (self.speculative_num_steps, num_seqs, self.topk)
        ](
            src.row_ids,
            src.ids,
            forward_batch.seq_lens,
            window_kv_indices_buffer,
            self.window_kv_indptr,
            forward_batch.positions,
            src.row_stride,
            window_kv_indices_buffer.shape[1],
            self.window_kv_indptr.shape[1],
            next_power_of_2(num_seqs),
            next_power_of_2(self.speculative_num_steps),
            next_power_of_2(bs),
            self.page_size,
            self.sliding_window_size,
            ENTRY_PAGE_SIZE=src.entry_page_size,
            v2p=src.v2p,
            TRANSLATE=src.v2p is not None,
        )
        if (
            not src.is_translated
            and self.kv_index_translator.window_kv_kind == IdSpaceKind.SLIDING_WINDOW
        ):
            # Static pool: the legacy full->swa translate, as
            # update_sliding_window_buffer applies it to the target's window.
            for i in range(self.speculative_num_steps):
                row = window_kv_indices_buffer[i][:width]
                row.copy_(self.token_to_kv_pool.translate_loc_from_full_to_swa(row))

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        kv_indices_width = draft_kv_indices_buffer_width(
            forward_batch.batch_size, self.topk, self.max_context_len
        )
        kv_indices = torch.empty(
            (self.speculative_num_steps, kv_indices_width),
            dtype=torch.int64,
            device=self.device,
        )
        window_kv_indices = None
        if self.window_rail:
            # zeros, not empty: a static pool translates the whole row.
            window_kv_indices = torch.zeros(
                (
                    self.speculative_num_steps,
                    forward_batch.batch_size * self.topk * self.sliding_window_size,
                ),
                dtype=torch.int64,
                device=self.device,
            )

        def call_fn(i, forward_batch):
            forward_batch.spec_info.kv_indptr = (
                forward_batch.spec_info.kv_indptr.clone()
            )
            forward_batch.spec_info.kv_indices = (
                forward_batch.spec_info.kv_indices.clone()
            )
            if self.window_rail:
                forward_batch.spec_info.window_kv_indptr = (
                    forward_batch.spec_info.window_kv_indptr.clone()
                )
                forward_batch.spec_info.window_kv_indices = (
                    forward_batch.spec_info.window_kv_indices.clone()
                )
            with self._step_writes(forward_batch, i):
                self.attn_backends[i].init_forward_metadata(forward_batch)

        self.common_template(
            forward_batch,
            kv_indices,
            call_fn,
            window_kv_indices_buffer=window_kv_indices,
        )

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        kv_indices_width = draft_kv_indices_buffer_width(
            max_bs, self.topk, self.max_context_len
        )
        self.cuda_graph_kv_indices = torch.zeros(
            (self.speculative_num_steps, kv_indices_width),
            dtype=torch.int64,
            device=self.device,
        )
        self.cuda_graph_num_kv_splits = torch.full(
            (max_num_tokens,),
            self.attn_backends[0].max_kv_splits,
            dtype=torch.int32,
            device=self.device,
        )
        if self.window_rail:
            self.cuda_graph_window_kv_indices = torch.zeros(
                (
                    self.speculative_num_steps,
                    max_bs * self.topk * self.sliding_window_size,
                ),
                dtype=torch.int64,
                device=self.device,
            )

        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_cuda_graph_state(
                max_bs,
                max_num_tokens,
                kv_indices_buf=self.cuda_graph_kv_indices[i],
                cuda_graph_num_kv_splits_buf=self.cuda_graph_num_kv_splits,
            )

    def init_forward_metadata_out_graph(
        self,
        forward_batch: ForwardBatch,
        in_capture: bool = False,
    ):
        from sglang.srt.model_executor.forward_batch_info import build_inner_fb_view

        if in_capture:
            inner_fb = build_inner_fb_view(
                forward_batch,
                bs=forward_batch.batch_size,
                forward_mode=ForwardMode.DECODE,
            )

            def call_fn(i, _forward_batch):
                with self._step_writes(inner_fb, i):
                    self.attn_backends[i].init_forward_metadata_out_graph(
                        inner_fb, in_capture=True
                    )

            self.common_template(forward_batch, None, call_fn)
        else:
            bs = forward_batch.batch_size
            self.common_template(forward_batch, None, None)

            # NOTE: Multi-step's attention backends use the slice of
            # - kv_indptr buffer (cuda graph and non-cuda graph)
            # - kv_indices buffer (cuda graph only)
            # So we don't need to assign the KV indices inside the attention backend.

            # Compute num_kv_splits only once
            num_token = bs * self.topk
            self.attn_backends[-1].get_num_kv_splits(
                self.attn_backends[-1].cuda_graph_num_kv_splits[:num_token],
                forward_batch.seq_lens[:bs],
            )
            if self.attn_backends[0].use_sliding_window_kv_pool:
                # Each captured step writes its window layers through its own
                # backend's swa buffer: refill it from that step's columns.
                for i in range(self.speculative_num_steps - 1):
                    with self._step_writes(forward_batch, i):
                        self.attn_backends[i]._fill_cuda_graph_swa_out_cache_loc(
                            forward_batch
                        )

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        for attn_backend in self.attn_backends:
            attn_backend.init_forward_metadata_in_graph(forward_batch)


def update_sliding_window_buffer(
    window_kv_indptr,
    translator,
    plan,
    req_pool_indices,
    sliding_window_size,
    seq_lens,
    bs,
    device=None,
    token_to_kv_pool=None,
    window_kv_indices=None,
):
    """Fill window KV buffers for sliding-window attention.

    Pass ``window_kv_indices`` to write into a pre-allocated buffer (CUDA-graph
    path); omit it (or pass ``None``) to allocate a fresh tensor (eager path,
    requires ``device``).

    Unified pool: the gather reads the swa sub-pool's own id space (built
    directly from virtual ids through the swa side's own v2p), so the window
    indices come out already swa-side ids -- no translate here, eager or
    captured. Static SWA pools gather full-token ids from req_to_token and keep
    the legacy full->swa translate below.
    """
    window_kv_lens = torch.minimum(
        seq_lens,
        torch.tensor(sliding_window_size),
    )
    window_kv_indptr[1 : bs + 1] = torch.cumsum(window_kv_lens, dim=0)
    window_kv_indptr = window_kv_indptr[: bs + 1]
    if window_kv_indices is None:
        window_kv_indices = torch.empty(
            window_kv_indptr[-1], dtype=torch.int64, device=device
        )
    window_kv_start_idx = seq_lens - window_kv_lens
    token_mapping = (
        token_to_kv_pool.full_to_swa_index_mapping
        if isinstance(token_to_kv_pool, SWAKVPool)
        else None
    )
    translated = translator.pack_read_stream(
        plan,
        req_pool_indices=req_pool_indices,
        seq_lens=window_kv_lens,
        indptr=window_kv_indptr,
        out=window_kv_indices,
        kv_start_idx=window_kv_start_idx,
        kind=translator.window_kv_kind,
        token_mapping=token_mapping,
    )
    if not translated and isinstance(token_to_kv_pool, BaseSWAKVPool):
        kv_last_index = window_kv_indptr[-1]
        window_kv_indices[:kv_last_index] = (
            token_to_kv_pool.translate_loc_from_full_to_swa(
                window_kv_indices[:kv_last_index]
            )
        )
    return window_kv_indptr, window_kv_indices, window_kv_lens, window_kv_start_idx
