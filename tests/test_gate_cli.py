"""`ddtree-ops gate` and the gate between servers named by URL (gates/url_gate.py), fast tier: URL
checks, the probe, several baselines as one reference, the worst canary deciding, and the command's
exit codes and bounds, against tiny SGLang servers on 127.0.0.1 that stream with real sleeps (and a
socket that accepts and never answers)."""

from __future__ import annotations

import http.server
import json
import signal
import socket
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from typer.testing import CliRunner

from ddtree_ops.cli.cmd_gate import Marginal, exit_code
from ddtree_ops.cli.commands import app
from ddtree_ops.config.perfgate_settings import Thresholds
from ddtree_ops.config.workload_settings import Workload
from ddtree_ops.errors import InputError, NoVerdict
from ddtree_ops.gates.perfgate import Verdict
from ddtree_ops.gates.url_gate import GateRequest, GateSettings, bound_s, combine, parse_url, run_gate
from ddtree_ops.gates.workload import STOP_GRACE_S, Measurement
from ddtree_ops.testing.fake_host import fake_inventory
from kit import wait_for

# Loose limits where only speed differs on purpose (the servers below sleep; the machine adds
# jitter): a 2x slower token gap is marginal, 8x fails, the same server passes. (4x was meant to
# fail, nominally +300 % ITL against the +250 % limit; but the jitter lands on the baseline's
# 10 ms gaps, not on the slow one's 40: measured 11.7 → 40.7 ms, +247 %, marginal, on a loaded
# machine, and tok/s −55 % against −60 %. At 8x it is +580 % and −80 % with 3 ms of jitter.)
SLOWEST_GAP_S = 0.08
LOOSE = {"marginal_drop": 0.2, "fail_drop": 0.6, "ttft_p50_marginal": 2.0, "ttft_p50_fail": 5.0,
         "ttft_p99_marginal": 9.0, "ttft_p99_fail": 10.0, "itl_p50_marginal": 0.5, "itl_p50_fail": 2.5,
         "itl_p99_marginal": 9.0, "itl_p99_fail": 10.0}
THRESHOLDS = Thresholds(**LOOSE)
QUICK = Workload(concurrency=2, duration_s=0, min_requests=4, max_new_tokens=8, request_timeout_s=5)


# --------------------------------------------------------------------------- tiny SGLang servers

@dataclass
class Behaviour:
    """What a tiny server does: /health's status; /generate's status, or a stream of `tokens`
    chunks, the first after `first_s`, the others `gap_s` apart, each with `accept`."""

    health: int = 200
    generate: int = 200
    first_s: float = 0.03
    gap_s: float = 0.01
    tokens: int = 8
    accept: float | None = 2.0


def sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


class _Sglang(http.server.BaseHTTPRequestHandler):
    server: Any

    def _sleep(self, seconds: float) -> None:
        if self.server.stopping.wait(seconds):  # the test is over: end, and write no more
            raise ConnectionAbortedError("the test server is stopping")

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.seen.append(("GET", self.path, self.headers.get("Authorization")))
        self.send_response(self.server.behaviour.health)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:  # noqa: N802
        b: Behaviour = self.server.behaviour
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.seen.append(("POST", self.path, self.headers.get("Authorization")))
        if b.generate != 200:
            self.send_response(b.generate)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"boom")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for n in range(1, b.tokens + 1):
            self._sleep(b.first_s if n == 1 else b.gap_s)
            meta: dict[str, Any] = {"completion_tokens": n, "finish_reason": None}
            if b.accept is not None:
                meta["spec_accept_length"] = b.accept
            self.wfile.write(sse({"text": "x" * n, "meta_info": meta}))
            self.wfile.flush()
        self.wfile.write(sse(b"[DONE]"))

    def log_message(self, *args: Any) -> None:
        pass


class _Quiet(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that left (the gate stopped its stream): a later test's captured stderr is not the place


@pytest.fixture
def tiny_sglang() -> Iterator[Any]:
    """tiny_sglang(**Behaviour fields) -> the URL of a tiny server on 127.0.0.1 (and its `.seen`)."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(**behaviour: Any) -> str:
        server = _Quiet(("127.0.0.1", 0), _Sglang)
        server.behaviour, server.seen, server.stopping = Behaviour(**behaviour), [], threading.Event()  # type: ignore
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    start.servers = servers  # type: ignore[attr-defined]
    yield start
    for s in servers:
        s.stopping.set()  # type: ignore[attr-defined]
        s.shutdown()
        s.server_close()


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A socket that accepts every connection and never answers a byte."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    t.join(5)
    for c in held:
        c.close()
    sock.close()


def refused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


def settings(**workload: Any) -> GateSettings:
    return GateSettings(replace(QUICK, **workload), THRESHOLDS)


# --------------------------------------------------------------------------- input

@pytest.mark.parametrize("given, normalised", [
    ("http://10.0.0.5:30000", "http://10.0.0.5:30000"),
    ("HTTP://GPU-1.Example:30000/", "http://gpu-1.example:30000"),
    ("https://gw.example/sglang/", "https://gw.example/sglang"),
    ("http://[FD00::5]:30000", "http://[fd00::5]:30000"),
    ("http://localhost", "http://localhost"),
])
def test_a_server_url_is_normalised(given, normalised):
    assert parse_url(given, "canary") == normalised


@pytest.mark.parametrize("given, why", [
    ("ftp://10.0.0.5", "must be an http:// or https:// URL"),
    ("10.0.0.5:30000", "must be an http:// or https:// URL"),
    ("http://", "needs a host name or an IP address"),
    ("http://bad_host:1", "needs a host name or an IP address"),
    ("http://u:secret@10.0.0.5", "credentials in a URL are refused"),
    ("http://10.0.0.5/?x=1", "without a query or fragment"),
    ("http://10.0.0.5#top", "without a query or fragment"),
    ("http://10.0.0.5:99999", "not a URL"),
    ("http://10.0.0.5:0", "port 0"),
    ("http://10.0.0.5/ x", "without spaces"),
    ("http://10.0.0.5/\x1b[2J", "printable"),
    ("", "must be a URL"),
    (None, "must be a URL"),
])
def test_a_server_url_that_is_not_http_with_a_host_and_nothing_more_is_refused(given, why):
    with pytest.raises(InputError, match="^canary .*" + why.replace("(", r"\(")):
        parse_url(given, "canary")


def test_each_side_needs_a_server_and_no_server_is_measured_twice():
    with pytest.raises(InputError, match="no baseline: give the URL of a baseline server"):
        GateRequest.of([], ["http://c:1"])
    with pytest.raises(InputError, match="no canary"):
        GateRequest.of(["http://b:1"], [])
    with pytest.raises(InputError, match=r"http://b:1 is given twice \(as baseline and as canary\)"):
        GateRequest.of(["http://b:1"], ["http://B:1/"])
    with pytest.raises(InputError, match="9 canary servers: at most 8"):
        GateRequest.of(["http://b:1"], [f"http://c{i}:1" for i in range(9)])
    r = GateRequest.of(["http://b:1", "http://b:2"], ["http://c:1"])
    assert r.servers() == [("baseline", "http://b:1"), ("baseline", "http://b:2"), ("canary", "http://c:1")]


def test_several_baselines_are_one_reference_per_server():
    a = Measurement(10, 0, 1000, 10.0, 0.1, 0.2, 0.01, 0.02, 2.0, ("HTTP 500: x",))
    b = Measurement(20, 2, 3000, 10.0, 0.3, 0.4, 0.03, 0.04, None, ("HTTP 500: x", "timeout"), stopped=True)
    c = combine([a, b])
    assert (c.requests, c.errors, c.output_tokens, c.wall_s) == (30, 2, 4000, 20.0)
    assert c.output_tps == pytest.approx(200.0)  # per server: (100 + 300) / 2, not 400
    assert c.error_rate == pytest.approx(2 / 30)  # pooled
    assert (c.ttft_p50_s, c.itl_p99_s) == (pytest.approx(0.2), pytest.approx(0.03))
    assert c.accept_length == 2.0  # the mean of the servers that report one
    assert c.error_examples == ("HTTP 500: x", "timeout") and c.stopped
    assert combine([a]) is a


# --------------------------------------------------------------------------- run_gate

def test_a_canary_like_its_baseline_passes_and_each_server_is_measured(tiny_sglang):
    base, canary = tiny_sglang(), tiny_sglang()
    out = run_gate(GateRequest.of([base], [canary]), settings())
    assert out.verdict is Verdict.PASS, out.report()
    assert [(m.role, m.url) for m in out.servers] == [("baseline", base), ("canary", canary)]
    assert all(m.measurement.requests >= 4 and m.measurement.errors == 0 for m in out.servers)
    assert out.baseline.accept_length == 2.0 and out.elapsed_s < bound_s(QUICK)


def test_the_worst_canary_decides_and_each_is_judged_on_its_own(tiny_sglang):
    base, fine, slow = tiny_sglang(), tiny_sglang(), tiny_sglang(gap_s=SLOWEST_GAP_S)
    out = run_gate(GateRequest.of([base], [fine, slow]), settings())
    by_url = {j.url: j.verdict.verdict for j in out.canaries}
    assert by_url == {fine: Verdict.PASS, slow: Verdict.FAIL}, out.report()
    assert out.verdict is Verdict.FAIL and out.worst.url == slow
    assert out.summary().startswith(f"fail: worst of 2 canaries {slow}: fail: ")
    assert all(r.startswith(slow + ": ") for r in out.reasons())
    report = out.report()
    assert f"canary {fine}: pass" in report and f"canary {slow}: fail" in report and "output tok/s" in report


def test_a_canary_that_fails_every_request_fails(tiny_sglang):
    out = run_gate(GateRequest.of([tiny_sglang()], [tiny_sglang(generate=500)]), settings())
    assert out.verdict is Verdict.FAIL
    assert any(r.startswith("error rate") for r in out.reasons()), out.reasons()
    assert out.worst.verdict.canary.error_examples == ("HTTP 500: boom",)


def test_a_baseline_without_a_successful_request_gives_no_verdict(tiny_sglang):
    base = tiny_sglang(generate=500)
    with pytest.raises(NoVerdict, match=f"baseline {base}: no successful request \\(HTTP 500: boom\\); nothing to "
                                        f"compare the canary with"):
        run_gate(GateRequest.of([base], [tiny_sglang()]), settings())


def test_a_server_that_is_unreachable_silent_or_not_ready_gives_no_verdict_within_the_probe_bound(
        tiny_sglang, silent_server):
    refused, loading, locked = refused_url(), tiny_sglang(health=503), tiny_sglang(health=401)
    t0 = time.monotonic()
    with pytest.raises(NoVerdict) as e:
        run_gate(GateRequest.of([refused, loading], [silent_server, locked]), settings(request_timeout_s=1))
    took = time.monotonic() - t0
    msg = str(e.value)
    assert f"baseline {refused}: cannot connect (" in msg
    assert f"baseline {loading}: GET /health answered HTTP 503: not ready" in msg
    assert f"canary {silent_server}: no answer to GET /health within 1 s" in msg
    assert f"canary {locked}: GET /health answered HTTP 401: the server wants an API key" in msg
    assert msg.endswith("; no verdict") and "\n" not in msg
    assert took < 1 + 2.0, took  # the silent server's probe ends at its 1 s


def test_a_canary_that_stops_answering_after_its_probe_is_cut_at_the_bound_and_fails(tiny_sglang):
    base, stuck = tiny_sglang(), tiny_sglang(first_s=30)
    # 2 streams, 4 requests: 2 time out after 1 s, the 2 after them by the cut at 2 s (or just before it)
    w = replace(QUICK, request_timeout_s=1)
    t0 = time.monotonic()
    out = run_gate(GateRequest.of([base], [stuck]), GateSettings(w, THRESHOLDS))
    assert time.monotonic() - t0 < bound_s(w)
    assert out.verdict is Verdict.FAIL, out.report()
    m = out.worst.verdict.canary
    assert m.stopped and m.requests == m.errors and m.requests in (2, 3), m
    assert m.error_examples[0].startswith("timeout"), m
    assert out.notes == (f"canary {stuck}: cut at the gate's bound after {m.requests} finished request(s); "
                         f"judged on those",)


def test_the_api_key_goes_to_every_server_as_a_bearer_token(tiny_sglang):
    base, canary = tiny_sglang(), tiny_sglang()
    run_gate(GateRequest.of([base], [canary]), GateSettings(QUICK, THRESHOLDS, api_key="k-123"))
    for server in tiny_sglang.servers:
        assert {auth for _, _, auth in server.seen} == {"Bearer k-123"}
        assert ("GET", "/health", "Bearer k-123") in server.seen


# --------------------------------------------------------------------------- the command

@pytest.mark.parametrize("verdict, marginal, code", [
    ("pass", Marginal.PASS, 0), ("pass", Marginal.FAIL, 0),
    ("marginal", Marginal.PASS, 0), ("marginal", Marginal.FAIL, 1),
    ("fail", Marginal.PASS, 1), ("fail", Marginal.FAIL, 1),
])
def test_the_exit_code_of_each_verdict(verdict, marginal, code):
    assert exit_code(verdict, marginal) == code


def gate_inventory(tmp_path: Path, **perf_gate: Any) -> Path:
    doc = fake_inventory(2, perf_gate={"duration_s": 1, "min_requests": 4, "concurrency": 2, "max_new_tokens": 8,
                                       "request_timeout_s": 5, "thresholds": LOOSE, **perf_gate})
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, ["gate", *args], catch_exceptions=False)


def test_gate_exits_0_on_pass_1_on_fail_and_a_marginal_verdict_as_its_flag_says(tiny_sglang, tmp_path):
    inv = str(gate_inventory(tmp_path))
    base, same = tiny_sglang(), tiny_sglang()
    slower, slowest = tiny_sglang(gap_s=0.02), tiny_sglang(gap_s=SLOWEST_GAP_S)
    ok = invoke("-i", inv, "--baseline", base, "--canary", same, "--json")
    assert ok.exit_code == 0, ok.output
    doc = json.loads(ok.stdout)
    assert doc["ok"] and doc["exit_code"] == 0 and doc["verdict"] == "pass" and doc["marginal"] == "pass"
    assert {r["metric"] for r in doc["rows"]} >= {"output_tps", "itl_p50_s", "accept_length"}
    assert doc["settings_from"] == inv and doc["thresholds"]["fail_drop"] == 0.6
    assert doc["workload"]["duration_s"] == 1 and [s["url"] for s in doc["servers"]] == [base, same]
    marginal = invoke("-i", inv, "--baseline", base, "--canary", slower, "--marginal", "fail")
    assert marginal.exit_code == 1 and marginal.stdout.startswith("marginal: "), marginal.output
    assert f"canary {slower}: marginal" in marginal.stdout and "output tok/s" in marginal.stdout
    failed = invoke("-i", inv, "--baseline", base, "--canary", slowest)
    assert failed.exit_code == 1 and failed.stdout.startswith("fail: "), failed.output
    assert "measuring 1 baseline and 1 canary server(s) side by side" in failed.stderr


@pytest.mark.parametrize("args, message", [
    (["--baseline", "ftp://b", "--canary", "http://c:1"], "error: baseline 'ftp://b': must be an http:// or https://"),
    (["--canary", "http://c:1"], "error: no baseline: give the URL of a baseline server (--baseline URL)"),
    (["--baseline", "http://b:1", "--canary", "http://c:1", "--duration", "0"], "error: --duration must be a number"),
    (["--baseline", "http://b:1", "--canary", "http://c:1", "--concurrency", "65"], "error: --concurrency must be"),
    (["--baseline", "http://b:1", "--canary", "http://c:1", "--host", "fh1"], "error: --host picks a host's"),
    (["--baseline", "http://b:1", "--canary", "http://c:1", "--api-key-env", "DDTREE_TEST_UNSET_VAR"],
     "error: --api-key-env DDTREE_TEST_UNSET_VAR: the variable is not set"),
    (["--baseline", "http://b:1", "--canary", "http://c:1", "--allow-host", "b"], "error: --allow-host is for --serve"),
    (["--serve", "127.0.0.1:0", "--allow-host", "b", "--json"], "error: --json and --marginal are for one run"),
    (["--serve", "127.0.0.1:0"], "error: --serve with nothing to measure"),
    (["--serve", "127.0.0.1:0", "--allow-host", "*"], "error: --allow-host '*': must be HOST"),
    (["--serve", "nowhere", "--allow-host", "b"], "error: --serve 'nowhere': must be HOST:PORT"),
])
def test_bad_input_is_exit_2_with_one_line_and_no_traceback(args, message):
    r = invoke(*args)
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines()[-1].startswith(message), r.stderr
    assert "Traceback" not in r.output
    if "--json" in args:  # the error as the one JSON document
        assert json.loads(r.stdout)["exit_code"] == 2 and r.stderr.startswith("error: ")
    else:
        assert r.stdout == ""


def test_an_unreachable_and_a_silent_server_end_the_command_within_its_bound_with_exit_2(silent_server):
    refused = refused_url()
    t0 = time.monotonic()
    r = invoke("--baseline", refused, "--canary", silent_server, "--request-timeout", "1", "--json")
    took = time.monotonic() - t0
    assert r.exit_code == 2 and took < 3, (took, r.output)
    doc = json.loads(r.stdout)
    assert doc["error"] == "NoVerdict" and doc["exit_code"] == 2
    assert f"baseline {refused}: cannot connect" in doc["message"]
    assert f"canary {silent_server}: no answer to GET /health within 1 s" in doc["message"]
    assert r.stderr.strip().splitlines()[-1] == f"error: {doc['message']}"


def test_hosts_whose_perf_gate_differs_need_host_and_an_unknown_host_is_named(tmp_path):
    doc = fake_inventory(2, perf_gate={"duration_s": 1})
    doc["all"]["hosts"]["fh2"] = {"perf_gate": {"duration_s": 2}}
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump(doc))
    r = invoke("-i", str(inv), "--baseline", "http://b:1", "--canary", "http://c:1")
    assert r.exit_code == 2 and "the hosts' perf_gate settings differ; name the host" in r.stderr, r.output
    r = invoke("-i", str(inv), "--host", "fh9", "--baseline", "http://b:1", "--canary", "http://c:1")
    assert r.exit_code == 2 and "no host named 'fh9'" in r.stderr, r.output


@pytest.mark.interrupts
def test_sigterm_stops_a_measuring_gate_within_the_grace_with_exit_143(tiny_sglang, start_cli):
    base, canary = tiny_sglang(tokens=10_000, gap_s=0.05), tiny_sglang(tokens=10_000, gap_s=0.05)  # long streams
    p = start_cli("gate", "--baseline", base, "--canary", canary, "--duration", "30", "--request-timeout", "60")
    wait_for(lambda: "measuring 1 baseline and 1 canary" in p.stderr(), timeout=30, what="the measurement")
    t0 = time.monotonic()
    p.signal(signal.SIGTERM)
    r = p.wait(timeout=30)
    assert r.code == 143 and time.monotonic() - t0 < STOP_GRACE_S + 2, (r.code, r.stderr)
    assert r.stderr.strip().splitlines()[-1] == "interrupted (SIGTERM)" and "Traceback" not in r.stderr, r.stderr
