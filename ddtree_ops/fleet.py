"""Running a per-host operation over the selected hosts and folding the results.

Each host gets its own SSH connection; an unreachable host or a refused host is a row in the
results, never a crash of the whole run. The overall exit code is the most serious one.
"""

from __future__ import annotations

import time
from typing import Callable

from .deploy import HostDeploy, HostResult, Reporter
from .errors import (EXIT_BAD_INPUT, EXIT_ERROR, EXIT_LOCKED, EXIT_NEEDS_PERSON, EXIT_OK,
                     EXIT_ROLLED_BACK, DdtreeOpsError, HostKeyError, InputError, LockHeldError,
                     RollbackFailed, UnreachableError)
from .inventory import Host
from .transport import HostConnection

# Most serious first: a person must look > rolled back > locked > refused > other error.
_SEVERITY = [EXIT_NEEDS_PERSON, EXIT_ROLLED_BACK, EXIT_LOCKED, EXIT_BAD_INPUT, EXIT_ERROR, EXIT_OK]


def overall_exit_code(results: list[HostResult]) -> int:
    codes = {r.exit_code for r in results}
    for code in _SEVERITY:
        if code in codes:
            return code
    return EXIT_OK


def _outcome_of(exc: DdtreeOpsError) -> str:
    if isinstance(exc, LockHeldError):
        return "locked"
    if isinstance(exc, HostKeyError):
        return "host_key_refused"
    if isinstance(exc, UnreachableError):
        return "unreachable"
    if isinstance(exc, RollbackFailed):
        return "rollback_failed"
    if isinstance(exc, InputError):
        return "refused"
    return "failed"


def run_on_host(host: Host, action: Callable[[HostDeploy], HostResult], *, accept_new_host_keys: bool = False,
                report: Reporter) -> HostResult:
    t0 = time.monotonic()
    try:
        conn = HostConnection(host, accept_new_host_keys=accept_new_host_keys)
        conn.open()
        try:
            return action(HostDeploy(conn, host, report))
        finally:
            conn.close()
    except DdtreeOpsError as e:
        result = getattr(e, "result", None)
        if result is None:
            result = HostResult(host.name, _outcome_of(e), e.exit_code, message=str(e),
                                seconds=time.monotonic() - t0)
        report(host.name, f"{result.outcome}: {str(e).splitlines()[0]}")
        return result


def run_sequential(hosts: list[Host], action: Callable[[HostDeploy], HostResult], *,
                   accept_new_host_keys: bool = False, report: Reporter) -> list[HostResult]:
    results = []
    for h in hosts:
        results.append(run_on_host(h, action, accept_new_host_keys=accept_new_host_keys, report=report))
        if results[-1].outcome == "interrupted":  # Ctrl-C: roll back this host, touch no other
            break
    return results
