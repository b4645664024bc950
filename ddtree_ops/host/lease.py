"""The controller's side of the lock's lease (the agent's side: host/agent/lease.py).

The agent keeps the deploy lock while it hears from its controller at least every `lease_s`
(inventory `lock_lease_s`); `Heartbeat` renews it every `renew_s` (`lock_renew_s`) while the
runbook makes no agent call of its own (a drain, the perf gate, router waits, a long /generate).
`LeaseWatch` is this controller's conservative view of it: renewed when an answer comes back (as
of the request's sending plus the time the agent worked on it, so an answer read after a SIGSTOP
renews nothing past its sending), and lost once no answer came for `lease_s`. That happens when
this process was stopped (SIGSTOP, a suspended laptop) or cut off from the host that long; the
agent has then let the lock go (and the host healed itself), so every later call fails at once
with LeaseLost (exit 4) and nothing more is sent to the host.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import LeaseLost


def lease_clock() -> float:
    """A clock that keeps counting while the controller's machine is suspended."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@dataclass
class LeaseWatch:
    host: str
    lease_s: float
    renew_s: float
    clock: Callable[[], float] = lease_clock
    renewed_at: float | None = None  # the agent's last renewal, at the earliest (None: no agent yet)
    step: str | None = None  # the journal's step as this run last wrote it
    lost: LeaseLost | None = None

    def answered(self, at: float | None = None) -> None:
        """The agent renewed its lease no earlier than `at` on this clock (None: now), never later
        than now: an answer read late (this process stopped while it was on its way) renews
        nothing beyond the time it was sent."""
        now = self.clock()
        t = now if at is None else min(at, now)
        self.renewed_at = t if self.renewed_at is None else max(self.renewed_at, t)

    def idle_s(self) -> float:
        return 0.0 if self.renewed_at is None else self.clock() - self.renewed_at

    def due(self) -> bool:
        return self.renewed_at is not None and self.idle_s() >= self.renew_s

    def left_s(self) -> float:
        return self.lease_s - self.idle_s()

    def check(self) -> None:
        """LeaseLost when the lease is lost, or has run out just now (then it is lost for good)."""
        if self.lost is None and self.renewed_at is not None and self.idle_s() >= self.lease_s:
            self.lose(f"no answer from the host's agent for {self.idle_s():.0f} s")
        if self.lost is not None:
            raise self.lost

    def lost_now(self) -> LeaseLost | None:
        """LeaseLost if the lease is lost (or has just run out), else None."""
        try:
            self.check()
        except LeaseLost as e:
            return e
        return None

    def lose(self, why: str, holder: dict[str, Any] | None = None) -> LeaseLost:
        if self.lost is None:
            self.lost = LeaseLost(lease_lost_message(self.host, self.lease_s, self.step, why, holder))
        return self.lost

    def journal_sent(self, request: dict[str, Any]) -> None:
        """Follow the step the run records in the host's journal (the message names it)."""
        if request.get("op") == "journal":
            self.step = None if request.get("clear") else (request.get("journal") or {}).get("step")


def lease_lost_message(host: str, lease_s: float, step: str | None, why: str,
                       holder: dict[str, Any] | None = None) -> str:
    at = (holder or {}).get("lost_at_step") or step
    where = f"at step {at!r}" if at else "before this run changed anything"
    return (f"{host}: the deploy lock's lease expired {where}: this controller was stopped or cut off from the host "
            f"for more than {lease_s:g} s (lock_lease_s; {why}). {_what_the_host_did(holder)} This run does nothing "
            f"more to the host; run `ddtree-ops status --limit {host}` to see its state.")


def _what_the_host_did(holder: dict[str, Any] | None) -> str:
    if not holder or not holder.get("lease_expired"):
        return "The host rolls itself back if this run had changed it, or is left as it was."
    if holder.get("healing"):  # the agent that lost the lease still holds the lock while it heals
        return ("The host's agent is healing it now: it undoes what this run changed, if anything, and then "
                "lets the lock go.")
    heal = holder.get("heal")
    if heal is None:
        return "The host had nothing to undo and was left as it was."
    if heal.get("healed"):
        return f"The host rolled itself back (to {heal.get('previous') or 'its previous state'})."
    return f"The host tried to roll itself back and could not ({heal.get('error')}); a person must look."


@dataclass
class Heartbeat:
    """A thread that calls `beat` every `tick_s` until `beat` says stop or `stop()` is called."""

    beat: Callable[[], bool]
    tick_s: float
    name: str = "lease heartbeat"
    _stopped: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.tick_s):
            if not self.beat():
                return

    def stop(self) -> None:
        self._stopped.set()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
