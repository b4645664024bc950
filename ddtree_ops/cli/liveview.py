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

from ..config.terminal import terminal_safe
from ..fleet.rollout import Progress
from ..runbook.events import Event, PhaseStarted

_STYLE = {"deployed": "green", "unchanged": "green", "rolled_back": "yellow", "reverted": "yellow",
          "running": "cyan", "queued": "dim", "skipped": "dim"}


class PlainProgress(Progress):
    """`[host] message` lines on stderr (CI logs). A message of several lines prints as several
    lines, each with its prefix: no line of one host's text can pass for the tool's own or for
    another host's."""

    def __init__(self):
        self._lock = threading.Lock()

    def _w(self, prefix: str, text: str) -> None:
        lines = terminal_safe(text, keep_newlines=True).split("\n")
        with self._lock:
            sys.stderr.write("".join(f"{prefix}{line}\n" for line in lines))
            sys.stderr.flush()

    def event(self, event: Event) -> None:
        self._w(f"[{terminal_safe(event.host)}] ", event.text)

    def note(self, msg: str) -> None:
        self._w("== ", msg)


class LiveProgress(Progress):
    """A rich Live table, one row per host: state, latest step, elapsed time."""

    def __init__(self):
        from rich.console import Console

        self.console = Console(stderr=True)
        self.rows: dict[str, dict] = {}
        self.notes: list[str] = []
        self._lock = threading.Lock()
        self._live = None

    def _table(self):
        from rich.table import Table

        from .tables import literal

        t = Table("host", "state", "phase", "step", "elapsed", title=(literal(self.notes[-1]) if self.notes else None),
                  title_justify="left")
        now = time.monotonic()
        with self._lock:
            for name, r in self.rows.items():
                el = ""
                if r["t0"] is not None:
                    el = f"{(r['t1'] or now) - r['t0']:.0f} s"
                st = r["state"]
                style = _STYLE.get(st, "red")
                phase = ""
                if r.get("phase") and st == "running":
                    phase = f"{r['phase']} {now - r['phase_t0']:.0f} s"
                t.add_row(literal(name), literal(st, style), literal(phase), literal(r["msg"][-80:]), el)
        return t

    def start(self, hosts, batches) -> None:
        from rich.live import Live

        with self._lock:
            for h in hosts:
                self.rows[h] = {"state": "queued", "msg": "", "t0": None, "t1": None}
        self._live = Live(get_renderable=self._table, console=self.console, refresh_per_second=4, transient=False)
        self._live.start()

    def state(self, host: str, state: str) -> None:
        with self._lock:
            r = self.rows.setdefault(host, {"state": "queued", "msg": "", "t0": None, "t1": None})
            if state == "running":
                r["t0"], r["t1"] = time.monotonic(), None
            elif state != "queued":
                r["t1"] = time.monotonic()
            r["state"] = state

    def event(self, event: Event) -> None:
        with self._lock:
            r = self.rows.setdefault(event.host, {"state": "running", "msg": "", "t0": time.monotonic(), "t1": None})
            if isinstance(event, PhaseStarted):  # the phase column, timed from here
                r["phase"], r["phase_t0"] = event.phase, time.monotonic()
                return
            msg = event.text
            r["msg"] = msg.split("\n")[0] if msg else ""

    def note(self, msg: str) -> None:
        with self._lock:
            self.notes.append(msg)
        if self._live is not None:
            from .tables import literal

            self._live.console.log(literal(msg))

    def pause(self) -> None:
        """While the operator answers a question: the table must not redraw over the prompt."""
        if self._live is not None:
            self._live.stop()

    def resume(self) -> None:
        if self._live is not None:
            self._live.start()

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


def make_progress() -> Progress:
    """Live table on a terminal; plain lines otherwise (also with --json: logs stay on stderr)."""
    if sys.stderr.isatty():
        return LiveProgress()
    return PlainProgress()
