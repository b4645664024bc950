"""What a run tells its watchers, as typed events: a host entered a phase, finished a step, failed,
or has something to say. The phase engine emits them; the live view, the plain log lines, the
JSON output (`HostResult.steps`) and the HTML report read them by type, never by parsing text.

Every event also has `text`: the line a plain log prints for it. Events carry what hosts and
servers said as they said it (the JSON output and the report keep it whole); whatever writes an
event to a terminal passes it through `config.terminal.terminal_safe` first (cli/liveview.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Union


@dataclass(frozen=True)
class PhaseStarted:
    """The host has just entered a phase (drain, stop, start, weights, cuda graphs, warm-up, health
    gate, perf gate, soak, ...): the live view times the phase from here."""

    host: str
    phase: str
    t: float = field(default_factory=time.time)

    @property
    def text(self) -> str:
        return f"phase: {self.phase}"


@dataclass(frozen=True)
class StepDone:
    """A step of the runbook is done (or, for a step the journal records, begun): one entry of the
    host's `steps` in the JSON output and one bar of the report's timeline."""

    host: str
    step: str
    detail: str = ""
    t: float = field(default_factory=time.time)

    @property
    def text(self) -> str:
        return f"{self.step}{': ' + self.detail if self.detail else ''}"

    def record(self) -> dict[str, Any]:
        """The step as `--json` prints it."""
        return {"step": self.step, "t": self.t, "detail": self.detail}

    @classmethod
    def from_record(cls, host: str, rec: Any) -> StepDone | None:
        """A step read back from a JSON document (possibly partial or hand-edited): None when it
        has no usable name or time."""
        if not isinstance(rec, dict):
            return None
        t, step, detail = rec.get("t"), rec.get("step"), rec.get("detail")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            return None
        return cls(host, "?" if step is None or step == "" else str(step), str(detail) if detail else "", float(t))


@dataclass(frozen=True)
class Failed:
    """A run failed at `step`; `then` says what happens next (rolling back, left as is)."""

    host: str
    step: str
    message: str
    then: str = "rolling back"
    t: float = field(default_factory=time.time)

    @property
    def text(self) -> str:
        return f"FAILED at {self.step}: {self.message}; {self.then}"


@dataclass(frozen=True)
class Note:
    """Anything else worth a line: progress while waiting, a warning, a lost connection, a row's
    outcome."""

    host: str
    message: str
    t: float = field(default_factory=time.time)

    @property
    def text(self) -> str:
        return self.message


Event = Union[PhaseStarted, StepDone, Failed, Note]
EventSink = Callable[[Event], None]


def quiet(event: Event) -> None:
    """A sink that drops every event."""
