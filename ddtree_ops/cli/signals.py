"""The signals that end `ddtree-ops`, all handled the way Ctrl-C is.

SIGINT (Ctrl-C, and a CI runner's first word), SIGTERM (a cancelled CI job, `kill`, `systemctl
stop` of a wrapper) and SIGHUP (a closed terminal) take one path: an `Interrupt` (a
KeyboardInterrupt that names its signal). While a rollout runs it is handed to the rollout
(fleet/rollout.py `deliver_interrupt`): every host in flight stops at its next event and is rolled
back (exit 3), no new batch starts, and a second signal of any of the three is noted and does not
cut that rollback short. Otherwise it is raised in the main thread, as Python raises Ctrl-C: the
command stops before any change (exit 128 + the signal's number: 130, 143, 129; a bundle's temp
folder is removed). SIGKILL cannot be handled: the host's journal and the next run's repair cover
it.

An inherited "ignore" is kept for SIGINT and SIGHUP: `nohup cmd` and a shell's `cmd &` start the
tool with them ignored on purpose, and it stays that way. SIGTERM is always handled, whatever the
tool inherited: it is how supervisors and CI runners stop a job before they SIGKILL it.

Installed once, by `commands.main`, in the main thread only (Python runs signal handlers there and
refuses to install them elsewhere); the previous handlers come back when the command ends.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from types import FrameType
from typing import Iterator

from ..fleet.rollout import deliver_interrupt
from ..runbook.describe import Interrupt

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Signals whose inherited SIG_IGN is the caller's choice, kept (nohup, `cmd &`).
IGNORE_KEPT = frozenset({signal.SIGINT, signal.SIGHUP})


def typer_swallowed(e: SystemExit) -> KeyboardInterrupt | None:
    """The interrupt behind a SystemExit, when Typer turned one into a silent exit 130: one that
    arrived outside a command's `guard` (while the arguments were parsed, or the command imported
    what it needs). None for any other exit."""
    cause = getattr(e.__context__, "__cause__", None)
    return cause if isinstance(cause, KeyboardInterrupt) else None


def _raise(signum: int, frame: FrameType | None) -> None:
    """While a rollout runs, hand it the interrupt (it stops its hosts at their next event, in its
    own time); otherwise raise it here, as Python raises Ctrl-C."""
    e = Interrupt(signum)
    if not deliver_interrupt(e):
        raise e


def handled_now(inherited: dict[signal.Signals, object]) -> tuple[signal.Signals, ...]:
    """Which of HANDLED to handle, given the dispositions the process inherited."""
    return tuple(s for s in HANDLED if not (s in IGNORE_KEPT and inherited.get(s) == signal.SIG_IGN))


@contextlib.contextmanager
def signals_as_interrupts() -> Iterator[tuple[signal.Signals, ...]]:
    """While the block runs, SIGINT, SIGTERM and SIGHUP raise `Interrupt` in the main thread
    (SIGINT and SIGHUP only when not inherited as ignored); yields the signals handled. Outside
    the main thread it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield ()
        return
    previous = {s: signal.getsignal(s) for s in HANDLED}
    handled = handled_now(previous)
    for s in handled:
        signal.signal(s, _raise)
    try:
        yield handled
    finally:
        for s in handled:
            old = previous[s]
            signal.signal(s, old if old is not None else signal.SIG_DFL)
