"""DDTree server-argument validation (ddtree-temp patch set).

Stdlib only. Called from ``ServerArgs.__post_init__`` (patched
server_args.py): ``--speculative-algorithm DDTREE`` becomes DFLASH with
``speculative_ddtree_budget`` / ``speculative_ddtree_topk_cap`` filled in.
"""

from __future__ import annotations

DDTREE = "DDTREE"
DEFAULT_BUDGET = 64


class DDTreeArgumentError(ValueError):
    pass


def _as_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = int(value)
        except (TypeError, ValueError):
            raise DDTreeArgumentError(f"--{name} must be an integer, got {value!r}.") from None
    return value


def resolve_ddtree_args(algorithm, budget, topk_cap, debug_metrics=False, tree_verify=False):
    """Validate. Returns (algorithm, budget, topk_cap) to store, or raises
    DDTreeArgumentError (a ValueError) with a message naming the flag."""
    algo = None if algorithm is None else str(algorithm).upper()
    flags_given = (
        budget is not None or topk_cap is not None or bool(debug_metrics) or bool(tree_verify)
    )
    if algo == DDTREE or (algo == "DFLASH" and budget is not None):
        budget = DEFAULT_BUDGET if budget is None else _as_int("speculative-ddtree-budget", budget)
        if budget < 1:
            raise DDTreeArgumentError(
                f"--speculative-ddtree-budget must be >= 1 (draft nodes per verify, root excluded), got {budget}."
            )
        topk_cap = budget if topk_cap is None else _as_int("speculative-ddtree-topk-cap", topk_cap)
        if not 1 <= topk_cap <= budget:
            raise DDTreeArgumentError(
                "--speculative-ddtree-topk-cap must satisfy 1 <= topk_cap <= budget, "
                f"got topk_cap={topk_cap}, budget={budget}."
            )
        return "DFLASH", budget, topk_cap
    if flags_given:
        raise DDTreeArgumentError(
            "--speculative-ddtree-budget/--speculative-ddtree-topk-cap/"
            "--speculative-ddtree-debug-metrics/--speculative-ddtree-tree-verify require --speculative-algorithm DDTREE "
            f"(got {algorithm!r})."
        )
    return algorithm, budget, topk_cap


def normalize_ddtree_server_args(server_args) -> None:
    """In place on a ServerArgs record (before resolution seals it)."""
    algo, budget, cap = resolve_ddtree_args(
        getattr(server_args, "speculative_algorithm", None),
        getattr(server_args, "speculative_ddtree_budget", None),
        getattr(server_args, "speculative_ddtree_topk_cap", None),
        getattr(server_args, "speculative_ddtree_debug_metrics", False),
        getattr(server_args, "speculative_ddtree_tree_verify", False),
    )
    if getattr(server_args, "speculative_algorithm", None) != algo:
        server_args.speculative_algorithm = algo
    if getattr(server_args, "speculative_ddtree_budget", None) != budget:
        server_args.speculative_ddtree_budget = budget
    if getattr(server_args, "speculative_ddtree_topk_cap", None) != cap:
        server_args.speculative_ddtree_topk_cap = cap
