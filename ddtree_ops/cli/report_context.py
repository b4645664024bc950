"""What the report says first about a rollout, gathered where the CLI knows it: who ran it
(user@machine), what the selected hosts change from and to (the units a deploy replaces, such
as DFlash's, → the DDTree unit with the patch set, budget/topk and bundle), and the canary size
the batches were numbered with."""

from __future__ import annotations

import getpass
import socket
from typing import Any, Sequence

from ..fleet.rollout import Target


def ran_by() -> str:
    """user@machine of this run, as the deploy lock records its holder."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _settings(targets: Sequence[Target]) -> str:
    """`budget 16, topk 4`, or each distinct setting with its hosts when they differ."""
    by: dict[str, list[str]] = {}
    for t in targets:
        h = t.hosts[0]
        by.setdefault(f"budget {h.budget}, topk {h.topk_cap}", []).append(t.name)
    if len(by) == 1:
        return next(iter(by))
    return "; ".join(f"{k} ({', '.join(v)})" for k, v in by.items())


def deploy_context(targets: Sequence[Target], patchset: str, bundle: str | None, canary: int) -> dict[str, Any]:
    hosts = [h for t in targets for h in t.hosts]
    units = sorted({h.unit for h in hosts})
    replaced = sorted({c for h in hosts for c in h.conflicts})
    before = ", ".join(replaced) + " or " if replaced else ""
    to = f"{', '.join(units)}: {patchset}, {_settings(targets)}" + (f", bundle {bundle}" if bundle else "")
    return {"ran_by": ran_by(), "canary": canary,
            "change": {"from": f"{before}the release each host ran before", "to": to}}


def rollback_context(targets: Sequence[Target], to: str) -> dict[str, Any]:
    return {"ran_by": ran_by(), "canary": 0, "change": {"from": "the release each host runs", "to": to}}
