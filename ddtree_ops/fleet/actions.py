"""Deploy and rollback over the fleet: the rollout (rollout.py) running the one-host runbook
(deploy.py, rollback.py) on single hosts and the multi-node one (multinode.py) on servers, each
target over its own SSH connection(s). An unreachable host is a row, never a crash."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from ..artifacts.patchset import PatchSet
from ..config.inventory import Host
from ..config.workload_settings import Workload
from ..errors import DdtreeOpsError
from ..gates.workload import Measurement, measure
from ..host.hooks import NO_HOOKS, Hooks
from ..host.http import http_client
from ..host.session import HostSession, open_session
from ..runbook.deploy import deploy_host
from ..runbook.events import EventSink, Note
from ..runbook.options import DeployOptions
from ..runbook.results import HostResult, failed_result, with_tries
from ..runbook.rollback import UndoRollout, rollback_host
from .multinode import deploy_server, rollback_server
from .policy import RolloutPolicy
from .rollout import Milestones, Progress, Rollout, RolloutResult, Target, TargetAction, plan_batches
from .routing import Routers, router_for, router_gate
from .serving_sample import before_after, read_serving

HostOp = Callable[[HostSession, EventSink], HostResult]
ServerOp = Callable[[Target, Callable[[Host], HostSession], EventSink], list[HostResult]]


def run_on_host(host: Host, op: HostOp, *, connect: Callable[[Host], HostSession], report: EventSink) -> HostResult:
    t0 = time.monotonic()
    session: HostSession | None = None
    try:
        session = connect(host)
        if session.connect_tries > 1:
            report(Note(host.name, f"connected after {session.connect_tries} tries"))
        try:
            return with_tries(op(session, report), session)
        finally:
            session.close()
    except DdtreeOpsError as e:
        result = failed_result(host.name, e, time.monotonic() - t0)
        report(Note(host.name, f"{result.outcome}: {e}"))
        return with_tries(result, session) if session is not None else result


def per_target(host_op: HostOp, server_op: ServerOp, connect: Callable[[Host], HostSession]) -> TargetAction:
    """A single host runs `host_op` on its own session; a multi-node server runs `server_op` whole."""
    def act(t: Target, report: EventSink) -> list[HostResult]:
        if t.multinode:
            return server_op(t, connect, report)
        return [run_on_host(t.hosts[0], host_op, connect=connect, report=report)]
    return act


def ssh_connector(accept_new_host_keys: bool = False, hooks: Hooks = NO_HOOKS) -> Callable[[Host], HostSession]:
    return lambda host: open_session(host, accept_new_host_keys=accept_new_host_keys, hooks=hooks)


def deploy_action(ps: PatchSet, opts: DeployOptions, connect: Callable[[Host], HostSession],
                  routers: Routers = router_for) -> TargetAction:
    def on_host(s: HostSession, report: EventSink) -> HostResult:
        before = read_serving(s)  # the report's accept length and tok/s before → after
        with routers(s.host) as router:
            result = deploy_host(s, ps, opts, report, router=router)
        result.serving = before_after(before, read_serving(s))
        return result
    return per_target(on_host, lambda t, c, report: deploy_server(t, ps, opts, connect=c, report=report,
                                                                  routers=routers), connect)


def rollback_action(to: str | UndoRollout | None, opts: DeployOptions, connect: Callable[[Host], HostSession],
                    routers: Routers = router_for) -> TargetAction:
    def on_host(s: HostSession, report: EventSink) -> HostResult:
        with routers(s.host) as router:
            return rollback_host(s, to, opts, report, router=router)
    return per_target(on_host, lambda t, c, report: rollback_server(t, to, opts, connect=c, report=report,
                                                                    routers=routers), connect)


def peer_measurer(targets: list[Target], batches: list[list[int]]
                  ) -> Callable[[str, Workload | None], Measurement | None]:
    """For the performance gate: measure, with one of a host's own workloads (the one its canary is
    measured with at the same time; None: its first), the serving node of the first target of a
    later batch (not yet updated while this host's batch runs); None in the last batch."""
    peer_of: dict[str, Host | None] = {}
    for bi, b in enumerate(batches):
        later = [targets[i] for bb in batches[bi + 1:] for i in bb]
        peer = later[0].hosts[0] if later else None
        for i in b:
            for h in targets[i].hosts:
                peer_of[h.name] = peer
    by_name = {h.name: h for t in targets for h in t.hosts}

    def measure_peer(name: str, workload: Workload | None = None) -> Measurement | None:
        peer = peer_of.get(name)
        if peer is None:
            return None
        with http_client(peer) as client:
            return measure(client, workload or by_name[name].perf_gate.workload)
    return measure_peer


def rolling_deploy(targets: list[Target], ps: PatchSet, opts: DeployOptions, *, canary: int = 1,
                   batch: str | None = None, max_fail: str | float = 0, forks: int = 10, keep_updated: bool = False,
                   accept_new_host_keys: bool = False, connect: Callable[[Host], HostSession] | None = None,
                   progress: Progress | None = None, notes: list[str] | None = None,
                   hooks: Hooks = NO_HOOKS, routers: Routers = router_for,
                   milestones: Milestones | None = None, policy: RolloutPolicy | None = None) -> RolloutResult:
    """`policy`: max_unavailable and the router's pool (policy.py); None: neither (library callers)."""
    connect = connect or ssh_connector(accept_new_host_keys, hooks)
    if opts.peer_measure is None:
        opts = dataclasses.replace(opts, peer_measure=peer_measurer(targets, plan_batches(
            len(targets), canary=canary, batch=batch, max_unavailable=policy.max_unavailable if policy else None)))
    revert_opts = DeployOptions(command=opts.command + " (abort: rollback)", rollout_id=opts.rollout_id)
    return Rollout(targets, deploy_action(ps, opts, connect, routers), kind="deploy", canary=canary, batch=batch,
                   max_fail=max_fail, forks=forks, keep_updated=keep_updated,
                   revert=rollback_action(None, revert_opts, connect, routers), progress=progress, notes=notes,
                   rollout_id=opts.rollout_id, stop_after_canary=opts.stop_after_canary, milestones=milestones,
                   **_guarded(targets, policy, routers)).run()


def rolling_rollback(targets: list[Target], to: str | UndoRollout | None, opts: DeployOptions, *,
                     batch: str | None = None, forks: int = 10, accept_new_host_keys: bool = False,
                     connect: Callable[[Host], HostSession] | None = None, progress: Progress | None = None,
                     notes: list[str] | None = None, hooks: Hooks = NO_HOOKS,
                     routers: Routers = router_for, milestones: Milestones | None = None,
                     policy: RolloutPolicy | None = None) -> RolloutResult:
    """Rollback over the selection: no canary, no abort (each host is rolled back on its own), in
    batches of at most `policy.max_unavailable` (as rolling_deploy)."""
    connect = connect or ssh_connector(accept_new_host_keys, hooks)
    return Rollout(targets, rollback_action(to, opts, connect, routers), kind="rollback", canary=0, batch=batch,
                   max_fail=100, forks=forks, progress=progress, notes=notes, rollout_id=opts.rollout_id,
                   milestones=milestones, **_guarded(targets, policy, routers)).run()


def _guarded(targets: list[Target], policy: RolloutPolicy | None, routers: Routers) -> dict[str, Any]:
    """The Rollout's arguments for `policy`: its batch bound, and the router's say before each batch."""
    if policy is None:
        return {}
    return {"max_unavailable": policy.max_unavailable, "admit": router_gate(targets, policy, routers)}
