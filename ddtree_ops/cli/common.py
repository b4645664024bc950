"""Small helpers every `ddtree-ops` command group shares: JSON on stdout, messages on stderr,
and turning the tool's exceptions into the documented exit codes.

A message often carries text from a host, a server or a file (an error's cause, a path): `log`
passes every line through `terminal_safe`, so no escape sequence in it reaches the terminal or a CI
log. JSON needs nothing more: `json.dumps` writes every control and non-ASCII character as `\\uXXXX`."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

import typer

from ..config.terminal import terminal_safe
from ..errors import DdtreeOpsError
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
        log(f"error: {e}")
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM/SIGHUP (signals.py): before any change
        raise typer.Exit(interrupted(e)) from None
    raise typer.Exit(code)


def interrupted(e: KeyboardInterrupt) -> int:
    """Say which interrupt ended the command; its exit code (128 + the signal's number)."""
    log(f"interrupted ({interrupt_label(e)})")
    return getattr(e, "exit_code", 130)
