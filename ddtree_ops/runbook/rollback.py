"""`rollback` on one node (a host, or each node of a server in the engine's `ROLLBACK_ORDER`):
back to the previous release, a named one, or the original files.

`releases_to_undo` decides from the host's history (pure); `ROLLBACK`, the phases run by the
engine's executor, verifies every backup it will need before touching anything, checks that the
host is still as the undone releases left it (restore_check.py: no file changed under them, the
same SGLang version; otherwise exit 2, nothing changed, unless --force), restores them newest
first, and brings the services back as they were before the oldest undone release, through the
same health gate as a deploy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import DdtreeOpsError, InputError, LeaseLost, LockHeldError, RollbackFailed, reason
from ..gates.router import SmgRouter
from ..host.release_store import LockHolder
from ..host.session import HostSession
from .describe import interrupt_label
from .engine import Nodes, Phase, run_phases
from .events import EventSink, quiet
from .options import DeployOptions
from .phases import Runbook
from .restore_check import check_before_restore, drift_refusal
from .results import HostResult, Outcome
from .steps import StepFailed

ORIGINAL = "original"


@dataclass(frozen=True)
class UndoRollout:
    """`rollback --rollout ID`: each host back to the release it ran before that rollout changed it."""

    rollout: str


def current_chain(history: dict[str, Any]) -> list[str]:
    """The current release and its predecessors, newest first."""
    by_id = {r["id"]: r for r in history["releases"]}
    chain: list[str] = []
    cur = history["current"]
    while cur and cur not in chain:
        chain.append(cur)
        cur = (by_id.get(cur) or {}).get("previous")
    return chain


def releases_of_rollout(history: dict[str, Any], rollout: str, host: str) -> list[str]:
    """Release ids to undo, newest first, to bring the host back to what it ran before `rollout`
    (a release recorded with that rollout id still on its current chain, and everything since).
    InputError when the rollout never changed the host, or its release was undone already."""
    by_id = {r["id"]: r for r in history["releases"]}
    chain = current_chain(history)
    hits = [i for i, rid in enumerate(chain) if (by_id.get(rid) or {}).get("rollout") == rollout]
    if not hits:
        gone = [r for r in history["releases"] if r.get("rollout") == rollout]
        if gone:
            raise InputError(f"{host}: release {gone[-1]['id']} of rollout {rollout} is no longer current "
                             f"({gone[-1].get('outcome')}); nothing of that rollout to undo")
        raise InputError(f"{host}: rollout {rollout} never changed this host")
    undo = chain[: hits[-1] + 1]
    _require_backups(undo, by_id, host)
    return undo


def _require_backups(undo: list[str], by_id: dict[str, Any], host: str) -> None:
    for rid in undo:
        if not by_id.get(rid, {}).get("backup_present"):
            raise InputError(f"{host}: the backup of release {rid} was pruned; cannot roll back past it")


def releases_to_undo(history: dict[str, Any], to: str | None, host: str) -> list[str]:
    """Release ids to undo, newest first: the current one (`to` None), down to the named one
    (excluded), or all of them (`to` 'original'). InputError when that is not possible."""
    by_id = {r["id"]: r for r in history["releases"]}
    chain = current_chain(history)
    if not chain:
        raise InputError(f"{host}: no deployed release to roll back (the host runs its original files)")
    if to is None:
        undo = chain[:1]
    elif to == ORIGINAL:
        undo = chain
    elif to in chain:
        undo = chain[: chain.index(to)]
        if not undo:
            raise InputError(f"{host}: release {to} is already current")
    else:
        raise InputError(f"{host}: release {to!r} is not an ancestor of the current release "
                         f"{history['current']} (see `ddtree-ops history --host {host}`)")
    _require_backups(undo, by_id, host)
    return undo


@dataclass
class RollbackRun:
    """The state of the rollback of one node (the engine's executor runs `ROLLBACK` over it)."""

    nodes: list[Runbook]  # the node being rolled back, alone: each node is rolled back on its own
    to: str | UndoRollout | None
    opts: DeployOptions
    lock: LockHolder
    undo: list[str] = field(default_factory=list)
    oldest: dict[str, Any] = field(default_factory=dict)
    journal: dict[str, Any] = field(default_factory=dict)
    started: list[int] = field(default_factory=list)

    @property
    def now_on(self) -> str | None:
        return None if self.to == ORIGINAL else self.oldest.get("previous")


def _choose(r: RollbackRun, i: int) -> None:
    """What to undo, and every backup it needs checked before anything is touched."""
    rb = r.nodes[i]
    history = rb.store.history()
    r.undo = (releases_of_rollout(history, r.to.rollout, rb.host.name) if isinstance(r.to, UndoRollout)
              else releases_to_undo(history, r.to, rb.host.name))
    for rid in r.undo:
        problems = rb.store.verify_backup(rid)
        if problems:
            raise RollbackFailed(f"{rb.host.name}: backup of release {rid} is corrupted, refusing to restore it: "
                                 + "; ".join(problems))
    # Every file the restore would write over as the undone releases left it, and the SGLang the
    # one they were installed onto: a venv upgraded under them is not given their backups.
    check_before_restore(rb.host, rb.step, lambda: rb.store.restore_check(r.undo, r.to == ORIGINAL),
                         force=r.opts.force, what="roll back")
    r.oldest = next(rel for rel in history["releases"] if rel["id"] == r.undo[-1])


def _journal(r: RollbackRun, i: int) -> None:
    rb = r.nodes[i]
    r.journal = rb.begin_rollback(r.undo, r.now_on, r.to == ORIGINAL, r.oldest, r.lock, rollout=r.opts.rollout_id)
    if r.opts.force:  # the host's heal and the next run's repair finish it without the restore check
        r.journal["force"] = True
        rb.store.journal(**r.journal)


def _restore(r: RollbackRun, i: int) -> None:
    """From the journal on, one transaction: whatever stops it (a failed step, a lost connection,
    a bug, Ctrl-C) leaves the journal naming the step, and the next run (`rollback` or `deploy`,
    no flags) finishes the rollback."""
    rb = r.nodes[i]
    try:
        rb.reconnecting(rb.window(r.opts), lambda: rb.finish_rollback(r.journal), "finish the rollback")
    except LeaseLost:
        raise  # the host finishes the rollback itself (or was left as it was): its own message says so
    except LockHeldError as e:  # another run took the host over: it finishes the rollback, or did
        raise RollbackFailed(f"{reason(e)}. Do not run `rollback` again blindly: see what the host runs now with "
                             f"`ddtree-ops status --limit {rb.host.name}`") from None
    except (Exception, KeyboardInterrupt) as e:
        what = (f"interrupted ({interrupt_label(e)})" if isinstance(e, KeyboardInterrupt) else str(e)
                if isinstance(e, (StepFailed, DdtreeOpsError)) and str(e).strip() else reason(e))
        raise RollbackFailed(f"{rb.host.name}: rollback failed at {r.journal.get('step')}: {what}; the journal on "
                             f"the host records it: a person must look, then run `ddtree-ops rollback --limit "
                             f"{rb.host.name}` again to finish it") from None


# The rollback of one node, after its lock and the repair of an interrupted run (which, when it
# happens, is the whole rollback). A server runs it on each node in engine.ROLLBACK_ORDER.
ROLLBACK: tuple[Phase, ...] = (
    Phase("choose and verify", Nodes.NODE0, run=_choose),
    Phase("journal", Nodes.NODE0, run=_journal, changes=True),
    Phase("restore", Nodes.NODE0, run=_restore),
)


def drift_refusal_of(session: HostSession, to: str | UndoRollout | None, opts: DeployOptions) -> DdtreeOpsError | None:
    """Before any node of a multi-node server is rolled back: the restore check this node's own
    rollback would make (read only, the lock not taken), so that one drifted node refuses the
    whole server instead of leaving its other nodes on another release. None: go ahead (each
    node's rollback checks again under its lock, and decides whatever else may be wrong)."""
    if opts.force:
        return None
    store, name = session.store, session.host.name
    try:
        journal = store.facts([]).get("journal")
        if isinstance(journal, dict):
            if journal.get("force"):
                return None
            reply = store.journal_restore_check()
            what = f"repair the interrupted {journal.get('kind', 'deploy')} of {journal.get('release')}"
        else:
            history = store.history()
            undo = (releases_of_rollout(history, to.rollout, name) if isinstance(to, UndoRollout)
                    else releases_to_undo(history, to, name))
            reply, what = store.restore_check(undo, to == ORIGINAL), "roll back"
    except DdtreeOpsError:
        return None  # nothing to roll back, a lost connection...: the node's own rollback deals with it
    return drift_refusal(session.host, reply, what) if reply.drifted else None


def rollback_host(session: HostSession, to: str | UndoRollout | None, opts: DeployOptions, report: EventSink = quiet, *,
                  health_checked: bool = True, router: SmgRouter | None = None) -> HostResult:
    t0 = time.monotonic()
    rb = Runbook(session, report, health_checked=health_checked, router=router)
    h = rb.host
    lock = rb.lock(opts)
    try:
        repaired = rb.repair_interrupted(rb.window(opts), force=opts.force)
        if repaired:  # the host is back on what was current before that deploy; stop there
            return HostResult(h.name, Outcome.ROLLED_BACK, 0, release=repaired, steps=rb.steps,
                              seconds=time.monotonic() - t0, repaired=repaired,
                              message=f"repaired the interrupted operation on {repaired}")
        run = RollbackRun([rb], to, opts, lock)
        run_phases(run, ROLLBACK)
        return HostResult(h.name, Outcome.ROLLED_BACK, 0, release=run.now_on, steps=rb.steps,
                          seconds=time.monotonic() - t0,
                          message="; ".join([f"now on {run.now_on or 'the original upstream files'}", *rb.warnings]))
    finally:
        rb.unlock(lock)
