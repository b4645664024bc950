"""The request router's settings as the inventory writes them (`router:`): which router, where,
the variable holding its control-plane key, and this host's worker URL as the router knows it.

Settings only: talking to the router is gates/router.py (`SmgRouter`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..errors import InputError, shown
from .schema import Check, Field, Invalid, env_name, http_url, mapping, matching, number_range

ROUTER_KINDS = ("smg",)
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_RETRY_WINDOW_S = 60.0


@dataclass(frozen=True)
class RouterSettings:
    """The router in front of a host (`router:` in the inventory)."""

    kind: str  # "smg"
    url: str  # the router's own URL (its control plane and data plane)
    admin_key_env: str | None  # the variable holding the control-plane key; None: the router takes none
    worker: str  # this host's server as the router knows it (default: the host's base_url)
    timeout_s: float = DEFAULT_TIMEOUT_S  # for register/deregister to be done
    # How long a router that does not answer (no connection, timeouts, 5xx) is asked again, with
    # backoff, before the operation fails: a router restart does not roll a deploy back. 0: never.
    retry_window_s: float = DEFAULT_RETRY_WINDOW_S


ROUTER_FIELDS: tuple[Field, ...] = (
    Field("kind", matching(re.compile(r"^smg$"), "smg (the SGLang Model Gateway; the only kind supported)"),
          "smg"),
    Field("url", http_url(), required="the router's http(s) URL such as http://10.0.0.9:30000"),
    Field("admin_key_env", env_name("the name of the environment variable that holds the router's "
                                    "control-plane key"), None),
    Field("worker", http_url(), None),
    Field("timeout_s", number_range(1, 3600), DEFAULT_TIMEOUT_S),
    Field("retry_window_s", number_range(0, 3600), DEFAULT_RETRY_WINDOW_S),
)


@dataclass(frozen=True)
class OwnServer:
    """Where this host's own server answers: its base_url, its port, and every name the inventory
    gives the host (address, base_url's host, `aliases`). A worker URL must be one of these."""

    base_url: str
    port: int
    names: frozenset[str]


def _settings(value: Any, default_worker: str, own: OwnServer | None = None) -> RouterSettings | None:
    """`value` (a `router:` mapping, or null: no router) as RouterSettings; Invalid names the
    field inside the mapping ('url', 'kind', ...)."""
    if value is None:
        return None
    values = mapping(ROUTER_FIELDS, value)
    if values["worker"] is None:
        values["worker"] = default_worker
    if normalize_url(values["worker"]) == normalize_url(values["url"]):
        raise Invalid(f"{shown(values['worker'])} is the router's own url: worker is this host's server as the "
                      f"router reaches it (default: the host's base_url)", "worker")
    if own is not None:
        _check_own_worker(values["worker"], own)
    return RouterSettings(**values)


def _check_own_worker(worker: str, own: OwnServer) -> None:
    """The worker is this host's server: deregistering it must take THIS host out of the router
    (a worker set in group vars, or copied from another host, once took an untouched host out and
    left the stopping one routed). Another address of the host is allowed once `aliases` says so."""
    if normalize_url(worker) == normalize_url(own.base_url):
        return
    w, b = urlsplit(worker), urlsplit(own.base_url)
    try:
        w_port = w.port or _DEFAULT_PORTS.get(w.scheme.lower())
        b_port = b.port or _DEFAULT_PORTS.get(b.scheme.lower())
    except ValueError:
        raise Invalid(f"{shown(worker)} has no valid port", "worker") from None
    host = (w.hostname or "").lower()
    if host not in own.names:
        raise Invalid(f"{shown(worker)} is not this host's server: {host} is neither its address nor its "
                      f"base_url's host; if it is another address of this host, list it in the host's `aliases`",
                      "worker")
    if w_port not in (own.port, b_port) or w.path.rstrip("/") != b.path.rstrip("/"):
        raise Invalid(f"{shown(worker)} is not this host's server: it must be {own.base_url} or the same port "
                      f"({own.port}) at another of the host's addresses", "worker")


def own_server(done: dict[str, Any]) -> OwnServer:
    """The host's own server from its fields validated so far (address, port, base_url, aliases)."""
    base = done["base_url"]
    names = {done["address"].lower(), (urlsplit(base).hostname or "").lower(),
             *(a.lower() for a in done.get("aliases") or ())}
    return OwnServer(base, done["port"], frozenset(n.strip("[]") for n in names))


def router_field(default_worker_field: str = "base_url") -> Check:
    """The inventory row's validator: the worker URL defaults to the field named (validated
    before it in the same table) and must be the host's own server (`own_server`)."""
    return lambda value, done: _settings(value, done[default_worker_field], own_server(done))


def parse_router(doc: Any, where: str, default_worker: str) -> RouterSettings | None:
    """A `router:` mapping (None/null: no router) → RouterSettings; InputError naming `where` and
    the field: "WHERE: router.url: must be an http(s) URL such as ..., got ..."."""
    try:
        return _settings(doc, default_worker)
    except Invalid as e:
        field = "router" if e.field is None else f"router.{e.field}"
        raise InputError(f"{where}: {field}: {e.problem}") from None


_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_url(url: str) -> str:
    """A worker URL as compared: scheme and host lower-cased, the default port dropped, no
    trailing '/', no query, fragment or user info. `http://H:80/` → `http://h`."""
    try:
        p = urlsplit(url.strip())
        port = p.port
    except ValueError:
        return url.strip().rstrip("/")
    scheme = p.scheme.lower()
    host = (p.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    if port is not None and port != _DEFAULT_PORTS.get(scheme):
        host += f":{port}"
    return f"{scheme}://{host}{p.path.rstrip('/')}"
