"""HTTP to a host's SGLang server: the client every check, gate and measurement of it uses.

The server's API key comes from the operator's environment (the variable `api_key_env` names);
the server itself reads it from secrets_config on the host. The TLS context is the run's one
(tls.py). Every request is bounded (bounded_http.py): its timeout is the deadline for the whole
answer, and its body is capped. The request router has its own client (gates.router), not this
one, bounded the same way.
"""

from __future__ import annotations

import httpx

from ..config.inventory import Host
from ..config.secrets import api_key
from .bounded_http import IDENTITY, bounded_transport
from .tls import tls_context


def http_client(host: Host, transport: httpx.BaseTransport | None = None) -> httpx.Client:
    """A client for the host's server. `transport`: None for the network; a fake host passes its
    httpx.MockTransport."""
    return url_client(host.base_url, key=api_key(host), timeout=host.health.request_timeout_s,
                      transport=transport)


def url_client(base_url: str, *, key: str | None = None, timeout: float,
               transport: httpx.BaseTransport | None = None) -> httpx.Client:
    """A client for the server at `base_url`, known by its URL alone (`ddtree-ops gate`, which
    compares servers no inventory lists), bounded as every client is; `key`: the server's API
    key. Redirects are not followed: the gate service checks each URL against its allow list, and
    a redirect would lead past it."""
    headers = dict(IDENTITY)
    if key:
        headers["Authorization"] = "Bearer " + key
    return httpx.Client(base_url=base_url, timeout=timeout, headers=headers, trust_env=False,
                        follow_redirects=False, transport=bounded_transport(transport, tls_context))
