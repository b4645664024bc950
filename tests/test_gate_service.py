"""`ddtree-ops gate --serve` (gates/gate_service.py), fast tier: how a request is read (query or
JSON body), what the allow list lets through, one measurement at a time, the verdict as Argo's
`result`, the answer's JSON, and the service stopping on SIGTERM. Most through `GateService.handle`
with a scripted gate; the HTTP side through the real server on 127.0.0.1, and once the real CLI."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Iterator

import httpx
import pytest
from test_gate_cli import QUICK, THRESHOLDS, tiny_sglang  # noqa: F401 (a fixture)

from ddtree_ops.config.workload_settings import Workload
from ddtree_ops.errors import InputError, NoVerdict
from ddtree_ops.gates import gate_service as gs
from ddtree_ops.gates.perfgate import Verdict, compare
from ddtree_ops.gates.url_gate import GateOutcome, GateRequest, GateSettings, Judged, Measured, bound_s
from ddtree_ops.gates.workload import Measurement
from kit import wait_for

B, C = "http://10.0.0.1:30000", "http://10.0.0.2:30000"
BASE = Measurement(requests=100, errors=0, output_tokens=20_000, wall_s=100.0, ttft_p50_s=0.2, ttft_p99_s=0.4,
                   itl_p50_s=0.03, itl_p99_s=0.06, accept_length=4.0)
CANARY_OF = {Verdict.PASS: BASE, Verdict.MARGINAL: replace(BASE, output_tokens=19_000),  # −5 %
             Verdict.FAIL: replace(BASE, output_tokens=10_000)}  # −50 %


def outcome(request: GateRequest, settings: GateSettings, verdict: Verdict = Verdict.PASS) -> GateOutcome:
    """What run_gate returns for `request` when its first canary is `verdict` against BASE."""
    canary = CANARY_OF[verdict]
    judged = tuple(Judged(u, compare(BASE, canary, settings.thresholds)) for u in request.canaries)
    measured = tuple(Measured(role, u, BASE if role == "baseline" else canary) for role, u in request.servers())
    return GateOutcome(judged[0].verdict.verdict, BASE, judged, measured, settings, 1.5)


class Scripted:
    """The service's gate: records each request, answers `verdict` (or raises `error`)."""

    def __init__(self, verdict: Verdict = Verdict.PASS, error: Exception | None = None):
        self.verdict, self.error, self.requests = verdict, error, []

    def __call__(self, request: GateRequest, settings: GateSettings, should_stop: Callable[[], bool]) -> GateOutcome:
        self.requests.append(request)
        if self.error:
            raise self.error
        return outcome(request, settings, self.verdict)


def service(run: Any = None, *, baselines=(B,), canaries=(C,), allow_host=(), **settings: Any) -> gs.GateService:
    allow = gs.AllowList.of(tuple(baselines) + tuple(canaries), list(allow_host))
    return gs.GateService(GateSettings(**settings), allow, tuple(baselines), tuple(canaries), run=run or Scripted(),
                          log=lambda msg: None)


# --------------------------------------------------------------------------- requests

@pytest.mark.parametrize("verdict, result", [(Verdict.PASS, "pass"), (Verdict.MARGINAL, "inconclusive"),
                                             (Verdict.FAIL, "fail")])
def test_a_verdict_is_argos_result_and_marginal_is_inconclusive(verdict, result):
    reply = service(Scripted(verdict)).handle("GET", "/gate")
    assert reply.status == 200 and reply.doc["result"] == result and reply.doc["verdict"] == verdict.value


@pytest.mark.parametrize("method, target, body, baselines, canaries", [
    ("GET", "/gate", None, (B,), (C,)),  # the start-up URLs
    ("GET", f"/gate?canary={C}", None, (B,), (C,)),
    ("GET", "/gate?canary=http://10.0.0.2:30000/&baseline=HTTP://10.0.0.1:30000", None, (B,), (C,)),
    ("GET", "/gate?canary=http%3A%2F%2Fgpu-3.llm.svc%3A30000", None, (B,), ("http://gpu-3.llm.svc:30000",)),
    ("GET", "/gate?canary=http://gpu-3.llm.svc:30000&canary=http://gpu-4.llm.svc:30000", None, (B,),
     ("http://gpu-3.llm.svc:30000", "http://gpu-4.llm.svc:30000")),
    ("POST", "/gate", b"{}", (B,), (C,)),
    ("POST", "/gate", json.dumps({"canary": "http://gpu-3.llm.svc:30000"}).encode(), (B,),
     ("http://gpu-3.llm.svc:30000",)),
    ("POST", "/gate", json.dumps({"baseline": [B], "canary": ["http://gpu-3.llm.svc:30000"]}).encode(), (B,),
     ("http://gpu-3.llm.svc:30000",)),
])
def test_a_request_names_its_servers_in_the_query_or_a_json_body_and_a_side_left_out_is_the_start_ups(
        method, target, body, baselines, canaries):
    run = Scripted()
    reply = service(run, allow_host=["*.llm.svc:30000"]).handle(method, target, body)
    assert reply.status == 200, reply.doc
    assert run.requests == [GateRequest(baselines, canaries)]


@pytest.mark.parametrize("method, target, body, status, message", [
    ("GET", "/gate?canary_url=http://c:1", None, 400, "unknown parameter 'canary_url'"),
    ("GET", "/gate?canary", None, 400, "bad query string"),
    ("GET", "/gate?canary=", None, 400, "canary '': must be a URL"),
    ("GET", "/gate?canary=ftp://10.0.0.2", None, 400, "canary 'ftp://10.0.0.2': must be an http://"),
    ("GET", f"/gate?canary={B}", None, 400, f"{B} is given twice (as baseline and as canary)"),
    ("GET", "/gate?" + "&".join(f"canary=http://c{i}:1" for i in range(9)), None, 400, "9 canary servers: at most 8"),
    ("GET", "/gate?" + "&".join(f"canary=http://c{i}:1" for i in range(19)), None, 400, "bad query string"),
    ("POST", "/gate", b"not json", 400, "the body must be a JSON object"),
    ("POST", "/gate", b"[1]", 400, "the body must be a JSON object, got [1]"),
    ("POST", "/gate", b'{"canary": 5}', 400, "canary 5: must be a URL"),
    ("POST", "/gate", b'{"canary": "http://c:1", "mode": "fast"}', 400, "unknown parameter 'mode'"),
    ("GET", "/gate?canary=http://10.9.9.9:30000", None, 403, "http://10.9.9.9:30000 is not allowed"),
    ("GET", "/metrics", None, 404, "no such path '/metrics'"),
    ("PUT", "/gate", b"{}", 405, "GET or POST /gate"),
    ("POST", "/healthz", b"", 405, "GET /healthz"),
])
def test_a_malformed_or_refused_request_is_answered_with_its_status_and_why(method, target, body, status, message):
    run = Scripted()
    reply = service(run).handle(method, target, body)
    assert reply.status == status and reply.doc["result"] == "error", reply.doc
    assert message in reply.doc["error"], reply.doc
    assert run.requests == []  # nothing measured


@pytest.mark.parametrize("rules, url, allowed", [
    ([], C, True), ([], "http://10.0.0.2:30001", False),  # the start-up URLs exactly
    (["gpu-1.example"], "http://gpu-1.example:30000", True),
    (["gpu-1.example"], "https://GPU-1.example", True),
    (["gpu-1.example"], "http://gpu-1.example.evil.net:30000", False),
    (["gpu-1.example:30000"], "http://gpu-1.example:30001", False),
    (["gpu-1.example:80"], "http://gpu-1.example", True),  # a URL without a port is on its scheme's
    (["*.llm.svc.cluster.local"], "http://sglang-canary.llm.svc.cluster.local:30000", True),
    (["*.llm.svc.cluster.local"], "http://llm.svc.cluster.local:30000", False),  # the domain itself is not
    (["*.llm.svc.cluster.local"], "http://a.evilllm.svc.cluster.local", False),
    (["*.llm.svc.cluster.local:30000"], "http://a.llm.svc.cluster.local:8080", False),
    (["10.0.0.0"], "http://10.0.0.9:30000", False),
    (["[fd00::5]:30000"], "http://[fd00::5]:30000", True),
])
def test_only_the_start_up_urls_and_the_allowed_hosts_are_measured(rules, url, allowed):
    run = Scripted()
    reply = service(run, allow_host=rules).handle("GET", f"/gate?canary={url}")
    assert (reply.status == 200) is allowed, reply.doc
    if not allowed:
        assert reply.status == 403 and "is not allowed: the service measures only" in reply.doc["error"]


@pytest.mark.parametrize("rule", ["*", "*:30000", "http://x", "x/y", "u@x", "a.*.b", "", "bad_host"])
def test_an_allow_rule_that_is_not_a_host_is_refused_at_start_up(rule):
    with pytest.raises(InputError, match=f"^--allow-host '{re.escape(rule)}': "):
        gs.AllowList.of((), [rule])


def test_the_allow_list_says_what_it_allows():
    allow = gs.AllowList.of((C, B), ["*.llm.svc:30000", "[FD00::5]", "gpu-1"])
    assert allow.describe() == f"{B}, {C}, *.llm.svc:30000, [fd00::5], gpu-1"


def test_no_verdict_is_a_502_that_says_why_and_bad_input_a_400():
    reply = service(Scripted(error=NoVerdict(f"canary {C}: cannot connect; no verdict"))).handle("GET", "/gate")
    assert (reply.status, reply.doc) == (502, {"result": "error", "error": f"canary {C}: cannot connect; no verdict"})
    reply = service(Scripted(error=InputError("nope"))).handle("GET", "/gate")
    assert (reply.status, reply.doc["error"]) == (400, "nope")


def test_the_answer_is_the_verdict_with_its_rows_measurements_thresholds_and_bound():
    reply = service(Scripted(Verdict.FAIL)).handle("GET", "/gate")
    doc = json.loads(json.dumps(reply.doc))
    assert doc["result"] == "fail" and doc["verdict"] == "fail"
    assert doc["summary"].startswith("fail: output tok/s 200.0 → 100.0 (−50.0 %") and doc["reasons"]
    assert [r["metric"] for r in doc["rows"]] == ["output_tps", "ttft_p50_s", "ttft_p99_s", "itl_p50_s",
                                                  "itl_p99_s", "error_rate", "accept_length"]
    assert doc["rows"][0]["verdict"] == "fail" and doc["rows"][0]["baseline"] == 200.0
    assert doc["baseline"]["output_tps"] == 200.0 and doc["canary"]["output_tps"] == 100.0
    assert [(s["role"], s["url"]) for s in doc["servers"]] == [("baseline", B), ("canary", C)]
    assert [c["url"] for c in doc["canaries"]] == [C] and doc["canaries"][0]["verdict"] == "fail"
    assert doc["thresholds"]["fail_drop"] == 0.1 and doc["workload"]["duration_s"] == 20.0
    assert doc["bound_s"] == bound_s(Workload()) and doc["settings_from"] == "the built-in defaults"


def test_healthz_says_ok_and_the_bound_and_the_stopping_service_is_503():
    s = service()
    assert s.handle("GET", "/healthz").doc == {"ok": True, "busy": False, "bound_s": bound_s(Workload())}
    s.close()
    assert s.handle("GET", "/healthz").status == 503
    reply = s.handle("GET", "/gate")
    assert (reply.status, reply.doc["result"]) == (503, "busy")


# --------------------------------------------------------------------------- over HTTP

@contextmanager
def serving(svc: gs.GateService) -> Iterator[str]:
    server = gs.listen(svc, "127.0.0.1:0")
    t = threading.Thread(target=gs.serve, args=(server,), daemon=True)
    t.start()
    try:
        yield gs.url_of(server)
    finally:
        server.shutdown()
        t.join(10)


class Blocking(Scripted):
    """A gate that measures until released (or until the service stops it)."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, request, settings, should_stop):
        self.started.set()
        while not self.release.is_set():
            if should_stop():
                raise NoVerdict("stopped before the measurement ended; no verdict")
            time.sleep(0.01)
        return super().__call__(request, settings, should_stop)


def test_a_second_request_while_one_measures_is_told_busy_with_retry_after():
    run = Blocking()
    with serving(service(run)) as url, httpx.Client(base_url=url, timeout=10, trust_env=False) as client:
        first: dict[str, Any] = {}
        t = threading.Thread(target=lambda: first.update(r=client.get("/gate")))
        t.start()
        assert run.started.wait(5)
        busy = client.get("/gate")
        assert busy.status_code == 503 and busy.json()["result"] == "busy", busy.text
        assert "one measurement at a time" in busy.json()["error"]
        assert 1 <= int(busy.headers["Retry-After"]) <= bound_s(Workload())
        assert client.get("/healthz").json()["busy"] is True
        run.release.set()
        t.join(10)
        assert first["r"].status_code == 200 and first["r"].json()["result"] == "pass"
        assert first["r"].headers["Content-Type"] == "application/json"
        assert client.get("/gate").status_code == 200  # free again
    assert len(run.requests) == 2


def test_stopping_the_service_stops_the_running_measurement_and_its_caller_gets_a_503():
    run = Blocking()
    svc = service(run)
    with serving(svc) as url:
        got: dict[str, Any] = {}
        t = threading.Thread(target=lambda: got.update(r=httpx.get(url + "/gate", timeout=10, trust_env=False)))
        t.start()
        assert run.started.wait(5)
        t0 = time.monotonic()
        svc.close()
        t.join(10)
        assert time.monotonic() - t0 < gs.CLOSE_WAIT_S
    assert got["r"].status_code == 503 and got["r"].json()["error"] == "the service is stopping; no verdict"


def test_a_caller_that_leaves_before_its_answer_costs_at_most_one_log_line_never_a_traceback(capfd):
    run, lines = Blocking(), []
    svc = gs.GateService(GateSettings(), gs.AllowList.of((B, C), []), (B,), (C,), run=run, log=lines.append)
    with serving(svc) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.get(url + "/gate", timeout=0.3, trust_env=False)  # Argo's timeoutSeconds, too short
        run.release.set()
        wait_for(lambda: not svc.handle("GET", "/healthz").doc["busy"], timeout=10, what="the measurement's end")
        time.sleep(0.2)  # the answer's write, after the lock is free
        again = httpx.get(url + "/gate", timeout=10, trust_env=False)
    assert again.status_code == 200  # the service goes on
    # Whether the write to the closed socket fails depends on when its RST arrives: if it does, one line.
    undelivered = [ln for ln in lines if "was not delivered" in ln]
    assert all(ln.startswith("gate service: the answer to 127.0.0.1 was not delivered (") for ln in undelivered)
    assert len(undelivered) <= 1 and "Traceback" not in capfd.readouterr().err
    server = gs.listen(svc, "127.0.0.1:0")  # the failed write itself, for certain
    try:
        raise BrokenPipeError(32, "Broken pipe")
    except BrokenPipeError:
        server.handle_error(None, ("10.0.0.9", 4711))
    server.server_close()
    assert lines[-1] == ("gate service: the answer to 10.0.0.9 was not delivered "
                         "(BrokenPipeError: [Errno 32] Broken pipe)")
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("headers, body, status", [
    ({"Content-Length": str(gs.BODY_MAX_BYTES + 1)}, b"", 413),
    ({}, None, 411),
])
def test_a_post_without_a_length_or_over_the_cap_is_refused_unread(headers, body, status):
    with serving(service()) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            sock.sendall(f"POST /gate HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + (body or b""))
            answer = b""
            while chunk := sock.recv(65536):  # the service closes the connection after its answer
                answer += chunk
    answer = answer.decode()
    assert answer.startswith(f"HTTP/1.1 {status} "), answer
    assert json.loads(answer.split("\r\n\r\n", 1)[1])["result"] == "error"


def test_the_service_measures_real_servers_and_answers_argo_over_http(tiny_sglang):  # noqa: F811 (the fixture)
    base, canary, slow = tiny_sglang(), tiny_sglang(), tiny_sglang(gap_s=0.04)
    svc = gs.GateService(GateSettings(QUICK, THRESHOLDS), gs.AllowList.of((base,), ["127.0.0.1"]), (base,), (),
                         log=lambda msg: None)
    with serving(svc) as url, httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        ok = client.get("/gate", params={"canary": canary})
        bad = client.post("/gate", json={"canary": [slow]})
    assert ok.status_code == 200 and ok.json()["result"] == "pass", ok.text
    assert bad.status_code == 200 and bad.json()["result"] == "fail", bad.text
    assert [s["url"] for s in bad.json()["servers"]] == [base, slow]
    assert bad.json()["servers"][1]["measurement"]["requests"] >= QUICK.min_requests


@pytest.mark.interrupts
def test_the_service_stops_on_sigterm_with_exit_0(start_cli):
    p = start_cli("gate", "--serve", "127.0.0.1:0", "--allow-host", "127.0.0.1")
    line = wait_for(lambda: next((ln for ln in p.stderr().splitlines() if ln.startswith("gate service on ")), None),
                    timeout=30, what="the service's first line")
    url = line.split()[3].rstrip(":")
    assert httpx.get(url + "/healthz", timeout=5, trust_env=False).json()["ok"] is True
    t0 = time.monotonic()
    p.signal(signal.SIGTERM)
    r = p.wait(timeout=15)
    assert r.code == 0 and time.monotonic() - t0 < 5, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "gate service stopped (SIGTERM)", r.stderr
    assert "allowed: 127.0.0.1" in line and "at most 94 s each" in line
