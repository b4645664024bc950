"""The performance gate as an HTTP service for Argo Rollouts' web metric provider (`ddtree-ops
gate --serve ADDR`): an AnalysisTemplate's `web:` metric calls it, and url_gate.run_gate measures.

  GET  /gate?baseline=URL&canary=URL      (each repeatable; a side left out: the start-up URLs)
  POST /gate  {"baseline": URL | [URL, ...], "canary": URL | [URL, ...]}   (the same, as JSON)
  GET  /healthz                            {"ok": true, "busy": false, "bound_s": 83.0}

Answers, always JSON:

  200  {"result": "pass" | "fail" | "inconclusive", "verdict": ..., "summary": ..., "rows": [...], ...}
       a verdict; marginal is "inconclusive", which pauses the Rollout for a person
  400  {"result": "error"}   a malformed request (no such parameter, a bad URL, a body not JSON)
  403  {"result": "error"}   a URL the allow list does not name
  502  {"result": "error"}   no verdict: a server did not answer its probe, a baseline had no success
  503  {"result": "busy"}    one measurement at a time: another is running (Retry-After: its bound
                              left), or the service is stopping
  404 / 405 / 411 / 413      an unknown path, method, a POST without Content-Length, a body over 64 KiB

Argo counts a non-2xx answer as a measurement Error and retries it (every 10 s unless the metric
sets an interval), up to the metric's consecutiveErrorLimit (4); past it the AnalysisRun errors and
the Rollout aborts. A busy service is therefore retried, a server that never answers aborts.

Not an open proxy: a request may name only the URLs given at start-up and the hosts of
`--allow-host` (AllowList); redirects are not followed (host/http.py url_client). The workload and
thresholds are the service's, fixed at start-up: a caller cannot ask for a longer run. With several
workloads (`perf_gate.workloads`) each one is measured in turn and the worst decides (url_gate.py);
`bound_s` is then the whole run's, every workload's together.
"""

from __future__ import annotations

import enum
import http.server
import json
import math
import socket
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable

from ..config.terminal import terminal_safe
from ..errors import InputError, NoVerdict, shown
from .perfgate import Verdict
from .url_gate import SERVERS_PER_SIDE_MAX, GateOutcome, GateRequest, GateSettings, parse_url, run_bound_s, run_gate

BODY_MAX_BYTES = 64 * 1024
REQUEST_READ_TIMEOUT_S = 10.0  # a caller that connects and sends nothing holds a thread no longer
CLOSE_WAIT_S = 5.0  # on SIGTERM, how long the running measurement has to stop (measure's grace and more)
PATHS = ("/gate", "/healthz")


class Result(str, enum.Enum):
    """The `result` an AnalysisTemplate's conditions read."""

    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
    ERROR = "error"
    BUSY = "busy"


RESULT_OF = {Verdict.PASS: Result.PASS, Verdict.MARGINAL: Result.INCONCLUSIVE, Verdict.FAIL: Result.FAIL}


# --------------------------------------------------------------------------- the allow list

@dataclass(frozen=True)
class HostRule:
    """One `--allow-host`: a host (`gpu-1.example`, `10.0.0.5`, `[fd00::5]`) or every host under a
    domain (`*.llm.svc.cluster.local`), on any port or one (`:30000`)."""

    host: str
    port: int | None
    suffix: bool  # "*.domain": the domain's hosts, not the domain itself

    @classmethod
    def parse(cls, text: str) -> HostRule:
        t = text.strip().lower()
        wild = t.startswith("*.")
        try:
            u = urllib.parse.urlsplit("http://" + (t[2:] if wild else t))
            port = u.port
        except ValueError:
            u, port = None, None
        if u is None or not u.hostname or u.path or u.query or u.fragment or "@" in u.netloc or "*" in u.netloc:
            raise InputError(f"--allow-host {shown(text)}: must be HOST, HOST:PORT or *.DOMAIN[:PORT] "
                             f"(a bare '*' would let any caller point the service anywhere)")
        try:
            parse_url(f"http://{u.netloc}", "--allow-host")  # a server URL's own rules for its host and port
        except InputError:
            raise InputError(f"--allow-host {shown(text)}: not a host name or IP address (with an optional "
                             f"port)") from None
        return cls(u.hostname, port, wild)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return ("*." if self.suffix else "") + host + (f":{self.port}" if self.port else "")

    def matches(self, host: str, port: int) -> bool:
        if self.port is not None and self.port != port:
            return False
        return host.endswith("." + self.host) if self.suffix else host == self.host


@dataclass(frozen=True)
class AllowList:
    """What a request may name: the start-up URLs exactly, and the hosts of the rules."""

    urls: frozenset[str] = frozenset()
    rules: tuple[HostRule, ...] = ()

    @classmethod
    def of(cls, urls: tuple[str, ...], patterns: list[str]) -> AllowList:
        allow = cls(frozenset(urls), tuple(HostRule.parse(p) for p in patterns))
        if not allow.urls and not allow.rules:
            raise InputError("--serve with nothing to measure: give --baseline/--canary URLs (the service's "
                             "defaults, and the only servers it will measure) or --allow-host HOST")
        return allow

    def allows(self, url: str) -> bool:
        """`url` (parse_url's form) is one of the start-up URLs or on an allowed host."""
        if url in self.urls:
            return True
        u = urllib.parse.urlsplit(url)
        port = u.port or (443 if u.scheme == "https" else 80)
        return any(r.matches(u.hostname or "", port) for r in self.rules)

    def describe(self) -> str:
        return ", ".join(sorted(self.urls) + [str(r) for r in self.rules])


# --------------------------------------------------------------------------- the service

@dataclass(frozen=True)
class Reply:
    status: int
    doc: dict[str, Any]
    headers: tuple[tuple[str, str], ...] = ()


def _error(status: int, message: str, result: Result = Result.ERROR) -> Reply:
    return Reply(status, {"result": result.value, "error": message})


Run = Callable[[GateRequest, GateSettings, Callable[[], bool]], GateOutcome]


def _stderr(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def _run_gate(request: GateRequest, settings: GateSettings, should_stop: Callable[[], bool]) -> GateOutcome:
    return run_gate(request, settings, should_stop=should_stop)


@dataclass
class GateService:
    """The service's state: its settings and allow list, the start-up URLs (each side's default),
    and the one measurement that may run. `run`: the seam tests measure with."""

    settings: GateSettings
    allow: AllowList
    baselines: tuple[str, ...] = ()
    canaries: tuple[str, ...] = ()
    run: Run = _run_gate
    log: Callable[[str], None] = _stderr
    stopping: threading.Event = field(default_factory=threading.Event, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _since: float | None = field(default=None, init=False)  # when the running measurement started

    @property
    def bound_s(self) -> float:
        return run_bound_s(self.settings)

    def handle(self, method: str, target: str, body: bytes | None = None) -> Reply:
        """The answer to one request (`target`: the path and query as sent)."""
        path, _, query = target.partition("?")
        if path not in PATHS:
            return _error(404, f"no such path {shown(path)}: GET /gate?baseline=URL&canary=URL, POST /gate, "
                               f"GET /healthz")
        if path == "/healthz":
            if method != "GET":
                return _error(405, "GET /healthz")
            if self.stopping.is_set():
                return Reply(503, {"ok": False, "stopping": True})
            return Reply(200, {"ok": True, "busy": self._lock.locked(), "bound_s": self.bound_s})
        if method == "GET":
            parsed = self._from_query(query)
        elif method == "POST":
            parsed = self._from_body(body)
        else:
            return Reply(405, {"result": Result.ERROR.value, "error": "GET or POST /gate"}, (("Allow", "GET, POST"),))
        if isinstance(parsed, Reply):
            return parsed
        return self._measure(*parsed)

    def _from_query(self, query: str) -> Reply | tuple[list[str], list[str]]:
        try:
            params = urllib.parse.parse_qs(query, keep_blank_values=True, strict_parsing=bool(query),
                                           max_num_fields=2 * SERVERS_PER_SIDE_MAX + 2)
        except ValueError as e:
            return _error(400, f"bad query string: {e}")
        return self._sides(params)

    def _from_body(self, body: bytes | None) -> Reply | tuple[list[str], list[str]]:
        try:
            doc = json.loads(body or b"null")
        except (ValueError, RecursionError):
            return _error(400, "the body must be a JSON object such as {\"baseline\": URL, \"canary\": URL}")
        if not isinstance(doc, dict):
            return _error(400, f"the body must be a JSON object, got {shown(doc)}")
        sides: dict[str, list[Any]] = {}
        for k, v in doc.items():
            sides[k] = v if isinstance(v, list) else [v]
        return self._sides(sides)

    def _sides(self, params: dict[str, list[Any]]) -> Reply | tuple[list[str], list[str]]:
        unknown = sorted(set(params) - {"baseline", "canary"})
        if unknown:
            return _error(400, f"unknown parameter {shown(unknown[0])}: only baseline and canary (URLs)")
        return (params.get("baseline") or list(self.baselines), params.get("canary") or list(self.canaries))

    def _measure(self, baselines: list[Any], canaries: list[Any]) -> Reply:
        try:
            request = GateRequest.of(baselines, canaries)
        except InputError as e:
            return _error(400, str(e))
        refused = [u for _, u in request.servers() if not self.allow.allows(u)]
        if refused:
            return _error(403, f"{refused[0]} is not allowed: the service measures only {self.allow.describe()} "
                               f"(start it with --allow-host HOST to allow more)")
        if self.stopping.is_set():
            return _error(503, "the service is stopping", Result.BUSY)
        if not self._lock.acquire(blocking=False):
            left = max(1, math.ceil(self.bound_s - (time.monotonic() - (self._since or time.monotonic()))))
            return Reply(503, {"result": Result.BUSY.value, "retry_after_s": left,
                               "error": f"busy: one measurement at a time, and one is running (it ends within "
                                        f"{left} s)"}, (("Retry-After", str(left)),))
        try:
            self._since = time.monotonic()
            outcome = self.run(request, self.settings, self.stopping.is_set)
        except NoVerdict as e:
            if self.stopping.is_set():
                return _error(503, "the service is stopping; no verdict", Result.BUSY)
            return _error(502, str(e))
        except InputError as e:
            return _error(400, str(e))
        finally:
            self._since = None
            self._lock.release()
        return Reply(200, {"result": RESULT_OF[outcome.verdict].value, **outcome.as_dict()})

    def close(self) -> None:
        """Stop: no new measurement starts, the running one stops (its caller gets a 503) and is
        waited for, CLOSE_WAIT_S at most."""
        self.stopping.set()
        if self._lock.acquire(timeout=CLOSE_WAIT_S):
            self._lock.release()


# --------------------------------------------------------------------------- HTTP

class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_READ_TIMEOUT_S
    protocol_version = "HTTP/1.1"
    server_version = "ddtree-ops-gate"

    def _serve(self, method: str) -> None:
        t0 = time.monotonic()
        try:
            reply = self._reply(method)
        except Exception as e:  # a bug: the caller gets a 500, the log one line, not a traceback
            reply = _error(500, f"internal error: {type(e).__name__}: {e}")
        data = json.dumps(reply.doc, default=str).encode()
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        for k, v in reply.headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True
        if self.path.partition("?")[0] != "/healthz":  # the kubelet's probes would drown the log
            result = reply.doc.get("result", "")
            self.server.service.log(terminal_safe(f"gate service: {method} {self.path[:500]} -> {reply.status} "
                                                  f"{result} ({time.monotonic() - t0:.1f} s)"))

    def _reply(self, method: str) -> Reply:
        service = self.server.service
        if method != "POST":
            return service.handle(method, self.path)
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            return _error(411, "POST /gate needs a Content-Length")
        if int(length) > BODY_MAX_BYTES:
            return _error(413, f"the body is over {BODY_MAX_BYTES} bytes")
        try:
            body = self.rfile.read(int(length))
        except OSError:
            return _error(400, "the body did not arrive")
        return service.handle(method, self.path, body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._serve("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._serve("DELETE")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        pass  # one line per request is _serve's; http.server's own errors (a bad request line) add nothing


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True  # a caller still reading cannot hold the service's exit
    block_on_close = False

    def __init__(self, address: tuple[str, int], service: GateService, family: socket.AddressFamily):
        self.address_family = family
        self.service = service
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A caller gone before its answer (Argo gave up at its timeoutSeconds): one line, where
        # socketserver would print a traceback on the operator's stderr.
        e = sys.exc_info()[1]
        self.service.log(terminal_safe(f"gate service: the answer to {client_address[0]} was not delivered "
                                       f"({type(e).__name__}: {e})"))


def parse_listen(addr: str) -> tuple[str, int, socket.AddressFamily]:
    """`--serve HOST:PORT` (`127.0.0.1:8089`, `0.0.0.0:8089`, `[::1]:8089`; port 0: any free one)."""
    try:
        u = urllib.parse.urlsplit("//" + addr)
        host, port = u.hostname, u.port
    except ValueError:
        host, port = None, None
    if not host or port is None or u.path or u.query or "@" in u.netloc:
        raise InputError(f"--serve {shown(addr)}: must be HOST:PORT, e.g. 127.0.0.1:8089 or 0.0.0.0:8089")
    return host, port, socket.AF_INET6 if ":" in host else socket.AF_INET


def listen(service: GateService, addr: str) -> _Server:
    """The service bound to `addr`, not yet serving; InputError when the address cannot be bound."""
    host, port, family = parse_listen(addr)
    try:
        return _Server((host, port), service, family)
    except OSError as e:
        raise InputError(f"--serve {addr}: cannot listen there: {e.strerror or e}") from None


def serve(server: _Server) -> None:
    """Answer requests until KeyboardInterrupt (SIGTERM and SIGINT, as the CLI raises them) or
    `server.shutdown()`; then stop the running measurement and close. The interrupt is raised."""
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.service.close()
        server.server_close()


def url_of(server: _Server) -> str:
    host, port = server.server_address[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"
