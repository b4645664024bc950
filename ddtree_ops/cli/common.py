"""Small helpers every `ddtree-ops` command group shares: JSON on stdout, messages on stderr,
and turning the tool's exceptions into the documented exit codes.

A message often carries text from a host, a server or a file (an error's cause, a path): `log`
passes every line through `terminal_safe`, so no escape sequence in it reaches the terminal or a CI
log. JSON needs nothing more: `json.dumps` writes every control and non-ASCII character as `\\uXXXX`."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

import typer

from ..config.terminal import terminal_safe
from ..errors import DdtreeOpsError, Declined, InputError
from ..host.hooks import NO_HOOKS, Hooks
from ..runbook.describe import interrupt_label


def emit_json(doc: Any) -> None:
    """One JSON document on stdout."""
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")


def log(msg: str) -> None:
    """A message on stderr, flushed; made safe for the terminal (a multi-line message, such as a
    list of preflight refusals, keeps its line breaks)."""
    sys.stderr.write(terminal_safe(msg, keep_newlines=True) + "\n")
    sys.stderr.flush()


def guard(fn: Callable[[], int | None], *, as_json: bool = False) -> None:
    """Run a command body; turn our exceptions into a message and the documented exit code."""
    try:
        code = fn() or 0
    except DdtreeOpsError as e:
        if as_json:
            emit_json({"ok": False, "error": type(e).__name__, "message": str(e), "exit_code": e.exit_code})
        log(str(e) if isinstance(e, Declined) else f"error: {e}")  # a "no" is the operator's choice
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM/SIGHUP (signals.py): before any change
        raise typer.Exit(interrupted(e)) from None
    raise typer.Exit(code)


def confirm(yes: bool, question: str) -> None:
    """Ask only on an interactive terminal without --yes; CI (stdin not a TTY) is never asked.
    No, or the end of input, is `Declined` (exit 2, "aborted: nothing changed"): a script that
    reads the exit code must not mistake the operator's no for a failure on a host (exit 1)."""
    if yes or not sys.stdin.isatty():
        return
    try:
        agreed = typer.confirm(terminal_safe(question), default=False, err=True)
    except (typer.Abort, EOFError):
        agreed = False
    if not agreed:
        raise Declined("aborted: nothing changed")


def interrupted(e: KeyboardInterrupt) -> int:
    """Say which interrupt ended the command; its exit code (128 + the signal's number)."""
    log(f"interrupted ({interrupt_label(e)})")
    return getattr(e, "exit_code", 130)


def output_file(flag: str, path: str, example: str) -> str:
    """A file the command will write (`--report`, `--out`), checked before anything connects: its
    folder exists and is writable, and it is not a folder. Exit 2 naming the flag."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise InputError(f"{flag} {path}: the folder {folder} does not exist or is not writable")
    if os.path.isdir(path):
        raise InputError(f"{flag} {path}: is a folder; give a file name such as {example}")
    return path


# The options every command that reaches hosts takes, defined once for all the command modules.
INVENTORY_OPT = typer.Option(..., "--inventory", "-i", envvar="DDTREE_OPS_INVENTORY",
                             help="Inventory file (or $DDTREE_OPS_INVENTORY). No default: name production explicitly.")
LIMIT_OPT = typer.Option(None, "--limit", "-l",
                         help="An Ansible host pattern: names, groups, globs, ~regex; ',' or ':' separated; "
                              "'!' excludes, '&' intersects.")


def hooks_of(ctx: typer.Context) -> Hooks:
    """The test hooks `main` was given (none for an operator's run)."""
    return ctx.obj if isinstance(ctx.obj, Hooks) else NO_HOOKS
