"""`deploy` on one host: the phase engine (engine.py) over a one-node server.

Any failure after the first change rolls the host back by itself (reconnecting if the SSH
connection was lost); Ctrl-C does the same. The result is a `HostResult`, or one of the
exceptions the CLI turns into an exit code (refused 2, rolled back 3, a person must look 4,
locked 5), carrying the host's result where there is one.
"""

from __future__ import annotations

import time
from contextlib import ExitStack

from ..artifacts.patchset import PatchSet
from ..errors import (
    ChangedSincePreflight,
    DdtreeOpsError,
    DeployFailed,
    Interrupted,
    LeaseLost,
    LockHeldError,
    PreflightError,
    RollbackFailed,
    reason,
)
from ..gates.router import SmgRouter
from ..host.session import HostSession
from .describe import describe_failure
from .engine import DeployEnd, DeployRun, Prepared, lock_all, prepare, transact
from .events import EventSink, quiet
from .options import DeployOptions
from .phases import Runbook
from .plan import HostPlan
from .results import HostResult, Outcome

__all__ = ["deploy_host", "describe_failure", "refusal"]


def refusal(host: str, plan_or_refusals: HostPlan | list[str], *, on: str = "") -> PreflightError:
    refusals = plan_or_refusals.refusals if isinstance(plan_or_refusals, HostPlan) else plan_or_refusals
    return PreflightError(host, f"preflight refused; nothing was changed{on}:\n  - " + "\n  - ".join(refusals))


def deploy_host(session: HostSession, ps: PatchSet, opts: DeployOptions, report: EventSink = quiet, *,
                router: SmgRouter | None = None) -> HostResult:
    """`router`: the client of the router in front of the host (fleet.routing), None without one."""
    t0 = time.monotonic()
    rb = Runbook(session, report, router=router)
    run = DeployRun([rb], ps, opts)
    with ExitStack() as stack:
        locks = lock_all(run, stack)
        if prepare(run, locks, lambda r: refusal(rb.host.name, r.plans[0])) is Prepared.UNCHANGED:
            return HostResult(rb.host.name, Outcome.UNCHANGED, 0, release=run.plans[0].current_release,
                              steps=rb.steps, seconds=time.monotonic() - t0, repaired=run.repaired[0])
        end = transact(run, report)
        if end.exc is not None:
            raise host_error(run, end, t0) from None
        return HostResult(rb.host.name, Outcome.DEPLOYED, 0, release=run.releases[0].id, steps=rb.steps,
                          seconds=time.monotonic() - t0, repaired=run.repaired[0], message="; ".join(rb.warnings),
                          perf_gate=rb.traffic.perf_result)


def host_error(run: DeployRun, end: DeployEnd, t0: float) -> DdtreeOpsError:
    """How a failed deploy of one host ends, as the exception to raise (`.result` holds the host's
    row where the host is back and healthy)."""
    rb, release = run.node0, run.releases[0]
    h, step, message = rb.host.name, end.failed_step, end.message
    if isinstance(end.exc, LeaseLost):  # the host went its own way: no rollback was tried
        return end.exc
    if isinstance(end.exc, ChangedSincePreflight) and not run.started:  # refused at backup, nothing changed
        return end.exc
    if end.left:
        if end.left_error is not None:
            message += f" (recording the failure failed too: {end.left_error})"
        return RollbackFailed(f"{h}: deploy failed at {step}: {message}; left as is because of --no-rollback. Run "
                              f"`ddtree-ops rollback --limit {h}` to restore the previous release.")
    if end.rollback_errors:
        e = end.rollback_errors[0][1]
        if isinstance(e, LeaseLost):
            return e
        if isinstance(e, LockHeldError):  # another run holds the host now: a rollback would undo its work
            return RollbackFailed(f"{h}: deploy failed at {step} ({message}); {reason(e)}. Do not run `rollback` "
                                  f"blindly: see what the host runs now with `ddtree-ops status --limit {h}` and "
                                  f"`ddtree-ops history --host {h}`.")
        return RollbackFailed(f"{h}: deploy failed at {step} ({message}) and the rollback failed too: {reason(e)}. "
                              f"The journal on the host records release {release.id}; a person must look, then run "
                              f"`ddtree-ops rollback --limit {h}`.")
    exc_type = Interrupted if end.interrupted else DeployFailed
    message += "".join(f"; warning: {w}" for w in rb.warnings)
    err = exc_type(f"{h}: deploy failed at {step}: {message}; rolled back to "
                   f"{release.previous or 'the previous state'}, healthy" + "".join(f"; {w}" for w in rb.warnings))
    err.result = HostResult(h, Outcome.INTERRUPTED if end.interrupted else Outcome.ROLLED_BACK, exc_type.exit_code,
                            release=release.id, failed_step=step, message=message, log=end.log, steps=rb.steps,
                            seconds=time.monotonic() - t0, repaired=run.repaired[0], perf_gate=rb.traffic.perf_result)
    return err
