"""`status --watch`: one round of status every `interval` seconds until Ctrl-C.

On a terminal each round redraws the screen; piped or in CI (no TTY) each round is one more
block, headed by its time, so a log keeps every round. The exit code is the last finished
round's (Ctrl-C between or during rounds), so a script sees the fleet as it was last seen."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import InputError

DEFAULT_INTERVAL_S = 5.0
MIN_INTERVAL_S = 0.5
MAX_INTERVAL_S = 86_400.0
CLEAR_SCREEN = "\x1b[H\x1b[2J"


def check_interval(interval_s: float) -> float:
    if not MIN_INTERVAL_S <= interval_s <= MAX_INTERVAL_S:
        raise InputError(f"--interval {interval_s:g}: give {MIN_INTERVAL_S:g}..{MAX_INTERVAL_S:g} seconds")
    return interval_s


@dataclass
class Watch:
    """The loop, its clock and output injectable (a test runs rounds without waiting)."""

    interval_s: float
    tty: bool
    write: Callable[[str], object] = lambda text: sys.stdout.write(text)  # the stdout of the moment
    wait: Callable[[float], object] = time.sleep
    now: Callable[[], float] = time.time
    rounds: Optional[int] = None  # stop after this many (None: until Ctrl-C)
    headed: bool = True  # False: rounds only (--json: one document per round, nothing between)

    def header(self) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.now()))
        if self.tty:
            return f"{CLEAR_SCREEN}status at {stamp}, every {self.interval_s:g} s (Ctrl-C to stop)\n"
        return f"== status at {stamp} ==\n"

    def run(self, one_round: Callable[[], int]) -> int:
        """Rounds until Ctrl-C; the last finished round's exit code. An interrupt before any round
        finished propagates (the command then exits as any interrupted one does)."""
        last: Optional[int] = None
        done = 0
        try:
            while self.rounds is None or done < self.rounds:
                if self.headed:
                    self.write(self.header())
                last = one_round()
                done += 1
                sys.stdout.flush()
                if self.rounds is None or done < self.rounds:
                    self.wait(self.interval_s)
        except KeyboardInterrupt:
            if last is None:
                raise
        return last if last is not None else 0
