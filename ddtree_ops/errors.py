"""One exception type per kind of failure the operator must act on.

The CLI turns each into a message and the exit code documented in the README:

  0  ok
  2  bad input or preflight refusal (nothing changed on any host)
  3  deploy failed; the host is back on its previous release and healthy
  4  deploy failed and the rollback failed too: a person must look
  5  the host's deploy lock is held by someone else
"""

from __future__ import annotations

import reprlib
from typing import Any

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_ROLLED_BACK = 3
EXIT_NEEDS_PERSON = 4
EXIT_LOCKED = 5


SHOWN_MAX = 80  # characters of a value quoted in a message
_BOUNDED = reprlib.Repr()  # a repr whose work is bounded, whatever the size of the value
_BOUNDED.maxlevel, _BOUNDED.maxstring, _BOUNDED.maxother, _BOUNDED.maxlong = 2, SHOWN_MAX, SHOWN_MAX, SHOWN_MAX
_BOUNDED.maxlist = _BOUNDED.maxtuple = _BOUNDED.maxdict = _BOUNDED.maxset = _BOUNDED.maxfrozenset = 30


def shown(value: Any, limit: int = SHOWN_MAX) -> str:
    """`value` as a message quotes it (its repr), cut to `limit` characters with an ellipsis: a
    value from a file or a host may be megabytes long."""
    r = repr(value[: limit + 1]) if isinstance(value, str) else _BOUNDED.repr(value)
    return r if len(r) <= limit else r[: limit - 1] + "…"


class DdtreeOpsError(Exception):
    """Base class; `exit_code` is what the CLI exits with."""

    exit_code = EXIT_ERROR


class InputError(DdtreeOpsError):
    """Bad input caught before anything changed (inventory, flags, patch set, bundle)."""

    exit_code = EXIT_BAD_INPUT


class InventoryError(InputError):
    """An inventory file is malformed; the message names file, host and field."""

    def __init__(self, file: str, host: str | None, field: str | None, problem: str):
        self.file, self.host, self.field, self.problem = file, host, field, problem
        where = file
        if host:
            where += f": host {shown(host)}"
        if field:
            where += f": field {shown(field)}"
        super().__init__(f"{where}: {problem}")


class DefaultsFileError(InputError):
    """The defaults file (ddtree-ops.toml, $DDTREE_OPS_CONFIG, [tool.ddtree-ops]) is unreadable or has
    an unknown key or a wrong value; the message names the file and the key."""

    def __init__(self, file: str, key: str | None, problem: str):
        self.file, self.key, self.problem = file, key, problem
        super().__init__(f"{file}: key {shown(key)}: {problem}" if key else f"{file}: {problem}")


class PatchSetError(InputError):
    """A patch set (manifest or files) is malformed or inconsistent."""


class BundleError(InputError):
    """A release bundle is tampered, truncated or malformed."""


class PreflightError(InputError):
    """A host refused in preflight: nothing on it was changed."""

    def __init__(self, host: str, message: str):
        self.host = host
        super().__init__(f"{host}: {message}")


class ChangedSincePreflight(PreflightError):
    """A file changed on the host between preflight and backup: the backup refused before writing
    anything and the deploy stops there, the host as preflight saw it (no rollback to run)."""


class DriftedSinceRelease(PreflightError):
    """A rollback (or the repair of an interrupted run) would restore backups over files, or into
    an SGLang version, that changed since the release being undone installed them (a venv
    upgraded under it): refused before anything was written; `rollback --force` restores anyway.
    `check` is the host agent's answer (protocol.RestoreCheckReply)."""

    def __init__(self, host: str, message: str, check: Any = None):
        super().__init__(host, message)
        self.check = check


class Declined(InputError):
    """The operator answered no to the confirmation prompt: nothing was changed."""


class LocalKeyMissing(InputError):
    """A host's `identity_file` is not a readable file on this machine: found before connecting."""


class HostKeyError(InputError):
    """The host's SSH key is unknown or changed; we refuse to talk to it."""


class UnreachableError(DdtreeOpsError):
    """The host cannot be reached over SSH (refused, timeout, auth failure)."""


class AuthRefused(UnreachableError):
    """The host's sshd refused the authentication: retried once (an sshd half up), final when it
    repeats (host/first_contact.py)."""


class RemoteCommandError(DdtreeOpsError):
    """A remote command failed unexpectedly."""


class RouterPoolShort(DdtreeOpsError):
    """The router in front of the next batch has too few workers ready to take it out of service
    (a worker that is not the rollout's is down, or max_unavailable allows none): the rollout
    stops before that batch. Exit 2 when it had changed nothing yet; 1 when earlier batches ran
    (they stay as they are: rolling them back would take more workers out of a short pool)."""

    def __init__(self, message: str, *, changed: bool):
        super().__init__(message)
        self.exit_code = EXIT_ERROR if changed else EXIT_BAD_INPUT


class LockHeldError(DdtreeOpsError):
    """Another operator (or a killed run) holds the host's deploy lock."""

    exit_code = EXIT_LOCKED


class DeployFailed(DdtreeOpsError):
    """The deploy failed and the host was rolled back to its previous release, healthy."""

    exit_code = EXIT_ROLLED_BACK


class RollbackFailed(DdtreeOpsError):
    """The deploy (or rollback) failed and the host could not be restored: a person must look."""

    exit_code = EXIT_NEEDS_PERSON


class CorruptJournal(RollbackFailed):
    """The host's journal cannot be read or is not one this tool wrote: nothing is guessed."""


class LeaseLost(RollbackFailed):
    """This run's lease on a host's deploy lock ran out (the controller was stopped or cut off for
    longer than lock_lease_s): the host went its own way (it rolls itself back when the run had
    changed it), so this run stops without touching it again."""


class NoVerdict(DdtreeOpsError):
    """The performance gate between servers named by URL (`ddtree-ops gate`) could not judge: a
    server did not answer its probe, or a baseline had no successful request to compare with.
    Exit 2 as for bad input, not 1: a pipeline must tell "the canary is slower" (1) from "the
    gate could not measure" (2)."""

    exit_code = EXIT_BAD_INPUT


class Interrupted(DdtreeOpsError):
    """The operator pressed Ctrl-C; the host was rolled back."""

    exit_code = EXIT_ROLLED_BACK


def reason(exc: BaseException) -> str:
    """What `exc` says, never empty: some exceptions carry no text (`EOFError()`, a bare
    `paramiko.SSHException()`), and "failed too: ." tells the operator nothing. Our own errors
    speak for themselves; anything else is named by its type."""
    text = str(exc)
    if not text.strip():
        return type(exc).__name__
    return text if isinstance(exc, DdtreeOpsError) else f"{type(exc).__name__}: {text}"
