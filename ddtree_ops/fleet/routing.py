"""The request router's client for one target, built where the target's runbook is built and
handed to it: a host session knows nothing of routers."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Callable, ContextManager, Iterator, Sequence

from ..config.inventory import Host
from ..gates.router import SmgRouter
from .policy import Admission, Pool, RolloutPolicy, admit, pool_of, routes

if TYPE_CHECKING:
    from .rollout import Target

# The client of the router in front of a host (None: the inventory names no router), open for
# the duration of the `with` block.
Routers = Callable[[Host], ContextManager["SmgRouter | None"]]


@contextlib.contextmanager
def router_for(host: Host) -> Iterator[SmgRouter | None]:
    if host.router is None:
        yield None
        return
    with SmgRouter(host.router) as router:
        yield router


def read_pools(targets: Sequence[Target], routers: Routers = router_for, *, retry: bool = True) -> dict[str, Pool]:
    """Every router in front of `targets`, read once through the client `routers` builds for the
    first target behind it: the pools `policy.admit` decides on. RouterError when one cannot be
    read: at once without `retry` (as preflight looks: nothing has changed yet), else after its
    router.retry_window_s."""
    first: dict[str, Host] = {}
    for t in targets:
        for r, _ in routes(t):
            first.setdefault(r, t.hosts[0])
    pools: dict[str, Pool] = {}
    for r, host in first.items():
        if not retry and host.router is not None:
            host = dataclasses.replace(host, router=dataclasses.replace(host.router, retry_window_s=0))
        with routers(host) as client:
            if client is None:
                continue
            entries = client.workers()
        pools[r] = pool_of(r, entries)
    return pools


def router_gate(targets: Sequence[Target], policy: RolloutPolicy,
                routers: Routers = router_for) -> Callable[[list[Target]], Admission] | None:
    """What the rollout asks before each batch (None when no target has a router): the routers
    read again, and which of the batch may leave service now."""
    if not any(routes(t) for t in targets):
        return None
    names = {w: t.name for t in targets for _, w in routes(t)}
    looks: list[int] = []

    def gate(batch: list[Target]) -> Admission:
        pools = read_pools(targets, routers, retry=bool(looks))
        looks.append(1)
        return admit(batch, pools, policy, names)
    return gate
