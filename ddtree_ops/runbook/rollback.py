"""`rollback` on one host: back to the previous release, a named one, or the original files.

`releases_to_undo` decides from the host's history (pure); `rollback_host` verifies every backup
it will need before touching anything, restores them newest first, and brings the services back
as they were before the oldest undone release, through the same health gate as a deploy.
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import DdtreeOpsError, InputError, RollbackFailed
from ..host.session import HostSession
from .phases import DeployOptions, Reporter, Runbook, StepFailed, quiet
from .results import HostResult, Outcome

ORIGINAL = "original"


def releases_to_undo(history: dict[str, Any], to: str | None, host: str) -> list[str]:
    """Release ids to undo, newest first: the current one (`to` None), down to the named one
    (excluded), or all of them (`to` 'original'). InputError when that is not possible."""
    by_id = {r["id"]: r for r in history["releases"]}
    chain: list[str] = []
    cur = history["current"]
    while cur and cur not in chain:
        chain.append(cur)
        cur = (by_id.get(cur) or {}).get("previous")
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
    for rid in undo:
        if not by_id.get(rid, {}).get("backup_present"):
            raise InputError(f"{host}: the backup of release {rid} was pruned; cannot roll back past it")
    return undo


def rollback_host(session: HostSession, to: str | None, opts: DeployOptions, report: Reporter = quiet, *,
                  health_checked: bool = True) -> HostResult:
    t0 = time.monotonic()
    rb = Runbook(session, report, health_checked=health_checked)
    h = rb.host
    lock = rb.lock(opts)
    try:
        repaired = rb.repair_interrupted()
        if repaired:  # the host is back on what was current before that deploy; stop there
            return HostResult(h.name, Outcome.ROLLED_BACK, 0, release=repaired, steps=rb.steps,
                              seconds=time.monotonic() - t0, repaired=repaired,
                              message=f"repaired the interrupted operation on {repaired}")
        history = rb.store.history()
        undo = releases_to_undo(history, to, h.name)
        for rid in undo:
            problems = rb.store.call("verify_backup", backup_dir=rb.store.backup_dir(rid))["problems"]
            if problems:
                raise RollbackFailed(f"{h.name}: backup of release {rid} is corrupted, refusing to restore it: "
                                     + "; ".join(problems))
        oldest = next(r for r in history["releases"] if r["id"] == undo[-1])
        now_on = None if to == ORIGINAL else oldest.get("previous")
        journal = rb.begin_rollback(undo, now_on, to == ORIGINAL, oldest, lock)
        # From the journal on, one transaction: whatever stops it (a failed step, a lost
        # connection, a bug, Ctrl-C) leaves the journal naming the step, and the next run
        # (`rollback` or `deploy`, no flags) finishes the rollback.
        try:
            rb.reconnecting(opts.reconnect_s, lambda: rb.finish_rollback(journal), "finish the rollback")
        except (Exception, KeyboardInterrupt) as e:
            what = ("interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else str(e)
                    if isinstance(e, (StepFailed, DdtreeOpsError)) else f"{type(e).__name__}: {e}")
            raise RollbackFailed(f"{h.name}: rollback failed at {journal.get('step')}: {what}; the journal on the "
                                 f"host records it: a person must look, then run `ddtree-ops rollback --limit "
                                 f"{h.name}` again to finish it") from None
        return HostResult(h.name, Outcome.ROLLED_BACK, 0, release=now_on, steps=rb.steps,
                          seconds=time.monotonic() - t0,
                          message="; ".join([f"now on {now_on or 'the original upstream files'}", *rb.warnings]))
    finally:
        rb.unlock(lock)
