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


@dataclass(frozen=True)
class RouterSettings:
    """The router in front of a host (`router:` in the inventory)."""

    kind: str  # "smg"
    url: str  # the router's own URL (its control plane and data plane)
    admin_key_env: str | None  # the variable holding the control-plane key; None: the router takes none
    worker: str  # this host's server as the router knows it (default: the host's base_url)
    timeout_s: float = DEFAULT_TIMEOUT_S  # for register/deregister to be done


ROUTER_FIELDS: tuple[Field, ...] = (
    Field("kind", matching(re.compile(r"^smg$"), "smg (the SGLang Model Gateway; the only kind supported)"),
          "smg"),
    Field("url", http_url(), required="the router's http(s) URL such as http://10.0.0.9:30000"),
    Field("admin_key_env", env_name("the name of the environment variable that holds the router's "
                                    "control-plane key"), None),
    Field("worker", http_url(), None),
    Field("timeout_s", number_range(1, 3600), DEFAULT_TIMEOUT_S),
)


def _settings(value: Any, default_worker: str) -> RouterSettings | None:
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
    return RouterSettings(**values)


def router_field(default_worker_field: str = "base_url") -> Check:
    """The inventory row's validator: the worker URL defaults to the field named (validated
    before it in the same table)."""
    return lambda value, done: _settings(value, done[default_worker_field])


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
