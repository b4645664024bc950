"""The server's own figures, read before a host's change and after it, so the report shows accept
length and tok/s before → after without the performance gate: two cheap reads of what the server
already publishes, no workload of our own. `/server_info`'s `avg_spec_accept_length` (the
running average of the server that answers) and, when the server runs with metrics on,
`/metrics`' `sglang:gen_throughput` gauge (tokens/s over its last logging interval, summed over
its schedulers): with no traffic it is 0, and the report shows what was read, as read."""

from __future__ import annotations

import math
from typing import Any

import httpx

from ..host.session import HostSession

READ_TIMEOUT_S = 2.0
THROUGHPUT = "sglang:gen_throughput"


def _accept_length(c: httpx.Client) -> float | None:
    try:
        states = c.get("/server_info", timeout=READ_TIMEOUT_S).json().get("internal_states") or [{}]
        v = states[0].get("avg_spec_accept_length")
        return float(v) if v is not None and math.isfinite(float(v)) else None
    except (httpx.HTTPError, ValueError, AttributeError, TypeError, IndexError):
        return None


def throughput(text: str) -> float | None:
    """`sglang:gen_throughput`'s samples summed (one per scheduler), or None without any."""
    values = []
    for line in text.splitlines():
        if line.startswith(THROUGHPUT) and line[len(THROUGHPUT):len(THROUGHPUT) + 1] in ("{", " "):
            try:
                values.append(float(line.rsplit(" ", 1)[1]))
            except (ValueError, IndexError):
                continue
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) if finite else None


def _output_tps(c: httpx.Client) -> float | None:
    try:
        r = c.get("/metrics", timeout=READ_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    return throughput(r.text[:1_000_000]) if r.status_code == 200 else None


def read_serving(session: HostSession) -> dict[str, Any] | None:
    """{accept_length, output_tps} of the server on the host now (None for what it does not say);
    None when nothing answers. Never raises: a figure for the report, not a gate."""
    if session.host.node_rank >= 1:
        return None
    try:
        with session.http() as c:
            sample = {"accept_length": _accept_length(c), "output_tps": _output_tps(c)}
    except Exception:  # noqa: BLE001 - a missing figure must not fail a deploy
        return None
    return sample if any(v is not None for v in sample.values()) else None


def before_after(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """The host result's `serving` document, or None when neither read found anything."""
    if before is None and after is None:
        return None
    return {"before": before, "after": after, "source": "server (/server_info, /metrics)"}
