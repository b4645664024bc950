"""Taking a host out of the request router in front of the fleet, and putting it back.

Operators front the SGLang servers with the SGLang Model Gateway (`smg launch --worker-urls
URL... --control-plane-api-keys ID:NAME:admin:KEY`, PyPI `smg`, here 1.13.0). Its control plane,
as 1.13.0 really behaves (measured against a running smg and stand-in servers):

    GET    /workers        {"workers": [{"id": UUID, "url", "status", "is_healthy", "load",
                            "model_id", ...}], "total", "stats"}: the registered workers only
                            (a worker still being added is not listed). `status` is pending,
                            ready, not_ready, failed or draining; smg's policies pick only workers
                            that are ready and healthy (and whose circuit breaker is closed).
    GET    /workers/{id}   one worker (404 when gone); a worker still being added shows
                            status "pending" and a `job_status` {"status": processing|failed,
                            "message"}. The id must be a UUID: 400 otherwise.
    POST   /workers        {"url": URL} → 202 {"worker_id", "location", ...}: added in the
                            background. smg probes /health, then discovers the model from
                            /v1/models, /server_info and /model_info (an SGLang server needs no
                            more); a healthy server is ready within about 0.2 s. One that is not
                            up yet stays pending and is retried every --worker-startup-check-interval
                            (30 s by default) until --worker-startup-timeout-secs (1800).
                            409 WORKER_ALREADY_EXISTS (registered) or WORKER_CREATE_IN_PROGRESS
                            (being added; the message names its id). URLs are compared as
                            strings: `http://h:1/` is a second worker beside `http://h:1`, and smg
                            then sends it `//generate`.
    DELETE /workers/{id}   202 at once: the worker turns `draining` (no new requests) and stays
                            listed for its drain window (5 s; `health.drain_settle_secs` of the
                            worker), then is removed. It does not wait for the requests in flight,
                            and those still complete after the removal (smg proxies them to the
                            end). A second DELETE of a draining worker removes it at once.

Every call carries `Authorization: Bearer KEY` (401 without or with a wrong one), the key read
from the operator's environment variable named by `admin_key_env`; it is never logged or put in a
message. `SmgRouter` turns that into `deregister` (returns once smg no longer routes to the
worker), `register` (returns once smg lists it ready and healthy, i.e. routes to it) and
`is_registered`; worker URLs are matched after normalisation (case, default port, trailing '/').
The `router:` settings and that normalisation are config/router_settings.py.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import httpx

from ..config.router_settings import ROUTER_KINDS, RouterSettings, normalize_url
from ..errors import DdtreeOpsError, InputError, shown
from ..host.bounded_http import IDENTITY, BodyTooLarge, DeadlineExceeded, bounded_transport
from ..host.tls import tls_context


class RouterError(DdtreeOpsError):
    """The request router refused or did not finish an operation (API error, unreachable, the
    worker not ready or not drained in time). Exit 1: the router's state is reported, nothing
    is guessed."""


class RouterUnavailable(RouterError):
    """One request found the router down or failing (no connection, a timeout, a 5xx answer):
    worth asking again, within router.retry_window_s. A 4xx (a wrong key included) is final."""


# ------------------------------------------------------------------------------------------------
# the client

_T = TypeVar("_T")


def backoff_s(tries: int) -> float:
    """The pause after the `tries`-th failed request in a row: 0.5 s, doubling, at most 5 s."""
    return min(5.0, 0.5 * 2 ** (tries - 1))


_UUID_RE = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


@dataclass(frozen=True)
class WorkerEntry:
    """One worker as the router lists it."""

    id: str
    url: str
    status: str  # pending, ready, not_ready, failed, draining
    healthy: bool
    load: int | None = None
    model_id: str | None = None

    @property
    def routable(self) -> bool:
        """smg sends new requests to it (its policies pick ready, healthy workers only)."""
        return self.status == "ready" and self.healthy

    @property
    def draining(self) -> bool:
        return self.status == "draining"


class SmgRouter:
    """The control plane of one smg router. `transport` is the seam for httpx.MockTransport;
    `sleep`/`clock` let tests run the waits without waiting."""

    def __init__(self, settings: RouterSettings, transport: httpx.BaseTransport | None = None, *,
                 poll_interval_s: float = 0.1, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic):
        if settings.kind not in ROUTER_KINDS:
            raise InputError(f"router.kind: {settings.kind!r} is not supported (only smg)")
        self.settings = settings
        self._transport = transport
        self._poll = poll_interval_s
        self._sleep = sleep
        self._clock = clock
        self._http: httpx.Client | None = None
        self.down_s = 0.0  # seconds spent waiting for an unavailable router (they extend the waits)

    # -- plumbing ----------------------------------------------------------------------------
    def __enter__(self) -> SmgRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def _where(self) -> str:
        return f"router {self.settings.url}"

    def _client(self) -> httpx.Client:
        if self._http is None:
            headers = dict(IDENTITY)
            name = self.settings.admin_key_env
            if name:
                key = os.environ.get(name)
                if not key:
                    raise RouterError(f"{self._where()}: the environment variable {name} (router.admin_key_env) "
                                      f"is not set: it must hold the router's control-plane key")
                headers["Authorization"] = "Bearer " + key
            self._http = httpx.Client(  # each request bounded whole by its timeout (bounded_http)
                base_url=self.settings.url, headers=headers, trust_env=False,
                transport=bounded_transport(self._transport, tls_context),
                timeout=min(10.0, self.settings.timeout_s))
        return self._http

    def _api(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (200,)) -> httpx.Response:
        """`_call`, asked again while the router is unavailable (RouterUnavailable), with backoff,
        until router.retry_window_s has passed since the first failure: a router restarting or
        briefly down does not fail the deploy. Not for a DELETE (see `deregister`)."""
        return self._retrying(lambda: self._call(method, path, body, ok))

    def _retrying(self, fn: Callable[[], _T]) -> _T:
        first: float | None = None
        tries = 0
        while True:
            try:
                result = fn()
            except RouterUnavailable as e:
                now = self._clock()
                first = now if first is None else first
                tries += 1
                window = self.settings.retry_window_s
                if now - first >= window:
                    raise RouterUnavailable(f"{e} (unavailable for {now - first:.0f} s, {tries} tries; "
                                            f"router.retry_window_s is {window:g} s)") from None
                self._sleep(min(backoff_s(tries), first + window - now))
                continue
            if first is not None:
                self.down_s += self._clock() - first
            return result

    def _call(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (200,)) -> httpx.Response:
        """One control-plane request; RouterError (never quoting the key) unless its status is
        in `ok`: RouterUnavailable for no answer or a 5xx."""
        client = self._client()
        try:
            r = client.request(method, path, json=body)
        except (DeadlineExceeded, BodyTooLarge) as e:  # its message names the request and the bound
            raise RouterUnavailable(f"{self._where()}: {e}") from None
        except httpx.HTTPError as e:
            raise RouterUnavailable(f"{self._where()}: {method} {path}: {type(e).__name__}: {e}") from None
        if r.status_code in ok:
            return r
        if r.status_code >= 500:
            raise RouterUnavailable(f"{self._where()}: {method} {path} answered {r.status_code}: "
                                    f"{shown(r.text, 200)}")
        if r.status_code in (401, 403):
            who = (f"the key in ${self.settings.admin_key_env}" if self.settings.admin_key_env
                   else "no key (router.admin_key_env is not set)")
            raise RouterError(f"{self._where()}: {method} {path} refused ({r.status_code}) with {who}: "
                              f"{shown(r.text, 200)}")
        raise RouterError(f"{self._where()}: {method} {path} answered {r.status_code}: {shown(r.text, 200)}")

    @staticmethod
    def _json(r: httpx.Response, what: str) -> Any:
        try:
            return r.json()
        except ValueError:
            raise RouterError(f"{what}: not JSON: {shown(r.text, 200)}") from None

    @staticmethod
    def _entry(d: Any) -> WorkerEntry:
        if not isinstance(d, dict) or not isinstance(d.get("id"), str) or not isinstance(d.get("url"), str):
            raise ValueError(f"a worker without id/url: {shown(d, 200)}")
        healthy = bool(d.get("is_healthy"))
        status = d.get("status")
        if not isinstance(status, str):  # older smg: is_healthy only
            status = "ready" if healthy else "not_ready"
        load = d.get("load")
        return WorkerEntry(id=d["id"], url=d["url"], status=status, healthy=healthy,
                           load=load if isinstance(load, int) and not isinstance(load, bool) else None,
                           model_id=d.get("model_id") if isinstance(d.get("model_id"), str) else None)

    # -- queries -----------------------------------------------------------------------------
    def workers(self) -> list[WorkerEntry]:
        """Every worker registered with the router (not those still being added)."""
        return self._retrying(self._list_workers)

    def check(self) -> None:
        """One look at the router (no retry): RouterError unless it answers with the key we hold.
        Preflight's: a router down before anything changed refuses the deploy at once."""
        self._list_workers()

    def _list_workers(self) -> list[WorkerEntry]:
        r = self._call("GET", "/workers")
        doc = self._json(r, f"{self._where()}: GET /workers")
        items = doc.get("workers") if isinstance(doc, dict) else None
        if not isinstance(items, list):
            raise RouterError(f"{self._where()}: GET /workers: no 'workers' list in {shown(doc, 200)}")
        try:
            return [self._entry(d) for d in items]
        except ValueError as e:
            raise RouterError(f"{self._where()}: GET /workers: {e}") from None

    def entries(self, worker_url: str, listing: Callable[[], list[WorkerEntry]] | None = None) -> list[WorkerEntry]:
        """The router's entries for `worker_url` (normalised: `http://h:1/` is `http://h:1`)."""
        want = normalize_url(worker_url)
        return [w for w in (listing or self.workers)() if normalize_url(w.url) == want]

    def is_registered(self, worker_url: str) -> bool:
        """The router has the worker in its pool: listed and not on its way out (draining). A
        registered worker that is unhealthy right now (not_ready, failed) still counts: the
        router sends it requests again once its health checks pass."""
        return any(not w.draining for w in self.entries(worker_url))

    def _worker(self, worker_id: str) -> dict | None:
        r = self._api("GET", f"/workers/{worker_id}", ok=(200, 404))
        if r.status_code == 404:
            return None
        doc = self._json(r, f"{self._where()}: GET /workers/{worker_id}")
        if not isinstance(doc, dict):
            raise RouterError(f"{self._where()}: GET /workers/{worker_id}: unexpected answer {shown(doc, 200)}")
        return doc

    # -- changes -----------------------------------------------------------------------------
    def deregister(self, worker_url: str) -> bool:
        """Take the worker out of the router: returns once the router no longer sends it new
        requests (every entry for the URL draining or gone). True if it was registered (listed,
        draining included), False if the router did not know it. Idempotent: an entry already
        draining is left to finish its drain window. Never a second DELETE to end the window
        early: smg's delayed removal, 5 s after the first, removes by URL, so it would take out the
        worker registered again meanwhile (seen with 1.13.0: every host gone after a rollout).
        Requests already in flight on the worker are not waited for: smg lets them complete."""
        entries = self.entries(worker_url)
        if not entries:
            return False
        for i, w in enumerate(entries):
            if i:  # smg may have drained a look-alike entry with the first: never DELETE a draining one
                w = next((e for e in self.entries(worker_url) if e.id == w.id), None)
            if w is not None and not w.draining:
                self._retrying(lambda w=w: self._delete_once(worker_url, w.id))
        deadline, down = self._clock() + self.settings.timeout_s, self.down_s
        while True:
            left = [w for w in self.entries(worker_url) if not w.draining]
            if not left:
                return True
            if self._clock() >= deadline + (self.down_s - down):
                states = ", ".join(f"{w.id} {w.status}" for w in left)
                raise RouterError(f"{self._where()}: worker {worker_url} still listed and not draining "
                                  f"{self.settings.timeout_s:g} s after its removal was requested ({states})")
            self._sleep(self._poll)

    def _delete_once(self, worker_url: str, worker_id: str) -> None:
        """DELETE the entry unless it is draining or gone already: a DELETE whose answer was lost
        may have been done, and a second one would end its drain window at once."""
        if any(e.id == worker_id and not e.draining for e in self.entries(worker_url, self._list_workers)):
            self._call("DELETE", f"/workers/{worker_id}", ok=(200, 202, 204, 404))

    def register(self, worker_url: str) -> None:
        """Add the worker and return once the router lists it ready and healthy: from then on
        its policy picks it for new requests. Already registered and ready: nothing to do. An
        entry still draining (a deregister moments ago) is first waited out: smg refuses a second
        entry for the same URL. RouterError on an API error, a failed registration, or when the
        worker is not ready within `timeout_s` (the message gives its last state)."""
        url = normalize_url(worker_url)
        deadline, down = self._clock() + self.settings.timeout_s, self.down_s
        worker_id: str | None = None
        last = "not added yet"
        while True:
            if worker_id is None:
                current = self.entries(url)
                live = [w for w in current if not w.draining]
                if live:
                    worker_id = live[0].id
                elif current:
                    last = f"waiting for the old entry {current[0].id} to finish draining"
                else:
                    worker_id, last = self._add(url)
            if worker_id is not None:
                doc = self._worker(worker_id)
                if doc is None:
                    worker_id, last = None, "its entry vanished (removed by someone else?)"
                else:
                    w = self._entry(doc) if isinstance(doc.get("id"), str) and isinstance(doc.get("url"), str) \
                        else None
                    job = doc.get("job_status") if isinstance(doc.get("job_status"), dict) else {}
                    if w is not None and w.routable:
                        return
                    if (job.get("status") == "failed" and job.get("job_type") in (None, "AddWorker")
                            and (w is None or w.status == "pending")):
                        raise RouterError(f"{self._where()}: adding worker {url} failed: "
                                          f"{shown(job.get('message') or 'no message', 300)}")
                    last = f"status {w.status if w else doc.get('status')!r}" + (
                        f", job {job.get('status')}" if job.get("status") else "")
            if self._clock() >= deadline + (self.down_s - down):
                raise RouterError(
                    f"{self._where()}: worker {url} not ready within {self.settings.timeout_s:g} s ({last}). smg "
                    f"adds only a worker whose /health answers 200 and retries one that does not every "
                    f"--worker-startup-check-interval (30 s by default): register a host after its health gate")
            self._sleep(self._poll)

    def _add(self, url: str) -> tuple[str | None, str]:
        """POST /workers; (the new or in-progress entry's id, or None to look again; what happened)."""
        r = self._api("POST", "/workers", {"url": url}, ok=(200, 201, 202, 409))
        doc = self._json(r, f"{self._where()}: POST /workers")
        if r.status_code != 409:
            wid = doc.get("worker_id") if isinstance(doc, dict) else None
            if not isinstance(wid, str):
                raise RouterError(f"{self._where()}: POST /workers: no worker_id in {shown(doc, 200)}")
            return wid, "added"
        code = doc.get("code") if isinstance(doc, dict) else None
        message = str(doc.get("error", "")) if isinstance(doc, dict) else ""
        if code == "WORKER_CREATE_IN_PROGRESS":
            m = _UUID_RE.search(message)
            if m:
                return m.group(0), "being added"
        if code in ("WORKER_ALREADY_EXISTS", "WORKER_CREATE_IN_PROGRESS"):
            return None, f"the router says: {shown(message, 200)}"  # listed after all: look again
        raise RouterError(f"{self._where()}: POST /workers answered 409: {shown(r.text, 200)}")

