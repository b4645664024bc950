"""The request router's client for one target, built where the target's runbook is built and
handed to it: a host session knows nothing of routers."""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator

from ..config.inventory import Host
from ..gates.router import SmgRouter

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
