"""The first contact with a host and the reconnect share one rule (fast tier; no network): a
connection that struggles is retried with growing pauses inside the reconnect window; a changed
or unknown host key, an authentication refusal that repeats and anything that is not connection
trouble end it at once; after the window, exit 1 naming it. The same on real hosts:
tests/test_ssh_blips.py."""

from __future__ import annotations

import errno

import paramiko
import pytest

from ddtree_ops.config.inventory import parse_inventory
from ddtree_ops.errors import (
    EXIT_ERROR,
    AuthRefused,
    HostKeyError,
    InventoryError,
    LockHeldError,
    PreflightError,
    UnreachableError,
)
from ddtree_ops.host import session as session_mod
from ddtree_ops.host.first_contact import MAX_PAUSE_S, WindowExceeded, retry_until_reached
from ddtree_ops.host.transport import HostConnection


class Clock:
    """A clock that only sleeps move."""

    def __init__(self):
        self.t, self.sleeps = 100.0, []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s

    def __call__(self) -> float:
        return self.t


def failing(troubles: list[BaseException], value: str = "session"):
    """An attempt that raises each of `troubles` in turn, then returns `value`; its calls counted."""
    calls = []

    def attempt():
        calls.append(1)
        if troubles:
            raise troubles.pop(0)
        return value
    return attempt, calls


HANDSHAKE = [EOFError(), paramiko.SSHException(), ConnectionResetError(errno.ECONNRESET, "reset by peer"),
             ConnectionRefusedError(errno.ECONNREFUSED, "refused"), UnreachableError("h1: connection lost")]


def test_a_blip_is_ridden_out_with_growing_pauses_and_the_tries_counted():
    clock = Clock()
    attempt, calls = failing(list(HANDSHAKE))
    got = retry_until_reached(attempt, window_s=60, sleep=clock.sleep, clock=clock)
    assert got.value == "session" and got.tries == len(HANDSHAKE) + 1 == len(calls)
    assert clock.sleeps == [0.5, 1.0, 2.0, 4.0, 4.0] and MAX_PAUSE_S == 4.0
    assert got.seconds == pytest.approx(sum(clock.sleeps))


def test_the_first_try_that_answers_costs_no_pause():
    clock = Clock()
    got = retry_until_reached(lambda: 7, window_s=60, sleep=clock.sleep, clock=clock)
    assert (got.value, got.tries, clock.sleeps) == (7, 1, [])


def test_an_outage_longer_than_the_window_ends_after_it_naming_the_window_the_tries_and_the_cause():
    clock = Clock()
    attempt, calls = failing([EOFError() for _ in range(100)])
    with pytest.raises(WindowExceeded) as ei:
        retry_until_reached(attempt, window_s=10, sleep=clock.sleep, clock=clock)
    assert ei.value.exit_code == EXIT_ERROR and ei.value.tries == len(calls)
    assert "EOFError" in str(ei.value) and "kept retrying for 10 s" in str(ei.value)
    assert "reconnect_window_s" in str(ei.value)
    assert clock.t - 100.0 == pytest.approx(10.0)  # never slept past the window's end
    assert 4 <= len(calls) <= 7


@pytest.mark.parametrize("final", [
    HostKeyError("h1: the host key of 10.0.0.1 has CHANGED"),
    HostKeyError("h1: 10.0.0.1 is not in known_hosts (unknown host key)"),
    LockHeldError("h1: the deploy lock is held by alice"),
    PreflightError("h1", "agent_python /nope cannot be run on the host"),
    ValueError("a bug is not an outage"),
])
def test_a_final_answer_is_not_retried(final):
    clock = Clock()
    attempt, calls = failing([EOFError(), final, EOFError()])
    with pytest.raises(type(final)):
        retry_until_reached(attempt, window_s=60, sleep=clock.sleep, clock=clock)
    assert len(calls) == 2 and clock.sleeps == [0.5]


def test_an_authentication_refusal_is_tried_once_more_then_final():
    clock = Clock()
    once, calls = failing([AuthRefused("h1: SSH authentication failed"), EOFError()])
    assert retry_until_reached(once, window_s=60, sleep=clock.sleep, clock=clock).tries == 3
    twice, calls = failing([AuthRefused("h1: refused"), AuthRefused("h1: refused"), EOFError()])
    with pytest.raises(AuthRefused, match="refused 2 times in a row"):
        retry_until_reached(twice, window_s=60, sleep=clock.sleep, clock=clock)
    assert len(calls) == 2
    # Not in a row: a refusal, a lost connection, a refusal: still retried.
    apart, calls = failing([AuthRefused("h1: refused"), EOFError(), AuthRefused("h1: refused")])
    assert retry_until_reached(apart, window_s=60, sleep=clock.sleep, clock=clock).tries == 4


def _host(tmp_path, **vars):
    kh = tmp_path / "known_hosts"
    kh.touch()
    (tmp_path / "id").touch()
    doc = {"all": {"hosts": {"h1": {
        "address": "127.0.0.1", "known_hosts": str(kh), "identity_file": str(tmp_path / "id"),
        "python": "/opt/v/bin/python", "site_packages": "/opt/v/lib/python3.12/site-packages", "model_path": "/m",
        "draft_model_path": "/d", **vars}}}}
    return parse_inventory(doc, "inv.yaml").host("h1")


def test_open_session_retries_within_the_inventorys_window_and_says_so(tmp_path, monkeypatch):
    monkeypatch.delenv("DDTREE_OPS_RECONNECT_S", raising=False)
    host = _host(tmp_path, reconnect_window_s=5)
    clock = Clock()
    tries = []

    class Opened:
        connect_tries = 0

    def open_once(h, accept_new, hooks):
        tries.append(h.name)
        if len(tries) < 3:
            raise UnreachableError(f"{h.name}: cannot reach 127.0.0.1:22: Connection refused")
        return Opened()

    monkeypatch.setattr(session_mod, "_open_once", open_once)
    s = session_mod.open_session(host, sleep=clock.sleep, clock=clock)
    assert s.connect_tries == 3 == len(tries)

    def never(h, accept_new, hooks):
        raise UnreachableError(f"{h.name}: cannot reach 127.0.0.1:22: refused")

    monkeypatch.setattr(session_mod, "_open_once", never)
    with pytest.raises(WindowExceeded) as ei:
        session_mod.open_session(host, sleep=clock.sleep, clock=clock)
    msg = str(ei.value)
    assert msg.startswith("h1: unreachable: cannot reach 127.0.0.1:22: refused; tried ") and "h1: cannot" not in msg
    assert "reconnect window (5 s, `reconnect_window_s` in the inventory); nothing was changed" in msg
    monkeypatch.setenv("DDTREE_OPS_RECONNECT_S", "2")  # the environment overrides every host's window
    with pytest.raises(WindowExceeded, match=r"reconnect window \(2 s"):
        session_mod.open_session(host, sleep=clock.sleep, clock=clock)


def test_each_retried_try_reaches_the_connect_retry_point_and_the_callers_hook(tmp_path, monkeypatch):
    """The sandbox tests time an outage from the first refused try through this point, not from the
    CLI's start; the caller's on_retry still hears each retry, after the point."""
    from ddtree_ops.host.hooks import Hooks

    monkeypatch.delenv("DDTREE_OPS_RECONNECT_S", raising=False)
    heard: list[str] = []

    class Recording(Hooks):
        def pause(self, point: str) -> None:
            heard.append(point)

    class Opened:
        connect_tries = 0

    tries = []

    def open_once(h, accept_new, hooks):
        tries.append(1)
        heard.append("try")
        if len(tries) < 3:
            raise UnreachableError(f"{h.name}: cannot reach 127.0.0.1:22: Connection refused")
        return Opened()

    monkeypatch.setattr(session_mod, "_open_once", open_once)
    clock = Clock()
    session_mod.open_session(_host(tmp_path, reconnect_window_s=5), hooks=Recording(), sleep=clock.sleep, clock=clock,
                             on_retry=lambda e, pause: heard.append(f"on_retry {pause:g}"))
    assert heard == ["before-connect", "try", "connect-retry", "on_retry 0.5", "try", "connect-retry", "on_retry 1",
                     "try"]


def test_the_window_is_an_inventory_field_with_a_range(tmp_path):
    assert _host(tmp_path).reconnect_window_s == 60
    assert _host(tmp_path, reconnect_window_s=0.5).reconnect_window_s == 0.5
    for bad in (-1, 3601, "soon"):
        with pytest.raises(InventoryError, match="reconnect_window_s"):
            _host(tmp_path, reconnect_window_s=bad)


@pytest.mark.parametrize("text, refused", [
    ("Authentication failed.", True),
    ("Authentication failed: transport shut down or saw EOF", False),  # the connection ended it
])
def test_an_authentication_ended_by_a_lost_connection_is_not_a_refusal(tmp_path, text, refused):
    conn = HostConnection(_host(tmp_path))

    def fake_connect(**kwargs):
        raise paramiko.AuthenticationException(text)

    conn._client.connect = fake_connect
    with pytest.raises(UnreachableError) as ei:
        conn.open()
    assert isinstance(ei.value, AuthRefused) is refused, ei.value
