"""HTTP with a whole-request deadline and a body cap: the transport every client of the tool uses.

httpx's timeouts bound each socket operation, not a request: a server that trickles a byte at a
time, or streams SSE comment lines (`: keep-alive`), never lets a read time out and holds its
caller forever; and nothing bounds how much a server may send. `BoundedTransport` wraps any
transport (the network, or a test's MockTransport) and gives every request:

- a total deadline: the request's own timeout (the `timeout=` the caller passed, else the
  client's) counted from the moment it is sent to the last byte of its body, streamed or not;
- a cap on the body's bytes (MAX_BODY_BYTES unless the request's extensions name another), and no
  compressed body (a small one may expand without bound): `Accept-Encoding: identity` is asked.

On the network the deadline reaches into every socket read, write and connect (`_DeadlineBackend`
shortens each to what is left), so even a trickled status line ends on time; a hit raises
`DeadlineExceeded` (an httpx.TimeoutException) or `BodyTooLarge` (an httpx.TransportError), so
each caller's usual error path takes it, with a message naming the method, the URL and the bound.
"""

from __future__ import annotations

import os
import ssl
import threading
import time
import typing
from typing import Any, Iterator

import httpcore
import httpx

from ..errors import shown

MAX_BODY_BYTES = 64 * 1024 * 1024
BODY_CAP_ENV = "DDTREE_OPS_MAX_HTTP_BODY_BYTES"  # a test's cap for every body (none sends 64 MiB)
BODY_CAP_EXTENSION = "ddtree_ops.max_body_bytes"  # one request's own cap (a long stream)
FALLBACK_TOTAL_S = 600.0  # a request sent without any timeout still ends
IDENTITY = {"Accept-Encoding": "identity"}  # the headers every bounded client sends

_current = threading.local()  # the deadline of the request this thread is working on


class _Refused:
    reason = ""  # the bound that was hit, without the request: for a status line


class DeadlineExceeded(_Refused, httpx.TimeoutException):
    """No complete answer (status, headers and the whole body) within the request's timeout."""


class BodyTooLarge(_Refused, httpx.TransportError):
    """The answer's body is over the cap, or compressed though it was asked not to be."""


def refused(cls: type[DeadlineExceeded] | type[BodyTooLarge], request: httpx.Request, reason: str) -> httpx.HTTPError:
    e = cls(f"{request.method} {request.url}: {reason}", request=request)
    e.reason = reason
    return e


def json_body(response: httpx.Response) -> Any:
    """The response's JSON; ValueError also for one nested too deeply for the parser (which
    raises RecursionError)."""
    try:
        return response.json()
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def body_cap(wanted: int | None = None) -> int:
    """A body's cap: `wanted` (a request's own) or MAX_BODY_BYTES; the environment's knob, when
    set, replaces either."""
    raw = os.environ.get(BODY_CAP_ENV, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else wanted or MAX_BODY_BYTES


def _left(timeout: float | None) -> float | None:
    """`timeout` shortened to what is left of this thread's request deadline; ReadTimeout past it."""
    deadline = getattr(_current, "deadline", None)
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise httpcore.ReadTimeout("the request deadline has passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream):
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _left(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _left(timeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, _left(timeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's socket backend, every operation cut to the request's deadline."""

    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: typing.Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_tcp(host, port, _left(timeout), local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: typing.Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_unix_socket(path, _left(timeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def network_transport(verify: typing.Callable[[], ssl.SSLContext]) -> httpx.BaseTransport:
    """The network: httpx's own transport over `_DeadlineBackend`, one per URL scheme, each made
    at its scheme's first request. `verify` (tls.tls_context) is called only for https: building it
    loads the CA bundle, about 0.05 CPU-s, which every CLI start paid though its hosts' servers
    answer plain http on their own network. The http transport's context verifies and trusts
    nothing: it is never handed a TLS connection, and if it were, the handshake could only fail."""
    return _PerScheme(verify)


def _pool_transport(ssl_context: ssl.SSLContext) -> httpx.HTTPTransport:
    # httpx's pool is the one seam it gives for a network backend: HTTPTransport builds the same
    # pool, without the backend argument.
    t = httpx.HTTPTransport(verify=ssl_context, trust_env=False)
    t._pool = httpcore.ConnectionPool(ssl_context=ssl_context, network_backend=_DeadlineBackend(),
                                      max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)
    return t


class _PerScheme(httpx.BaseTransport):
    def __init__(self, verify: typing.Callable[[], ssl.SSLContext]):
        self._verify = verify
        self._by_scheme: dict[str, httpx.HTTPTransport] = {}
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        scheme = request.url.scheme
        with self._lock:
            transport = self._by_scheme.get(scheme)
            if transport is None:
                context = self._verify() if scheme == "https" else ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                transport = self._by_scheme[scheme] = _pool_transport(context)
        return transport.handle_request(request)

    def close(self) -> None:
        with self._lock:
            transports, self._by_scheme = list(self._by_scheme.values()), {}
        for t in transports:
            t.close()


class _BoundedBody(httpx.SyncByteStream):
    def __init__(self, inner: httpx.SyncByteStream, bound: _Bound):
        self._inner, self._bound = inner, bound

    def __iter__(self) -> Iterator[bytes]:
        b = self._bound
        got = 0
        chunks = iter(self._inner)
        while True:
            _current.deadline = b.deadline  # the body may be read long after the headers
            try:
                chunk = b.run(lambda: next(chunks, None))
            finally:
                _current.deadline = None
            if chunk is None:
                return
            got += len(chunk)
            if got > b.cap:
                raise refused(BodyTooLarge, b.request, f"answer larger than {b.cap} bytes")
            if time.monotonic() > b.deadline:
                raise b.late()
            yield chunk

    def close(self) -> None:
        self._inner.close()


class _Bound:
    """One request's limits, and how a hit reads."""

    def __init__(self, request: httpx.Request, total_s: float, cap: int):
        self.request, self.total_s, self.cap = request, total_s, cap
        self.deadline = time.monotonic() + total_s

    def late(self) -> httpx.HTTPError:
        return refused(DeadlineExceeded, self.request, f"no complete answer within {self.total_s:g} s")

    def run(self, step: typing.Callable[[], Any]) -> Any:
        try:
            return step()
        except httpx.TimeoutException:
            if time.monotonic() >= self.deadline - 0.001:
                raise self.late() from None
            raise


class BoundedTransport(httpx.BaseTransport):
    """`inner` with a total deadline and a body cap on every request (see the module's doc)."""

    def __init__(self, inner: httpx.BaseTransport):
        self._inner = inner

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout") or {}
        total = timeout.get("read") or FALLBACK_TOTAL_S
        cap = body_cap(request.extensions.get(BODY_CAP_EXTENSION))
        bound = _Bound(request, total, cap)
        _current.deadline = bound.deadline
        try:
            response = bound.run(lambda: self._inner.handle_request(request))
        finally:
            _current.deadline = None
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            response.close()
            raise refused(BodyTooLarge, request,
                          f"a compressed answer ({shown(encoding, 40)}) though none was asked for")
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > cap:
            response.close()
            raise refused(BodyTooLarge, request, f"answer larger than {cap} bytes (Content-Length {length})")
        assert isinstance(response.stream, httpx.SyncByteStream)
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=_BoundedBody(response.stream, bound), extensions=response.extensions)

    def close(self) -> None:
        self._inner.close()


def bounded_transport(transport: httpx.BaseTransport | None,
                      verify: typing.Callable[[], ssl.SSLContext]) -> BoundedTransport:
    """The transport a client of the tool is built with: `transport` (a test's MockTransport) or
    the network (`verify` builds its TLS context, at the first https request), bounded."""
    return BoundedTransport(transport if transport is not None else network_transport(verify))
