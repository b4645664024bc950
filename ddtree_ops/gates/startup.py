"""Which start-up phase a restarting SGLang server is in, read from its own log lines.

A 1T model spends many minutes in each of three phases: loading weights, capturing CUDA graphs
and warming up. One overall deadline cannot tell a slow but progressing load from a capture that
hangs, so each phase has a deadline of its own (`health.*_deadline_s`) and the live view shows the
phase and its elapsed time. The markers are SGLang 0.5.23's lines (model_runner.py,
cuda_graph_runner.py, http_server.py); the last phase (ready) is /health 200, which the wait
itself checks.

The tracker only moves forward: once a marker was seen the phase is known, even after its line
has scrolled out of the log tail. Lines that were already in the unit's log before the restart
(the previous server's) are ignored.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable


class Phase(str, enum.Enum):
    STARTING = "starting"  # the process runs; nothing logged yet that names a phase
    WEIGHTS = "weights"
    CUDA_GRAPHS = "cuda graphs"
    WARMUP = "warm-up"  # HTTP is up; /health 503 until SGLang's warm-up request has run

    def __str__(self) -> str:
        return self.value


ORDER = (Phase.STARTING, Phase.WEIGHTS, Phase.CUDA_GRAPHS, Phase.WARMUP)

# The line that shows a phase has begun. Warm-up begins when HTTP is up (uvicorn's lines); a
# server without CUDA graphs (--disable-cuda-graph) goes from weights straight to warm-up.
# 0.5.23 captures several graphs in a row ("Capture target verify CUDA graph begin", then the
# draft's), so the end of one capture is not the end of the phase: warm-up begins with HTTP.
MARKERS: dict[Phase, tuple[str, ...]] = {
    Phase.WEIGHTS: ("Load weight begin",),
    Phase.CUDA_GRAPHS: ("CUDA graph begin", "cuda graph begin"),
    Phase.WARMUP: ("Application startup complete", "Uvicorn running on"),
}


def phase_of_line(line: str) -> Phase | None:
    for phase in reversed(ORDER[1:]):
        if any(m in line for m in MARKERS[phase]):
            return phase
    return None


@dataclass
class Transition:
    ended: Phase  # the phase that just ended
    seconds: float  # how long it lasted (as seen between polls)


@dataclass
class PhaseTracker:
    """Fed each poll's log tail (and whether HTTP answered); says which phases ended."""

    old_lines: frozenset[str] = frozenset()  # the unit's log before the restart
    phase: Phase = Phase.STARTING
    since: float = 0.0  # elapsed seconds (of the wait) when `phase` began

    def update(self, lines: Iterable[str], elapsed: float, http_up: bool = False) -> list[Transition]:
        latest = self.phase
        for line in lines:
            if line in self.old_lines:
                continue
            p = phase_of_line(line)
            if p is not None and ORDER.index(p) > ORDER.index(latest):
                latest = p
        if http_up and ORDER.index(Phase.WARMUP) > ORDER.index(latest):
            latest = Phase.WARMUP
        out: list[Transition] = []
        # Phases passed between two polls end at once (0 s): they happened, briefly.
        for p in ORDER[ORDER.index(self.phase):ORDER.index(latest)]:
            out.append(Transition(p, elapsed - self.since if p == self.phase else 0.0))
        if latest != self.phase:
            self.phase, self.since = latest, elapsed
        return out

    def finish(self, elapsed: float) -> list[Transition]:
        """/health 200: every phase up to the end of warm-up has ended."""
        return [Transition(p, elapsed - self.since if p == self.phase else 0.0)
                for p in ORDER[ORDER.index(self.phase):]]

    def in_phase(self, elapsed: float) -> float:
        return elapsed - self.since
