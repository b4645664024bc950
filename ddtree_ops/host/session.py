"""One host, connected: the noun the runbook talks to.

A `HostSession` delegates to the three ways the tool touches a host: the release store (files,
backups, lock, journal) and the units (systemctl), both through the one agent process that serves
the operation on the host, and HTTP to the server (health, /generate). A fake host
(ddtree_ops.testing.fake_host) offers the same attributes in memory, so the runbook's order of
steps and its rollbacks are tested without hosts.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import httpx

from ..config.inventory import Host
from ..gates.health import http_client
from ..gates.router import SmgRouter
from .release_store import AgentChannel, ReleaseStore
from .services import Services
from .transport import HostConnection


class HostSession:
    def __init__(self, host: Host, conn: HostConnection):
        self.host, self.conn = host, conn
        self.agent = AgentChannel(conn, host)
        self.store = ReleaseStore(self.agent, host)
        self.services = Services(self.agent, host.name, host.secret_files)
        self._router: SmgRouter | None = None

    def http(self) -> httpx.Client:
        return http_client(self.host)

    def router(self) -> SmgRouter | None:
        """The request router in front of this host (inventory `router:`), or None."""
        if self.host.router is not None and self._router is None:
            self._router = SmgRouter(self.host.router)
        return self._router

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def reconnect(self) -> None:
        """A fresh SSH connection in place of a lost one (same host-key checks), a new agent, and
        the operation's lock taken again (LockHeldError if another run took it meanwhile)."""
        self.agent.reset()
        self.conn.reconnect()
        self.store.relock()

    def close(self) -> None:
        if self._router is not None:
            self._router.close()
        self.agent.close()
        self.conn.close()


def open_session(host: Host, *, accept_new_host_keys: bool = False) -> HostSession:
    conn = HostConnection(host, accept_new_host_keys=accept_new_host_keys)
    conn.open()
    return HostSession(host, conn)


@contextlib.contextmanager
def session_to(host: Host, *, accept_new_host_keys: bool = False) -> Iterator[HostSession]:
    session = open_session(host, accept_new_host_keys=accept_new_host_keys)
    try:
        yield session
    finally:
        session.close()
