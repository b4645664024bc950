"""What ended a deploy, said safely: the failed step, the message and the server's log lines,
scrubbed of secrets before anyone sees them; and what interrupted it, by name (`Interrupt`)."""

from __future__ import annotations

import signal
from typing import Any

from ..config.redaction import scrub, scrub_lines
from ..config.secrets import known_secrets
from ..errors import reason
from .steps import StepFailed


class Interrupt(KeyboardInterrupt):
    """A signal that ends the tool the way Ctrl-C does (ddtree_ops.cli.signals raises it): the
    same path as a KeyboardInterrupt, with the signal's name for every message that reports it."""

    def __init__(self, signum: int = signal.SIGINT):
        self.signum = signal.Signals(signum)
        super().__init__(self.signum.name)

    @property
    def exit_code(self) -> int:
        """The shell's convention for a command a signal ended: 128 + its number (130 for Ctrl-C)."""
        return 128 + int(self.signum)


def interrupt_label(exc: BaseException) -> str:
    """How messages name an interruption: "Ctrl-C" for SIGINT (or a KeyboardInterrupt that no
    signal raised), the signal's name otherwise ("SIGTERM", "SIGHUP")."""
    signum = getattr(exc, "signum", signal.SIGINT)
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def interrupted_by(exc: BaseException) -> str:
    """The reason an interrupted run gives: by the operator (Ctrl-C) or by the signal."""
    label = interrupt_label(exc)
    return "interrupted by the operator (Ctrl-C)" if label == "Ctrl-C" else f"interrupted by {label}"


def describe_failure(rb: Any, exc: BaseException) -> tuple[str, str, list[str]]:
    """(failed step, message, log lines) of what ended a deploy on `rb` (a runbook: its `host` and
    `last_step`): a failed step names itself; anything else happened during the step the journal
    records last. The message and the server's log lines are scrubbed (redaction.scrub: the API key
    the controller holds, and every secret-named field such as the `'api_key': '...'` SGLang logs
    at start-up) before they are shown, returned in JSON or recorded in the host's journal."""
    if isinstance(exc, KeyboardInterrupt):
        label = interrupt_label(exc)
        why = "interrupted by the operator" if label == "Ctrl-C" else f"interrupted by {label}"
        return f"interrupted ({label}) during {rb.last_step}", why, []
    secrets = known_secrets(rb.host)
    if isinstance(exc, StepFailed):
        return exc.step, scrub(str(exc), secrets), scrub_lines(exc.log, secrets)
    return rb.last_step, scrub(reason(exc), secrets), []
