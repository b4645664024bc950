"""One host, connected: the noun the runbook talks to, the same class in every test tier.

A `HostSession` builds the ways the tool touches a host on top of one `HostLink`: the release
store (files, backups, lock, journal) and the units (systemctl), both as requests to the one
agent process that serves the operation on the host, and HTTP to the server (health,
/generate). The link is the only seam: `SshLink` over SSH, and the fast tier's fake host
(ddtree_ops.testing.fake_host), which answers the same agent requests in-process, serves HTTP
from memory and lets time pass without sleeping. So the real `ReleaseStore` and `Services` run
in every tier. The request router is not part of a session: it has its own client
(gates.router), built where the runbook is built.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Iterator, Protocol

import httpx

from ..config.inventory import Host
from ..errors import HostKeyError, LeaseLost, LockHeldError, RemoteCommandError, UnreachableError, reason
from .channel import AgentChannel
from .first_contact import WindowExceeded, cause, retry_until_reached
from .hooks import NO_HOOKS, Hooks
from .http import http_client
from .release_store import ReleaseStore
from .services import Services
from .transport import HostConnection, is_connection_trouble


class HostLink(Protocol):
    """The lowest seams between the controller and one host."""

    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One request to the host's agent: its result, or RemoteCommandError/UnreachableError."""

    def http_transport(self) -> httpx.BaseTransport | None:
        """How HTTP reaches the host's server (None: the network)."""

    def sleep(self, seconds: float) -> None:
        """Let time pass between two polls of the host."""

    def monotonic(self) -> float:
        """The clock the deadlines of those polls are read on (seconds; only differences count)."""

    def reconnect(self) -> None:
        """A fresh connection in place of a lost one, and a new agent on the next call, which
        takes the lock over from the old one (still waiting out its lease); LeaseLost once the
        lease has run out."""

    def lease_lost(self) -> LeaseLost | None:
        """LeaseLost when this controller's lease on the host's lock is lost (see host/lease.py)."""

    def close(self) -> None:
        """Hang up on the agent (an agent still holding the lock keeps it for the rest of its
        lease) and close the connection."""


class SshLink:
    """The link over SSH: one agent process per operation, started on the first request."""

    def __init__(self, host: Host, conn: HostConnection, hooks: Hooks = NO_HOOKS):
        self.conn = conn
        self.agent = AgentChannel(conn, host, hooks)

    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        return self.agent.call(request, timeout)

    def http_transport(self) -> httpx.BaseTransport | None:
        return None

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def monotonic(self) -> float:
        return time.monotonic()

    def reconnect(self) -> None:
        """Same host-key checks as the first connection; none once the lease is lost (LeaseLost)."""
        self.agent.reset()
        self.conn.reconnect()

    def lease_lost(self) -> LeaseLost | None:
        return self.agent.watch.lost_now()

    def close(self) -> None:
        self.agent.close()
        self.conn.close()


class HostSession:
    def __init__(self, host: Host, link: HostLink, hooks: Hooks = NO_HOOKS):
        self.host, self.link, self.hooks = host, link, hooks
        self.connect_tries = 1  # how many tries the first contact took (open_session)
        self.reconnects = 0  # connections lost during the operation and made again
        self.store = ReleaseStore(link, host)
        self.services = Services(link, host.name, host.secret_files)

    def http(self) -> httpx.Client:
        return http_client(self.host, self.link.http_transport())

    def sleep(self, seconds: float) -> None:
        self.link.sleep(seconds)

    def monotonic(self) -> float:
        return self.link.monotonic()

    def reconnect(self) -> None:
        """A fresh connection and agent, and the operation's lock taken again (LockHeldError if
        another run took it meanwhile, LeaseLost if the lease ran out, HostKeyError for a changed
        key: all final). Whatever else breaks the handshake while the host's sshd comes and goes
        (a bare EOFError or SSHException from Paramiko, a socket error, an agent that did not
        answer its `hello` or its lock request) is UnreachableError naming the cause: worth another
        try."""
        try:
            self.link.reconnect()
            self.store.relock()
            self.reconnects += 1
        except RemoteCommandError as e:
            raise UnreachableError(f"{self.host.name}: reconnected, but the new agent did not answer cleanly: "
                                   f"{reason(e)}") from None
        except (LeaseLost, LockHeldError, HostKeyError, UnreachableError):
            raise
        except Exception as e:
            if not is_connection_trouble(e):
                raise
            raise UnreachableError(f"{self.host.name}: reconnecting failed: {reason(e)}") from None

    def check_lease(self) -> None:
        """LeaseLost when the lease on the host's lock is lost: the host goes its own way, and
        nothing more is sent to it."""
        lost = self.link.lease_lost()
        if lost is not None:
            raise lost

    def close(self) -> None:
        self.link.close()


def reconnect_window_s(host: Host) -> float:
    """How long a lost or failing connection to `host` is retried: the inventory's
    `reconnect_window_s`; DDTREE_OPS_RECONNECT_S in the environment overrides it for every host
    (an operator's one-off, or a test's)."""
    env = os.environ.get("DDTREE_OPS_RECONNECT_S", "").strip()
    return float(env) if env else host.reconnect_window_s


def _open_once(host: Host, accept_new_host_keys: bool, hooks: Hooks) -> HostSession:
    conn = HostConnection(host, accept_new_host_keys=accept_new_host_keys)
    link: SshLink | None = None
    try:
        conn.open()
        link = SshLink(host, conn, hooks)
        link.agent.start()
    except RemoteCommandError as e:  # an agent that did not answer its hello: as on a reconnect
        (link or conn).close()
        raise UnreachableError(f"{host.name}: connected, but the agent did not answer cleanly: {reason(e)}") from None
    except BaseException:
        (link or conn).close()
        raise
    return HostSession(host, link, hooks)


def open_session(host: Host, *, accept_new_host_keys: bool = False, hooks: Hooks = NO_HOOKS,
                 window_s: float | None = None, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic,
                 on_retry: Callable[[BaseException, float], None] | None = None) -> HostSession:
    """The host connected, its agent started: retried with growing pauses within the reconnect
    window (first_contact.py), so a blip before the first change costs nothing. The session's
    `connect_tries` says how many tries it took. Final at once: a changed or unknown host key, a
    repeated authentication refusal, an agent_python that cannot run; after the window,
    WindowExceeded (exit 1) naming it, with nothing changed on the host."""
    window = reconnect_window_s(host) if window_s is None else window_s

    def retrying(e: BaseException, pause: float) -> None:
        hooks.pause("connect-retry")  # a try failed and is to be retried: a test's proof that one did
        if on_retry is not None:
            on_retry(e, pause)

    hooks.pause("before-connect")
    try:
        reached = retry_until_reached(lambda: _open_once(host, accept_new_host_keys, hooks), window_s=window,
                                      sleep=sleep, clock=clock, on_retry=retrying)
    except WindowExceeded as e:
        raise WindowExceeded(f"{host.name}: unreachable: {cause(e.last, host.name)}; tried {e.tries} times over the "
                             f"reconnect window ({window:g} s, `reconnect_window_s` in the inventory); nothing was "
                             f"changed", tries=e.tries, last=e.last) from None
    reached.value.connect_tries = reached.tries
    return reached.value


@contextlib.contextmanager
def session_to(host: Host, *, accept_new_host_keys: bool = False) -> Iterator[HostSession]:
    session = open_session(host, accept_new_host_keys=accept_new_host_keys)
    try:
        yield session
    finally:
        session.close()
