"""An in-memory smg control plane for the fast tier: what `router.SmgRouter` talks to, as smg
1.13.0 answers (see router.py's docstring), behind an httpx.MockTransport. A removed worker
drains for `drain_looks` more lists before it is gone; an added one is ready at once unless
`unhealthy` names it. `events` records every change, in order, for the runbook's tests.
`client()` is the real router client talking to it: the router is its own client, handed to the
runbook beside the host's session, never part of it."""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable

import httpx

from ..config.router_settings import RouterSettings, normalize_url
from ..gates.router import SmgRouter


class FakeSmg:
    def __init__(self, workers: list[str] = (), *, key: str | None = None, drain_looks: int = 5,
                 events: list[str] | None = None):
        self.key = key
        self.drain_looks = drain_looks
        self.workers: dict[str, dict[str, Any]] = {}
        self.draining_left: dict[str, int] = {}
        self.unhealthy: set[str] = set()  # URLs that never become ready once added
        self.down = False  # the router does not answer at all
        self.events: list[str] = [] if events is None else events  # e.g. the fake host's, to see the order
        for url in workers:
            self._new(url)

    def _new(self, url: str) -> str:
        wid = str(uuid.uuid4())
        ready = normalize_url(url) not in self.unhealthy
        self.workers[wid] = {"id": wid, "url": url, "status": "ready" if ready else "not_ready",
                             "is_healthy": ready, "load": 0, "model_id": "stand-in-model"}
        return wid

    def routed(self) -> list[str]:
        """URLs the router sends new requests to."""
        return [w["url"] for w in self.workers.values() if w["status"] == "ready" and w["is_healthy"]]

    def _tick_drains(self) -> None:
        for wid in list(self.draining_left):
            self.draining_left[wid] -= 1
            if self.draining_left[wid] < 0:
                del self.draining_left[wid]
                self.workers.pop(wid, None)

    def handle(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if self.key and request.headers.get("Authorization") != f"Bearer {self.key}":
            return httpx.Response(401, json={"error": "Unauthorized"})
        path = request.url.path.rstrip("/")
        if request.method == "GET" and path == "/workers":
            self._tick_drains()
            items = list(self.workers.values())
            return httpx.Response(200, json={"workers": items, "total": len(items), "stats": {}})
        if request.method == "POST" and path == "/workers":
            url = json.loads(request.content)["url"]
            if any(normalize_url(w["url"]) == normalize_url(url) for w in self.workers.values()):
                return httpx.Response(409, json={"code": "WORKER_ALREADY_EXISTS", "error": f"{url} exists"})
            wid = self._new(url)
            self.events.append(f"register {url}")
            return httpx.Response(202, json={"worker_id": wid, "location": f"/workers/{wid}"})
        if path.startswith("/workers/"):
            wid = path.rsplit("/", 1)[1]
            w = self.workers.get(wid)
            if w is None:
                return httpx.Response(404, json={"error": "not found"})
            if request.method == "GET":
                return httpx.Response(200, json=w)
            if request.method == "DELETE":
                if w["status"] != "draining":
                    w["status"] = "draining"
                    self.draining_left[wid] = self.drain_looks
                    self.events.append(f"deregister {w['url']}")
                return httpx.Response(202, json={"status": "accepted"})
        return httpx.Response(404, json={"error": "no such route"})

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def client(self, settings: RouterSettings, *, sleep: Callable[[float], None] = lambda s: None) -> SmgRouter:
        """`sleep`: what a wait between two looks at the router does (a fake host's `tick`)."""
        return SmgRouter(settings, self.transport(), sleep=sleep)
