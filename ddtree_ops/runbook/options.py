"""What the operator asked of a deploy or rollback, beyond the inventory: the options every
phase of the runbook reads (engine.py, phases.py, traffic.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class DeployOptions:
    force: bool = False
    break_tokens: tuple[str, ...] = ()  # --break-lock TOKEN: holders the operator chose to end
    no_rollback: bool = False
    command: str = "ddtree-ops deploy"
    deadline_s: float | None = None
    bundle_id: str | None = None
    # A connection lost during a run: keep reconnecting this long to carry on (or roll back).
    # None: the host's `reconnect_window_s` (host/session.reconnect_window_s).
    reconnect_s: float | None = None
    templates_dir: str | None = None  # a verified bundle's templates/ (default: the packaged ones)
    perf_gate: bool | None = None  # --perf-gate/--no-perf-gate; None: the inventory's perf_gate.enabled
    marginal: str = "fail"  # a marginal performance verdict: "accept" | "fail" | "ask" (a terminal)
    ask: Callable[[str], bool] | None = None  # how "ask" asks (the CLI's prompt)
    # A host not yet updated, measured with the same workload for comparison (set by the rollout):
    # (host name, the perf gate's workload) → its measurement.
    peer_measure: Callable[[str, Any], Any] | None = None
    # The rollout this run is part of (fleet/rollout_id.py), recorded with each host's release.
    rollout_id: str | None = None
    stop_after_canary: bool = False  # deploy: the canary batch only, left on the new release
    # --budget/--topk-cap given on the command line: recorded, so `promote` applies them again.
    overrides: dict[str, int] = field(default_factory=dict)

    def rollout_args(self) -> dict[str, Any]:
        """What `promote` must repeat to continue this rollout with the same gates."""
        return {"overrides": dict(self.overrides), "perf_gate": self.perf_gate, "deadline_s": self.deadline_s,
                "marginal": "fail" if self.marginal == "ask" else self.marginal}
