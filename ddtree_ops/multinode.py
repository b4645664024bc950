"""A multi-node SGLang server (`--nnodes/--node-rank/--dist-init-addr`): one deploy over its nodes.

The inventory declares it as a group with `multinode: true` and a `node_rank` per host (see
inventory.py). Deploying it:

1. connect to every node and take every node's deploy lock (any failure: nothing changed);
2. preflight every node (same checks as a single host); one refusal refuses the server;
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
from typing import Any

from .deploy import DeployOptions, HostDeploy, HostResult, Reporter, StepFailed, plan_host
from .errors import (DdtreeOpsError, DeployFailed, Interrupted, PreflightError, RemoteCommandError,
                     RollbackFailed, UnreachableError)
from .health import probe_unit
from .release_store import new_release_id
from .transport import HostConnection


class NodeDeploy(HostDeploy):
    """A node of a multi-node server: rank >= 1 nodes are restarted without a health gate."""

    def _bring_back(self, unit: str, running_pid: int | None) -> None:
        if self.host.node_rank == 0:
            return super()._bring_back(unit, running_pid)
        # Ranks >= 1 answer 200 on /health regardless: node 0's gate speaks for the server.
        if not running_pid:
            self.svc.restart(unit)
        p = probe_unit(self.conn, unit, lines=10)
        if p.active not in ("active", "activating"):
            raise StepFailed("rollback health", f"{unit} is {p.active} after the rollback (rank {self.host.node_rank})", p.log)
        self._step("rollback: restarted", f"{unit} (rank {self.host.node_rank}; node 0 is health-checked)")


def _close_all(nodes: list[NodeDeploy]) -> None:
    for n in nodes:
        try:
            n.conn.close()
        except Exception:
            pass


def _connect(target, report: Reporter, accept_new_host_keys: bool) -> list[NodeDeploy]:
    nodes: list[NodeDeploy] = []
    try:
        for h in target.hosts:
            conn = HostConnection(h, accept_new_host_keys=accept_new_host_keys)
            conn.open()
            nodes.append(NodeDeploy(conn, h, report))
    except BaseException:
        _close_all(nodes)
        raise
    return sorted(nodes, key=lambda n: n.host.node_rank)


def _all_failed(target, exc: DdtreeOpsError, t0: float, culprit: str | None = None) -> list[HostResult]:
    from .fleet import _outcome_of

    out = []
    for h in target.hosts:
        msg = str(exc) if culprit in (None, h.name) else f"not changed: node {culprit} of server {target.name}: {exc}"
        out.append(HostResult(h.name, _outcome_of(exc), exc.exit_code, message=msg, seconds=time.monotonic() - t0))
    return out


def deploy_server(target, ps, opts: DeployOptions, *, accept_new_host_keys: bool = False,
                  report: Reporter) -> list[HostResult]:
    t0 = time.monotonic()
    try:
        nodes = _connect(target, report, accept_new_host_keys)
    except DdtreeOpsError as e:
        report(target.name, f"unreachable: {e}")
        return _all_failed(target, e, t0, getattr(e, "host", None))
    locks: list[tuple[NodeDeploy, Any]] = []
    try:
        try:
            for n in nodes:
                locks.append((n, n.store.acquire_lock(opts.command, break_lock=opts.break_lock)))
            for n in nodes:
                n.repair_interrupted()
            plans, refusals = [], []
            for n in nodes:
                n._step("preflight", f"node rank {n.host.node_rank} of {target.name}")
                p = plan_host(n.conn, n.host, ps, force=opts.force, templates_dir=opts.templates_dir)
                plans.append(p)
                r = list(p.refusals) + n._compile_check(ps) + n._verify_unit(p.unit_new)
                refusals += [f"{n.host.name}: {x}" for x in r]
            if refusals:
                raise PreflightError(target.name, "preflight refused; nothing was changed on any node:\n  - "
                                     + "\n  - ".join(refusals))
        except DdtreeOpsError as e:
            report(target.name, f"{type(e).__name__}: {e}")
            return _all_failed(target, e, t0)
        return _deploy_nodes(target, nodes, plans, ps, opts, locks, t0)
    finally:
        for n, lock in locks:
            n._release_lock(lock)
        _close_all(nodes)


def _deploy_nodes(target, nodes: list[NodeDeploy], plans, ps, opts: DeployOptions, locks, t0: float) -> list[HostResult]:
    states = {n.host.name: n.svc.states((n.host.unit, *n.host.conflicts)) for n in nodes}
    active_before = {name: {u: s.active for u, s in st.items()} for name, st in states.items()}
    enabled_before = {name: {u: s.enabled for u, s in st.items()} for name, st in states.items()}
    if not any(p.changes for p in plans) and all(active_before[n.host.name].get(n.host.unit) == "active" for n in nodes):
        for n in nodes:
            n._step("unchanged", "files and unit already as asked")
        return [HostResult(n.host.name, "unchanged", 0, release=p.current_release, steps=n.steps,
                           seconds=time.monotonic() - t0) for n, p in zip(nodes, plans)]
    rid = new_release_id()
    journals = {n.host.name: {"release": rid, "previous": p.current_release, "active_before": active_before[n.host.name],
                              "enabled_before": enabled_before[n.host.name], "holder": lock.holder,
                              "patchset": ps.label, "server": target.name}
                for (n, lock), p in zip(locks, plans)}
    started: list[NodeDeploy] = []
    unit_bytes: dict[str, bytes] = {}
    pids: dict[str, int | None] = {}
    try:
        for n, p in zip(nodes, plans):
            started.append(n)
            unit_bytes[n.host.name] = n._install_phase(ps, p, rid, journals[n.host.name], opts)
        # rank >= 1 first, rank 0 last
        for n in [*nodes[1:], nodes[0]]:
            pids[n.host.name] = n._restart_phase(journals[n.host.name])
        n0 = nodes[0]
        n0._journal_step(journals[n0.host.name], "wait for weights")
        n0._wait_and_gate(n0.host.unit, pids[n0.host.name], opts.deadline_s)
        for n in nodes[1:]:
            pr = probe_unit(n.conn, n.host.unit, lines=20)
            if pr.active != "active" or (pids[n.host.name] and pr.main_pid != pids[n.host.name]):
                raise StepFailed("node check", f"{n.host.name} (rank {n.host.node_rank}): {n.host.unit} is {pr.active}, "
                                               f"MainPID {pr.main_pid}", pr.log)
            n._step("node check", f"{n.host.unit} active (rank {n.host.node_rank})")
        for n, p in zip(nodes, plans):
            n._commit_phase(p, rid, journals[n.host.name], unit_bytes[n.host.name], pids.get(n.host.name))
    except (StepFailed, KeyboardInterrupt) as e:
        interrupted = isinstance(e, KeyboardInterrupt)
        failed_step = "interrupted (Ctrl-C)" if interrupted else e.step
        message = "interrupted by the operator" if interrupted else str(e)
        log = [] if interrupted else e.log
        nodes[0].report(target.name, f"FAILED at {failed_step}: {message}; rolling back every node")
        problems = []
        order = sorted(started, key=lambda n: -n.host.node_rank)  # rank 0 last
        for n in order:
            try:
                n.rollback_release(rid, journals[n.host.name], outcome=f"rolled back ({failed_step})",
                                   failed_step=failed_step, error=message)
            except (StepFailed, RemoteCommandError, UnreachableError) as re:
                problems.append(f"{n.host.name}: {re}")
        out = []
        for n in nodes:
            if problems:
                out.append(HostResult(n.host.name, "rollback_failed", RollbackFailed.exit_code, release=rid,
                                      failed_step=failed_step,
                                      message=f"server {target.name}: deploy failed at {failed_step} ({message}) and "
                                              f"the rollback failed: {'; '.join(problems)}; a person must look",
                                      log=log, steps=n.steps, seconds=time.monotonic() - t0))
            else:
                code = Interrupted.exit_code if interrupted else DeployFailed.exit_code
                out.append(HostResult(n.host.name, "interrupted" if interrupted else "rolled_back", code, release=rid,
                                      failed_step=failed_step,
                                      message=f"server {target.name}: deploy failed at {failed_step}: {message}; "
                                              f"every node rolled back",
                                      log=log, steps=n.steps, seconds=time.monotonic() - t0))
        return out
    except (RemoteCommandError, UnreachableError) as e:  # outside a guarded step: treat as a person-must-look
        return [HostResult(n.host.name, "rollback_failed", RollbackFailed.exit_code, release=rid,
                           message=f"server {target.name}: {e}", steps=n.steps, seconds=time.monotonic() - t0)
                for n in nodes]
    return [HostResult(n.host.name, "deployed", 0, release=rid, steps=n.steps, seconds=time.monotonic() - t0)
            for n in nodes]


def rollback_server(target, to: str | None, opts: DeployOptions, *, accept_new_host_keys: bool = False,
                    report: Reporter) -> list[HostResult]:
    """Every node back (ranks >= 1 first, rank 0 last; node 0 gated)."""
    t0 = time.monotonic()
    try:
        nodes = _connect(target, report, accept_new_host_keys)
    except DdtreeOpsError as e:
        return _all_failed(target, e, t0, getattr(e, "host", None))
    try:
        out: dict[str, HostResult] = {}
        for n in sorted(nodes, key=lambda n: -n.host.node_rank):
            try:
                out[n.host.name] = n.rollback(to, opts)
            except DdtreeOpsError as e:
                from .fleet import result_from_error

                out[n.host.name] = result_from_error(n.host.name, e, t0)
                report(n.host.name, f"{out[n.host.name].outcome}: {e}")
        return [out[h.name] for h in target.hosts]
    finally:
        _close_all(nodes)


__all__ = ["deploy_server", "rollback_server", "NodeDeploy"]
