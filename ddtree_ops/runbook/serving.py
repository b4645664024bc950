"""Where a host's server serves: the base URL its checks use and its worker URL in the router.

Today's inventory says where the NEW release will serve. A deploy that changes the port (or one
whose new port the launch check refuses) leaves the OLD server serving where it always did, so
the drain before its stop, the deregistration, and every check and registration of the rollback
must go to the old address. `begin` records it in the journal (and the release record keeps it),
read from the `--port` of the file of the unit serving now (ours, or the conflicting unit it
replaces): that is the line systemd started the running server with, under our lock nothing has
changed it since, and it exists also on a host no release of this tool ever touched (a previous
release record would not; the running process's argv would need /proc and the same parse).
Without a serving unit or a `--port` in its ExecStart, the server is taken to serve where the
inventory says. One address per host: the unit that served before is the one the rollback
brings back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from ..artifacts.units import exec_start_words
from ..config.inventory import Host
from ..host.http import http_client

JOURNAL_KEY = "serve_before"  # in the journal and the release record: where the old server serves
UNIT_DIR = "/etc/systemd/system"  # where a conflicting unit's file is read from (ours: host.unit_path)


@dataclass(frozen=True)
class ServingAt:
    """A server's address: `base_url` for its health checks, `worker` for the router (None: no
    router in front)."""

    base_url: str
    worker: str | None

    def record(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "worker": self.worker}


def today(host: Host) -> ServingAt:
    """Where the inventory says the host's server serves (the new release)."""
    return ServingAt(host.base_url, host.router.worker if host.router else None)


def unit_port(unit_text: str | None) -> int | None:
    """The `--port` of a unit's ExecStart (`--port N` or `--port=N`); None without one."""
    words = exec_start_words(unit_text or "") or []
    for i, w in enumerate(words):
        value = words[i + 1] if w == "--port" and i + 1 < len(words) else (
            w[len("--port="):] if w.startswith("--port=") else None)
        if value is not None and value.isdigit() and 0 < int(value) < 65536:
            return int(value)
    return None


def moved(url: str, from_port: int, to_port: int) -> str:
    """`url` with its port `from_port` made `to_port`; a URL on another port (a proxy in front of
    the server, say) is left as it is."""
    try:
        p = urlsplit(url)
        port = p.port
    except ValueError:
        return url
    if port != from_port or p.hostname is None:
        return url
    host = f"[{p.hostname}]" if ":" in p.hostname else p.hostname
    return urlunsplit((p.scheme, f"{host}:{to_port}", p.path, p.query, p.fragment))


def before_deploy(host: Host, unit_text: str | None) -> ServingAt:
    """Where the server that runs now serves, from `unit_text` (the file of the unit serving now,
    ours or a conflicting one; None: nothing serves): today's addresses, moved to its port when its
    ExecStart names another port than the inventory's."""
    now = today(host)
    port = unit_port(unit_text)
    if port is None or port == host.port:
        return now
    return ServingAt(moved(now.base_url, host.port, port),
                     None if now.worker is None else moved(now.worker, host.port, port))


def from_record(host: Host, record: Any) -> ServingAt:
    """The address a journal or release record kept (`serve_before`); today's when it kept none
    (written by an older version) or kept something that is not a pair of http(s) URLs."""
    now = today(host)
    if not isinstance(record, dict) or not _is_url(record.get("base_url")):
        return now
    worker = record.get("worker")
    if now.worker is None:  # no router in front today: nothing to route
        return ServingAt(record["base_url"], None)
    return ServingAt(record["base_url"], worker if _is_url(worker) else now.worker)


def _is_url(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(("http://", "https://")) and len(value) < 2048


class ServerAt:
    """A host session whose HTTP goes to `at.base_url` (what the health checks and the drain
    need of a session: its units, HTTP, time)."""

    def __init__(self, session: Any, at: ServingAt):
        self._session = session
        self.host = replace(session.host, base_url=at.base_url)
        self.services = session.services

    def http(self) -> httpx.Client:
        return http_client(self.host, self._session.link.http_transport())

    def sleep(self, seconds: float) -> None:
        self._session.sleep(seconds)

    def monotonic(self) -> float:
        return self._session.monotonic()


def server_at(session: Any, at: ServingAt | None) -> Any:
    """`session` itself when `at` is where it already points, else a view of it at `at`."""
    if at is None or at.base_url == session.host.base_url:
        return session
    return ServerAt(session, at)
