"""The canary performance gate (fast tier): verdicts from data and
measure() against a scripted SSE stream (httpx.MockTransport, a test clock) and a tiny local
HTTP server on 127.0.0.1 streaming with real sleeps."""

from __future__ import annotations

import _thread
import http.server
import json
import threading
from dataclasses import replace
from typing import Any

import httpx
import pytest

from ddtree_ops.config.perfgate_settings import Thresholds
from ddtree_ops.config.workload_settings import DEFAULT_PROMPTS, Workload
from ddtree_ops.gates.perfgate import Verdict, compare, format_rows
from ddtree_ops.gates.workload import (
    ERROR_CUTOFF,
    Measurement,
    measure,
    percentile,
    sse_events,
)

# --------------------------------------------------------------------------- helpers


class Clock:
    """A test clock: time moves only when a scripted stream says so."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


DONE = sse(b"[DONE]")


def chunk(tokens: int, accept: float | None = None, finish: dict | None = None, text: str = "x") -> bytes:
    meta: dict[str, Any] = {"completion_tokens": tokens, "finish_reason": finish}
    if accept is not None:
        meta["spec_accept_length"] = accept
    return sse({"text": text * tokens, "meta_info": meta})


def scripted(clock: Clock | None, scripts: list[tuple[int, float, list[tuple[float, bytes]]]],
             bodies: list[dict] | None = None) -> httpx.Client:
    """A client whose i-th request gets scripts[i]: (status, seconds to the headers, [(seconds
    before the part, the part)]). A part that is an exception is raised there."""
    lock = threading.Lock()

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.method == "POST" and request.url.path == "/generate"
        with lock:
            i = len(bodies_)
            bodies_.append(json.loads(request.content))
        status, head_s, parts = scripts[i % len(scripts)]
        if clock:
            clock.t += head_s

        def body():
            for delay, part in parts:
                if clock:
                    clock.t += delay
                if isinstance(part, BaseException):
                    raise part
                yield part
        return httpx.Response(status, content=body(), headers={"content-type": "text/event-stream"})

    bodies_ = bodies if bodies is not None else []
    return httpx.Client(base_url="http://server", transport=httpx.MockTransport(handler))


def ok_stream(tokens: int = 3) -> list[tuple[float, bytes]]:
    return [(0.0, chunk(n)) for n in range(1, tokens + 1)] + [(0.0, DONE)]


# --------------------------------------------------------------------------- pure helpers

@pytest.mark.parametrize("values, p, expected", [
    ([], 50, None),
    ([7.0], 99, 7.0),
    ([4.0, 1.0, 3.0, 2.0], 50, 2.0),  # ceil(0.5 · 4) = 2nd smallest: nearest rank, no interpolation
    ([4.0, 1.0, 3.0, 2.0], 99, 4.0),
    ([float(i) for i in range(1, 101)], 99, 99.0),
    ([float(i) for i in range(1, 101)], 50, 50.0),
    ([float(i) for i in range(1, 201)], 99, 198.0),
])
def test_percentile_is_nearest_rank(values, p, expected):
    assert percentile(values, p) == expected


def test_sse_events_follow_the_event_stream_format():
    lines = [": a comment", "event: x", "data: {\"a\": 1}", "", "", "data:two", "data: lines", "", "id: 3",
             "data: [DONE]"]  # the last event has no blank line after it
    assert list(sse_events(lines)) == ['{"a": 1}', "two\nlines", "[DONE]"]


def test_measurement_round_trips_through_its_dict():
    m = Measurement(10, 2, 640, 4.0, 0.1, 0.3, 0.01, 0.05, 3.2, ("HTTP 500: boom",), stopped=True)
    d = json.loads(json.dumps(m.as_dict()))
    assert d["error_rate"] == pytest.approx(0.2) and d["output_tps"] == pytest.approx(160.0)
    assert Measurement.from_dict(d) == m


# --------------------------------------------------------------------------- compare

# 200 tok/s, TTFT 200/400 ms, ITL 30/60 ms, accept length 4.0, no errors.
BASE = Measurement(requests=100, errors=0, output_tokens=20_000, wall_s=100.0, ttft_p50_s=0.200,
                   ttft_p99_s=0.400, itl_p50_s=0.030, itl_p99_s=0.060, accept_length=4.0)


def tps(v: float) -> dict:
    return {"output_tokens": round(v * 100)}


CASES = [
    # (case, baseline changes, canary changes, metric, verdict)
    ("tps -2%", {}, tps(196), "output_tps", Verdict.PASS),
    ("tps -5%", {}, tps(190), "output_tps", Verdict.MARGINAL),
    ("tps -15%", {}, tps(170), "output_tps", Verdict.FAIL),
    ("tps +20%", {}, tps(240), "output_tps", Verdict.PASS),
    ("tps floor", tps(5.0), tps(4.2), "output_tps", Verdict.PASS),  # −16 % but 0.8 tok/s
    ("ttft p50 +5%", {}, {"ttft_p50_s": 0.210}, "ttft_p50_s", Verdict.PASS),
    ("ttft p50 +15%", {}, {"ttft_p50_s": 0.230}, "ttft_p50_s", Verdict.MARGINAL),
    ("ttft p50 +50%", {}, {"ttft_p50_s": 0.300}, "ttft_p50_s", Verdict.FAIL),
    ("ttft floor", {"ttft_p50_s": 0.002}, {"ttft_p50_s": 0.003}, "ttft_p50_s", Verdict.PASS),  # +50 %, 1 ms
    ("ttft p99 +12.5% (lenient)", {}, {"ttft_p99_s": 0.450}, "ttft_p99_s", Verdict.PASS),
    ("ttft p99 +25%", {}, {"ttft_p99_s": 0.500}, "ttft_p99_s", Verdict.MARGINAL),
    ("ttft p99 +75%", {}, {"ttft_p99_s": 0.700}, "ttft_p99_s", Verdict.FAIL),
    ("itl p50 +5%", {}, {"itl_p50_s": 0.0315}, "itl_p50_s", Verdict.PASS),
    ("itl p50 +20%", {}, {"itl_p50_s": 0.036}, "itl_p50_s", Verdict.MARGINAL),
    ("itl p50 +50%", {}, {"itl_p50_s": 0.045}, "itl_p50_s", Verdict.FAIL),
    ("itl floor", {"itl_p50_s": 0.004}, {"itl_p50_s": 0.0055}, "itl_p50_s", Verdict.PASS),  # +37 %, 1.5 ms
    ("itl p99 +15%", {}, {"itl_p99_s": 0.069}, "itl_p99_s", Verdict.PASS),
    ("itl p99 +30%", {}, {"itl_p99_s": 0.078}, "itl_p99_s", Verdict.MARGINAL),
    ("itl p99 +70%", {}, {"itl_p99_s": 0.102}, "itl_p99_s", Verdict.FAIL),
    ("errors none", {}, {}, "error_rate", Verdict.PASS),
    ("errors 0.5% new", {}, {"requests": 200, "errors": 1}, "error_rate", Verdict.MARGINAL),
    ("errors 3%", {}, {"errors": 3}, "error_rate", Verdict.FAIL),
    ("errors as before", {"requests": 200, "errors": 1}, {"requests": 200, "errors": 1}, "error_rate",
     Verdict.PASS),
    ("errors 5% as before", {"errors": 5}, {"errors": 5}, "error_rate", Verdict.FAIL),  # absolute
    ("accept -2.5%", {}, {"accept_length": 3.9}, "accept_length", Verdict.PASS),
    ("accept -7.5%", {}, {"accept_length": 3.7}, "accept_length", Verdict.MARGINAL),
    ("accept -20%", {}, {"accept_length": 3.2}, "accept_length", Verdict.FAIL),
    ("accept floor", {"accept_length": 0.5}, {"accept_length": 0.42}, "accept_length", Verdict.PASS),
    ("accept gone", {}, {"accept_length": None}, "accept_length", Verdict.FAIL),  # speculative decoding off
    ("accept new", {"accept_length": None}, {}, "accept_length", Verdict.PASS),
    ("accept never", {"accept_length": None}, {"accept_length": None}, "accept_length", Verdict.PASS),
]


@pytest.mark.parametrize("case, base_changes, canary_changes, metric, expected", CASES, ids=[c[0] for c in CASES])
def test_each_metric_passes_is_marginal_or_fails_by_its_limits(case, base_changes, canary_changes, metric, expected):
    base = replace(BASE, **base_changes)
    v = compare(base, replace(base, **canary_changes))
    rows = {r.metric: r for r in v.rows}
    assert rows[metric].verdict is expected, format_rows(v.rows)
    others = [r for r in v.rows if r.metric != metric and r.verdict is not Verdict.PASS]
    assert not others, format_rows(v.rows)  # the change is blamed on its own metric only
    assert v.verdict is expected
    assert len(v.reasons) == (expected is not Verdict.PASS)
    if expected is not Verdict.PASS:
        assert v.reasons[0].startswith(rows[metric].label) and rows[metric].reason == v.reasons[0]


def test_thresholds_are_the_callers():
    canary = replace(BASE, **tps(190))  # −5 %: marginal by default
    assert compare(BASE, canary).verdict is Verdict.MARGINAL
    assert compare(BASE, canary, Thresholds(marginal_drop=0.06)).verdict is Verdict.PASS
    assert compare(BASE, canary, Thresholds(fail_drop=0.04, marginal_drop=0.01)).verdict is Verdict.FAIL


def test_summary_names_the_worst_metric_with_its_change_and_limit():
    base = replace(BASE, output_tokens=21_200)
    v = compare(base, replace(base, output_tokens=15_030))
    assert v.summary() == "fail: output tok/s 212.0 → 150.3 (−29.1 %, limit −10 %)"
    ok = compare(base, replace(base, output_tokens=21_500))
    assert ok.summary() == "pass: output tok/s 212.0 → 215.0 (+1.4 %); all 7 metrics within limits"


def test_the_overall_verdict_is_the_worst_and_fails_are_listed_first():
    v = compare(BASE, replace(BASE, accept_length=3.7, ttft_p50_s=0.300))  # marginal, then fail
    assert v.verdict is Verdict.FAIL
    assert [r.split()[0] for r in v.reasons] == ["TTFT", "accept"]
    assert v.summary().startswith("fail: TTFT p50 200.0 ms → 300.0 ms (+50.0 %, limit +25 %)")
    assert v.summary().endswith("(+1 more)")


def test_a_canary_without_successful_requests_fails_its_latencies():
    dead = Measurement(requests=10, errors=10, output_tokens=0, wall_s=1.0, ttft_p50_s=None, ttft_p99_s=None,
                       itl_p50_s=None, itl_p99_s=None, accept_length=None)
    v = compare(BASE, dead)
    failing = {r.metric for r in v.rows if r.verdict is Verdict.FAIL}
    assert failing == {"output_tps", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "error_rate",
                       "accept_length"}
    assert any("no canary value" in r for r in v.reasons)
    assert any("speculative decoding off" in r for r in v.reasons)


def test_peers_faster_than_the_canary_fail_it_even_when_the_baseline_agrees():
    peers = replace(BASE, **tps(250))
    v = compare(BASE, BASE, peers=peers)  # canary = baseline: −20 % against the peers
    row = next(r for r in v.rows if r.metric == "output_tps")
    assert v.verdict is Verdict.FAIL and row.verdict is Verdict.FAIL and row.against == "peers"
    assert row.change == pytest.approx(-0.2) and row.peers == pytest.approx(250.0)
    assert v.summary() == "fail: output tok/s peers 250.0 → canary 200.0 (−20.0 %, limit −10 %)"
    assert compare(BASE, BASE).verdict is Verdict.PASS  # the same canary without peers


def test_the_worse_of_baseline_and_peers_counts():
    canary = replace(BASE, **tps(190))  # −5 % against the baseline: marginal
    slow_peers = replace(BASE, **tps(150))  # the canary is +27 % against them: pass
    v = compare(BASE, canary, peers=slow_peers)
    row = next(r for r in v.rows if r.metric == "output_tps")
    assert v.verdict is Verdict.MARGINAL and row.against == "baseline" and row.change == pytest.approx(-0.05)
    assert all(r.against == "baseline" for r in v.rows)  # ties (pass and pass) go to the baseline
    # Peers with errors do not excuse a canary's: the absolute limit fails it either way.
    erring = replace(BASE, errors=5)
    assert compare(erring, erring, peers=erring).verdict is Verdict.FAIL
    # Peers' TTFT much lower: the canary fails against them.
    assert compare(BASE, BASE, peers=replace(BASE, ttft_p50_s=0.1)).verdict is Verdict.FAIL


def test_the_verdict_as_json():
    peers = replace(BASE, itl_p99_s=0.05)
    v = compare(BASE, replace(BASE, **tps(190)), peers=peers)
    d = json.loads(json.dumps(v.as_dict()))
    assert d["verdict"] == "marginal"
    assert d["baseline"]["output_tps"] == pytest.approx(200.0) and d["canary"]["output_tps"] == pytest.approx(190.0)
    assert d["peers"]["itl_p99_s"] == pytest.approx(0.05)
    assert [r["metric"] for r in d["rows"]] == ["output_tps", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                                               "error_rate", "accept_length"]
    tps_row = d["rows"][0]
    assert {"metric", "baseline", "canary", "peers", "change", "verdict", "limit"} <= set(tps_row)
    assert tps_row["verdict"] == "marginal" and tps_row["peers"] == pytest.approx(200.0)
    assert tps_row["limit"].startswith("marginal −3 %, fail −10 %")
    assert d["reasons"] == [v.reasons[0]] and d["thresholds"]["fail_drop"] == 0.10
    assert json.loads(json.dumps(compare(BASE, BASE).as_dict()))["peers"] is None


def test_format_rows_prints_every_metric():
    v = compare(BASE, replace(BASE, accept_length=None, ttft_p50_s=0.3), peers=BASE)
    text = format_rows(v.rows)
    lines = text.splitlines()
    assert len(lines) == 8 and lines[0].split()[:3] == ["metric", "baseline", "canary"]
    ttft = next(line for line in lines if line.startswith("TTFT p50"))
    assert "300.0 ms" in ttft and "+50.0 %" in ttft and "fail" in ttft
    accept = next(line for line in lines if line.startswith("accept length"))
    assert "4.00" in accept and " - " in accept and "fail" in accept


# --------------------------------------------------------------------------- measure: scripted streams

def test_measure_times_first_tokens_and_each_token_after_them():
    clock = Clock()
    # Request 0: headers after 0.1 s, a chunk with no token yet, the first token at 0.3 s, then
    # one token after 0.05 s, one after 0.05 s, four in one speculative step after 0.04 s, a last
    # chunk that adds none. Request 1 the same, with a slower first token and a 0.08 s gap.
    def script(ttft_rest: float, gap: float, accepts: list[float]) -> tuple[int, float, list]:
        return (200, 0.1, [(0.1, chunk(0)), (ttft_rest, chunk(1, accepts[0])), (0.05, chunk(2, accepts[1])),
                           (gap, chunk(3, accepts[2])), (0.04, chunk(7, accepts[3])),
                           (0.0, chunk(7, accepts[3], finish={"type": "length", "length": 7})), (0.0, DONE)])
    bodies: list[dict] = []
    client = scripted(clock, [script(0.1, 0.05, [1.0, 3.5, 2.0, 2.0]), script(0.3, 0.08, [1.0, 1.0, 3.0, 3.0])],
                      bodies)
    w = Workload(concurrency=1, duration_s=0.4, min_requests=2, max_new_tokens=7, temperature=0.5, top_p=0.8)
    m = measure(client, w, clock=clock)
    # Request 0 ends at 0.44 s, past the duration, but min_requests asks for a second one.
    assert (m.requests, m.errors, m.output_tokens) == (2, 0, 14)
    assert m.wall_s == pytest.approx(0.44 + 0.67)
    assert m.output_tps == pytest.approx(14 / 1.11)
    assert m.ttft_p50_s == pytest.approx(0.3) and m.ttft_p99_s == pytest.approx(0.5)
    # One sample per token: [.05, .05, .01 ×4] and [.05, .08, .01 ×4]; p50 is the 6th of 12.
    assert m.itl_p50_s == pytest.approx(0.01) and m.itl_p99_s == pytest.approx(0.08)
    assert m.accept_length == pytest.approx(2.5)  # the last value of each request, averaged
    assert not m.stopped and m.error_examples == ()
    assert bodies == [{"text": DEFAULT_PROMPTS[i], "stream": True,
                       "sampling_params": {"temperature": 0.5, "top_p": 0.8, "max_new_tokens": 7}} for i in (0, 1)]


def test_measure_keeps_sending_until_the_duration_is_over():
    clock = Clock()
    client = scripted(clock, [(200, 0.0, [(0.25, chunk(1)), (0.0, chunk(2)), (0.0, DONE)])])
    m = measure(client, Workload(concurrency=1, duration_s=1.0, min_requests=1), clock=clock)
    assert m.requests == 4 and m.output_tokens == 8 and m.wall_s == pytest.approx(1.0)
    assert m.accept_length is None and m.itl_p50_s == 0.0  # both tokens in the same instant


def test_measure_runs_concurrency_requests_at_once():
    arrived = threading.Barrier(4, timeout=5)  # breaks (and the run raises) unless 4 are in flight together
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        if len(bodies) <= 4:
            arrived.wait()
        return httpx.Response(200, content=b"".join(p for _, p in ok_stream(2)))

    client = httpx.Client(base_url="http://server", transport=httpx.MockTransport(handler))
    m = measure(client, Workload(concurrency=4, duration_s=0, min_requests=10))
    assert m.requests == 10 and m.errors == 0 and m.output_tokens == 20
    assert sorted(b["text"] for b in bodies) == sorted(DEFAULT_PROMPTS[i % 8] for i in range(10))


BAD_STREAMS = [
    ("http 500", (500, 0.0, [(0.0, b"internal boom")]), "HTTP 500: internal boom"),
    ("error chunk", (200, 0.0, [(0.0, chunk(1)), (0.0, sse({"error": {"message": "bad sampling"}})), (0.0, DONE)]),
     "stream error: 'bad sampling'"),
    ("abort", (200, 0.0, [(0.0, chunk(1)), (0.0, chunk(1, finish={"type": "abort", "message": "shutting down"})),
                          (0.0, DONE)]), "aborted by the server: 'shutting down'"),
    ("no done", (200, 0.0, [(0.0, chunk(1)), (0.0, chunk(2))]), "ended without data: [DONE]"),
    ("not json", (200, 0.0, [(0.0, chunk(1)), (0.0, b"data: {oops\n\n"), (0.0, DONE)]), "bad stream: not JSON"),
    ("no tokens field", (200, 0.0, [(0.0, sse({"text": "a", "meta_info": {}})), (0.0, DONE)]),
     "without meta_info.completion_tokens"),
    ("tokens backwards", (200, 0.0, [(0.0, chunk(3)), (0.0, chunk(2)), (0.0, DONE)]), "went back from 3 to 2"),
    ("reset", (200, 0.0, [(0.0, chunk(1)), (0.0, httpx.ReadError("connection reset"))]), "ReadError: connection reset"),
    ("read timeout", (200, 0.0, [(0.0, httpx.ReadTimeout("slow"))]), "timeout (no answer within 60 s)"),
    ("too slow overall", (200, 0.0, [(0.0, chunk(1)), (61.0, chunk(2)), (0.0, DONE)]),
     "timeout (not finished within 60 s)"),
]


@pytest.mark.parametrize("case, script, message", BAD_STREAMS, ids=[c[0] for c in BAD_STREAMS])
def test_each_kind_of_failed_request_is_an_error(case, script, message):
    clock = Clock()
    m = measure(scripted(clock, [script]), Workload(concurrency=1, duration_s=0, min_requests=1), clock=clock)
    assert (m.requests, m.errors, m.output_tokens) == (1, 1, 0)
    assert m.error_rate == 1.0 and m.ttft_p50_s is None
    assert len(m.error_examples) == 1 and message in m.error_examples[0], m.error_examples


def test_errors_count_but_their_tokens_and_latencies_do_not():
    clock = Clock()
    scripts = [(200, 0.0, [(0.1, chunk(1, 2.0)), (0.02, chunk(3, 2.0)), (0.0, DONE)]),  # ok: 3 tokens
               (500, 0.0, [(0.0, b"boom")]),
               (200, 0.0, [(5.0, chunk(1, 9.0)), (5.0, chunk(40, 9.0))])]  # broken: slow, 40 tokens, no [DONE]
    m = measure(scripted(clock, scripts), Workload(concurrency=1, duration_s=0, min_requests=6), clock=clock)
    assert (m.requests, m.errors, m.output_tokens) == (6, 4, 6)
    assert m.error_rate == pytest.approx(4 / 6)
    assert m.ttft_p99_s == pytest.approx(0.1) and m.itl_p99_s == pytest.approx(0.01) and m.accept_length == 2.0
    assert m.error_examples == ("HTTP 500: boom", "bad stream: ended without data: [DONE]")  # distinct only


def test_a_server_failing_everything_is_given_up_on_quickly():
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(503, text="loading")

    client = httpx.Client(base_url="http://server", transport=httpx.MockTransport(handler))
    # should_stop: a backstop so that a run without the cut-off fails this test instead of hanging it.
    m = measure(client, Workload(concurrency=2, duration_s=600, min_requests=1), should_stop=lambda: len(calls) > 200)
    assert m.errors == m.requests == len(calls) and not m.stopped
    assert ERROR_CUTOFF <= m.requests <= ERROR_CUTOFF + 2
    assert m.error_examples == ("HTTP 503: loading",)


def test_should_stop_ends_the_run_and_closes_the_open_stream():
    stop = threading.Event()
    rest_sent: list[int] = []
    seen: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(1)

        def body():
            yield chunk(1)
            if len(seen) == 3:
                stop.set()  # the operator presses Ctrl-C during the third request
            yield chunk(2)
            rest_sent.append(len(seen))
            yield DONE
        return httpx.Response(200, content=body())

    client = httpx.Client(base_url="http://server", transport=httpx.MockTransport(handler))
    m = measure(client, Workload(concurrency=1, duration_s=600, min_requests=100), should_stop=stop.is_set)
    assert m.stopped and m.requests == 2 and m.errors == 0 and m.output_tokens == 4
    assert rest_sent == [1, 2]  # the third stream was closed before its end was read
    assert len(seen) == 3


@pytest.mark.interrupts
def test_ctrl_c_stops_the_workers_and_is_raised(sigint_raises):
    seen: list[int] = []
    finished: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(1)
        if len(seen) == 3:
            _thread.interrupt_main()  # Ctrl-C in the thread that called measure()

        def body():
            for n in range(1, 6):
                threading.Event().wait(0.01)
                yield chunk(n)
            finished.append(1)
            yield DONE
        return httpx.Response(200, content=body())

    client = httpx.Client(base_url="http://server", transport=httpx.MockTransport(handler))
    with pytest.raises(KeyboardInterrupt):
        measure(client, Workload(concurrency=2, duration_s=600, min_requests=1),
                should_stop=lambda: len(seen) > 200)  # a backstop: without Ctrl-C handling the test ends
    assert not [t for t in threading.enumerate() if t.name.startswith("perfgate-") and t.is_alive()]
    # Stopped soon after the interrupt (a loaded machine delivers it late: a few more requests may
    # start), long before the backstop's 200.
    assert len(seen) <= 40 and len(finished) <= 40


def test_a_bug_in_a_worker_is_raised_not_counted():
    def handler(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("transport bug")

    client = httpx.Client(base_url="http://server", transport=httpx.MockTransport(handler))
    with pytest.raises(RuntimeError, match="transport bug"):
        measure(client, Workload(concurrency=2, duration_s=0, min_requests=4))


# --------------------------------------------------------------------------- measure: a real local server

class _Streamer(http.server.BaseHTTPRequestHandler):
    """SGLang's streaming /generate in miniature: the first token after 60 ms, then one every
    20 ms; a prompt containing BREAK gets one token and then a closed connection."""

    tokens = 4

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.auth.append(self.headers.get("Authorization"))  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for n in range(1, self.tokens + 1):
            threading.Event().wait(0.06 if n == 1 else 0.02)
            self.wfile.write(chunk(n, accept=2.0))
            self.wfile.flush()
            if "BREAK" in body["text"]:
                return  # HTTP/1.0, no length: the stream just ends, without [DONE]
        self.wfile.write(DONE)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def streaming_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Streamer)
    server.daemon_threads = True
    server.auth = []  # type: ignore[attr-defined]
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server
    server.shutdown()
    server.server_close()


def test_measure_against_a_streaming_http_server(streaming_server):
    host, port = streaming_server.server_address
    with httpx.Client(base_url=f"http://{host}:{port}", headers={"Authorization": "Bearer k"},
                      trust_env=False) as client:
        w = Workload(prompts=("one", "two", "BREAK", "four"), concurrency=2, duration_s=0, min_requests=4,
                     request_timeout_s=5)
        m = measure(client, w)
    assert (m.requests, m.errors, m.output_tokens) == (4, 1, 12)
    assert m.error_examples == ("bad stream: ended without data: [DONE]",)
    assert 0.06 <= m.ttft_p50_s <= m.ttft_p99_s < 1.0
    assert 0.015 <= m.itl_p50_s < 0.5
    assert m.accept_length == 2.0
    assert m.output_tps == pytest.approx(12 / m.wall_s) and m.wall_s >= 0.12
    assert streaming_server.auth == ["Bearer k"] * 4  # the client's API key header goes with every request
