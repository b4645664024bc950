"""The secret values the controller holds, read from the operator's environment by the variable
names the inventory gives (the inventory itself never holds a secret): the server's API key
(`api_key_env`) and the router's control-plane key (`router.admin_key_env`). `known_secrets` is
what every message, log line and record is scrubbed of (redaction.scrub)."""

from __future__ import annotations

import os

from .inventory import Host
from .router_settings import RouterSettings


def api_key(host: Host) -> str | None:
    """The server's API key as the controller knows it, or None."""
    return (os.environ.get(host.api_key_env) or None) if host.api_key_env else None


def router_secrets(settings: RouterSettings | None) -> tuple[str, ...]:
    """The control-plane key the controller holds for `settings`, or nothing."""
    if settings is None or not settings.admin_key_env:
        return ()
    key = os.environ.get(settings.admin_key_env)
    return (key,) if key else ()


def known_secrets(host: Host) -> tuple[str, ...]:
    """Every secret value the controller holds for `host`: the server's API key and the router's
    control-plane key."""
    key = api_key(host)
    return ((key,) if key else ()) + router_secrets(host.router)
