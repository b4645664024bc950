"""What ended a deploy, said safely: the failed step, the message and the server's log lines,
scrubbed of secrets before anyone sees them."""

from __future__ import annotations

from typing import Any

from ..config.redaction import scrub, scrub_lines
from ..config.secrets import known_secrets
from ..errors import DdtreeOpsError
from .steps import StepFailed


def describe_failure(rb: Any, exc: BaseException) -> tuple[str, str, list[str]]:
    """(failed step, message, log lines) of what ended a deploy on `rb` (a runbook: its `host` and
    `last_step`): a failed step names itself; anything else happened during the step the journal
    records last. The message and the server's log lines are scrubbed (redaction.scrub: the API key
    the controller holds, and every secret-named field such as the `'api_key': '...'` SGLang logs
    at start-up) before they are shown, returned in JSON or recorded in the host's journal."""
    if isinstance(exc, KeyboardInterrupt):
        return f"interrupted (Ctrl-C) during {rb.last_step}", "interrupted by the operator", []
    secrets = known_secrets(rb.host)
    if isinstance(exc, StepFailed):
        return exc.step, scrub(str(exc), secrets), scrub_lines(exc.log, secrets)
    if isinstance(exc, DdtreeOpsError):
        return rb.last_step, scrub(str(exc), secrets), []
    return rb.last_step, scrub(f"{type(exc).__name__}: {exc}", secrets), []
