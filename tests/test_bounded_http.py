"""Every HTTP caller of the tool ends on time against a server that never finishes its answer.

Real sockets on 127.0.0.1, one thread per connection: a server that trickles its answer one byte
every 0.2 s (httpx's per-read timeout never fires), one that sends SSE keep-alive comments for
ever, and one that floods a body without end. Each caller runs with a 1 s request timeout and must
return through its own error path within that plus slack; a well-behaved server is the control.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import ssl
import threading
import time
from types import SimpleNamespace
from typing import Callable

import httpx
import pytest

from ddtree_ops.config.router_settings import RouterSettings
from ddtree_ops.config.workload_settings import Workload
from ddtree_ops.gates.health import (
    HealthFailure,
    drain,
    generated_text,
    health_gate,
    health_status,
    in_flight,
    wait_until_serving,
)
from ddtree_ops.gates.router import RouterError, SmgRouter
from ddtree_ops.gates.workload import measure
from ddtree_ops.host.bounded_http import BODY_CAP_ENV, BodyTooLarge, DeadlineExceeded, bounded_transport
from ddtree_ops.host.http import http_client
from ddtree_ops.host.services import UnitProbe
from ddtree_ops.host.tls import tls_context
from ddtree_ops.testing.fake_host import fake_hosts

TIMEOUT_S = 1.0
SLACK_S = 1.5  # thread start, a loaded CI machine
BYTE_EVERY_S = 0.2

Behaviour = Callable[[socket.socket, str, threading.Event], None]


def _send_slowly(conn: socket.socket, data: bytes, stop: threading.Event) -> None:
    for i in range(len(data)):
        if stop.wait(BYTE_EVERY_S):
            return
        conn.sendall(data[i:i + 1])


def trickle(conn: socket.socket, path: str, stop: threading.Event) -> None:
    """A whole, valid answer, one byte every 0.2 s: 30 s for the status line alone."""
    body = b'{"text": "Paris"}'
    _send_slowly(conn, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body), stop)


def sse_keepalive(conn: socket.socket, path: str, stop: threading.Event) -> None:
    """Headers at once, then an SSE comment every 0.2 s and never an event."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
    while not stop.wait(BYTE_EVERY_S):
        conn.sendall(b": keep-alive\n\n")


def flood(conn: socket.socket, path: str, stop: threading.Event) -> None:
    """A JSON body as fast as the socket takes it, without a length and without an end."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n[")
    block = b"1," * 32768
    while not stop.is_set():
        conn.sendall(block)


def normal(conn: socket.socket, path: str, stop: threading.Event) -> None:
    """An SGLang server and an smg router in one, answering at once (the control)."""
    wid = "00000000-0000-4000-8000-000000000001"
    if path.startswith("/generate") and "stream" in path:
        chunks = [{"text": "Par", "meta_info": {"completion_tokens": 1}},
                  {"text": "Paris", "meta_info": {"completion_tokens": 2}}]
        body = b"".join(b"data: %s\n\n" % json.dumps(c).encode() for c in chunks) + b"data: [DONE]\n\n"
        ctype = "text/event-stream"
    else:
        doc = {"/health": {}, "/generate": {"text": "Paris"},
               "/v1/loads": {"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]},
               "/workers": {"worker_id": wid, "workers": []},
               f"/workers/{wid}": {"id": wid, "url": "http://127.0.0.1:9", "status": "ready", "is_healthy": True},
               }.get(path.split("?")[0].split(" ")[0], {})
        body, ctype = json.dumps(doc).encode(), "application/json"
    status = b"202 Accepted" if path.startswith("/workers POST") else b"200 OK"
    conn.sendall(b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                 % (status, ctype.encode(), len(body), body))


class LoopbackServer:
    """`behave(conn, path, stop)` answers each request; `path` is the request path, with " POST"
    or " stream" appended for a POST or a streaming /generate."""

    def __init__(self, behave: Behaviour, tls: ssl.SSLContext | None = None):
        self.behave, self.stop, self.tls = behave, threading.Event(), tls
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            data = b""
            while b"\r\n\r\n" not in data:
                part = conn.recv(65536)
                if not part:
                    return
                data += part
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                body += conn.recv(65536)
            method, path = head.split(b" ")[:2]
            streaming = b'"stream":true' in body.replace(b" ", b"")
            path_s = path.decode() + (" POST" if method == b"POST" else "") + (" stream" if streaming else "")
            self.behave(conn, path_s, self.stop)
        except OSError:
            pass  # the client gave up: what the bounded callers do
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def serve():
    servers: list[LoopbackServer] = []

    def start(behave: Behaviour, tls: ssl.SSLContext | None = None) -> LoopbackServer:
        servers.append(LoopbackServer(behave, tls))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


@pytest.fixture
def base_host(tmp_path):
    return fake_hosts(tmp_path / "hosts")[0].host


def host_at(base, url: str):
    health = dataclasses.replace(base.health, request_timeout_s=TIMEOUT_S, poll_interval_s=0.1,
                                 consecutive_successes=2)
    return dataclasses.replace(base, base_url=url, api_key_env=None, health=health)


@dataclasses.dataclass
class Access:
    """What the health checks need of a session: the server over the network, a serving unit."""

    host: object
    services: object = dataclasses.field(default_factory=lambda: SimpleNamespace(
        probe=lambda unit, lines=30: UnitProbe("active", 42, [])))

    def http(self) -> httpx.Client:
        return http_client(self.host)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def monotonic(self) -> float:
        return time.monotonic()


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    t0 = time.monotonic()
    try:
        out: object = fn()
    except Exception as e:  # the error is the result under test
        out = e
    return out, time.monotonic() - t0


HOSTILE = [pytest.param(trickle, "no complete answer within 1 s", id="trickle"),
           pytest.param(sse_keepalive, "no complete answer within 1 s", id="sse-keepalive")]


# ----------------------------------------------------------------------------------- the control

def test_a_trickling_server_holds_a_plain_httpx_client_past_its_timeout(serve):
    """Why the bound is needed: httpx's own timeout (1 s per read) never fires against it."""
    srv = serve(trickle)
    done = threading.Event()

    def get() -> None:
        try:
            with httpx.Client(timeout=TIMEOUT_S) as c:
                c.get(srv.url + "/health")
        except httpx.HTTPError:
            pass
        done.set()
    threading.Thread(target=get, daemon=True).start()
    assert not done.wait(3 * TIMEOUT_S), "the plain client returned: the trickling server proves nothing"
    srv.close()
    assert done.wait(5)


def test_every_caller_passes_against_a_normal_server(serve, base_host):
    srv = serve(normal)
    host = host_at(base_host, srv.url)
    acc = Access(host)
    with http_client(host) as c:
        assert health_status(c) == 200
        assert generated_text(c, host.health) == "Paris"
    assert wait_until_serving(acc, "u.service", expected_pid=42, deadline_s=5) >= 0
    assert health_gate(acc, "u.service", 42).text == "Paris"
    assert drain(acc, 5).at_start == 0
    w = Workload(concurrency=1, min_requests=2, duration_s=0.0, request_timeout_s=TIMEOUT_S)
    with http_client(host) as c:
        m = measure(c, w)
    assert (m.requests, m.errors, m.output_tokens) == (2, 0, 4), m.error_examples
    with SmgRouter(RouterSettings("smg", srv.url, None, host.base_url, timeout_s=3, retry_window_s=0)) as r:
        assert r.workers() == []
        r.register(host.base_url)
        assert r.deregister(host.base_url) is False


# ----------------------------------------------------------------------- each caller, each server

@pytest.mark.parametrize("behave,words", HOSTILE)
def test_health_polling_ends_on_time_with_the_reason(serve, base_host, behave, words):
    host = host_at(base_host, serve(behave).url)
    with http_client(host) as c:
        status, took = timed(lambda: health_status(c))
    assert status == f"timeout ({words})"
    assert took < TIMEOUT_S + SLACK_S


@pytest.mark.parametrize("behave,words", HOSTILE)
def test_waiting_for_the_server_ends_at_its_deadline(serve, base_host, behave, words):
    host = host_at(base_host, serve(behave).url)
    err, took = timed(lambda: wait_until_serving(Access(host), "u.service", expected_pid=42, deadline_s=1.5))
    assert isinstance(err, HealthFailure), err
    assert "not ready after" in str(err) and words in str(err)
    assert took < 1.5 + 2 * TIMEOUT_S + SLACK_S


@pytest.mark.parametrize("behave,words", HOSTILE)
def test_the_health_gate_fails_on_time(serve, base_host, behave, words):
    host = host_at(base_host, serve(behave).url)
    err, took = timed(lambda: health_gate(Access(host), "u.service", 42))
    assert isinstance(err, HealthFailure) and words in str(err), err
    assert took < TIMEOUT_S + SLACK_S


@pytest.mark.parametrize("behave,words", HOSTILE)
def test_the_sampled_generate_fails_on_time_naming_the_url(serve, base_host, behave, words):
    srv = serve(behave)
    host = host_at(base_host, srv.url)
    with http_client(host) as c:
        err, took = timed(lambda: generated_text(c, host.health))
    assert isinstance(err, HealthFailure), err
    assert str(err) == f"POST /generate failed: POST {srv.url}/generate: {words}"
    assert took < TIMEOUT_S + SLACK_S


@pytest.mark.parametrize("behave,words", HOSTILE)
def test_the_drain_does_not_wait_on_a_server_that_never_answers(serve, base_host, behave, words):
    host = host_at(base_host, serve(behave).url)
    result, took = timed(lambda: drain(Access(host), 60))
    assert result.at_start is None and result.remaining is None, result
    assert took < TIMEOUT_S + SLACK_S


@pytest.mark.parametrize("behave,words", HOSTILE)
def test_the_perf_gate_counts_a_stream_without_end_as_an_error(serve, base_host, behave, words):
    host = host_at(base_host, serve(behave).url)
    w = Workload(concurrency=2, min_requests=2, duration_s=0.0, request_timeout_s=TIMEOUT_S)
    with http_client(host) as c:
        m, took = timed(lambda: measure(c, w))
    assert (m.requests, m.errors) == (2, 2), m
    assert m.error_examples == (f"timeout ({words})",)
    assert took < TIMEOUT_S + SLACK_S


@pytest.mark.parametrize("behave,words", HOSTILE)
@pytest.mark.parametrize("call", ["workers", "register", "deregister"])
def test_every_router_call_fails_on_time(serve, base_host, behave, words, call):
    srv = serve(behave)
    settings = RouterSettings("smg", srv.url, None, "http://127.0.0.1:9", timeout_s=TIMEOUT_S, retry_window_s=0)
    with SmgRouter(settings) as r:
        err, took = timed(lambda: getattr(r, call)(*(() if call == "workers" else (settings.worker,))))
    assert isinstance(err, RouterError), err
    assert f"GET {srv.url}/workers: {words}" in str(err)
    assert took < TIMEOUT_S + SLACK_S


# ------------------------------------------------------------------------------------- the body cap

def test_a_body_without_end_is_refused_at_the_cap_by_every_client(serve, base_host, monkeypatch):
    monkeypatch.setenv(BODY_CAP_ENV, str(1 << 20))
    srv = serve(flood)
    host = host_at(base_host, srv.url)
    with http_client(host) as c:
        with pytest.raises(BodyTooLarge, match=rf"^GET {srv.url}/v1/loads: answer larger than 1048576 bytes$"):
            c.get("/v1/loads")
        err, took = timed(lambda: generated_text(c, host.health))
        assert isinstance(err, HealthFailure) and "answer larger than 1048576 bytes" in str(err), err
        assert health_status(c) == "refused answer (answer larger than 1048576 bytes)"
        assert in_flight(c) is None
        m = measure(c, Workload(concurrency=1, min_requests=1, duration_s=0.0, request_timeout_s=30))
    assert m.error_examples == ("answer larger than 1048576 bytes",)
    settings = RouterSettings("smg", srv.url, None, "http://127.0.0.1:9", timeout_s=30, retry_window_s=0)
    with SmgRouter(settings) as r, pytest.raises(RouterError, match="answer larger than 1048576 bytes"):
        r.workers()
    assert took < 10


def test_a_declared_length_over_the_cap_is_refused_before_reading(base_host, monkeypatch):
    monkeypatch.setenv(BODY_CAP_ENV, "100")
    sent = httpx.MockTransport(lambda req: httpx.Response(200, content=b"x" * 101))
    fits = httpx.MockTransport(lambda req: httpx.Response(200, content=b"x" * 100))
    with http_client(base_host, sent) as c, pytest.raises(BodyTooLarge, match="Content-Length 101"):
        c.get("/health")
    with http_client(base_host, fits) as c:
        assert c.get("/health").content == b"x" * 100


def test_a_compressed_answer_is_refused_and_identity_is_asked(base_host):
    asked: list[str] = []

    def gz(req: httpx.Request) -> httpx.Response:
        asked.append(req.headers.get("accept-encoding", ""))
        return httpx.Response(200, content=b"\x1f\x8b", headers={"Content-Encoding": "gzip"})
    with http_client(base_host, httpx.MockTransport(gz)) as c, pytest.raises(BodyTooLarge, match="compressed"):
        c.get("/health")
    assert asked == ["identity"]


def test_a_deeply_nested_answer_is_a_failed_check_not_a_crash(base_host):
    deep = httpx.MockTransport(lambda req: httpx.Response(200, content=b"[" * 100_000 + b"]" * 100_000))
    hs = dataclasses.replace(base_host.health, min_accept_length=1.0)
    with http_client(base_host, deep) as c:
        with pytest.raises(HealthFailure, match="returned no JSON"):
            generated_text(c, hs)
        assert in_flight(c) is None


def test_the_deadline_counts_the_whole_stream_of_a_mock_transport_too(base_host):
    """Between chunks the deadline is checked whatever the transport (a fake host's included)."""
    def slow_chunks():
        for _ in range(50):
            time.sleep(0.1)
            yield b": keep-alive\n\n"
    t = httpx.MockTransport(lambda req: httpx.Response(200, content=slow_chunks()))
    with http_client(base_host, t) as c:
        err, took = timed(lambda: c.get("/health", timeout=0.5).read())
    assert isinstance(err, DeadlineExceeded) and "no complete answer within 0.5 s" in str(err), err
    assert took < 0.5 + SLACK_S


def test_each_request_gets_its_own_deadline_on_a_reused_connection(serve, base_host):
    """A deadline that leaked to the next request on the same thread would fail this."""
    host = host_at(base_host, serve(normal).url)
    with http_client(host) as c:
        for _ in range(3):
            assert c.get("/health", timeout=0.3).status_code == 200
            time.sleep(0.4)


@pytest.fixture(scope="module")
def loopback_cert(tmp_path_factory) -> tuple[ssl.SSLContext, str]:
    """A self-signed certificate for 127.0.0.1: the server's context, and the certificate's file."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert_obj = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                               critical=False)
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
    (d / "cert.pem").write_bytes(cert_obj.public_bytes(serialization.Encoding.PEM))
    (d / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(d / "cert.pem", d / "key.pem")
    return server, str(d / "cert.pem")


def test_the_ca_bundle_is_loaded_for_https_only_and_https_still_verifies(serve, loopback_cert):
    """Plain http (a host's server on its own network) never builds the TLS context; https builds
    it at its first request and refuses a certificate it does not trust; a context trusting the
    certificate is the control."""
    server_tls, cert = loopback_cert
    built: list[str] = []

    def verify(trusting: bool = False) -> ssl.SSLContext:
        built.append("trusting" if trusting else "bundle")
        return ssl.create_default_context(cafile=cert) if trusting else tls_context()

    plain, tls = serve(normal), serve(normal, server_tls)
    with httpx.Client(transport=bounded_transport(None, verify), trust_env=False, timeout=5) as c:
        assert c.get(plain.url + "/health").status_code == 200
        assert built == []
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            c.get(tls.url + "/health")
        assert c.get(plain.url + "/health").status_code == 200
    assert built == ["bundle"]
    with httpx.Client(transport=bounded_transport(None, lambda: verify(trusting=True)), trust_env=False,
                      timeout=5) as c:
        assert c.get(tls.url + "/health").json() == {}
    assert built == ["bundle", "trusting"]
