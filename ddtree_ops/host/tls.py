"""The one verifying TLS context of a run (the servers' and the router's clients share it)."""

from __future__ import annotations

import functools
import ssl


@functools.lru_cache(maxsize=1)
def tls_context() -> ssl.SSLContext:
    """httpx would build a context per client, loading the CA bundle each time (about 0.1 s of
    CPU: most of the controller's CPU in a fleet deploy)."""
    import certifi

    return ssl.create_default_context(cafile=certifi.where())
