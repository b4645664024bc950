"""DDTree server-argument validation (ddtree-temp patch set).

Stdlib only. Called from ``ServerArgs.__post_init__`` (patched server_args.py):
``--speculative-algorithm DDTREE`` becomes DFLASH with
``speculative_ddtree_budget`` / ``speculative_ddtree_topk_cap`` filled in, and
every option the tree verify cannot serve is refused here, at parse time, with
a message naming the option and what to use instead. A server that starts
with DDTREE therefore always verifies trees; there is no silent fallback.
"""

from __future__ import annotations

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


def tree_verify_refusals(server_args) -> list:
    """Every option the DDTree verify cannot serve, as messages that say what to
    use instead (empty: the combination is served)."""
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
    attn_dp = bool(getattr(server_args, "enable_dp_attention", False)) or (
        (getattr(server_args, "attn_dp_size", 1) or 1) > 1
    )
    if attn_dp:
        why.append("DP attention is not supported by the tree verify; drop --enable-dp-attention / --attn-dp-size")
    if getattr(server_args, "enable_lora", False):
        why.append("--enable-lora: the draft top-k does not cover LoRA-added vocabulary; serve without LoRA")
    if getattr(server_args, "speculative_adaptive", False):
        why.append("--speculative-adaptive changes the verify width at run time; the tree width is fixed (budget + 1)")
    if getattr(server_args, "speculative_use_rejection_sampling", False):
        why.append(
            "--speculative-use-rejection-sampling is a chain sampler; "
            "DDTREE samples the tree with SGLang's tree kernel"
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
    return why


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
