"""Range checks of the command line's numbers, run before anything connects.

A typo in a flag must cost nothing: `--deadline -5` once stopped the serving unit and rolled
it back at once (two restarts of a 1T model), and `--forks 0` ended in a thread pool's
ValueError. Each check uses the inventory's own validators (config/schema.py), so a flag and
the inventory value it overrides accept the same numbers; a refusal is InputError (exit 2)
naming the flag.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config.perfgate_settings import PERF_GATE_FIELDS
from ..config.schema import CountOrShare, Invalid, count_or_share, int_range, number_range
from ..config.workload_settings import Workload
from ..errors import InputError
from ..fleet.rollout import parse_percent, plan_batches

FORKS_MAX = 1000  # SSH connections at once; more would run out of file descriptors first
CANARY_MAX = 10_000
DEADLINE_MAX_S = 86_400.0  # the inventory's health.load_deadline_s bound


def _checked(flag: str, check: Any, value: Any) -> Any:
    try:
        return check(value, {})
    except Invalid as e:
        raise InputError(f"{flag} {e.problem}") from None


def check_forks(forks: int) -> int:
    return _checked("--forks", int_range(1, FORKS_MAX), forks)


def check_deadline(deadline_s: float | None) -> float | None:
    """--deadline: seconds for the weights to load; None keeps the inventory's."""
    if deadline_s is None:
        return None
    return _checked("--deadline", number_range(1, DEADLINE_MAX_S), deadline_s)


def check_max_unavailable(value: str | None) -> CountOrShare | None:
    """--max-unavailable N|P%: None keeps the inventory's (policy.py)."""
    if value is None:
        return None
    return _checked("--max-unavailable", count_or_share(), value)


def check_rollout_flags(targets: int, *, forks: int, canary: int = 0, batch: str | None = None,
                        max_fail: str | None = None, deadline_s: float | None = None,
                        max_unavailable: str | None = None) -> None:
    """Every number a rollout takes: InputError for the first one out of range."""
    check_forks(forks)
    check_max_unavailable(max_unavailable)
    _checked("--canary", int_range(0, CANARY_MAX), canary)
    if max_fail is not None:
        parse_percent(max_fail)
    plan_batches(targets, canary=canary, batch=batch)
    check_deadline(deadline_s)


def rollout_policy_for(targets: list, flag: str | None, *, canary: int = 0, batch: str | None = None):
    """The rollout policy (fleet/policy.py) for the selection, from --max-unavailable or the
    inventory, and its notes: (policy, notes). InputError (exit 2) for a flag out of range or a
    canary larger than max_unavailable, before anything connects."""
    from ..fleet.policy import rollout_policy
    from ..fleet.rollout import batch_size

    size = batch_size(batch, len(targets)) if batch is not None else None
    return rollout_policy(targets, check_max_unavailable(flag), canary=canary, batch_size=size, batch_flag=batch)


def check_workload_flags(workload: Workload, flags: dict[str, tuple[str, Any]]) -> Workload:
    """`workload` with the performance gate's flags applied ({field: (flag, value)}, a None value
    left alone), each checked by its `perf_gate:` key's own validator (`--duration 0` is refused
    as `perf_gate.duration_s: 0` is)."""
    checks = {f.name: f.check for f in PERF_GATE_FIELDS}
    given = {name: _checked(flag, checks[name], value) for name, (flag, value) in flags.items() if value is not None}
    return dataclasses.replace(workload, **given)
