"""DDTree server-argument validation (ddtree-temp patch set).

Stdlib only. Called from ``ServerArgs.__post_init__`` (patched server_args.py):
``--speculative-algorithm DDTREE`` becomes DFLASH with
``speculative_ddtree_budget`` / ``speculative_ddtree_topk_cap`` filled in, and
every option the tree verify cannot serve is refused here, at parse time, with
a message naming the option and what to use instead. A server that starts
with DDTREE therefore always verifies trees; there is no silent fallback.
Requests asking for what the tree step does not apply (min_p, penalties,
min_new_tokens, hidden states, a custom logit processor that reads the
request's history) are refused at admission with a message for the client (``ddtree_request_refusal``, called from the patched
``validate_dflash_request``).
"""

from __future__ import annotations

from typing import Optional

DDTREE = "DDTREE"
DEFAULT_BUDGET = 64
MAX_BUDGET = 1024

# The only 0.5.23 attention backend that applies a per-request custom mask in
# TARGET_VERIFY for MHA *and* MLA models, eager and under CUDA graphs
# (triton_backend.py: init_forward_metadata / _update_target_verify_buffers
# read spec_info.custom_mask with mask_indptr = W * (seq_len + W)).
TREE_VERIFY_BACKENDS = ("triton",)

# Why the backends read in the 0.5.23 source cannot verify a DDTree; every
# other backend is refused as "not checked" (see the patch set's README).
_BACKEND_REASONS = {
    "flashinfer": (
        "its DFLASH verify replay (fast_prefill_plan) is built for a causal block and asserts "
        "that any custom mask is EAGLE's; a tree mask there is unchecked"
    ),
    "fa3": "it applies a tree mask only in EAGLE's topk x steps layout",
    "fa4": "it applies a tree mask only in EAGLE's topk x steps layout",
}


class DDTreeArgumentError(ValueError):
    pass


def _as_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = int(value)
        except (TypeError, ValueError):
            raise DDTreeArgumentError(f"--{name} must be an integer, got {value!r}.") from None
    return value


def resolve_ddtree_args(algorithm, budget, topk_cap):
    """Validate the DDTree flags. Returns (algorithm, budget, topk_cap) to store,
    or raises DDTreeArgumentError (a ValueError) with a message naming the flag."""
    algo = None if algorithm is None else str(algorithm).upper()
    if algo == DDTREE or (algo == "DFLASH" and budget is not None):
        budget = DEFAULT_BUDGET if budget is None else _as_int("speculative-ddtree-budget", budget)
        if not 1 <= budget <= MAX_BUDGET:
            raise DDTreeArgumentError(
                f"--speculative-ddtree-budget must be in 1..{MAX_BUDGET} "
                f"(draft nodes per verify, root excluded), got {budget}."
            )
        topk_cap = budget if topk_cap is None else _as_int("speculative-ddtree-topk-cap", topk_cap)
        if not 1 <= topk_cap <= budget:
            raise DDTreeArgumentError(
                "--speculative-ddtree-topk-cap must satisfy 1 <= topk_cap <= budget, "
                f"got topk_cap={topk_cap}, budget={budget}."
            )
        return "DFLASH", budget, topk_cap
    if budget is not None or topk_cap is not None:
        raise DDTreeArgumentError(
            "--speculative-ddtree-budget/--speculative-ddtree-topk-cap require "
            f"--speculative-algorithm DDTREE (got {algorithm!r})."
        )
    return algorithm, budget, topk_cap


TREE_DISTRIBUTIONS = ("request", "raw")


def resolve_tree_distribution(budget, distribution):
    """``--speculative-ddtree-tree-distribution``: which draft distribution the
    tree is built from. ``request`` (the default under DDTREE): each request's
    temperature, top-k and top-p, as its verify samples; ``raw``: the draft at
    temperature 1, unrestricted (2.0's tree), for a drafter that is poorly
    calibrated at low temperature (bench/results/tempered_tree.md: sharpening a
    wrong draft loses). Refused without DDTREE."""
    if budget is None:
        if distribution is not None:
            raise DDTreeArgumentError(
                "--speculative-ddtree-tree-distribution requires --speculative-algorithm DDTREE."
            )
        return None
    distribution = "request" if distribution is None else str(distribution)
    if distribution not in TREE_DISTRIBUTIONS:
        raise DDTreeArgumentError(
            f"--speculative-ddtree-tree-distribution must be one of {', '.join(TREE_DISTRIBUTIONS)}, "
            f"got {distribution!r}."
        )
    return distribution


def verify_backend(server_args) -> str | None:
    """The backend that runs TARGET_VERIFY (SGLang's rule: the prefill backend
    unless --speculative-attention-mode decode)."""
    mode = getattr(server_args, "speculative_attention_mode", "prefill") or "prefill"
    override = getattr(
        server_args,
        "decode_attention_backend" if mode == "decode" else "prefill_attention_backend",
        None,
    )
    return override or getattr(server_args, "attention_backend", None)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _set(server_args, name: str) -> bool:
    """An option is in use when it holds anything but its off value."""
    value = getattr(server_args, name, None)
    return value not in (None, False, 0, "", "null", "none", [], ())


def _wider_than_one(server_args, name: str) -> bool:
    return (getattr(server_args, name, 1) or 1) > 1


def _attention_refusals(server_args) -> list:
    """What the triton TARGET_VERIFY path with a custom mask cannot run."""
    why = []
    backend = verify_backend(server_args)
    if backend is not None and backend not in TREE_VERIFY_BACKENDS:
        reason = _BACKEND_REASONS.get(
            backend, "it is not known to apply a custom tree mask in target verify"
        )
        why.append(
            f"attention backend '{backend}' cannot verify a DDTree ({reason}); "
            "use --attention-backend triton (MHA and MLA models, CUDA graphs supported)"
        )
    page_size = getattr(server_args, "page_size", None)
    if page_size not in (None, 1):
        why.append(
            f"--page-size {page_size}: the accepted path's KV is moved token by token "
            "inside the request's tree window; use --page-size 1"
        )
    if _wider_than_one(server_args, "dcp_size"):
        why.append(
            f"--dcp-size {server_args.dcp_size}: triton's decode-context-parallel extend "
            "(_forward_extend_dcp) raises NotImplementedError for a custom mask, and the tree "
            "verify always carries one; use --dcp-size 1"
        )
    cp = [_flag(n) for n in _CONTEXT_PARALLEL if _set(server_args, n)]
    if _wider_than_one(server_args, "attn_cp_size"):
        cp.insert(0, f"--attn-cp-size {server_args.attn_cp_size}")
    if cp:
        why.append(
            f"context parallelism ({', '.join(cp)}) is not supported with DDTREE: triton has no "
            "prefill-CP path and the tree verify is unproven under CP; drop the CP options"
        )
    for name in ("enable_nvidia_megakernel", "enable_amd_monokernel"):
        if getattr(server_args, name, False):
            why.append(
                f"{_flag(name)}: the plugin's fused kernels take over the verify steps they "
                "support and are not known to apply a custom tree mask; drop it"
            )
    if getattr(server_args, "enable_mis", False):
        why.append(
            "--enable-mis needs the flashinfer attention backend, which cannot verify a DDTree; "
            "serve multi-item scoring without DDTREE"
        )
    return why


# Context-parallel options of 0.5.23 (arg_groups/fields/parallel.py) besides
# --attn-cp-size (any width > 1) and --dcp-size (refused on its own).
_CONTEXT_PARALLEL = (
    "enable_prefill_cp",
    "cp_strategy",
    "enable_cp_decode_attn_tp",
    "enable_dsa_cache_layer_split",
    "enable_kv_cache_sharding",
)


def _topology_refusals(server_args) -> list:
    """Process layouts whose decode step is not the single-group tree step."""
    why = []
    device = getattr(server_args, "device", None)
    if device is not None and not str(device).startswith("cuda"):
        why.append(
            f"--device {device}: the tree acceptance is SGLang's CUDA tree sampler (eagle_sample "
            "takes the greedy argmax on CPU and XPU, so sampled requests would be served greedy); "
            "use --device cuda"
        )
    attn_dp = bool(getattr(server_args, "enable_dp_attention", False)) or _wider_than_one(
        server_args, "attn_dp_size"
    )
    if attn_dp:
        why.append("DP attention is not supported by the tree verify; drop --enable-dp-attention / --attn-dp-size")
    if _wider_than_one(server_args, "dwdp_size"):
        why.append(
            f"--dwdp-size {server_args.dwdp_size} forces attention DP (attn_dp_size = dwdp_size), "
            "which the tree verify does not support; drop --dwdp-size"
        )
    if getattr(server_args, "ep_join_mode", None) == "scale" or (
        _set(server_args, "elastic_ep_backend")
        and (getattr(server_args, "max_ep_size", None) or 0) > (getattr(server_args, "tp_size", 1) or 1)
    ):
        why.append(
            "elastic EP scale-up (--elastic-ep-join-mode scale, --max-ep-size above --tp-size) "
            "adds attention-DP ranks, which the tree verify does not support; drop --max-ep-size "
            "or use --elastic-ep-join-mode recover"
        )
    if _wider_than_one(server_args, "pp_size"):
        why.append(
            f"--pp-size {server_args.pp_size}: DFlash (and so DDTREE) runs with one pipeline "
            "stage only; use --pp-size 1"
        )
    if getattr(server_args, "enable_two_batch_overlap", False):
        why.append(
            "--enable-two-batch-overlap splits a TARGET_VERIFY batch with EAGLE's verify-input "
            "layout (split_spec_info), which the DDTree verify input does not have; drop it"
        )
    if getattr(server_args, "disaggregation_mode", "null") not in (None, "null"):
        why.append(
            f"--disaggregation-mode {server_args.disaggregation_mode}: PD disaggregation hands "
            "requests to the decode server as prebuilt batches, a path the tree step and its "
            "KV reservation are not proven on; serve DDTREE colocated"
        )
    if getattr(server_args, "decoupled_spec_role", "null") not in (None, "null"):
        why.append(
            "--decoupled-spec-role runs draft and verify as separate engines; "
            "the DDTree worker drafts and verifies in one step; drop it"
        )
    if getattr(server_args, "enable_pdmux", False):
        why.append(
            "--enable-pdmux runs decode on per-SM-group attention backends beside split "
            "prefill, unproven with the tree verify; drop it"
        )
    if _set(server_args, "dllm_algorithm"):
        why.append(
            "--dllm-algorithm (diffusion decoding) replaces the autoregressive step the tree verifies; drop it"
        )
    return why


def _feature_refusals(server_args) -> list:
    """Features whose results the tree step would silently get wrong."""
    why = []
    if getattr(server_args, "enable_lora", False):
        why.append("--enable-lora: the draft top-k does not cover LoRA-added vocabulary; serve without LoRA")
    elif _set(server_args, "lora_paths") and getattr(server_args, "enable_lora", None) is not False:
        why.append(
            "--lora-paths turns LoRA on when the arguments are resolved, and the draft "
            "top-k does not cover LoRA-added vocabulary; serve without LoRA"
        )
    if getattr(server_args, "speculative_adaptive", False):
        why.append(
            "--speculative-adaptive changes the verify width at run time; the tree width is fixed "
            "(budget + 1); drop it"
        )
    if getattr(server_args, "speculative_use_rejection_sampling", False):
        why.append(
            "--speculative-use-rejection-sampling is a chain sampler; "
            "DDTREE samples the tree with SGLang's tree kernel; drop it"
        )
    if getattr(server_args, "speculative_use_block_verification", False):
        why.append("--speculative-use-block-verification is chain-only; drop it")
    for flag in ("speculative_accept_threshold_single", "speculative_accept_threshold_acc"):
        value = getattr(server_args, flag, 1.0)
        if value is not None and float(value) != 1.0:
            why.append(
                f"--{flag.replace('_', '-')} {value}: thresholds below 1 make the tree verify lossy; leave it at 1.0"
            )
    if getattr(server_args, "speculative_draft_window_size", None) is not None:
        why.append("--speculative-draft-window-size (compact draft cache) is not supported with DDTREE; drop it")
    for name in ("enable_return_routed_experts", "enable_return_indexer_topk"):
        if getattr(server_args, name, False):
            why.append(
                f"{_flag(name)}: the capture is stored per verified KV slot, i.e. per tree node in "
                "node order, and read back per committed position, so every accepted token after "
                "the first would get another node's record; drop it"
            )
    if getattr(server_args, "enable_return_aux_hidden_states", False):
        why.append(
            "--enable-return-aux-hidden-states turns speculative decoding off (the algorithm only "
            "names a capture convention), which a DDTree budget cannot go with; use "
            "--speculative-algorithm DFLASH for the capture"
        )
    if getattr(server_args, "enable_watermark", False):
        why.append(
            "--enable-watermark: the tree step does not append the committed tokens to the "
            "watermark history (watermark_state.append_speculative), so later contexts would be "
            "wrong; serve watermarked traffic without DDTREE"
        )
    return why


def tree_verify_refusals(server_args) -> list:
    """Every option the DDTree verify cannot serve, as messages that say what to
    use instead (empty: the combination is served). Reads plain attributes, so
    it also runs on a resolved record (``resolved_view``)."""
    return _attention_refusals(server_args) + _topology_refusals(server_args) + _feature_refusals(server_args)


# What the tree step does not apply to the target's distribution. eagle_sample
# applies logit_bias, the grammar mask, temperature, top-k, top-p and the
# accumulated penalties, but those stay neutral: only the non-speculative and
# EAGLE decode preps feed committed tokens to the penalizers, DFlash's does not.
# request parameter -> (is it asked for?, why it cannot be served).
_REQUEST_REFUSALS = (
    ("min_p", lambda sp: (getattr(sp, "min_p", 0.0) or 0.0) > 0.0,
     "the tree verify samples with temperature/top-k/top-p only (eagle_sample ignores min_p)"),
    ("frequency_penalty", lambda sp: (getattr(sp, "frequency_penalty", 0.0) or 0.0) != 0.0,
     "DFlash-family decode never feeds the committed tokens to the penalizers, so it would have no effect"),
    ("presence_penalty", lambda sp: (getattr(sp, "presence_penalty", 0.0) or 0.0) != 0.0,
     "DFlash-family decode never feeds the committed tokens to the penalizers, so it would have no effect"),
    ("repetition_penalty", lambda sp: getattr(sp, "repetition_penalty", 1.0) not in (None, 1.0),
     "DFlash-family decode never feeds the committed tokens to the penalizers, so it would have no effect"),
    ("min_new_tokens", lambda sp: (getattr(sp, "min_new_tokens", 0) or 0) > 0,
     "the output-length counter never advances in DFlash-family decode, so the tree verify "
     "would ban EOS and stop_token_ids for the whole generation"),
)


# How a custom logit processor reaches a request's history: SGLang puts the
# request itself into each row's params under "__req__" (Req.__init__), and
# the history is its token lists. The tree step hands every tree row the same
# params (apply_custom_logit_processor, as DFLASH does for its block rows), so
# a processor that reads them sees the root's history on a node at depth >= 1,
# not the node's own path: a silently wrong distribution.
_HISTORY_KEY = "__req__"
_HISTORY_ATTRS = frozenset({"output_ids", "origin_input_ids", "fill_ids"})


def _code_objects(obj):
    fn = getattr(obj, "__func__", obj)  # classmethod / staticmethod
    if isinstance(obj, property):
        for part in (obj.fget, obj.fset, obj.fdel):
            if part is not None:
                yield from _code_objects(part)
        return
    code = getattr(fn, "__code__", None)
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        yield c
        stack.extend(k for k in c.co_consts if hasattr(k, "co_consts"))


def reads_request_history(processor_cls) -> bool:
    """Whether a custom logit processor class can see the request's history: its
    code (every method of its own and of its bases, nested functions included)
    names the ``"__req__"`` entry or a history attribute (``output_ids``, ...).
    A processor that names neither cannot reach the history."""
    for klass in getattr(processor_cls, "__mro__", (processor_cls,)):
        if klass is object or klass.__module__ == "abc":
            continue
        for value in vars(klass).values():
            for code in _code_objects(value):
                if _HISTORY_KEY in code.co_consts or _HISTORY_ATTRS & set(code.co_names):
                    return True
    return False


def _custom_processor_refusal(serialized) -> Optional[str]:
    """Why the request's custom logit processor cannot run on the tree, or None.
    SGLang loads it the same way when it applies it (a server runs these only
    with --enable-custom-logit-processor)."""
    try:
        from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

        processor_cls = type(CustomLogitProcessor.from_str(serialized))
    except Exception as exc:  # noqa: BLE001 - named for the client, never served unchecked
        return (
            f"custom_logit_processor: it could not be loaded to check what it reads "
            f"({type(exc).__name__}: {exc})"
        )
    if reads_request_history(processor_cls):
        return (
            f"custom_logit_processor {processor_cls.__name__}: it reads the request's history "
            f"(custom_params[{_HISTORY_KEY!r}]), and every tree row would see the root's "
            "history instead of its own path, wrong from depth 1 on"
        )
    return None


def ddtree_request_refusal(req):
    """Why a DDTREE server cannot serve this request (a message for the client),
    or None. Reads plain attributes of a scheduler ``Req``; stdlib only, but
    for a request with a custom logit processor, which is loaded to see what
    it reads (SGLang's own loader)."""
    sp = getattr(req, "sampling_params", None)
    why = []
    for name, asked, reason in _REQUEST_REFUSALS:
        if sp is not None and asked(sp):
            why.append(f"{name}={getattr(sp, name)!r}: {reason}")
    processor = getattr(req, "custom_logit_processor", None)
    if processor is not None:
        refused = _custom_processor_refusal(processor)
        if refused is not None:
            why.append(refused)
    if getattr(req, "return_hidden_states", False):
        why.append(
            "return_hidden_states: the tree step keeps the verified nodes' hidden states only "
            "to fill the draft KV and returns none"
        )
    if not why:
        return None
    return (
        "DDTREE speculative decoding cannot serve this request: " + "; ".join(why)
        + ". Drop these parameters, or send the request to a server without DDTREE."
    )


def normalize_ddtree_server_args(server_args) -> None:
    """In place on a ServerArgs record (before resolution seals it): validate,
    normalise DDTREE to DFLASH + budget, pick the tree-verify defaults (triton
    attention, page size 1) where the operator left them unset, and refuse the
    rest."""
    algo, budget, cap = resolve_ddtree_args(
        getattr(server_args, "speculative_algorithm", None),
        getattr(server_args, "speculative_ddtree_budget", None),
        getattr(server_args, "speculative_ddtree_topk_cap", None),
    )
    if budget is not None:
        why = tree_verify_refusals(server_args)
        if why:
            raise DDTreeArgumentError(
                f"--speculative-algorithm DDTREE (budget {budget}) cannot run with: " + "; ".join(why) + "."
            )
        if verify_backend(server_args) is None:
            server_args.attention_backend = "triton"
        if getattr(server_args, "page_size", None) is None:
            server_args.page_size = 1
    if getattr(server_args, "speculative_algorithm", None) != algo:
        server_args.speculative_algorithm = algo
    if getattr(server_args, "speculative_ddtree_budget", None) != budget:
        server_args.speculative_ddtree_budget = budget
    if getattr(server_args, "speculative_ddtree_topk_cap", None) != cap:
        server_args.speculative_ddtree_topk_cap = cap
    dist = resolve_tree_distribution(budget, getattr(server_args, "speculative_ddtree_tree_distribution", None))
    if getattr(server_args, "speculative_ddtree_tree_distribution", None) != dist:
        server_args.speculative_ddtree_tree_distribution = dist
