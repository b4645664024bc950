"""A multi-node SGLang server (`--nnodes/--node-rank/--dist-init-addr`): one deploy over its nodes.

The inventory declares it as a group with `multinode: true` and a `node_rank` per host (see
config/inventory.py). Its deploy and rollback are the phase engine's (runbook/engine.py: which
phase runs on which node, in which order, which node is health-gated), the same as a single
host's; this module connects to the nodes and turns how the run ended into one row per node.
Every node ends with the same outcome: a failure anywhere rolls every started node back.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Callable

from ..artifacts.patchset import PatchSet
from ..config.inventory import Host
from ..errors import ChangedSincePreflight, DdtreeOpsError, DeployFailed, Interrupted, RollbackFailed, reason
from ..host.session import HostSession
from ..runbook.deploy import refusal
from ..runbook.engine import DeployEnd, DeployRun, Prepared, health_gated, lock_all, prepare, rollback_nodes, transact
from ..runbook.events import EventSink, Note
from ..runbook.options import DeployOptions
from ..runbook.phases import Runbook
from ..runbook.results import HostResult, Outcome, failed_result, with_tries
from ..runbook.rollback import UndoRollout, drift_refusal_of, rollback_host
from .rollout import Target
from .routing import Routers, router_for

Connect = Callable[[Host], HostSession]


def _open_nodes(stack: ExitStack, server: Target, connect: Connect) -> list[HostSession]:
    sessions = []
    for h in sorted(server.hosts, key=lambda h: h.node_rank):
        s = connect(h)
        stack.callback(s.close)
        sessions.append(s)
    return sessions


def _everyone_failed(server: Target, exc: DdtreeOpsError, t0: float, culprit: str | None = None) -> list[HostResult]:
    return [failed_result(h.name, exc, time.monotonic() - t0,
                          message=str(exc) if culprit in (None, h.name)
                          else f"not changed: node {culprit} of server {server.name}: {exc}")
            for h in server.hosts]


def _server_refusal(run: DeployRun) -> DdtreeOpsError:
    refusals = [f"{n.host.name}: {r}" for n, p in zip(run.nodes, run.plans, strict=True) for r in p.refusals]
    return refusal(run.server or "", refusals, on=" on any node")


def deploy_server(server: Target, ps: PatchSet, opts: DeployOptions, *, connect: Connect,
                  report: EventSink, routers: Routers = router_for) -> list[HostResult]:
    t0 = time.monotonic()
    with ExitStack() as stack:
        try:
            sessions = _open_nodes(stack, server, connect)
        except DdtreeOpsError as e:
            report(Note(server.name, f"unreachable: {e}"))
            return _everyone_failed(server, e, t0, getattr(e, "host", None))
        router = stack.enter_context(routers(sessions[0].host))  # node 0 is the one routed to
        nodes = [Runbook(s, report, health_checked=health_gated(i), router=router if health_gated(i) else None)
                 for i, s in enumerate(sessions)]
        run = DeployRun(nodes, ps, opts, server=server.name)
        try:
            prepared = prepare(run, lock_all(run, stack), _server_refusal)
        except DdtreeOpsError as e:
            report(Note(server.name, f"{type(e).__name__}: {e}"))
            return _everyone_failed(server, e, t0)
        if prepared is Prepared.UNCHANGED:
            return [with_tries(HostResult(n.host.name, Outcome.UNCHANGED, 0, release=p.current_release, steps=n.steps,
                                          seconds=time.monotonic() - t0), n.session)
                    for n, p in zip(nodes, run.plans, strict=True)]
        rows = _server_rows(run, transact(run, report), t0)
        return [with_tries(r, n.session) for r, n in zip(rows, run.nodes, strict=True)]


def _server_rows(run: DeployRun, end: DeployEnd, t0: float) -> list[HostResult]:
    """One row per node, all with the same outcome."""
    def rows(outcome: Outcome, code: int, **kw) -> list[HostResult]:
        return [HostResult(n.host.name, outcome, code, release=run.releases[0].id, steps=n.steps,
                           seconds=time.monotonic() - t0, perf_gate=n.traffic.perf_result, **kw) for n in run.nodes]

    if end.exc is None:
        return rows(Outcome.DEPLOYED, 0, message="; ".join(w for n in run.nodes for w in n.warnings))
    step, message, name = end.failed_step, end.message, run.server
    if isinstance(end.exc, ChangedSincePreflight) and not run.started:  # refused at backup, nothing changed
        return rows(Outcome.REFUSED, ChangedSincePreflight.exit_code, failed_step=step,
                    message=f"server {name}: {reason(end.exc)}")
    if end.rollback_errors:
        problems = "; ".join(f"{node}: {reason(e)}" for node, e in end.rollback_errors)
        return rows(Outcome.ROLLBACK_FAILED, RollbackFailed.exit_code, failed_step=step, log=end.log,
                    message=f"server {name}: deploy failed at {step} ({message}) and the rollback failed: "
                            f"{problems}; a person must look")
    outcome, code = ((Outcome.INTERRUPTED, Interrupted.exit_code) if end.interrupted
                     else (Outcome.ROLLED_BACK, DeployFailed.exit_code))
    return rows(outcome, code, failed_step=step, log=end.log,
                message=f"server {name}: deploy failed at {step}: {message}; every node rolled back")


def rollback_server(server: Target, to: str | UndoRollout | None, opts: DeployOptions, *, connect: Connect,
                    report: EventSink, routers: Routers = router_for) -> list[HostResult]:
    """Every node back, in the engine's rollback order (highest rank first, rank 0 last; node 0 gated)."""
    t0 = time.monotonic()
    with ExitStack() as stack:
        try:
            sessions = _open_nodes(stack, server, connect)
        except DdtreeOpsError as e:
            return _everyone_failed(server, e, t0, getattr(e, "host", None))
        # One node whose files or SGLang changed under the release refuses them all: rolled back
        # node by node, the others would run another release than it (runbook/restore_check.py).
        for s in sessions:
            drifted = drift_refusal_of(s, to, opts)
            if drifted is not None:
                return _everyone_failed(server, drifted, t0, s.host.name)
        router = stack.enter_context(routers(sessions[0].host))

        def one(i: int) -> HostResult:
            s = sessions[i]
            try:
                return with_tries(rollback_host(s, to, opts, report, health_checked=health_gated(i),
                                                router=router if health_gated(i) else None), s)
            except DdtreeOpsError as e:
                row = failed_result(s.host.name, e, time.monotonic() - t0)
                report(Note(s.host.name, f"{row.outcome}: {e}"))
                return with_tries(row, s)

        out = {sessions[i].host.name: row for i, row in rollback_nodes(len(sessions), one).items()}
        return [out[h.name] for h in server.hosts]
