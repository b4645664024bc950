"""A multi-node SGLang server (`--nnodes/--node-rank/--dist-init-addr`): one deploy over its nodes.

The inventory declares it as a group with `multinode: true` and a `node_rank` per host (see
inventory.py). Deploying it composes the same runbook phases as a single host:

1. connect to every node and take every node's deploy lock (any failure: nothing changed);
2. repair and preflight every node; one refusal refuses the server;
3. backup + install the same files and each node's own unit on every node (one release id);
4. restart ranks >= 1 first, rank 0 last (rank 0 hosts the HTTP server and the dist-init store
   the others connect to, and is the one clients talk to);
5. wait for weights and run the health gate on node 0 only (ranks >= 1 answer 200 on /health
   whatever their state); then check every other node's unit is still active, same MainPID;
6. commit on every node. Any failure after the first change rolls ALL nodes back together,
   ranks >= 1 first, rank 0 last, gated on node 0.

`rollback` of a server likewise restores every node and gates on node 0 only.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Callable

from ..artifacts.patchset import PatchSet
from ..config.inventory import Host
from ..errors import DdtreeOpsError, DeployFailed, Interrupted, RollbackFailed
from ..host.release_store import LockHolder
from ..host.session import HostSession
from ..runbook.deploy import describe_failure, refusal
from ..runbook.phases import DeployOptions, Reporter, Runbook
from ..runbook.plan import HostPlan
from ..runbook.results import HostResult, Outcome, failed_result
from ..runbook.rollback import rollback_host
from .rollout import Target

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


def deploy_server(server: Target, ps: PatchSet, opts: DeployOptions, *, connect: Connect,
                  report: Reporter) -> list[HostResult]:
    t0 = time.monotonic()
    with ExitStack() as stack:
        try:
            sessions = _open_nodes(stack, server, connect)
        except DdtreeOpsError as e:
            report(server.name, f"unreachable: {e}")
            return _everyone_failed(server, e, t0, getattr(e, "host", None))
        nodes = [Runbook(s, report, health_checked=s.host.node_rank == 0) for s in sessions]
        try:
            locks = []
            for n in nodes:
                locks.append(n.lock(opts))
                stack.callback(n.unlock, locks[-1])
            for n in nodes:
                n.repair_interrupted()
            plans = [n.preflight(ps, opts, f"node rank {n.host.node_rank} of {server.name}") for n in nodes]
            refusals = [f"{n.host.name}: {r}" for n, p in zip(nodes, plans, strict=True) for r in p.refusals]
            if refusals:
                raise refusal(server.name, refusals, on=" on any node")
        except DdtreeOpsError as e:
            report(server.name, f"{type(e).__name__}: {e}")
            return _everyone_failed(server, e, t0)
        return _deploy_nodes(server, nodes, locks, plans, ps, opts, t0)


def _deploy_nodes(server: Target, nodes: list[Runbook], locks: list[LockHolder], plans: list[HostPlan],
                  ps: PatchSet, opts: DeployOptions, t0: float) -> list[HostResult]:
    def rows(outcome: Outcome, code: int, **kw) -> list[HostResult]:
        return [HostResult(n.host.name, outcome, code, steps=n.steps, seconds=time.monotonic() - t0,
                           perf_gate=n.perf_result, **kw) for n in nodes]

    before = [n.services_before() for n in nodes]
    if all(n.is_running_as_planned(p, b) for n, p, b in zip(nodes, plans, before, strict=True)):
        for n in nodes:
            n.step("unchanged", "files and unit already as asked")
        return [HostResult(n.host.name, Outcome.UNCHANGED, 0, release=p.current_release, steps=n.steps,
                           seconds=time.monotonic() - t0) for n, p in zip(nodes, plans, strict=True)]
    baseline = nodes[0].measure_baseline(opts, serving=before[0][nodes[0].host.unit].active == "active")
    first = nodes[0].begin(plans[0], ps, locks[0], before[0], server=server.name)
    releases = [first] + [n.begin(p, ps, lk, b, release_id=first.id, server=server.name)
                          for n, lk, p, b in zip(nodes[1:], locks[1:], plans[1:], before[1:], strict=True)]
    started: list[int] = []
    try:
        for i, (n, p, r) in enumerate(zip(nodes, plans, releases, strict=True)):
            started.append(i)
            n.backup_and_install(ps, p, r, opts)
        if before[0][nodes[0].host.unit].active == "active":  # a redeploy: node 0 serves; drain it first
            nodes[0].drain(nodes[0].host.unit)
        for i in [*range(1, len(nodes)), 0]:  # rank >= 1 first, rank 0 last
            nodes[i].restart(releases[i])
        nodes[0].wait_and_gate(releases[0], opts.deadline_s)
        for n, r in zip(nodes[1:], releases[1:], strict=True):
            n.check_running(r)
        nodes[0].join_router()
        nodes[0].perf_gate(baseline, opts)
        nodes[0].soak(releases[0])
        for n, r in zip(nodes[1:], releases[1:], strict=True):
            n.check_running(r)  # again: a node that died during the soak must not be committed
        for n, p, r in zip(nodes, plans, releases, strict=True):
            n.commit(p, r)
    except (Exception, KeyboardInterrupt) as e:  # one transaction over every node, as for one host
        interrupted = isinstance(e, KeyboardInterrupt)
        latest = max(nodes, key=lambda n: n.steps[-1]["t"] if n.steps else 0.0)  # the node that was busy
        failed_step, message, log = describe_failure(latest, e)
        if interrupted:
            failed_step = "interrupted (Ctrl-C)"
        nodes[0].report(server.name, f"FAILED at {failed_step}: {message}; rolling back every node")
        problems = []
        for i in sorted(started, key=lambda i: -nodes[i].host.node_rank):  # rank 0 last
            try:
                nodes[i].roll_back_reconnecting(opts.reconnect_s, releases[i].id, releases[i].journal,
                                                outcome=f"rolled back ({failed_step})", failed_step=failed_step,
                                                error=message)
            except Exception as re:
                problems.append(f"{nodes[i].host.name}: {re}")
        if problems:
            return rows(Outcome.ROLLBACK_FAILED, RollbackFailed.exit_code, release=first.id, failed_step=failed_step,
                        log=log, message=f"server {server.name}: deploy failed at {failed_step} ({message}) and "
                                         f"the rollback failed: {'; '.join(problems)}; a person must look")
        outcome, code = ((Outcome.INTERRUPTED, Interrupted.exit_code) if interrupted
                         else (Outcome.ROLLED_BACK, DeployFailed.exit_code))
        return rows(outcome, code, release=first.id, failed_step=failed_step, log=log,
                    message=f"server {server.name}: deploy failed at {failed_step}: {message}; every node rolled back")
    return rows(Outcome.DEPLOYED, 0, release=first.id,
                message="; ".join(w for n in nodes for w in n.warnings))


def rollback_server(server: Target, to: str | None, opts: DeployOptions, *, connect: Connect,
                    report: Reporter) -> list[HostResult]:
    """Every node back (ranks >= 1 first, rank 0 last; node 0 gated)."""
    t0 = time.monotonic()
    with ExitStack() as stack:
        try:
            sessions = _open_nodes(stack, server, connect)
        except DdtreeOpsError as e:
            return _everyone_failed(server, e, t0, getattr(e, "host", None))
        out: dict[str, HostResult] = {}
        for s in sorted(sessions, key=lambda s: -s.host.node_rank):
            try:
                out[s.host.name] = rollback_host(s, to, opts, report, health_checked=s.host.node_rank == 0)
            except DdtreeOpsError as e:
                out[s.host.name] = failed_result(s.host.name, e, time.monotonic() - t0)
                report(s.host.name, f"{out[s.host.name].outcome}: {e}")
        return [out[h.name] for h in server.hosts]
