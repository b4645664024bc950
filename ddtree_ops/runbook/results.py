"""What a run did to each host: an outcome, an exit code, the steps it took.

One `HostResult` per host; failures are built in one place (`failed_result`) from the exception
that ended the host's run; the run's exit code is the most serious of its hosts'.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Protocol

from ..config.redaction import scrub_lines
from ..errors import (
    EXIT_BAD_INPUT,
    EXIT_ERROR,
    EXIT_LOCKED,
    EXIT_NEEDS_PERSON,
    EXIT_OK,
    EXIT_ROLLED_BACK,
    DeployFailed,
    HostKeyError,
    InputError,
    Interrupted,
    LockHeldError,
    RollbackFailed,
    UnreachableError,
    reason,
)


class Outcome(str, enum.Enum):
    """How a host's run ended. The values are what `--json` prints."""

    DEPLOYED = "deployed"  # the new release runs and passed the health gate
    UNCHANGED = "unchanged"  # already as asked; nothing done
    ROLLED_BACK = "rolled_back"  # deploy failed and the host is back, healthy; or `rollback` succeeded
    INTERRUPTED = "interrupted"  # Ctrl-C, SIGTERM or SIGHUP: rolled back, or stopped before any change
    REVERTED = "reverted"  # deployed, then rolled back because the rollout was aborted
    REFUSED = "refused"  # bad input or preflight refusal: nothing changed
    LOCKED = "locked"  # another run holds the host's deploy lock
    UNREACHABLE = "unreachable"
    HOST_KEY_REFUSED = "host_key_refused"
    ROLLBACK_FAILED = "rollback_failed"  # a person must look
    REVERT_FAILED = "revert_failed"  # a person must look
    # Deployed; the abort's rollback refused before changing anything (the host changed under the
    # release: runbook/restore_check.py): left on the new release, which passed its health gate.
    REVERT_REFUSED = "revert_refused"
    FAILED = "failed"  # anything else (a bug is a row too)
    SKIPPED = "skipped"  # not started: the rollout was aborted before its batch

    def __str__(self) -> str:
        return self.value


# What counts as success for each command (everything else counts against the failure budget).
SUCCESS = {"deploy": frozenset({Outcome.DEPLOYED, Outcome.UNCHANGED}),
           "rollback": frozenset({Outcome.ROLLED_BACK})}


@dataclass
class HostResult:
    host: str
    outcome: Outcome
    exit_code: int
    release: str | None = None
    failed_step: str | None = None
    message: str = ""
    log: list[str] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)  # events.StepDone.record(), in order
    seconds: float = 0.0
    repaired: str | None = None  # an interrupted deploy this run repaired first
    perf_gate: dict[str, Any] | None = None  # the canary's performance gate (perfgate.GateVerdict.as_dict)
    serving: dict[str, Any] | None = None  # the server's accept length, tok/s before → after (fleet/serving_sample.py)
    # Tries the first connection took (1: at once; more: it rode out an SSH blip), and connections
    # lost and made again during the run (each followed by the phase resumed).
    connect_tries: int = 1
    reconnects: int = 0

    def to_dict(self) -> dict[str, Any]:
        """For --json. The log lines were scrubbed where they were read (deploy.describe_failure);
        secret-named fields are masked again here, whatever built the row."""
        d = asdict(self)
        d["outcome"] = self.outcome.value
        d["log"] = scrub_lines(self.log)
        return d


class _Connected(Protocol):
    connect_tries: int
    reconnects: int


def with_tries(result: HostResult, session: _Connected) -> HostResult:
    """The row says what the host's connection took: the first contact's tries, the reconnects
    during the run."""
    result.connect_tries = session.connect_tries
    result.reconnects = max(result.reconnects, session.reconnects)
    return result


def outcome_of(exc: BaseException) -> Outcome:
    if isinstance(exc, LockHeldError):
        return Outcome.LOCKED
    if isinstance(exc, HostKeyError):
        return Outcome.HOST_KEY_REFUSED
    if isinstance(exc, UnreachableError):
        return Outcome.UNREACHABLE
    if isinstance(exc, RollbackFailed):
        return Outcome.ROLLBACK_FAILED
    if isinstance(exc, (Interrupted, KeyboardInterrupt)):
        return Outcome.INTERRUPTED
    if isinstance(exc, DeployFailed):
        return Outcome.ROLLED_BACK
    if isinstance(exc, InputError):
        return Outcome.REFUSED
    return Outcome.FAILED


def failed_result(host: str, exc: BaseException, seconds: float, **fields: Any) -> HostResult:
    """The row of a host whose run ended with `exc`. An exception that carries the result of the
    host's run (`exc.result`: steps, log, release) gives that; otherwise the outcome and exit code
    follow from the exception's type, and `fields` (message, exit_code, release, ...) override."""
    carried = getattr(exc, "result", None)
    if isinstance(carried, HostResult):
        return carried
    row: dict[str, Any] = {"outcome": outcome_of(exc), "exit_code": getattr(exc, "exit_code", EXIT_ERROR),
                           "message": str(exc) if str(exc).strip() else reason(exc)}
    if isinstance(getattr(exc, "tries", None), int):  # a first contact that never answered (WindowExceeded)
        row["connect_tries"] = exc.tries
    row.update(fields)
    return HostResult(host, seconds=seconds, **row)


# Most serious first: a person must look > rolled back > locked > refused > other error.
_SEVERITY = (EXIT_NEEDS_PERSON, EXIT_ROLLED_BACK, EXIT_LOCKED, EXIT_BAD_INPUT, EXIT_ERROR, EXIT_OK)


def overall_exit_code(results: list[HostResult]) -> int:
    return worst_exit_code(r.exit_code for r in results)


def worst_exit_code(codes: Iterable[int]) -> int:
    """The rollout's exit code from its hosts' (4 before 3 before 5 before 2)."""
    seen = set(codes)
    return next((code for code in _SEVERITY if code in seen), EXIT_OK)
