"""One line on the request routers in front of a rollout's targets, for the live view: how many of
each router's workers are ready (routed to) now. Read in the view's own thread, never the rollout's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from ..errors import reason
from .policy import Pool, routes
from .routing import Routers, read_pools, router_for

if TYPE_CHECKING:
    from .rollout import Target


def pool_line(pools: Mapping[str, Pool]) -> str:
    """`router URL: 2 of 3 workers ready` per router."""
    return "; ".join(f"router {r}: {len(p.ready)} of {len(p.workers)} workers ready" for r, p in pools.items())


def pool_reader(targets: Sequence[Target], routers: Routers = router_for) -> Callable[[], str] | None:
    """A function giving the routers' line now (what went wrong, when one cannot be read); None
    when no target is behind a router."""
    if not any(routes(t) for t in targets):
        return None

    def read() -> str:
        try:
            return pool_line(read_pools(targets, routers))
        except Exception as e:  # the view says it; the rollout's own reads decide what happens
            return f"router pool not readable: {reason(e)}"
    return read
