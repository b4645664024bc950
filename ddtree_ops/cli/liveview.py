"""How a rollout is shown: a live per-host table on a terminal, plain log lines otherwise.

Both write to stderr only: stdout is reserved for the result (a table, or one JSON document).
The live table takes every value as literal text (`tables.literal`): a host's message is never
Rich markup. Both pass what hosts and servers say through `terminal_safe` (the live table by way
of `literal`): a server's log line in a progress note cannot move the cursor, set the window
title or write the clipboard, in a terminal or in a CI log read later.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..config.terminal import terminal_safe
from ..fleet.rollout import Progress
from ..runbook.events import Event, Failed, PhaseStarted, StepDone

_STYLE = {"deployed": "green", "unchanged": "green", "rolled_back": "yellow", "reverted": "yellow",
          "running": "cyan", "queued": "dim", "skipped": "dim", "refused": "yellow", "locked": "yellow",
          "revert_refused": "yellow"}


class PlainProgress(Progress):
    """`[host] message` lines on stderr (CI logs). A message of several lines prints as several
    lines, each with its prefix: no line of one host's text can pass for the tool's own or for
    another host's."""

    def __init__(self):
        self._lock = threading.Lock()
        self._states: dict[str, str] = {}

    def start(self, hosts, batches) -> None:
        self._states = {h: "queued" for h in hosts}

    def state(self, host: str, state: str) -> None:
        """A host that finished: `== 2/3 done`, so a CI log shows how far the rollout is."""
        self._states[host] = str(state)
        if state not in ("queued", "running"):
            done = sum(s not in ("queued", "running") for s in self._states.values())
            self._w("== ", f"{done}/{len(self._states)} done ({host}: {state})")

    def _w(self, prefix: str, text: str) -> None:
        lines = terminal_safe(text, keep_newlines=True).split("\n")
        with self._lock:
            sys.stderr.write("".join(f"{prefix}{line}\n" for line in lines))
            sys.stderr.flush()

    def event(self, event: Event) -> None:
        self._w(f"[{terminal_safe(event.host)}] ", event.text)

    def note(self, msg: str) -> None:
        self._w("== ", msg)


@dataclass
class _Row:
    """One host's line of the live table. A phase ends (its time stops) when a step is done after
    it: the next phase, if any, starts its own clock."""

    state: str = "queued"
    msg: str = ""
    t0: float | None = None
    t1: float | None = None
    phase: str = ""
    phase_t0: float = 0.0
    phase_t1: float | None = None

    def phase_cell(self, now: float) -> str:
        if not self.phase or self.state != "running":
            return ""
        took = (self.phase_t1 or now) - self.phase_t0
        return f"{self.phase} {took:.0f} s" + (", done" if self.phase_t1 is not None else "")

    def elapsed(self, now: float) -> str:
        return "" if self.t0 is None else f"{(self.t1 or now) - self.t0:.0f} s"


STEP_WIDTH = 160  # characters of a host's latest message shown: its start, where it says what happened
POOL_EVERY_S = 2.0  # how often the live view reads the router's pool


class LiveProgress(Progress):
    """A rich Live table, one row per host: state, phase (timed), latest step, elapsed time; under
    it how many hosts are done and, with a router, its ready workers. Notes print once, above."""

    def __init__(self, pool: Callable[[], str] | None = None):
        from rich.console import Console

        self.console = Console(stderr=True)
        self.rows: dict[str, _Row] = {}
        self._lock = threading.Lock()
        self._live = None
        self._pool, self.pool_line = pool, ""
        self._stopped = threading.Event()

    def _table(self):
        from rich.console import Group
        from rich.table import Table

        from .tables import literal

        t = Table("host", "state", "phase", "step", "elapsed")
        now = time.monotonic()
        with self._lock:
            for name, r in self.rows.items():
                t.add_row(literal(name), literal(r.state, _STYLE.get(r.state, "red")), literal(r.phase_cell(now)),
                          literal(r.msg), r.elapsed(now))
            footer = self.footer()
        return Group(t, literal(footer))

    def footer(self) -> str:
        """`2/3 done (1 deployed, 1 refused)`, then the router's pool."""
        done: dict[str, int] = {}
        for r in self.rows.values():
            if r.state not in ("queued", "running"):
                done[r.state] = done.get(r.state, 0) + 1
        counts = ", ".join(f"{n} {state}" for state, n in done.items())
        line = f"{sum(done.values())}/{len(self.rows)} done" + (f" ({counts})" if counts else "")
        return line + (f" · {self.pool_line}" if self.pool_line else "")

    def _row(self, host: str, state: str = "queued") -> _Row:
        return self.rows.setdefault(host, _Row(state=state))

    def start(self, hosts, batches) -> None:
        from rich.live import Live

        with self._lock:
            for h in hosts:
                self._row(h)
        self._live = Live(get_renderable=self._table, console=self.console, refresh_per_second=4, transient=False)
        self._live.start()
        if self._pool is not None:
            threading.Thread(target=self._read_pool, name="live view: router pool", daemon=True).start()

    def _read_pool(self) -> None:
        while not self._stopped.is_set():
            line = self._pool()
            with self._lock:
                self.pool_line = line
            self._stopped.wait(POOL_EVERY_S)

    def state(self, host: str, state: str) -> None:
        with self._lock:
            r = self._row(host)
            if state == "running":
                r.t0, r.t1, r.phase = time.monotonic(), None, ""
            elif state != "queued":
                r.t1 = time.monotonic()
            r.state = str(state)

    def event(self, event: Event) -> None:
        from .messages import one_line, start_of

        now = time.monotonic()
        with self._lock:
            r = self._row(event.host, "running")
            if r.t0 is None:
                r.t0 = now
            if isinstance(event, PhaseStarted):  # the phase column, timed from here
                r.phase, r.phase_t0, r.phase_t1 = event.phase, now, None
                return
            if isinstance(event, Failed):  # what runs now is the rollback, not the phase that failed
                r.phase, r.phase_t0, r.phase_t1 = event.then, now, None
            elif isinstance(event, StepDone) and r.phase and r.phase_t1 is None:  # a step done ends the phase
                r.phase_t1 = now
            r.msg = start_of(one_line(event.text).replace(f"{event.host}: ", "", 1), STEP_WIDTH)  # the row names it

    def note(self, msg: str) -> None:
        from .tables import literal

        # print, not log: a log line carries the caller's file:line, and the note is said once
        self.console.print(literal(msg))

    def pause(self) -> None:
        """While the operator answers a question: the table must not redraw over the prompt."""
        if self._live is not None:
            self._live.stop()

    def resume(self) -> None:
        if self._live is not None:
            self._live.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._live is not None:
            self._live.stop()
            self._live = None


def make_progress(pool: Callable[[], str] | None = None) -> Progress:
    """Live table on a terminal; plain lines otherwise (also with --json: logs stay on stderr).
    `pool`: reads the router's pool, for the live table's last line (fleet/pool_summary.py)."""
    if sys.stderr.isatty():
        return LiveProgress(pool)
    return PlainProgress()
