"""A rollout an orchestrator runs host by host (the ddtree.ops Ansible collection, an AWX
workflow): its id, and its milestones told to the hosts' webhooks once for the whole rollout.

The orchestrator deploys each host with `deploy --rollout-id ID --no-notify`, so every host
records the same rollout (`rollouts`, `rollback --rollout ID` work on it as on a CLI rollout) and
no host announces a rollout of its own; `start` and `finish` here tell the webhooks of all its
hosts, each webhook once, as a CLI rollout does (fleet/notify.py). Best effort, as there: a
webhook that fails costs a warning line, never the rollout.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from ..config.inventory import Host
from ..config.notify_settings import NotifyEvent
from ..config.schema import CountOrShare
from ..errors import DdtreeOpsError, InputError, RouterPoolShort
from ..runbook.results import worst_exit_code
from .notify import MESSAGE_MAX, RolloutInfo, notifier_for, operator
from .policy import rollout_policy
from .rollout import Target
from .rollout_id import new_rollout_id
from .routing import Routers, router_for, router_gate

__all__ = ["check_batch", "finish_rollout", "start_rollout"]


def _notifier(hosts: Sequence[Host], kind: str, rollout_id: str, warn: Callable[[str], None], *,
              patchset: str | None, bundle: str | None, **kw: Any):
    targets = [Target(h.name, (h,)) for h in hosts]
    return notifier_for(targets, RolloutInfo(kind, rollout_id, patchset, bundle, operator()), warn, **kw)


def start_rollout(hosts: Sequence[Host], kind: str, warn: Callable[[str], None], *,
                  batches: Sequence[Sequence[str]] = (), patchset: str | None = None, bundle: str | None = None,
                  **notifier_kw: Any) -> str:
    """A new rollout id, its `start` told to the hosts' webhooks. `notifier_kw`: Notifier's
    (environ, transport, clock)."""
    rollout_id = new_rollout_id()
    n = _notifier(hosts, kind, rollout_id, warn, patchset=patchset, bundle=bundle, **notifier_kw)
    if n is not None:
        n.started([h.name for h in hosts], [list(b) for b in batches] or [[h.name for h in hosts]])
    return rollout_id


def finish_rollout(hosts: Sequence[Host], kind: str, rollout_id: str, rows: Sequence[Mapping[str, Any]],
                   warn: Callable[[str], None], *, patchset: str | None = None, bundle: str | None = None,
                   aborted: bool = False, reason: str | None = None, **notifier_kw: Any) -> int:
    """Tell the hosts' webhooks the rollout ended, with each host's row (host, outcome, exit_code,
    release, message; a host the orchestrator never reached has no row); the rollout's exit code."""
    clean = [{"host": str(r.get("host")), "outcome": r.get("outcome"), "exit_code": r.get("exit_code"),
              "release": r.get("release"), "message": (str(r.get("message") or ""))[:MESSAGE_MAX] or None}
             for r in rows]
    code = worst_exit_code(int(r["exit_code"]) for r in clean if isinstance(r["exit_code"], int))
    n = _notifier(hosts, kind, rollout_id, warn, patchset=patchset, bundle=bundle, **notifier_kw)
    if n is not None:
        if aborted:
            n.aborted(reason or "aborted by the orchestrator")
        n.send(NotifyEvent.FINISH, hosts=clean, exit_code=code, aborted=aborted, reason=reason)
    return code


def check_batch(hosts: Sequence[Host], batch: Sequence[str], *, max_unavailable: CountOrShare | None = None,
                changed: bool = False, routers: Routers = router_for) -> str:
    """Before an orchestrator's batch (an Ansible `serial` batch) leaves service, the CLI's two
    checks: no more than max_unavailable of all `hosts` at once, and every router in front of the
    batch keeps its pool less max_unavailable ready (policy.py). The orchestrator cannot split a
    batch as the CLI does, so a batch the router cannot take whole is refused (RouterPoolShort;
    `changed`: whether earlier batches ran). A line saying what was checked."""
    targets = [Target(h.name, (h,)) for h in hosts]
    by_name = {t.name: t for t in targets}
    unknown = [n for n in batch if n not in by_name]
    if unknown:
        raise InputError(f"batch host {unknown[0]!r} is not one of the rollout's hosts ({', '.join(by_name)})")
    policy, _ = rollout_policy(targets, max_unavailable)
    if len(batch) > policy.max_unavailable:
        raise InputError(f"a batch of {len(batch)} ({', '.join(batch)}) would take more targets out of service at "
                         f"once than {policy.said}: make the play's serial batches at most {policy.max_unavailable}")
    names = ", ".join(batch)
    gate = router_gate(targets, policy, routers)
    if gate is None:
        return f"batch {names}: {len(batch)} of at most {policy.max_unavailable} ({policy.said}); no router"
    after = f"before {names}" + ("" if changed else "; nothing was changed")
    try:
        adm = gate([by_name[n] for n in batch])
    except DdtreeOpsError as e:
        raise RouterPoolShort(f"the router's workers could not be read: {e}; stopped {after}",
                              changed=changed) from None
    if adm.wait:
        raise RouterPoolShort(f"{adm.why}; stopped {after} (an Ansible batch goes whole: make serial smaller)",
                              changed=changed)
    return (f"batch {names}: {len(batch)} of at most {policy.max_unavailable} ({policy.said}); "
            f"the router keeps enough ready")
