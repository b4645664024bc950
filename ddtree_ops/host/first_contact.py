"""Reaching a host again and again until it answers, within the reconnect window.

One rule for every place a run (re)connects: the first contact of deploy, promote, rollback, plan,
status and logs (TCP connect, SSH handshake, channel open, the agent's start and hello), and the
reconnect after a connection lost mid-run (Runbook.reconnecting). A blip (sshd restarting, every
session killed for a moment, a network hiccup) costs a few seconds of growing pauses instead of the
host's row; only an answer that another try cannot change ends it at once:

- a changed or unknown host key (HostKeyError): retrying would be trusting an attacker;
- an authentication refusal that repeats (AuthRefused twice in a row): one refusal may be an sshd
  that is half up, two are a wrong key;
- anything that is not connection trouble (transport.is_connection_trouble): a lock another run
  holds, a lost lease, an agent_python that cannot run, a step the host refused.

After `window_s` seconds of trouble, WindowExceeded (an UnreachableError, exit 1) names the window,
the tries and the last cause.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from ..errors import AuthRefused, UnreachableError, reason
from .transport import is_connection_trouble

T = TypeVar("T")

# The pauses between two tries: short at first (a blip), growing (an sshd that keeps failing).
FIRST_PAUSE_S = 0.5
MAX_PAUSE_S = 4.0


class WindowExceeded(UnreachableError):
    """The host stayed unreachable for the whole reconnect window."""

    def __init__(self, message: str, *, tries: int, last: BaseException):
        super().__init__(message)
        self.tries, self.last = tries, last


@dataclass(frozen=True)
class Reached(Generic[T]):
    value: T
    tries: int  # 1: the first try answered
    seconds: float


def retry_until_reached(attempt: Callable[[], T], *, window_s: float, sleep: Callable[[float], None],
                        clock: Callable[[], float], first_pause_s: float = FIRST_PAUSE_S,
                        on_retry: Callable[[BaseException, float], None] | None = None) -> Reached[T]:
    """`attempt()` until it returns, while what it raises is connection trouble and `window_s`
    seconds have not passed since the first try; pauses of `first_pause_s`, doubling up to
    MAX_PAUSE_S, never past the window's end. `on_retry(cause, pause)` hears each failed try that
    is retried. Raises what `attempt` raised when that is final, or WindowExceeded."""
    start = clock()
    deadline = start + window_s
    pause, tries, refusals = first_pause_s, 0, 0
    while True:
        tries += 1
        try:
            return Reached(attempt(), tries, clock() - start)
        except Exception as e:
            if not is_connection_trouble(e):
                raise
            refusals = refusals + 1 if isinstance(e, AuthRefused) else 0
            if refusals >= 2:
                raise AuthRefused(f"{reason(e)} (refused {refusals} times in a row; not retried further)") from None
            left = deadline - clock()
            if left <= 0:
                raise WindowExceeded(f"{reason(e)} (kept retrying for {window_s:g} s, the reconnect window "
                                     f"`reconnect_window_s`; {tries} tries)", tries=tries, last=e) from None
            wait = max(min(pause, left), 0.05)
            if on_retry is not None:
                on_retry(e, wait)
            sleep(wait)
            pause = min(pause * 2, MAX_PAUSE_S)


def cause(exc: BaseException, host: str) -> str:
    """What `exc` says, without the host's name in front (the message around it names the host)."""
    text = reason(exc)
    return text[len(host) + 2:] if text.startswith(f"{host}: ") else text
