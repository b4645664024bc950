"""What a DDTREE server does with every SGLang 0.5.23 server option and request parameter.

Data only. ``test_ddtree_options.py`` checks it against the real 0.5.23 parser and request
structs (an option or field the table does not classify, or classifies twice, fails), proves
every parse-time and per-request refusal through SGLang's own code, and checks that the
patch set's README section "Every option and request parameter" names every entry.

Server options are keyed by argparse ``dest`` (one dest can have several flags, e.g.
``--enable-amd-monokernel`` / ``--monokernel-backend``). Verdicts:

- ``refused``: ``ddtree_args.tree_verify_refusals`` refuses it when the arguments are parsed
  (``prepare_server_args``), under the condition given; every one has a case in
  ``test_ddtree_options.PARSE_CASES``.
- ``defaulted``: DDTREE fills it in when unset (and refuses any other value).
- ``served``: the tree path reads or depends on it and serves it; the note says how, and
  which test (or which source reading) backs it.
- ``no effect``: it only acts with another algorithm, a model class DDTREE refuses at worker
  start, or an option refused here; or 0.5.23 never reads it.
- request parameters: ``served``, ``refused per request`` (``ddtree_args.ddtree_request_refusal``
  through the patched ``validate_dflash_request``), ``refused by 0.5.23`` or ``no effect``.
- ``UNTOUCHED`` groups: served unchanged; the tree step (draft block, top-k, tree, TARGET_VERIFY,
  acceptance, commit) never reads them, so they act exactly as under DFLASH.
"""

from __future__ import annotations

REFUSED = "refused"
DEFAULTED = "defaulted"
SERVED = "served"
NO_EFFECT = "no effect"
REFUSED_REQUEST = "refused per request"
REFUSED_BY_SGLANG = "refused by 0.5.23"

_PARSE = "test_ddtree_options.py::test_each_refusal_names_its_option_and_the_rest_parses"
_SAMPLED = "test_worker_sampled_cpu.py"
_LOGPROB = "test_worker_decode_cpu.py::test_ddtree_decode_step_real_pools[b20-cap4-block8]"
_GRAMMAR = "test_worker_features_cpu.py::test_grammar_tree_reaches_the_host_before_the_verify_launch"
_CLP = "test_worker_features_cpu.py::test_custom_logit_processor_bans_a_token_the_tree_proposes"
_MASK = "test_worker_features_cpu.py::test_return_sampling_mask_request_gets_its_mask_from_the_accepted_path"
_REQ = "test_ddtree_options.py::test_requests_the_tree_step_cannot_serve_are_refused_at_admission"
_SIZES = "test_sizes_upstream.py"
_KV = "test_kv_reservation.py"
_RESOLVED = "test_ddtree_options.py::test_resolution_keeps_the_tree_verify_defaults"

# --- server options the tree path reads, changes, refuses or makes moot ------------------------

OPTIONS = {
    # spec.py
    "speculative_algorithm": (SERVED, "DDTREE (any case) is stored as DFLASH + speculative_ddtree_budget "
                              "(like NEXTN -> EAGLE), so every DFlash path applies", "test_sglang_integration.py"),
    "speculative_ddtree_budget": (SERVED, "1..1024 (default 64), refused outside and without DDTREE",
                                  "test_sglang_integration.py"),
    "speculative_ddtree_topk_cap": (SERVED, "1..budget (default budget), refused outside",
                                    "test_sglang_integration.py"),
    "speculative_ddtree_tree_distribution": (
        SERVED, "request (default: each request's temperature/top-k/top-p) or raw (the draft at T = 1, "
        "unrestricted); refused without DDTREE",
        "test_worker_features_cpu.py::test_the_raw_tree_distribution_verifies_the_untempered_tree"),
    "speculative_num_draft_tokens": (SERVED, "the DFlash block b; max tree depth min(B, b - 1)",
                                     "test_worker_decode_cpu.py"),
    "speculative_dflash_block_size": (SERVED, "same as --speculative-num-draft-tokens (DFLASH makes them equal)",
                                      "test_worker_decode_cpu.py"),
    "speculative_attention_mode": (SERVED, "picks which backend carries TARGET_VERIFY: that one must be triton",
                                   "test_sglang_integration.py"),
    "speculative_draft_model_path": (SERVED, "the DFlash draft (required, as DFLASH)", ""),
    "speculative_draft_attention_backend": (SERVED, "the DFlash draft block's backend (DFlash's own forward, "
                                            "no tree mask)", ""),
    "speculative_num_steps": (NO_EFFECT, "DFLASH forces 1", ""),
    "speculative_eagle_topk": (NO_EFFECT, "DFLASH forces 1; the tree's width is the budget", ""),
    "speculative_accept_threshold_single": (REFUSED, "below 1: lossy tree acceptance", _PARSE),
    "speculative_accept_threshold_acc": (REFUSED, "below 1: lossy tree acceptance", _PARSE),
    "speculative_use_rejection_sampling": (REFUSED, "chain sampler; the tree kernel samples", _PARSE),
    "speculative_use_block_verification": (REFUSED, "chain-only", _PARSE),
    "speculative_adaptive": (REFUSED, "changes the verify width at run time; the tree width is fixed", _PARSE),
    "speculative_adaptive_config": (NO_EFFECT, "only with --speculative-adaptive (refused)", ""),
    "speculative_draft_window_size": (REFUSED, "compact draft cache not supported", _PARSE),
    "speculative_draft_sink_size": (NO_EFFECT, "needs --speculative-draft-window-size (refused); "
                                    "0.5.23 refuses it alone", ""),
    "speculative_token_map": (NO_EFFECT, "EAGLE's hot-vocabulary map; DFLASH does not read it", ""),
    "enable_multi_layer_eagle": (NO_EFFECT, "EAGLE only", ""),
    "spec_trace_dir": (NO_EFFECT, "not read anywhere in 0.5.23", ""),
    "uno_lora_path": (NO_EFFECT, "UNO only", ""),
    "speculative_domino_candidate_pool_size": (NO_EFFECT, "Domino drafts only, which the worker refuses at start", ""),
    "speculative_dspark_block_size": (NO_EFFECT, "DSPARK only", ""),
    "speculative_dspark_sps_table_path": (NO_EFFECT, "DSPARK only", ""),
    "speculative_dspark_confidence_sts_path": (NO_EFFECT, "DSPARK only", ""),
    "speculative_dspark_align_verify_tokens_to_graph_tier": (NO_EFFECT, "DSPARK only", ""),
    "speculative_ngram_min_bfs_breadth": (NO_EFFECT, "NGRAM only", ""),
    "speculative_ngram_max_bfs_breadth": (NO_EFFECT, "NGRAM only", ""),
    "speculative_ngram_match_type": (NO_EFFECT, "NGRAM only", ""),
    "speculative_ngram_max_trie_depth": (NO_EFFECT, "NGRAM only", ""),
    "speculative_ngram_capacity": (NO_EFFECT, "NGRAM only", ""),
    "speculative_ngram_external_corpus_path": (NO_EFFECT, "NGRAM only", ""),
    "speculative_ngram_external_sam_budget": (NO_EFFECT, "NGRAM only", ""),
    "speculative_ngram_external_corpus_max_tokens": (NO_EFFECT, "NGRAM only", ""),
    # exec_.py: attention and the verify kernels
    "attention_backend": (DEFAULTED, "triton when unset (the only backend that applies the tree mask in "
                          "TARGET_VERIFY for MHA and MLA); any other verify backend is refused", _RESOLVED),
    "prefill_attention_backend": (REFUSED, "anything but triton while it carries TARGET_VERIFY "
                                  "(--speculative-attention-mode prefill, the default)", _PARSE),
    "decode_attention_backend": (REFUSED, "anything but triton while it carries TARGET_VERIFY "
                                 "(--speculative-attention-mode decode)", _PARSE),
    "enable_nvidia_megakernel": (REFUSED, "the plugin takes over verify steps; tree mask unknown", _PARSE),
    "enable_amd_monokernel": (REFUSED, "the plugin takes over verify steps; tree mask unknown", _PARSE),
    "enable_mis": (REFUSED, "needs flashinfer attention, which cannot verify a tree", _PARSE),
    "enable_lean_attention": (NO_EFFECT, "a decode-kernel option; the tree step runs TARGET_VERIFY (extend kernel)",
                              ""),
    "flashinfer_mla_disable_ragged": (NO_EFFECT, "flashinfer MLA only (refused backend)", ""),
    "enable_deterministic_inference": (SERVED, "triton's deterministic extend (_forward_extend_unified) applies the "
                                       "custom mask with the same FULL_MASK offsets; resolution keeps triton "
                                       "(read; the resolution is run)", _RESOLVED),
    "rl_on_policy_target": (SERVED, "turns deterministic inference on (as above)", ""),
    "enable_torch_compile": (SERVED, "compiles the captured graphs, the W-wide verify included; the mask reaches "
                             "the triton kernel as in EAGLE's tree verify (not run)", ""),
    "torch_compile_max_bs": (SERVED, "as --enable-torch-compile", ""),
    "enable_torch_compile_debug_mode": (SERVED, "as --enable-torch-compile", ""),
    "cuda_graph_config": (SERVED, "target verify graphs are captured budget + 1 wide on the masked path "
                          "(patched spec_info / dflash_utils / triton_backend); graph off: the eager verify "
                          "reads the mask in init_forward_metadata (sizes proven, not run on a GPU)", _SIZES),
    "cuda_graph_backend_decode": (SERVED, "as --cuda-graph-config", _SIZES),
    "cuda_graph_max_bs_decode": (SERVED, "graph batch sizes of the W-wide verify; logits buffer G*W rows", _SIZES),
    "cuda_graph_bs_decode": (SERVED, "as --cuda-graph-max-bs-decode", _SIZES),
    "disable_decode_cuda_graph": (SERVED, "eager verify, same mask", ""),
    "disable_cuda_graph": (SERVED, "eager verify, same mask (deprecated flag)", ""),
    "disable_cuda_graph_padding": (SERVED, "unpadded batch sizes run the eager verify", ""),
    "grammar_backend": (SERVED, "grammar masks over the tree (GrammarTree); 'none' turns grammars off", _GRAMMAR),
    "enable_custom_logit_processor": (SERVED, "per-request processors over the tree rows", _CLP),
    "sampling_mask_max_tokens": (SERVED, "return_sampling_mask along the accepted path", _MASK),
    "sampling_backend": (SERVED, "the prefill sampler; the tree acceptance (eagle_sample) uses its own "
                         "softmax/renorm kernels whatever it is", ""),
    "enable_fp32_lm_head": (SERVED, "the draft top-k reads the target LM head in its own dtype (float32 accepted)", ""),
    "enable_return_hidden_states": (SERVED, "server side only; requests with return_hidden_states are refused "
                                    "per request", _REQ),
    "return_hidden_states_mode": (SERVED, "as --enable-return-hidden-states (the tree verify captures FULL anyway)",
                                  _REQ),
    "enable_return_routed_experts": (REFUSED, "captured per tree-node KV slot, read per committed position", _PARSE),
    "enable_return_indexer_topk": (REFUSED, "captured per tree-node KV slot, read per committed position", _PARSE),
    "enable_return_aux_hidden_states": (REFUSED, "turns speculative decoding off but would keep the DDTree budget",
                                        _PARSE),
    "return_aux_hidden_state_layer_ids": (NO_EFFECT, "needs --enable-return-aux-hidden-states (refused); 0.5.23 "
                                          "refuses it alone", ""),
    "enable_watermark": (REFUSED, "the tree step does not append committed tokens to the watermark history", _PARSE),
    "watermark_config": (NO_EFFECT, "needs --enable-watermark (refused); 0.5.23 refuses it alone", ""),
    "enable_two_batch_overlap": (REFUSED, "split_spec_info slices an EAGLE-shaped verify input", _PARSE),
    "tbo_token_distribution_threshold": (NO_EFFECT, "two-batch overlap only (refused)", ""),
    "dllm_algorithm": (REFUSED, "diffusion decoding replaces the autoregressive step", _PARSE),
    "dllm_algorithm_config": (NO_EFFECT, "only with --dllm-algorithm (refused)", ""),
    "dllm_fdfo": (NO_EFFECT, "only with --dllm-algorithm (refused)", ""),
    "elastic_ep_backend": (SERVED, "recover mode only; scale-up adds attention-DP ranks and is refused "
                           "(--max-ep-size, --elastic-ep-join-mode scale)", _PARSE),
    "ep_join_mode": (REFUSED, "'scale': a scale joiner runs attention DP", _PARSE),
    "mlx_enable_sampling": (NO_EFFECT, "MLX backend only", ""),
    # parallel.py
    "tp_size": (SERVED, "the draft top-k is exact over the whole vocabulary under TP (vocab_parallel_topk_logprobs)",
                "test_verify_parts.py::test_sharded_topk_equals_the_full_vocabulary_topk_on_every_rank"),
    "dp_size": (SERVED, "independent replicas, each a DDTree worker; with --enable-dp-attention it means DP "
                "attention (refused)", ""),
    "load_balance_method": (SERVED, "routing between replicas", ""),
    "dcp_size": (REFUSED, "> 1: triton's DCP extend raises NotImplementedError for a custom mask", _PARSE),
    "dcp_comm_backend": (NO_EFFECT, "DCP only (refused)", ""),
    "dcp_replicate_q_proj": (NO_EFFECT, "DCP only (refused)", ""),
    "attn_cp_size": (REFUSED, "> 1: context parallelism", _PARSE),
    "enable_prefill_cp": (REFUSED, "context parallelism", _PARSE),
    "cp_strategy": (REFUSED, "context parallelism", _PARSE),
    "enable_cp_decode_attn_tp": (REFUSED, "context parallelism", _PARSE),
    "enable_dsa_cache_layer_split": (REFUSED, "context parallelism", _PARSE),
    "enable_kv_cache_sharding": (REFUSED, "context parallelism / KV sharding", _PARSE),
    "moe_dp_size": (NO_EFFECT, "> 1 needs --attn-cp-size equal to it (0.5.23), which is refused", ""),
    "attn_dp_size": (REFUSED, "> 1: DP attention", _PARSE),
    "enable_dp_attention": (REFUSED, "DP attention (deprecated flag)", _PARSE),
    "dwdp_size": (REFUSED, "> 1 forces attn_dp_size = dwdp_size", _PARSE),
    "max_ep_size": (REFUSED, "above --tp-size with --elastic-ep-backend: elastic scale-up adds attention-DP ranks",
                    _PARSE),
    "ep_join_rank_offset": (NO_EFFECT, "elastic EP scale joiners only (refused)", ""),
    "elastic_ep_initial_size": (NO_EFFECT, "elastic EP scale-up only (refused)", ""),
    "enable_dp_attention_local_control_broadcast": (NO_EFFECT, "DP attention only (refused)", ""),
    "enable_dp_lm_head": (NO_EFFECT, "without DP attention the attention-TP group is the TP group", ""),
    "enable_tp_lm_head_all_to_all": (NO_EFFECT, "DP attention only (refused)", ""),
    "enable_dense_mlp_attn_tp": (NO_EFFECT, "DP attention only (refused)", ""),
    "pp_size": (REFUSED, "> 1: DFlash runs one pipeline stage (0.5.23 also refuses it for DFLASH)", _PARSE),
    "pp_max_micro_batch_size": (NO_EFFECT, "pipeline parallelism only (refused)", ""),
    "pp_async_batch_depth": (NO_EFFECT, "pipeline parallelism only (refused)", ""),
    "enable_layernorm_sp": (SERVED, "active only in ForwardMode.EXTEND (prefill, DFlash's own path), not in the "
                            "tree's TARGET_VERIFY", ""),
    "enable_megamoe_for_layernorm_sp": (SERVED, "as --enable-layernorm-sp", ""),
    # device.py
    "device": (REFUSED, "anything but cuda: the tree acceptance is the CUDA tree sampler", _PARSE),
    # disagg.py
    "disaggregation_mode": (REFUSED, "prefill/decode: prebuilt batches, unproven with the tree step", _PARSE),
    "decoupled_spec_role": (REFUSED, "draft and verify in separate engines", _PARSE),
    "enable_pdmux": (REFUSED, "per-SM-group decode backends and split prefill, unproven", _PARSE),
    "pdmux_config_path": (NO_EFFECT, "PD multiplexing only (refused)", ""),
    "sm_group_num": (NO_EFFECT, "PD multiplexing only (refused)", ""),
    "encoder_only": (NO_EFFECT, "an encoder-only server runs no decode", ""),
    # lora.py
    "enable_lora": (REFUSED, "the draft top-k does not cover LoRA-added vocabulary", _PARSE),
    "lora_paths": (REFUSED, "turns LoRA on at resolution (unless --enable-lora is explicitly off)", _PARSE),
    # schedule.py / model.py / memory.py
    "page_size": (DEFAULTED, "1 when unset; any other size refused (KV moves token by token in the window)",
                  _RESOLVED),
    "disable_overlap_schedule": (SERVED, "host lengths mirrored (non-overlap) or only reserved (overlap): both "
                                 "shapes run through the real step",
                                 "test_worker_decode_cpu.py::test_ddtree_decode_step_real_pools"),
    "enable_mixed_chunk": (SERVED, "mixed steps are extend batches: DFlash's own one-token decode for the running "
                           "requests (DDTreeWorkerV2 delegates them); the reservation covers a DFlash-served step",
                           _KV),
    "num_continuous_decode_steps": (NO_EFFECT, "not read anywhere in 0.5.23", ""),
    "max_running_requests": (SERVED, "DFLASH's default 48 applies; caps the sampling pre-warm batch", _SIZES),
    "context_length": (SERVED, "the req_to_token rows get the tree window's extra columns", _KV),
    "kv_cache_dtype": (SERVED, "the tree writes and moves KV through the pool's own set/move", ""),
    "quantization": (SERVED, "a quantised LM head at TP > 1 is refused at worker start (no exact sharded top-k)",
                     "test_verify_parts.py::test_model_refusals_name_every_reason"),
    "is_embedding": (NO_EFFECT, "embedding models do not decode", ""),
    "sampling_defaults": (SERVED, "'model' copies repetition_penalty / min_p from generation_config.json into "
                          "chat requests, which are then refused per request; use 'openai' for such models", _REQ),
    "enable_strict_thinking": (SERVED, "the thinking budget is a grammar (reasoner grammar backend)", _GRAMMAR),
    "reasoning_parser": (SERVED, "parsing is output-side; strict thinking is a grammar", ""),
    "constrained_json_whitespace_pattern": (SERVED, "grammar compilation", _GRAMMAR),
    "constrained_json_disable_any_whitespace": (SERVED, "grammar compilation", _GRAMMAR),
    "constrained_json_max_whitespace_cnt": (SERVED, "grammar compilation", _GRAMMAR),
    "disable_outlines_disk_cache": (SERVED, "grammar compilation", _GRAMMAR),
    "random_seed": (SERVED, "seeds the RNG of the tree sampler's coins", ""),
}

_MODEL_SPECIFIC = ("settings of model classes whose attention is not the triton backend (DSA, DeepSeek-V4, "
                   "hybrid SWA/Mamba pools, linear attention); no effect on the models DDTREE serves, and "
                   "mamba/linear-attention targets are refused at worker start")

# --- served unchanged, grouped by the 0.5.23 field file that declares them ----------------------

UNTOUCHED = {
    "model.py": (
        "weights, checkpoint formats, model configuration and loading: they shape the model before and inside "
        "its forward, the same for every token the tree verifies",
        "model_path load_format model_loader_extra_config trust_remote_code revision model_impl model_config_parser "
        "json_model_override_args dtype quantization_param_path modelopt_quant modelopt_checkpoint_restore_path "
        "modelopt_checkpoint_save_path modelopt_export_path quantize_and_serve rl_quant_profile "
        "startup_weight_load_mode custom_weight_loader weight_loader_disable_mmap weight_loader_prefetch_checkpoints "
        "weight_loader_prefetch_num_threads weight_loader_drop_cache_after_load "
        "remote_instance_weight_loader_seed_instance_ip remote_instance_weight_loader_seed_instance_service_port "
        "remote_instance_weight_loader_send_weights_group_ports remote_instance_weight_loader_backend "
        "remote_instance_weight_loader_start_seed_via_transfer_engine engine_info_bootstrap_port modelexpress_config "
        "download_dir model_checksum delete_ckpt_after_loading decrypted_config_file decrypted_draft_config_file "
        "checkpoint_engine_wait_weights_before_ready weight_cache_mode weight_cache_socket weight_cache_timeout",
    ),
    "model.py, model-specific": (_MODEL_SPECIFIC, "qsa_indexer_dtype"),
    "serving.py": (
        "HTTP/gRPC front end, tokenizer and detokenizer, chat templates, output parsers, streaming: outside the "
        "scheduler's decode step",
        "tokenizer_path tokenizer_mode tokenizer_backend tokenizer_worker_num detokenizer_worker_num "
        "skip_tokenizer_init host port fastapi_root_path smg_grpc_mode grpc_mode grpc_port sidecar sidecar_args "
        "skip_server_warmup warmups enable_http2 http2_max_concurrent_streams http2_initial_connection_window_size "
        "ssl_keyfile ssl_certfile ssl_ca_certs ssl_keyfile_password enable_ssl_refresh api_key admin_api_key "
        "served_model_name weight_version chat_template trust_request_chat_template hf_chat_template_name "
        "completion_template file_storage_path enable_cache_report return_input_ids return_output_ids "
        "default_chat_template_kwargs strip_thinking_cache tool_server asr_max_buffer_seconds "
        "asr_max_concurrent_sessions preferred_sampling_params allow_auto_truncate stream_interval batch_notify_size "
        "stream_response_default_include_usage incremental_streaming_output enable_streaming_session "
        "enable_dynamic_batch_tokenizer dynamic_batch_tokenizer_batch_size dynamic_batch_tokenizer_batch_timeout "
        "enable_tokenizer_batch_encode disable_tokenizer_batch_decode enable_response_store "
        "grpc_response_timeout_secs enable_http_worker_reuseport tool_call_parser",
    ),
    "mm.py": (
        "multimodal inputs are processed and encoded for the prompt (prefill, DFlash's own path); the tree step "
        "sees token ids and positions only (M-RoPE positions come from the tree's, compute_spec_mrope_positions)",
        "enable_multimodal mm_attention_backend enable_broadcast_mm_inputs_process enable_prefix_mm_cache "
        "mm_enable_dp_encoder mm_process_config mm_processor_worker_num mm_io_worker_num allowed_media_domains "
        "media_url_max_file_size_mb mm_preprocess_cache_size_mb trust_mm_content_hashes limit_mm_data_per_request "
        "enable_mm_global_cache image_processor_backend mm_global_cache_backend disable_fast_image_processor "
        "mm_feature_transport",
    ),
    "exec_.py, kernels and communication": (
        "GEMM/MoE/normalisation kernels, collectives and their fusions, autotuning, profiling and the prefill "
        "graphs: inside the model's forward or the prefill path, per token; the verify's token counts they size "
        "for come from max_speculative_num_draft_tokens = max(b, W) (test_sizes_upstream)",
        "enable_tf32_matmul fp8_gemm_runner_backend fp4_gemm_runner_backend bf16_gemm_backend "
        "disable_flashinfer_autotune flashinfer_autotune_skip_ops cuda_graph_backend_prefill "
        "cuda_graph_max_bs_prefill cuda_graph_bs_prefill cuda_graph_prefill_max_context disable_prefill_cuda_graph "
        "cuda_graph_max_seq_len_prefill enable_profile_cuda_graph enable_cudagraph_gc debug_cuda_graph "
        "enable_layerwise_nvtx_marker enable_nccl_nvls enable_symm_mem triton_attention_reduce_in_fp32 "
        "triton_attention_num_kv_splits triton_attention_split_tile_size enable_fused_qk_norm_rope "
        "enable_precise_embedding_interpolation enable_fused_moe_sum_all_reduce disable_custom_all_reduce "
        "enable_mscclpp enable_torch_symm_mem enable_scattered_sconv pre_warm_nccl boundary_reduction "
        "enable_quant_communications enforce_disable_flashinfer_allreduce_fusion flashinfer_allreduce_fusion_backend "
        "enable_aiter_allreduce_fusion disable_aiter_allreduce_fusion_in_prefill "
        "disable_aiter_allreduce_fusion_in_decode enable_flashinfer_allreduce_fusion prefill_kv_cache_dequant_dtype",
    ),
    "exec_.py, MoE and experts": (
        "expert routing, dispatch, placement and load balancing: per token inside the MoE layers",
        "moe_a2a_backend enable_w4a4_mxfp4_megamoe deepep_v2_mode moe_runner_backend flashinfer_mxfp4_moe_precision "
        "deepep_mode fuseep_mode deepep_dispatcher_output_dtype ep_num_redundant_experts ep_dispatch_algorithm "
        "init_expert_location enable_eplb eplb_algorithm eplb_rebalance_num_iterations "
        "eplb_rebalance_layers_per_chunk eplb_min_rebalancing_utilization_threshold "
        "expert_distribution_recorder_mode expert_distribution_recorder_buffer_size "
        "expert_balancedness_report_mode deepep_config enable_elastic_expert_backup mooncake_ib_device "
        "enable_waterfill elastic_ep_scale_timeout disable_flashinfer_cutlass_moe_fp4_allgather "
        "disable_shared_experts_fusion enforce_shared_experts_fusion flashinfer_a2a_dispatch_type "
        "enable_single_batch_overlap enable_paged_experts paged_experts_num_resident kt_weight_path kt_method "
        "kt_cpuinfer kt_threadpool_count kt_num_gpu_experts kt_max_deferred_experts_per_token",
    ),
    "exec_.py, weights in memory": (
        "weight offload and release/restore: decoder layers are wrapped (make_layers), the LM head the draft top-k "
        "reads is not",
        "cpu_offload_gb offload_group_size offload_num_in_group offload_prefetch_step offload_mode "
        "enable_memory_saver enable_weights_cpu_backup enable_draft_weights_cpu_backup ple_offload_embedding "
        "ple_offload_backend ple_offload_dir",
    ),
    "exec_.py, model-specific": (
        _MODEL_SPECIFIC,
        "dsa_prefill_backend dsv4_prefill_backend dsa_decode_backend dsa_paged_mqa_logits_backend dsa_topk_backend "
        "enable_deepseek_v4_fp4_indexer dsv4_attn_backend enable_encoder_swa_bounded_replay "
        "enable_decoder_swa_bounded_replay dsa_triton_union enable_dsa_fused_indexer mamba_backend mamba_ssm_dtype "
        "mamba_max_states_per_path enable_mamba_cache_stochastic_rounding mamba_cache_philox_rounds "
        "mamba_radix_cache_strategy mamba_track_interval enable_int8_mamba_checkpoint int8_mamba_ckpt_size "
        "linear_attn_backend linear_attn_decode_backend linear_attn_prefill_backend linear_attn_verify_backend "
        "enable_linear_replayssm linear_replayssm_cache_len enable_linear_replayssm_spec",
    ),
    "schedule.py": (
        "admission, chunking, priorities, retraction and memory budgets: they decide which requests run; each "
        "admitted request gets the DDTree reservation (ddtree_kv), proven through retractions and re-admission",
        "mem_fraction_static max_queued_requests max_total_tokens chunked_prefill_size prefill_decode_interval "
        "enable_dynamic_chunking max_prefill_tokens prefill_max_requests schedule_policy enable_priority_scheduling "
        "disable_priority_preemption default_priority_value abort_on_priority_when_disabled "
        "schedule_low_priority_values_first priority_scheduling_preemption_threshold retraction_policy "
        "schedule_conservativeness prefill_only_disable_kv_cache disable_chunked_prefix_cache "
        "scheduler_recv_interval enable_prefill_delayer prefill_delayer_max_delay_passes "
        "prefill_delayer_token_usage_low_watermark prefill_delayer_forward_passes_buckets "
        "prefill_delayer_wait_seconds_buckets prefill_delayer_queue_min_ratio prefill_delayer_max_delay_ms "
        "min_free_slots_delay prefill_decode_interval_min_bs",
    ),
    "schedule.py, model-specific": (
        _MODEL_SPECIFIC,
        "c128_page_size swa_full_tokens_ratio disable_hybrid_swa_memory swa_prefix_tails max_mamba_cache_size "
        "mamba_full_memory_ratio",
    ),
    "memory.py": (
        "prefix caches and KV stores: they hold committed tokens' KV, which the tree step has already moved into "
        "place (move_accept_tokens_to_target_kvcache) when the radix tree or a store reads it",
        "radix_eviction_policy radix_eviction_policy_config disable_radix_cache enable_session_radix_cache "
        "radix_cache_backend enable_hierarchical_cache hicache_host_memory_mode hicache_ratio hicache_size "
        "hicache_write_policy hicache_io_backend hicache_mem_layout hicache_storage_backend "
        "hicache_storage_prefetch_policy hicache_storage_backend_extra_config "
        "hicache_storage_prefetch_retry_poll_interval hicache_storage_prefetch_retry_max_attempts "
        "enable_unified_cache_external_linker unified_cache_external_linker_backend enable_lmcache "
        "lmcache_config_file enable_flexkv flexkv_config_file hicache_host_memory_fraction enable_linker_mla_dedup "
        "unified_cache_external_linker_config",
    ),
    "memory.py, model-specific": (
        _MODEL_SPECIFIC,
        "enable_page_major_kv_layout enable_unified_memory enable_hisparse hisparse_config",
    ),
    "parallel.py": (
        "process placement, communication setup and MoE/shared-expert sharding: the tree step runs inside one "
        "TP group as DFlash does",
        "nccl_port dist_timeout dist_init_addr gated_launch_port nnodes node_rank enable_attn_tp_input_scattered "
        "enable_shared_experts_attn_tp shared_experts_tp_size disable_attn_tp_gather enable_p2p_check ep_size "
        "moe_dense_tp_size",
    ),
    "device.py": (
        "GPU placement, watchdogs, process hygiene",
        "base_gpu_id gpu_id_step watchdog_timeout soft_watchdog_timeout sleep_on_idle use_ray numa_node gc_threshold",
    ),
    "observability.py": (
        "logging, metrics, tracing, dumps and canaries: they observe the step",
        "log_level log_level_http log_requests log_requests_level log_requests_format log_requests_target "
        "uvicorn_access_log_exclude_prefixes crash_dump_folder show_time_cost enable_metrics smg_http_sidecar_port "
        "enable_mfu_metrics enable_metrics_for_all_schedulers load_snapshot_publish_interval "
        "tokenizer_metrics_custom_labels_header tokenizer_metrics_allowed_custom_labels extra_metric_labels "
        "bucket_time_to_first_token bucket_inter_token_latency bucket_e2e_request_latency prompt_tokens_buckets "
        "generation_tokens_buckets gc_warning_threshold_secs decode_log_interval enable_request_time_stats_logging "
        "kv_events_config load_publish_endpoint enable_forward_pass_metrics forward_pass_metrics_worker_id "
        "forward_pass_metrics_ipc_name enable_trace trace_modules otlp_traces_endpoint export_metrics_to_file "
        "export_metrics_to_file_dir kv_canary kv_canary_sweep_interval debug_tensor_dump_output_folder "
        "debug_tensor_dump_layers debug_tensor_dump_input_file forward_hooks msprobe_dump_config otlp_service_name "
        "kv_canary_real_data",
    ),
    "spec.py, the DFlash draft": (
        "how the DFlash draft model is loaded and run: DFlash's own code, the tree consumes its hidden states",
        "speculative_draft_model_revision speculative_draft_load_format speculative_dsa_topk_backend "
        "speculative_draft_kv_cache_dtype speculative_moe_runner_backend speculative_moe_a2a_backend "
        "speculative_enable_w4a4_mxfp4_megamoe speculative_draft_model_quantization",
    ),
    "disagg.py": (
        "PD disaggregation and decoupled speculation settings: no effect, their modes are refused",
        "decoupled_spec_bind_endpoint decoupled_spec_connect_endpoints decoupled_spec_rank "
        "disaggregation_transfer_backend disaggregation_bootstrap_port disaggregation_ib_device "
        "disaggregation_decode_enable_radix_cache disaggregation_decode_enable_offload_kvcache "
        "disaggregation_decode_retraction_backup num_reserved_decode_tokens disaggregation_decode_extra_slots "
        "disaggregation_decode_polling_interval optimistic_prefill_attempts disaggregation_enable_kv_checksum "
        "enable_pd_role_switch disaggregation_decode_host_receive_threshold disaggregation_decode_allocation_policy",
    ),
    "disagg.py, encoder disaggregation": (
        "the prompt's multimodal embeddings come from an encoder server; the language side decodes with the "
        "plain tree step",
        "language_only language_model_only encoder_transfer_backend encoder_urls encoder_bootstrap_port "
        "encoder_register_urls enable_adaptive_dispatch_to_encoder",
    ),
    "lora.py": (
        "LoRA settings: no effect, LoRA is refused",
        "enable_lora_overlap_loading max_lora_rank lora_target_modules max_loaded_loras max_loras_per_batch "
        "lora_eviction_policy lora_backend max_lora_chunk_size experts_shared_outer_loras lora_use_virtual_experts "
        "lora_strict_loading lora_drain_wait_threshold",
    ),
    "the parser itself": (
        "--config merges a YAML file into the same argument list (the refusals apply to it); -h prints help",
        "config help",
    ),
}


def untouched_dests() -> dict:
    """dest -> group name, for every option served unchanged."""
    out = {}
    for group, (_, names) in UNTOUCHED.items():
        for name in names.split():
            out.setdefault(name, []).append(group)
    return out


# --- request parameters --------------------------------------------------------------------------

_PROMPT = (SERVED, "prompt side: tokenised, embedded or cached before the first decode step", "")
_IDENTITY = (SERVED, "bookkeeping, routing, streaming or logging around the request", "")
_FINISH = (SERVED, "finish checks on the committed tokens (scheduler host side, as DFLASH)", "")
_LOGPROBS = (SERVED, "compute_spec_logprobs gathers the accepted path's rows (accept_index)", _LOGPROB)
_SAMPLING_MASK = (SERVED, "the sampling support of the accepted path", _MASK)
_PENALTY = (REFUSED_REQUEST, "DFlash-family decode never feeds committed tokens to the penalizers: no effect", _REQ)
_DISAGG = (NO_EFFECT, "PD disaggregation / pipeline only (refused at parse)", "")
_NEEDS_CAPTURE = (NO_EFFECT, "needs --enable-return-routed-experts / --enable-return-indexer-topk (refused at "
                  "parse); without them 0.5.23 returns nothing", "")
_UNREAD = (NO_EFFECT, "not read by the scheduler in 0.5.23", "")

SAMPLING_PARAMS = {
    "max_new_tokens": _FINISH,
    "stop": _FINISH,
    "stop_strs": _FINISH,
    "stop_token_ids": _FINISH,
    "stop_regex": _FINISH,
    "stop_regex_strs": _FINISH,
    "stop_str_max_len": _FINISH,
    "stop_regex_max_len": _FINISH,
    "ignore_eos": _FINISH,
    "no_stop_trim": _FINISH,
    "is_normalized": (SERVED, "internal normalisation flag", ""),
    "temperature": (SERVED, "eagle_sample: temperature softmax over every tree row", _SAMPLED),
    "top_p": (SERVED, "eagle_sample: top-p renormalisation", _SAMPLED),
    "top_k": (SERVED, "eagle_sample: top-k renormalisation; top_k = 1 (or temperature 0) is greedy", _SAMPLED),
    "min_p": (REFUSED_REQUEST, "> 0: eagle_sample has no min-p step, so it would be silently ignored", _REQ),
    "frequency_penalty": _PENALTY,
    "presence_penalty": _PENALTY,
    "repetition_penalty": _PENALTY,
    "min_new_tokens": (REFUSED_REQUEST, "> 0: the output-length counter never advances, so EOS and stop_token_ids "
                       "would stay banned for the whole generation", _REQ),
    "n": (SERVED, "n > 1 is fanned out into independent requests before the scheduler", ""),
    "beam_width": (REFUSED_BY_SGLANG, "BeamCoordinator: beam search is not supported with speculative decoding", ""),
    "json_schema": (SERVED, "grammar mask over the tree", _GRAMMAR),
    "regex": (SERVED, "grammar mask over the tree", _GRAMMAR),
    "ebnf": (SERVED, "grammar mask over the tree", _GRAMMAR),
    "structural_tag": (SERVED, "grammar mask over the tree", _GRAMMAR),
    "ebnf_full_assistant": (SERVED, "grammar compilation", _GRAMMAR),
    "skip_special_tokens": (SERVED, "detokenizer", ""),
    "spaces_between_special_tokens": (SERVED, "detokenizer", ""),
    "stream_interval": (SERVED, "output streaming", ""),
    "logit_bias": (SERVED, "eagle_sample adds it to every tree row (read, not run)", ""),
    "sampling_seed": (SERVED, "eagle_sample draws the tree sampler's coins from it (_seeded_verify_coins; read, "
                      "not run)", ""),
    "custom_params": (SERVED, "handed to custom logit processors", _CLP),
    "watermark": (NO_EFFECT, "needs --enable-watermark (refused at parse); without it 0.5.23's tokenizer refuses a "
                  "request that turns watermarking on", ""),
}

# Fields of the request the scheduler receives (TokenizedGenerateReqInput); sampling_params is above.
SCHEDULER_REQUEST = {
    "rid": _IDENTITY, "http_worker_ipc": _IDENTITY, "stream": _IDENTITY, "session_id": _IDENTITY,
    "session_params": (SERVED, "continuations reuse the committed tokens' KV, moved into place by the tree step", ""),
    "routed_dp_rank": _IDENTITY, "routing_key": _IDENTITY, "priority": _IDENTITY, "extra_key": _IDENTITY,
    "no_logs": _IDENTITY, "time_stats": _IDENTITY, "cache_salt": _IDENTITY, "kv_hints": _IDENTITY,
    "lora_name": (NO_EFFECT, "LoRA is refused at parse", ""),
    "input_text": _PROMPT, "input_ids": _PROMPT, "input_embeds": _PROMPT, "mm_inputs": _PROMPT,
    "token_type_ids": _PROMPT, "positional_embed_overrides": _PROMPT, "need_wait_for_mm_inputs": _PROMPT,
    "num_items_assigned": _PROMPT, "encoder_urls": _PROMPT,
    "multi_item_delimiter_indices": (SERVED, "scoring readout of the prompt (prefill)", ""),
    "token_indices_to_pool": (SERVED, "pooling readout of the prompt (prefill)", ""),
    "sampling_params": (SERVED, "see SamplingParams", ""),
    "return_logprob": _LOGPROBS, "logprob_start_len": _LOGPROBS, "top_logprobs_num": _LOGPROBS,
    "token_ids_logprob": _LOGPROBS, "return_flat_raw_top_logprobs": _LOGPROBS,
    "return_sampling_mask": _SAMPLING_MASK, "sampling_logprobs_mode": _SAMPLING_MASK,
    "return_hidden_states": (REFUSED_REQUEST, "the tree step returns no hidden states", _REQ),
    "return_routed_experts": _NEEDS_CAPTURE, "routed_experts_start_len": _NEEDS_CAPTURE,
    "return_indexer_topk": _NEEDS_CAPTURE,
    "lora_id": (NO_EFFECT, "LoRA is refused at parse; 0.5.23's tokenizer refuses an adapter request", ""),
    "custom_logit_processor": (SERVED, "applied to the tree rows; one whose code reads the request's history "
                               "(custom_params['__req__']) is refused per request, as is one that cannot be loaded",
                               _CLP + ", " + _REQ),
    "bootstrap_host": _DISAGG, "bootstrap_port": _DISAGG, "bootstrap_room": _DISAGG,
    "bootstrap_pair_key": _DISAGG, "decode_tp_size": _DISAGG, "disagg_prefill_dp_rank": _DISAGG,
    "pp_prefetch_ticketed": _DISAGG,
    "require_reasoning": (SERVED, "reasoning grammar", _GRAMMAR),
    "return_bytes": _UNREAD, "return_entropy": _UNREAD,
}

# Fields of /generate (GenerateReqInput) that do not reach the scheduler under the same name.
GENERATE_ONLY = {
    "text": _PROMPT, "image_data": _PROMPT, "video_data": _PROMPT, "audio_data": _PROMPT, "mm_hashes": _PROMPT,
    "mm_content_hashes": _PROMPT, "use_audio_in_video": _PROMPT, "video_config": _PROMPT, "modalities": _PROMPT,
    "max_dynamic_patch": _PROMPT, "min_dynamic_patch": _PROMPT, "image_max_dynamic_patch": _PROMPT,
    "video_max_dynamic_patch": _PROMPT, "images_config": _PROMPT, "mm_processor_kwargs": _PROMPT,
    "watermark": SAMPLING_PARAMS["watermark"],
    "return_text_in_logprobs": _LOGPROBS, "return_flat_raw_output_top_logprobs": _LOGPROBS,
    "return_flat_raw_top_logprobs_b64": _LOGPROBS,
    "log_metrics": _IDENTITY, "conversation_id": _IDENTITY, "background": _IDENTITY, "custom_labels": _IDENTITY,
    "external_trace_header": _IDENTITY, "received_time": _IDENTITY, "data_parallel_rank": _IDENTITY,
    "return_prompt_token_ids": _IDENTITY,
    "lora_path": SCHEDULER_REQUEST["lora_id"],
    "max_thinking_tokens": (SERVED, "thinking budget, enforced by the reasoner grammar", _GRAMMAR),
}
