"""Measuring the performance gate's workload against a server.

  measure(client, workload)    run it: streaming POST /generate, TTFT, inter-token latency, tok/s

What is sent (`Workload`, the prompts file) is settings: config/workload_settings.py.

Pure or with its I/O as arguments (an `httpx.Client`, a clock): perfgate.py judges what this
measures, traffic.py decides when to measure.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import httpx

from ..config.workload_settings import Workload
from ..errors import shown
from ..host.bounded_http import BODY_CAP_EXTENSION, BodyTooLarge, DeadlineExceeded

# A server that fails every request fails fast: stop launching once this many errors are more
# than half of what finished (the verdict is "fail" anyway; hammering a broken server helps no one).
ERROR_CUTOFF = 20
ERROR_EXAMPLES = 5  # distinct error messages kept for the report
STOP_GRACE_S = 2.0  # after a stop, how long measure() waits for the workers to close their streams
# SGLang's stream repeats the whole text so far in every chunk: 4096 tokens of escaped non-ASCII
# text come to about 200 MB. Over that, the stream is not an answer to this workload.
STREAM_MAX_BYTES = 256 * 1024 * 1024


# --------------------------------------------------------------------------- measurement

@dataclass(frozen=True)
class Measurement:
    """One run of a workload against one server.

    `requests` counts finished requests, failed ones included (requests cut off by a stop are not
    counted); `output_tokens`, the latencies and the accept length come from successful requests
    only. Latencies in seconds, percentiles by nearest rank (`percentile`). Inter-token latency
    has one sample per generated token after the first: a chunk carrying k new tokens after a gap
    g gives k samples of g/k, so speculative multi-token steps weigh as the tokens they produced.
    `accept_length` is the mean over requests of the last `spec_accept_length` each reported
    (SGLang's completion_tokens / verify steps for the request); None without speculative decoding.
    """

    requests: int
    errors: int
    output_tokens: int
    wall_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    accept_length: float | None
    error_examples: tuple[str, ...] = ()
    stopped: bool = False  # cut short by should_stop / Ctrl-C: not a full measurement

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def output_tps(self) -> float:
        """Output tokens of successful requests per second of wall time (first request started
        to last one finished)."""
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["error_examples"] = list(self.error_examples)
        d["error_rate"] = self.error_rate
        d["output_tps"] = self.output_tps
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Measurement:
        """The inverse of as_dict (derived keys ignored): a baseline kept across a restart."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in d.items() if k in names}
        values["error_examples"] = tuple(values.get("error_examples") or ())
        return cls(**values)


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least p % of the values ≤ it
    (sorted, index ceil(p/100 · n) − 1). Always one of the values, no interpolation; None when
    there are none."""
    if not values:
        return None
    s = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(s)))
    return s[min(rank, len(s)) - 1]


class _StreamError(Exception):
    """The request failed; the message is what the report shows."""


@dataclass
class _RequestResult:
    ok: bool
    error: str | None = None
    tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    accept_length: float | None = None


def sse_events(lines: Iterable[str]) -> Iterator[str]:
    """The data of each server-sent event in `lines` (lines without their line breaks): `data:`
    lines joined with newlines, dispatched at a blank line; comments and other fields ignored.
    SGLang writes `data: {json}` and a blank line per chunk, and `data: [DONE]` last."""
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:  # a last event without its blank line still counts
        yield "\n".join(data)


class _Run:
    """One measurement in progress: the shared counters the worker threads draw from."""

    def __init__(self, client: httpx.Client, workload: Workload, clock: Callable[[], float],
                 should_stop: Callable[[], bool] | None):
        self.client, self.workload, self.clock, self.should_stop = client, workload, clock, should_stop
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.stopped = False
        self.started = 0
        self.finished = 0
        self.errors = 0
        self.results: list[_RequestResult] = []
        self.crashed: list[BaseException] = []
        self.t0 = clock()

    def cancelled(self) -> bool:
        if self.stop.is_set():
            return True
        if self.should_stop is not None and self.should_stop():
            self.stopped = True
            self.stop.set()
            return True
        return False

    def next_index(self) -> int | None:
        """The index of the next request to send, or None when the run is over."""
        with self.lock:
            if self.cancelled():
                return None
            w = self.workload
            if self.clock() - self.t0 >= w.duration_s and self.started >= w.min_requests:
                return None
            if self.errors >= ERROR_CUTOFF and self.errors * 2 > self.finished:
                return None
            self.started += 1
            return self.started - 1

    def record(self, result: _RequestResult) -> None:
        with self.lock:
            self.results.append(result)
            self.finished += 1
            self.errors += not result.ok

    def worker(self) -> None:
        try:
            while (i := self.next_index()) is not None:
                result = self.one(i)
                if result is None:  # cut off by a stop: neither a success nor an error
                    return
                self.record(result)
        except BaseException as e:  # a bug: re-raised by measure() in the calling thread
            self.crashed.append(e)
            self.stop.set()

    def one(self, index: int) -> _RequestResult | None:
        w = self.workload
        start = self.clock()
        try:
            with self.client.stream("POST", "/generate", json=w.request_body(index), timeout=w.request_timeout_s,
                                    extensions={BODY_CAP_EXTENSION: STREAM_MAX_BYTES}) as r:
                if r.status_code != 200:
                    return _RequestResult(False, f"HTTP {r.status_code}: {_head(r)}")
                return self.read_stream(r, start)
        except _StreamError as e:
            return _RequestResult(False, str(e))
        except httpx.TimeoutException as e:
            if self.stop.is_set():
                return None
            if isinstance(e, DeadlineExceeded):
                return _RequestResult(False, f"timeout ({e.reason})")
            return _RequestResult(False, f"timeout (no answer within {w.request_timeout_s:g} s)")
        except BodyTooLarge as e:
            return _RequestResult(False, e.reason)
        except httpx.HTTPError as e:
            if self.stop.is_set():  # the stop closed the stream under it
                return None
            return _RequestResult(False, f"{type(e).__name__}: {e}"[:200])

    def read_stream(self, r: httpx.Response, start: float) -> _RequestResult | None:
        deadline = start + self.workload.request_timeout_s
        res = _RequestResult(True)
        last_tokens, last_t = 0, start
        for data in sse_events(r.iter_lines()):
            if self.cancelled():
                return None  # leaving the with-block closes the stream: SGLang aborts the request
            now = self.clock()
            if now > deadline:
                raise _StreamError(f"timeout (not finished within {self.workload.request_timeout_s:g} s)")
            if data == "[DONE]":
                res.tokens = last_tokens
                return res
            try:
                chunk = json.loads(data)
            except (ValueError, RecursionError):
                raise _StreamError(f"bad stream: not JSON: {shown(data)}") from None
            if not isinstance(chunk, dict):
                raise _StreamError(f"bad stream: not a JSON object: {shown(chunk)}")
            if "error" in chunk:  # SGLang reports a failure inside a 200 stream
                err = chunk["error"]
                msg = err.get("message") if isinstance(err, dict) else err
                raise _StreamError(f"stream error: {shown(msg)}")
            meta = chunk.get("meta_info")
            tokens = meta.get("completion_tokens") if isinstance(meta, dict) else None
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
                raise _StreamError("bad stream: a chunk without meta_info.completion_tokens")
            reason = meta.get("finish_reason")
            if isinstance(reason, dict) and reason.get("type") == "abort":
                raise _StreamError(f"aborted by the server: {shown(reason.get('message'))}")
            new = tokens - last_tokens
            if new < 0:
                raise _StreamError(f"bad stream: completion_tokens went back from {last_tokens} to {tokens}")
            if new > 0:
                if res.ttft_s is None:
                    # The first chunk's gap is prefill (and queueing), not decoding: TTFT only.
                    res.ttft_s = now - start
                else:
                    res.itl_s.extend([(now - last_t) / new] * new)
                last_tokens, last_t = tokens, now
            accept = meta.get("spec_accept_length")
            if isinstance(accept, (int, float)) and not isinstance(accept, bool):
                res.accept_length = float(accept)
        raise _StreamError("bad stream: ended without data: [DONE]")

    def measurement(self) -> Measurement:
        with self.lock:  # after a stop, a straggling worker may still record: take a snapshot
            results = list(self.results)
        ok = [r for r in results if r.ok]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        itl = [x for r in ok for x in r.itl_s]
        accepts = [r.accept_length for r in ok if r.accept_length is not None]
        examples: list[str] = []
        for r in results:
            if not r.ok and r.error not in examples and len(examples) < ERROR_EXAMPLES:
                examples.append(r.error or "error")
        return Measurement(
            requests=len(results), errors=len(results) - len(ok),
            output_tokens=sum(r.tokens for r in ok), wall_s=self.clock() - self.t0,
            ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
            itl_p50_s=percentile(itl, 50), itl_p99_s=percentile(itl, 99),
            accept_length=sum(accepts) / len(accepts) if accepts else None,
            error_examples=tuple(examples), stopped=self.stopped)


def _head(r: httpx.Response, limit: int = 200) -> str:
    """The start of an error body, read no further than needed (it may be large or endless)."""
    body = b""
    try:
        for part in r.iter_bytes():
            body += part
            if len(body) > limit:
                break
    except httpx.HTTPError:
        pass
    return body[:limit].decode("utf-8", "replace").strip() or r.reason_phrase


def measure(client: httpx.Client, workload: Workload, *, clock: Callable[[], float] = time.monotonic,
            should_stop: Callable[[], bool] | None = None) -> Measurement:
    """Run `workload` against the server behind `client` (base_url: the server; it carries the
    API key header, see host.http.http_client) with `workload.concurrency` threads, each sending
    streaming `POST /generate` requests one after another.

    A request fails (counts in `errors`) on a status other than 200, a connection error, a
    timeout (`request_timeout_s`, for the whole request: a trickling stream or one of keep-alive
    comments ends there, see host/bounded_http.py), a body over STREAM_MAX_BYTES, a stream that is not
    SGLang's (not JSON, no `meta_info.completion_tokens`, no `[DONE]`), an `error` chunk or a
    chunk finished with reason "abort". TTFT is the time from sending to the first chunk that
    carries a completion token.

    `should_stop` is polled (from the worker threads and the calling thread) before each request,
    after each chunk and while waiting; when it answers True the run ends: streams are closed at
    their next chunk (SGLang aborts those requests), measure() waits STOP_GRACE_S at most for
    them, and the measurement of what finished comes back with `stopped=True`. Ctrl-C in the
    calling thread (or SIGTERM/SIGHUP, which the CLI raises as one) does the same, then re-raises
    the KeyboardInterrupt. `clock` is the seam tests drive time with."""
    run = _Run(client, workload, clock, should_stop)
    threads = [threading.Thread(target=run.worker, name=f"perfgate-{i}", daemon=True)
               for i in range(workload.concurrency)]
    for t in threads:
        t.start()
    try:
        _wait(threads, run)
    except KeyboardInterrupt:
        run.stopped = True
        run.stop.set()
        _wait(threads, run)
        raise
    if run.crashed:
        raise run.crashed[0]
    return run.measurement()


def _wait(threads: Sequence[threading.Thread], run: _Run) -> None:
    """Until the workers are done; once the run is stopped, STOP_GRACE_S at most. A worker blocked
    on a silent server sees the stop only when its read times out (request_timeout_s): it is
    left behind (a daemon thread; it records nothing the measurement reads)."""
    grace_end: float | None = None
    for t in threads:
        while t.is_alive():
            if grace_end is None and run.cancelled():
                grace_end = time.monotonic() + STOP_GRACE_S  # real time: the clock may be a test's
            if grace_end is not None and time.monotonic() >= grace_end:
                return
            t.join(0.05)  # a bounded join: Ctrl-C reaches this thread while it waits
