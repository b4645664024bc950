"""`deploy` on one host: the runbook's phases, top to bottom.

Any failure after the first change rolls the host back by itself (reconnecting if the SSH
connection was lost); Ctrl-C does the same. The result is a `HostResult`, or one of the
exceptions the CLI turns into an exit code (refused 2, rolled back 3, a person must look 4,
locked 5), carrying the host's result where there is one.
"""

from __future__ import annotations

import time

from ..artifacts.patchset import PatchSet
from ..config.redaction import scrub, scrub_lines
from ..errors import (
    DdtreeOpsError,
    DeployFailed,
    Interrupted,
    PreflightError,
    RollbackFailed,
)
from ..gates.health import known_secrets
from ..host.session import HostSession
from .phases import DeployOptions, Release, Reporter, Runbook, StepFailed, quiet
from .plan import HostPlan
from .results import HostResult, Outcome


def refusal(host: str, plan_or_refusals: HostPlan | list[str], *, on: str = "") -> PreflightError:
    refusals = plan_or_refusals.refusals if isinstance(plan_or_refusals, HostPlan) else plan_or_refusals
    return PreflightError(host, f"preflight refused; nothing was changed{on}:\n  - " + "\n  - ".join(refusals))


def deploy_host(session: HostSession, ps: PatchSet, opts: DeployOptions, report: Reporter = quiet) -> HostResult:
    t0 = time.monotonic()
    rb = Runbook(session, report)
    lock = rb.lock(opts)
    try:
        repaired = rb.repair_interrupted()
        plan = rb.preflight(ps, opts)
        if plan.refusals:
            raise refusal(rb.host.name, plan)
        before = rb.services_before()
        if rb.is_running_as_planned(plan, before):
            rb.step("unchanged", "files and unit already as asked; nothing to do")
            return HostResult(rb.host.name, Outcome.UNCHANGED, 0, release=plan.current_release, steps=rb.steps,
                              seconds=time.monotonic() - t0, repaired=repaired)
        baseline = rb.measure_baseline(opts, serving=any(s.active == "active" for s in before.values()))
        release = rb.begin(plan, ps, lock, before)
        # From the first change on, one transaction: whatever goes wrong (a failed step, a remote
        # error or a lost connection between steps, a bug, Ctrl-C) rolls the host back.
        try:
            rb.backup_and_install(ps, plan, release, opts)
            rb.restart(release)
            rb.wait_and_gate(release, opts.deadline_s)
            rb.join_router()
            rb.perf_gate(baseline, opts)
            rb.soak(release)
            rb.commit(plan, release)
        except (Exception, KeyboardInterrupt) as e:
            raise recover(rb, release, e, opts, t0=t0, repaired=repaired) from None
        return HostResult(rb.host.name, Outcome.DEPLOYED, 0, release=release.id, steps=rb.steps,
                          seconds=time.monotonic() - t0, repaired=repaired, message="; ".join(rb.warnings),
                          perf_gate=rb.perf_result)
    finally:
        rb.unlock(lock)


def describe_failure(rb: Runbook, exc: BaseException) -> tuple[str, str, list[str]]:
    """(failed step, message, log lines) of what ended a deploy: a failed step names itself;
    anything else happened during the step the journal records last. The message and the server's
    log lines are scrubbed (redaction.scrub: the API key the controller holds, and every
    secret-named field such as the `'api_key': '...'` SGLang logs at start-up) before they are
    shown, returned in JSON or recorded in the host's journal."""
    if isinstance(exc, KeyboardInterrupt):
        return f"interrupted (Ctrl-C) during {rb.last_step}", "interrupted by the operator", []
    secrets = known_secrets(rb.host)
    if isinstance(exc, StepFailed):
        return exc.step, scrub(str(exc), secrets), scrub_lines(exc.log, secrets)
    if isinstance(exc, DdtreeOpsError):
        return rb.last_step, scrub(str(exc), secrets), []
    return rb.last_step, scrub(f"{type(exc).__name__}: {exc}", secrets), []


def recover(rb: Runbook, release: Release, exc: BaseException, opts: DeployOptions, *, t0: float,
            repaired: str | None = None) -> DdtreeOpsError:
    """After a failed step (or Ctrl-C): roll the release back and say how it ended, as the
    exception to raise (`.result` holds the host's row)."""
    h = rb.host
    interrupted = isinstance(exc, KeyboardInterrupt)
    failed_step, message, log = describe_failure(rb, exc)
    if opts.no_rollback and not interrupted:
        try:
            rb.leave_failed(release, failed_step, message)
        except Exception as e:  # the journal still names the step it failed at
            message += f" (recording the failure failed too: {e})"
        return RollbackFailed(f"{h.name}: deploy failed at {failed_step}: {message}; left as is because of "
                              f"--no-rollback. Run `ddtree-ops rollback --limit {h.name}` to restore the "
                              f"previous release.")
    rb.report(h.name, f"FAILED at {failed_step}: {message}; rolling back")
    try:
        rb.roll_back_reconnecting(opts.reconnect_s, release.id, release.journal,
                                  outcome=f"rolled back ({failed_step})", failed_step=failed_step, error=message)
    except Exception as e:
        return RollbackFailed(f"{h.name}: deploy failed at {failed_step} ({message}) and the rollback failed too: "
                              f"{e}. The journal on the host records release {release.id}; a person must look, "
                              f"then run `ddtree-ops rollback --limit {h.name}`.")
    exc_type = Interrupted if interrupted else DeployFailed
    err = exc_type(f"{h.name}: deploy failed at {failed_step}: {message}; rolled back to "
                   f"{release.previous or 'the previous state'}, healthy")
    err.result = HostResult(h.name, Outcome.INTERRUPTED if interrupted else Outcome.ROLLED_BACK, exc_type.exit_code,
                            release=release.id, failed_step=failed_step, message=message, log=log, steps=rb.steps,
                            seconds=time.monotonic() - t0, repaired=repaired, perf_gate=rb.perf_result)
    return err
