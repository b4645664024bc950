"""The phase engine: the order of a deploy and a rollback, for one host and for the nodes of a
multi-node server alike (a single host is a one-node server).

`DEPLOY` below is the deploy, top to bottom; each phase names the nodes it runs on (`Nodes`).
Node 0 (rank 0) hosts the HTTP server, the dist-init store the other ranks connect to, the router
entry and the health gate; ranks >= 1 answer 200 on /health whatever their state, so they are only
checked to be running. Before the phases: take every node's lock, repair an interrupted run,
preflight every node (one refusal refuses the server), measure the baseline on node 0. From the
first change on, one transaction: whatever goes wrong (a failed step, a lost connection, a bug,
Ctrl-C, SIGTERM, SIGHUP) rolls every started node back, highest rank first, rank 0 last.

The rollback of one node is the same executor over `rollback.ROLLBACK` (choose and verify the
backups, journal, restore); a server runs it on each node in `ROLLBACK_ORDER`, each node on its own.

The engine says what happened (`DeployEnd`); deploy.py (a host) and multinode.py (a server) turn
that into results and exit codes.
"""

from __future__ import annotations

import enum
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ..artifacts.patchset import PatchSet
from ..errors import ChangedSincePreflight, DdtreeOpsError, LeaseLost, LockHeldError
from .describe import describe_failure, interrupt_label
from .events import EventSink, Failed
from .options import DeployOptions
from .phases import Release, Runbook
from .plan import HostPlan


class Nodes(enum.Enum):
    """Which nodes a phase runs on, in which order (index 0 is rank 0)."""

    ALL = "every node, rank order"
    RANK0_LAST = "every node, ranks >= 1 first, rank 0 last"
    DESCENDING = "every node, highest rank first, rank 0 last"
    NODE0 = "node 0 only"
    OTHERS = "ranks >= 1, rank order"

    def order(self, n: int) -> list[int]:
        return {Nodes.ALL: list(range(n)), Nodes.RANK0_LAST: [*range(1, n), 0][:n] if n else [],
                Nodes.DESCENDING: list(range(n - 1, -1, -1)),
                Nodes.NODE0: [0][:n], Nodes.OTHERS: list(range(1, n))}[self]


# A rollback, of a failed deploy or by `rollback`: the highest rank first, rank 0 (the gated one)
# last, so the server comes back when the node that gates it does.
ROLLBACK_ORDER = Nodes.DESCENDING


def health_gated(index: int) -> bool:
    """Only node 0 answers /health for the server: the health gate, router and perf gate are its."""
    return index == 0


@dataclass
class DeployRun:
    """The state of one deploy over the nodes (rank order) of one server, or of one host."""

    nodes: list[Runbook]
    ps: PatchSet
    opts: DeployOptions
    server: str | None = None  # the server's name; None: a single host
    plans: list[HostPlan] = field(default_factory=list)
    before: list[dict[str, Any]] = field(default_factory=list)
    releases: list[Release] = field(default_factory=list)
    repaired: list[str | None] = field(default_factory=list)
    baseline: Any = None
    started: list[int] = field(default_factory=list)  # nodes the transaction changed (or began to)

    @property
    def node0(self) -> Runbook:
        return self.nodes[0]

    def node0_serves(self) -> bool:
        return self.before[0][self.node0.host.unit].active == "active"


class Run(Protocol):
    """What the executor needs of a run: its nodes (rank order), the ones it changed, its options."""

    nodes: list[Runbook]
    started: list[int]
    opts: DeployOptions


@dataclass(frozen=True)
class Phase:
    """A named phase: what it does on node `i` of a run, on which nodes, and when it applies."""

    name: str
    nodes: Nodes
    run: Callable[[Any, int], None]  # (the run: DeployRun, or rollback.RollbackRun; node index)
    when: Callable[[Any], bool] = lambda run: True
    changes: bool = False  # from this phase on the node is rolled back if the run fails


def _drain_ahead(run: DeployRun) -> bool:
    """Another node restarts before node 0, taking the server down under node 0's requests: drain
    them first. (A single host drains inside its own restart.)"""
    return run.node0_serves() and Nodes.RANK0_LAST.order(len(run.nodes))[0] != 0


DEPLOY: tuple[Phase, ...] = (
    Phase("backup and install", Nodes.ALL, changes=True,
          run=lambda r, i: r.nodes[i].backup_and_install(r.ps, r.plans[i], r.releases[i], r.opts)),
    Phase("drain", Nodes.NODE0, when=_drain_ahead, run=lambda r, i: r.nodes[i].drain(r.nodes[i].host.unit)),
    Phase("restart", Nodes.RANK0_LAST, run=lambda r, i: r.nodes[i].restart(r.releases[i])),
    Phase("wait and gate", Nodes.NODE0, run=lambda r, i: r.nodes[i].wait_and_gate(r.releases[i], r.opts.deadline_s)),
    Phase("node check", Nodes.OTHERS, run=lambda r, i: r.nodes[i].check_running(r.releases[i])),
    Phase("register", Nodes.NODE0, run=lambda r, i: r.nodes[i].traffic.join_router()),
    Phase("perf gate", Nodes.NODE0, run=lambda r, i: r.nodes[i].traffic.perf_gate(r.baseline, r.opts)),
    Phase("soak", Nodes.NODE0, run=lambda r, i: r.nodes[i].soak(r.releases[i])),
    # Again: a node that died during the soak must not be committed.
    Phase("node check after soak", Nodes.OTHERS, run=lambda r, i: r.nodes[i].check_running(r.releases[i])),
    Phase("commit", Nodes.ALL, run=lambda r, i: r.nodes[i].commit(r.plans[i], r.releases[i])),
)


def run_phases(run: Run, phases: tuple[Phase, ...] | None = None) -> None:
    """Each phase in turn, on its nodes in its order; a node is `started` before its first
    changing phase runs on it, so a failure in that very phase rolls it back too.

    A connection lost during a phase is not its failure: the node reconnects (within the run's
    reconnect window, taking its lock back) and the phase runs again from where the host is
    (each phase is resumable: phases.Release says what it must not do twice). Only a connection
    that stays lost past the window, a lease lost meanwhile (the host rolled itself back) or a lock
    another run took ends the phase, and then the run fails as for any other failure."""
    for phase in DEPLOY if phases is None else phases:
        if not phase.when(run):
            continue
        for i in phase.nodes.order(len(run.nodes)):
            if phase.changes and i not in run.started:
                run.started.append(i)
            node = run.nodes[i]
            node.reconnecting(node.window(run.opts), lambda phase=phase, i=i: phase.run(run, i), f"resume {phase.name}")


# -- before the first change ---------------------------------------------------------------------

class Prepared(enum.Enum):
    GO = "go"
    UNCHANGED = "unchanged"


def lock_all(run: DeployRun, stack: ExitStack) -> list[Any]:
    """Every node's deploy lock, rank order; each released when `stack` closes."""
    locks = []
    for n in run.nodes:
        locks.append(n.lock(run.opts))
        stack.callback(n.unlock, locks[-1])
    return locks


def prepare(run: DeployRun, locks: list[Any], refusal: Callable[[DeployRun], DdtreeOpsError]) -> Prepared:
    """Repair, preflight (`refusal` builds the error of a refused run), decide whether anything is
    to do, measure the baseline and open the releases (one id over every node). Changes nothing
    but a repair of an interrupted run."""
    run.repaired = [n.repair_interrupted(n.window(run.opts)) for n in run.nodes]
    detail = (lambda n: f"node rank {n.host.node_rank} of {run.server}") if run.server else (lambda n: "")
    # Preflight changes nothing: a connection lost during it is reconnected and it starts again.
    run.plans = [n.reconnecting(n.window(run.opts), lambda n=n: n.preflight(run.ps, run.opts, detail(n)),
                                "preflight") for n in run.nodes]
    if any(p.refusals for p in run.plans):
        raise refusal(run)
    run.before = [n.services_before() for n in run.nodes]
    if all(n.is_running_as_planned(p, b) for n, p, b in zip(run.nodes, run.plans, run.before, strict=True)):
        for n in run.nodes:
            n.step("unchanged", "files and unit already as asked" + ("" if run.server else "; nothing to do"))
        return Prepared.UNCHANGED
    serving = any(s.active == "active" for s in run.before[0].values())
    run.baseline = run.node0.traffic.measure_baseline(run.opts, serving=serving)
    tag = {"server": run.server} if run.server else {}
    first = run.node0.begin(run.plans[0], run.ps, locks[0], run.before[0], **tag)
    run.releases = [first] + [n.begin(p, run.ps, lk, b, release_id=first.id, **tag) for n, lk, p, b in
                              zip(run.nodes[1:], locks[1:], run.plans[1:], run.before[1:], strict=True)]
    return Prepared.GO


# -- the transaction ------------------------------------------------------------------------------

@dataclass
class DeployEnd:
    """How the transaction ended. `exc` None: deployed. Otherwise it failed at `failed_step`;
    `left` (--no-rollback) means nothing was rolled back; `rollback_errors` names the nodes whose
    rollback failed (a person must look)."""

    exc: BaseException | None = None
    failed_step: str = ""
    message: str = ""
    log: list[str] = field(default_factory=list)
    left: bool = False
    left_error: str | None = None
    rollback_errors: list[tuple[str, BaseException]] = field(default_factory=list)

    @property
    def interrupted(self) -> bool:
        return isinstance(self.exc, KeyboardInterrupt)


def transact(run: DeployRun, report: EventSink) -> DeployEnd:
    """Run the phases; on any failure, roll back (or, --no-rollback on a single host, leave)."""
    try:
        run_phases(run)
    except (Exception, KeyboardInterrupt) as e:
        return fail(run, e, report)
    return DeployEnd()


def fail(run: DeployRun, exc: BaseException, report: EventSink) -> DeployEnd:
    busy = max(run.nodes, key=lambda n: n.log.last_t)  # the node that was at work when it failed
    failed_step, message, log = describe_failure(busy, exc)
    end = DeployEnd(exc, failed_step, message, log)
    if isinstance(exc, ChangedSincePreflight):  # that node refused before its first change: nothing to undo
        run.started = [i for i in run.started if run.nodes[i].host.name != exc.host]
        if not run.started:
            return end
    if run.server and end.interrupted:
        end.failed_step = f"interrupted ({interrupt_label(end.exc)})"
    if run.opts.no_rollback and not end.interrupted and not run.server:
        return leave(run, end)
    report(Failed(run.server or busy.host.name, end.failed_step, message,
                  "the host rolls itself back" if isinstance(exc, LeaseLost) else
                  "another run holds the host now: not touched" if isinstance(exc, LockHeldError) else
                  "rolling back every node" if run.server else "rolling back"))
    for i in [i for i in ROLLBACK_ORDER.order(len(run.nodes)) if i in run.started]:
        n, r = run.nodes[i], run.releases[i]
        if n.store.held is None:  # its lock went to another run at a reconnect: that run owns the node now
            end.rollback_errors.append((n.host.name, exc if isinstance(exc, (LockHeldError, LeaseLost)) else
                                        LockHeldError(f"{n.host.name}: the deploy lock was taken by another run "
                                                      f"while the connection was down")))
            continue
        try:
            n.roll_back_reconnecting(n.window(run.opts), r.id, r.journal, outcome=f"rolled back ({end.failed_step})",
                                     failed_step=end.failed_step, error=message)
        except Exception as e:
            end.rollback_errors.append((n.host.name, e))
    return end


def leave(run: DeployRun, end: DeployEnd) -> DeployEnd:
    """--no-rollback: record the failure on every started node, change nothing else."""
    end.left = True
    for i in run.started:
        try:
            run.nodes[i].leave_failed(run.releases[i], end.failed_step, end.message)
        except Exception as e:  # the journal still names the step it failed at
            end.left_error = str(e)
    return end


# -- rollback ------------------------------------------------------------------------------------


def rollback_nodes(count: int, roll_back_one: Callable[[int], Any]) -> dict[int, Any]:
    """Each node rolled back on its own (one failing does not stop the others), in rollback order."""
    return {i: roll_back_one(i) for i in ROLLBACK_ORDER.order(count)}
