"""The step log of one host's run, and the exception a failed step raises.

`StepLog` turns the runbook's "I am in phase X" / "step Y done" into typed events (events.py)
for the watchers, and keeps the steps done, which become the host's `steps` in its result.
"""

from __future__ import annotations

from typing import Any

from .events import EventSink, Failed, Note, PhaseStarted, StepDone, quiet


class StepFailed(Exception):
    """A step of the runbook failed; the host may be half-changed and must be rolled back."""

    def __init__(self, step: str, message: str, log: list[str] | None = None):
        super().__init__(message)
        self.step, self.log = step, log or []


class StepLog:
    """One host's events, sent to `sink` as they happen; the steps done are kept in order."""

    def __init__(self, host: str, sink: EventSink = quiet):
        self.host, self.sink = host, sink
        self.done: list[StepDone] = []

    def phase(self, name: str) -> None:
        self.sink(PhaseStarted(self.host, name))

    def step(self, name: str, detail: str = "") -> None:
        ev = StepDone(self.host, name, detail)
        self.done.append(ev)
        self.sink(ev)

    def note(self, message: str) -> None:
        self.sink(Note(self.host, message))

    def failed(self, step: str, message: str, then: str = "rolling back") -> None:
        self.sink(Failed(self.host, step, message, then))

    @property
    def last_step(self) -> str:
        return self.done[-1].step if self.done else "?"

    @property
    def last_t(self) -> float:
        return self.done[-1].t if self.done else 0.0

    def records(self) -> list[dict[str, Any]]:
        return [ev.record() for ev in self.done]
