"""The canary performance gate: measure a fixed workload, compare it with a baseline, give a verdict.

A deploy changes the speculative-decoding modules of an SGLang 0.5.23 server, so "healthy" (the
health gate) is not enough: a release can answer every request and still be slower or accept
fewer draft tokens. Like Argo Rollouts' analysis with Kayenta, the gate runs the same workload
against the server before the change (baseline) and after it (canary), and in a rollout also
against peers not yet updated, and compares metric by metric: pass, marginal or fail.

The pieces here are pure or take their I/O as arguments (an `httpx.Client`, a clock), so the
deploy code decides when to measure and what a verdict does:

  Workload / load_prompts      what is sent (prompts, concurrency, sampling, duration)
  measure(client, workload)    run it: streaming POST /generate, TTFT, inter-token latency, tok/s
  Thresholds / compare(...)    the verdict per metric and overall, with reasons
  parse_perf_gate(doc, where)  the inventory's `perf_gate` mapping, validated

Thresholds (defaults; `compare` documents the rules):

  metric            better   marginal when          fail when              ignored when the change is
  output tok/s      higher   drop > 3 %             drop > 10 %            ≤ 1 tok/s
  TTFT p50          lower    rise > 10 %            rise > 25 %            ≤ 20 ms
  TTFT p99          lower    rise > 20 %            rise > 50 %            ≤ 20 ms
  ITL p50           lower    rise > 10 %            rise > 25 %            ≤ 2 ms
  ITL p99           lower    rise > 20 %            rise > 50 %            ≤ 2 ms
  error rate        lower    > 0 and > reference    > 1 % (absolute)       -
  accept length     higher   drop > 5 %             drop > 15 %            ≤ 0.1 tokens
"""

from __future__ import annotations

import enum
import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import httpx

from .errors import InputError, shown
from .schema import Field, Invalid, apply, boolean, int_range, known_keys, number_range

# --------------------------------------------------------------------------- defaults

# Varied on purpose: code, arithmetic, prose, translation, lists, structured output and dialogue
# draft differently (code and lists are easy for a drafter, free prose is hard), so the accept
# length and the speed of the mix move when any one kind regresses.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "A train leaves at 09:40 and travels 312 km at 78 km/h. When does it arrive? Explain step by step.",
    "Write a short story, about 150 words, about a lighthouse keeper who finds a message in a bottle.",
    "Translate into French and German: 'The meeting is moved to Thursday afternoon because of the strike.'",
    "List ten countries in Africa with their capitals, one per line, in the form 'Country: Capital'.",
    "Explain to a new engineer why a database index speeds up reads but slows down writes.",
    "Return a JSON object describing a book with the keys title, author, year, genres (a list) and isbn.",
    "You are a support agent. A customer says their order arrived damaged. Reply politely and offer options.",
)

DEFAULT_CONCURRENCY = 4
DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_TEMPERATURE = 0.7  # what the DDTree modules are tuned for (temperature-aware drafting)
DEFAULT_TOP_P = 0.9
DEFAULT_DURATION_S = 20.0
DEFAULT_MIN_REQUESTS = 8  # percentiles of fewer requests say little
DEFAULT_REQUEST_TIMEOUT_S = 60.0  # per request, and per read while streaming

# Thresholds. Drops and rises are relative to the reference (baseline or peers); floors are
# absolute and a change at or under its floor never counts, so noise on small numbers (TTFT
# 2 ms → 3 ms is +50 %) cannot fail a release.
MARGINAL_DROP = 0.03  # output tok/s
FAIL_DROP = 0.10
TTFT_P50_MARGINAL = 0.10
TTFT_P50_FAIL = 0.25
TTFT_P99_MARGINAL = 0.20  # tails are noisier: p99 of ~100 requests is close to their maximum
TTFT_P99_FAIL = 0.50
ITL_P50_MARGINAL = 0.10
ITL_P50_FAIL = 0.25
ITL_P99_MARGINAL = 0.20
ITL_P99_FAIL = 0.50
ERROR_RATE_MARGINAL = 0.0  # absolute: any error the reference did not have is marginal
ERROR_RATE_FAIL = 0.01  # absolute: above 1 % fails whatever the reference had
ACCEPT_MARGINAL_DROP = 0.05  # mean spec_accept_length
ACCEPT_FAIL_DROP = 0.15
TPS_FLOOR = 1.0  # tok/s
TTFT_FLOOR_S = 0.020  # TTFT includes queueing and prefill: tens of ms of jitter are normal
ITL_FLOOR_S = 0.002
ACCEPT_FLOOR = 0.1  # tokens per verify step

# Prompts files: bounds that keep a wrong path (a model file, a log) from being read whole.
PROMPTS_FILE_MAX_BYTES = 8 * 1024 * 1024
PROMPTS_MAX = 10_000
PROMPT_MAX_CHARS = 65_536

CONCURRENCY_MAX = 64  # under httpx's default pool of 100 connections, so no request waits for one
# A server that fails every request fails fast: stop launching once this many errors are more
# than half of what finished (the verdict is "fail" anyway; hammering a broken server helps no one).
ERROR_CUTOFF = 20
ERROR_EXAMPLES = 5  # distinct error messages kept for the report
STOP_GRACE_S = 2.0  # after a stop, how long measure() waits for the workers to close their streams


# --------------------------------------------------------------------------- workload

@dataclass(frozen=True)
class Workload:
    """What the gate sends. Request i uses prompts[i % len(prompts)], so baseline and canary see
    the same mix. The run starts requests until `duration_s` has passed *and* at least
    `min_requests` were started; each started request finishes (or times out), so at least
    `min_requests` are counted unless the run is stopped."""

    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    concurrency: int = DEFAULT_CONCURRENCY
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    duration_s: float = DEFAULT_DURATION_S
    min_requests: int = DEFAULT_MIN_REQUESTS
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    prompts_file: str | None = None  # where the prompts came from (None: the built-in list)

    def __post_init__(self) -> None:
        # A list from a caller becomes a tuple: the dataclass is frozen and hashable.
        object.__setattr__(self, "prompts", tuple(self.prompts))
        if not self.prompts:
            raise ValueError("a workload needs at least one prompt")
        if self.concurrency < 1 or self.min_requests < 0:
            raise ValueError("concurrency must be ≥ 1 and min_requests ≥ 0")

    def request_body(self, index: int) -> dict[str, Any]:
        """The JSON body of request `index`: SGLang's native /generate, streaming."""
        return {
            "text": self.prompts[index % len(self.prompts)],
            "sampling_params": {"temperature": self.temperature, "top_p": self.top_p,
                                "max_new_tokens": self.max_new_tokens},
            "stream": True,
        }


def load_prompts(path: str) -> tuple[str, ...]:
    """Prompts from a file: `*.jsonl` holds one JSON object per line with a non-empty string
    "text" (other keys ignored); any other file holds one prompt per line. Blank lines are
    skipped. The format follows the name, never the content: a plain prompt may start with "{".
    Raises InputError naming the file and line."""
    try:
        with open(path, "rb") as f:
            data = f.read(PROMPTS_FILE_MAX_BYTES + 1)
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from None
    if len(data) > PROMPTS_FILE_MAX_BYTES:
        raise InputError(f"{path}: larger than {PROMPTS_FILE_MAX_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 (byte {e.start})") from None
    jsonl = path.endswith(".jsonl")
    prompts: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if jsonl:
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise InputError(f"{path} line {n}: not JSON ({e})") from None
            prompt = obj.get("text") if isinstance(obj, dict) else None
            if not isinstance(prompt, str) or not prompt.strip():
                raise InputError(f"{path} line {n}: needs a JSON object with a non-empty string \"text\", "
                                 f"got {shown(obj)}")
        else:
            prompt = line
        if len(prompt) > PROMPT_MAX_CHARS:
            raise InputError(f"{path} line {n}: prompt longer than {PROMPT_MAX_CHARS} characters")
        prompts.append(prompt)
        if len(prompts) > PROMPTS_MAX:
            raise InputError(f"{path}: more than {PROMPTS_MAX} prompts")
    if not prompts:
        shape = 'one JSON object with "text" per line' if jsonl else "one prompt per line"
        raise InputError(f"{path}: no prompts ({shape})")
    return tuple(prompts)


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
            with self.client.stream("POST", "/generate", json=w.request_body(index),
                                    timeout=w.request_timeout_s) as r:
                if r.status_code != 200:
                    return _RequestResult(False, f"HTTP {r.status_code}: {_head(r)}")
                return self.read_stream(r, start)
        except _StreamError as e:
            return _RequestResult(False, str(e))
        except httpx.TimeoutException:
            if self.stop.is_set():
                return None
            return _RequestResult(False, f"timeout (no answer within {w.request_timeout_s:g} s)")
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
            except ValueError:
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
    API key header, see health.http_client) with `workload.concurrency` threads, each sending
    streaming `POST /generate` requests one after another.

    A request fails (counts in `errors`) on a status other than 200, a connection error, a
    timeout (`request_timeout_s`, per read and for the whole request), a stream that is not
    SGLang's (not JSON, no `meta_info.completion_tokens`, no `[DONE]`), an `error` chunk or a
    chunk finished with reason "abort". TTFT is the time from sending to the first chunk that
    carries a completion token.

    `should_stop` is polled (from the worker threads and the calling thread) before each request,
    after each chunk and while waiting; when it answers True the run ends: streams are closed at
    their next chunk (SGLang aborts those requests), measure() waits STOP_GRACE_S at most for
    them, and the measurement of what finished comes back with `stopped=True`. Ctrl-C in the
    calling thread does the same, then re-raises KeyboardInterrupt. `clock` is the seam tests drive time with."""
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


# --------------------------------------------------------------------------- verdicts

class Verdict(str, enum.Enum):
    """A metric's or the gate's result; ordered pass < marginal < fail."""

    PASS = "pass"
    MARGINAL = "marginal"
    FAIL = "fail"

    @property
    def rank(self) -> int:
        return _RANK[self]

    def __str__(self) -> str:
        return self.value


_RANK = {Verdict.PASS: 0, Verdict.MARGINAL: 1, Verdict.FAIL: 2}


def worst(verdicts: Iterable[Verdict]) -> Verdict:
    return max(verdicts, key=lambda v: v.rank, default=Verdict.PASS)


@dataclass(frozen=True)
class Thresholds:
    """When the canary is marginal or failing, metric by metric (the module docstring's table).

    Relative limits are fractions of the reference: output tok/s fails when
    canary < reference × (1 − fail_drop); a latency fails when canary > reference × (1 + *_fail).
    A change at or under the metric's absolute floor never counts. The error rate is absolute:
    fail above `error_rate_fail`; marginal above `error_rate_marginal` when it is also above the
    reference's rate."""

    marginal_drop: float = MARGINAL_DROP
    fail_drop: float = FAIL_DROP
    ttft_p50_marginal: float = TTFT_P50_MARGINAL
    ttft_p50_fail: float = TTFT_P50_FAIL
    ttft_p99_marginal: float = TTFT_P99_MARGINAL
    ttft_p99_fail: float = TTFT_P99_FAIL
    itl_p50_marginal: float = ITL_P50_MARGINAL
    itl_p50_fail: float = ITL_P50_FAIL
    itl_p99_marginal: float = ITL_P99_MARGINAL
    itl_p99_fail: float = ITL_P99_FAIL
    error_rate_marginal: float = ERROR_RATE_MARGINAL
    error_rate_fail: float = ERROR_RATE_FAIL
    accept_marginal_drop: float = ACCEPT_MARGINAL_DROP
    accept_fail_drop: float = ACCEPT_FAIL_DROP
    tps_floor: float = TPS_FLOOR
    ttft_floor_s: float = TTFT_FLOOR_S
    itl_floor_s: float = ITL_FLOOR_S
    accept_floor: float = ACCEPT_FLOOR

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _minus(text: str) -> str:
    return text.replace("-", "−")


def _pct(x: float) -> str:
    return _minus(f"{x * 100:+.1f} %")


def _limit_pct(x: float, sign: str) -> str:
    return f"{sign}{x * 100:g} %"


def _fmt_tps(v: float) -> str:
    return f"{v:.1f}"


def _fmt_s(v: float) -> str:
    return f"{v * 1000:.1f} ms"


def _fmt_rate(v: float) -> str:
    return f"{v * 100:.1f} %"


def _fmt_accept(v: float) -> str:
    return f"{v:.2f}"


@dataclass(frozen=True)
class _Metric:
    key: str  # Measurement attribute and the row's "metric"
    label: str
    higher_is_better: bool
    fmt: Callable[[float], str]
    marginal: str  # Thresholds attribute names
    fail: str
    floor: str | None
    floor_fmt: Callable[[float], str] = _fmt_tps


_METRICS: tuple[_Metric, ...] = (
    _Metric("output_tps", "output tok/s", True, _fmt_tps, "marginal_drop", "fail_drop", "tps_floor",
            lambda v: f"{v:g} tok/s"),
    _Metric("ttft_p50_s", "TTFT p50", False, _fmt_s, "ttft_p50_marginal", "ttft_p50_fail", "ttft_floor_s", _fmt_s),
    _Metric("ttft_p99_s", "TTFT p99", False, _fmt_s, "ttft_p99_marginal", "ttft_p99_fail", "ttft_floor_s", _fmt_s),
    _Metric("itl_p50_s", "ITL p50", False, _fmt_s, "itl_p50_marginal", "itl_p50_fail", "itl_floor_s", _fmt_s),
    _Metric("itl_p99_s", "ITL p99", False, _fmt_s, "itl_p99_marginal", "itl_p99_fail", "itl_floor_s", _fmt_s),
    _Metric("error_rate", "error rate", False, _fmt_rate, "error_rate_marginal", "error_rate_fail", None),
    _Metric("accept_length", "accept length", True, _fmt_accept, "accept_marginal_drop", "accept_fail_drop",
            "accept_floor", lambda v: f"{v:g}"),
)


@dataclass(frozen=True)
class GateRow:
    """One metric. `change` is the canary's relative change against the reference that decided
    the verdict (`against`: "baseline" or "peers"): (canary − ref) / ref; for error_rate the
    absolute difference canary − ref. None when there is nothing to compare."""

    metric: str
    label: str
    baseline: float | None
    canary: float | None
    peers: float | None
    change: float | None
    against: str
    verdict: Verdict
    limit: str
    reason: str | None  # why it is not "pass"

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "label": self.label, "baseline": self.baseline, "canary": self.canary,
                "peers": self.peers, "change": self.change, "against": self.against,
                "verdict": self.verdict.value, "limit": self.limit}


@dataclass(frozen=True)
class GateVerdict:
    """The gate's result: the worst row's verdict, the rows, and a reason per non-pass row."""

    verdict: Verdict
    baseline: Measurement
    canary: Measurement
    peers: Measurement | None
    rows: tuple[GateRow, ...]
    reasons: tuple[str, ...]
    thresholds: Thresholds = field(default_factory=Thresholds)

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict.value, "baseline": self.baseline.as_dict(),
                "canary": self.canary.as_dict(), "peers": self.peers.as_dict() if self.peers else None,
                "rows": [r.as_dict() for r in self.rows], "reasons": list(self.reasons),
                "thresholds": self.thresholds.as_dict()}

    def summary(self) -> str:
        """One line: the verdict and its first reason, e.g.
        "fail: output tok/s 212.0 → 150.3 (−29.1 %, limit −10 %) (+1 more)"."""
        if self.reasons:
            more = f" (+{len(self.reasons) - 1} more)" if len(self.reasons) > 1 else ""
            return f"{self.verdict.value}: {self.reasons[0]}{more}"
        tps = next(r for r in self.rows if r.metric == "output_tps")
        change = f" ({_pct(tps.change)})" if tps.change is not None else ""
        ref = tps.peers if tps.against == "peers" else tps.baseline
        was = _fmt_tps(ref) if ref is not None else "n/a"
        return (f"{self.verdict.value}: output tok/s {was} → {_fmt_tps(tps.canary or 0.0)}{change}; "
                f"all {len(self.rows)} metrics within limits")


def _limit_text(m: _Metric, t: Thresholds) -> str:
    marginal, fail = getattr(t, m.marginal), getattr(t, m.fail)
    if m.key == "error_rate":
        return f"marginal > {_limit_pct(marginal, '')} and above reference, fail > {_limit_pct(fail, '')}"
    sign = "−" if m.higher_is_better else "+"
    floor = f", changes ≤ {m.floor_fmt(getattr(t, m.floor))} ignored" if m.floor else ""
    return f"marginal {_limit_pct(marginal, sign)}, fail {_limit_pct(fail, sign)}{floor}"


def _judge(m: _Metric, t: Thresholds, ref: float | None, canary: float | None
           ) -> tuple[Verdict, float | None, str | None]:
    """(verdict, change, crossed limit) of `canary` against `ref` for one metric."""
    marginal, fail = getattr(t, m.marginal), getattr(t, m.fail)
    if m.key == "error_rate":
        assert canary is not None and ref is not None
        if canary > fail:
            return Verdict.FAIL, canary - ref, _limit_pct(fail, "")
        if canary > marginal and canary > ref:
            return Verdict.MARGINAL, canary - ref, f"{_limit_pct(marginal, '')} and above reference"
        return Verdict.PASS, canary - ref, None
    if ref is None:
        return Verdict.PASS, None, None  # nothing to compare with (e.g. no speculative decoding before)
    if canary is None:
        return Verdict.FAIL, None, "no canary value"
    change = (canary - ref) / ref if ref else None
    floor = getattr(t, m.floor) if m.floor else 0.0
    if m.higher_is_better:
        if ref - canary <= floor:
            return Verdict.PASS, change, None
        if canary < ref * (1 - fail):
            return Verdict.FAIL, change, _limit_pct(fail, "−")
        if canary < ref * (1 - marginal):
            return Verdict.MARGINAL, change, _limit_pct(marginal, "−")
        return Verdict.PASS, change, None
    if canary - ref <= floor:
        return Verdict.PASS, change, None
    if canary > ref * (1 + fail):
        return Verdict.FAIL, change, _limit_pct(fail, "+")
    if canary > ref * (1 + marginal):
        return Verdict.MARGINAL, change, _limit_pct(marginal, "+")
    return Verdict.PASS, change, None


def _reason(m: _Metric, against: str, ref: float | None, canary: float | None, change: float | None,
            limit: str) -> str:
    if canary is None:
        if m.key == "accept_length":
            return f"accept length: the canary reports no spec_accept_length ({against} had " \
                   f"{_fmt_accept(ref or 0.0)}; speculative decoding off?)"
        return f"{m.label}: no canary value (no successful request)"
    was = m.fmt(ref) if ref is not None else "n/a"
    frm = f"{was} → {m.fmt(canary)}" if against == "baseline" else f"peers {was} → canary {m.fmt(canary)}"
    if m.key == "error_rate":
        return f"{m.label} {frm} (limit {limit})"
    ch = f"{_pct(change)}, " if change is not None else ""
    return f"{m.label} {frm} ({ch}limit {limit})"


def compare(baseline: Measurement, canary: Measurement, thresholds: Thresholds | None = None, *,
            peers: Measurement | None = None) -> GateVerdict:
    """The gate's verdict on `canary` (the server after the change).

    Each metric is judged against the baseline (the same server before the change) and, when
    `peers` is given (servers not yet updated, measured at about the same time as the canary),
    also against the peers; the worse of the two verdicts counts, so a canary must hold up both
    to its own past and to the fleet's present (a baseline measured on a quiet cluster cannot
    hide a regression, and neither can a slow peer). Ties go to the baseline. Rules per metric:

    - a higher-is-better metric (output tok/s, accept length) fails when
      canary < ref × (1 − fail limit), is marginal when canary < ref × (1 − marginal limit);
    - a lower-is-better latency fails when canary > ref × (1 + fail limit), marginal likewise;
    - a change at or under the metric's floor (Thresholds.*_floor*) is always a pass;
    - the error rate fails above error_rate_fail whatever the reference had, and is marginal
      above error_rate_marginal when it is also above the reference's rate;
    - a reference without a value (no successful request; no speculative decoding) passes the
      metric, there being nothing to compare; a canary without a value where the reference had
      one fails it (a canary without spec_accept_length runs without speculative decoding).

    The overall verdict is the worst row's. Whether the measurements were complete
    (`Measurement.stopped`) is the caller's to check."""
    t = thresholds or Thresholds()
    rows: list[GateRow] = []
    fails: list[str] = []
    marginals: list[str] = []
    for m in _METRICS:
        b, c = getattr(baseline, m.key), getattr(canary, m.key)
        p = getattr(peers, m.key) if peers is not None else None
        verdict, change, crossed = _judge(m, t, b, c)
        against, ref = "baseline", b
        if peers is not None:
            pv, pchange, pcrossed = _judge(m, t, p, c)
            if pv.rank > verdict.rank:
                verdict, change, crossed, against, ref = pv, pchange, pcrossed, "peers", p
        reason = None
        if verdict is not Verdict.PASS:
            reason = _reason(m, against, ref, c, change, crossed or "")
            (fails if verdict is Verdict.FAIL else marginals).append(reason)
        rows.append(GateRow(m.key, m.label, b, c, p, change, against, verdict, _limit_text(m, t), reason))
    return GateVerdict(worst(r.verdict for r in rows), baseline, canary, peers, tuple(rows),
                       tuple(fails + marginals), t)


def format_rows(rows: Sequence[GateRow]) -> str:
    """A plain-text table of `rows` (metric, baseline, canary, peers, change, verdict, limit)."""
    by_key = {m.key: m for m in _METRICS}
    table = [("metric", "baseline", "canary", "peers", "change", "verdict", "limit")]
    for r in rows:
        m = by_key[r.metric]

        def fmt(v: float | None, m: _Metric = m) -> str:
            return "-" if v is None else m.fmt(v)
        if r.change is None:
            change = "-"
        elif r.metric == "error_rate":
            change = _minus(f"{r.change * 100:+.1f} pp")
        else:
            change = _pct(r.change)
        if r.against == "peers" and r.change is not None:
            change += " vs peers"
        table.append((r.label, fmt(r.baseline), fmt(r.canary), fmt(r.peers), change, r.verdict.value, r.limit))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    return "\n".join("  ".join([c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)] + [row[-1]]).rstrip()
                     for row in table)


# --------------------------------------------------------------------------- inventory

@dataclass(frozen=True)
class PerfGateSettings:
    """The inventory's `perf_gate`. Absent or null: disabled. A mapping: enabled unless it says
    `enabled: false` (writing the section is asking for the gate)."""

    enabled: bool = False
    workload: Workload = field(default_factory=Workload)
    thresholds: Thresholds = field(default_factory=Thresholds)
    compare_peers: bool = True


def _ratio(value: Any, done: Mapping[str, Any]) -> float:
    return number_range(0, 1)(value, done)


def _increase(value: Any, done: Mapping[str, Any]) -> float:
    return number_range(0, 10)(value, done)


def _at_most(inner: Callable[[Any, Mapping[str, Any]], float], bound: str) -> Callable[..., float]:
    """`inner`, and ≤ the earlier field `bound` (a marginal limit never beyond its fail limit)."""

    def check(value: Any, done: Mapping[str, Any]) -> float:
        v = inner(value, done)
        if v > done[bound]:
            raise Invalid(f"must be ≤ {bound} ({done[bound]:g}), got {shown(value)}")
        return v
    return check


def _top_p(value: Any, done: Mapping[str, Any]) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise Invalid(f"must be a number > 0 and ≤ 1, got {shown(value)}")
    return float(value)


def _prompts_file(value: Any, done: Mapping[str, Any]) -> str:
    if not isinstance(value, str) or not value or "\0" in value:
        raise Invalid(f"must be a path to a file of prompts, got {shown(value)}")
    return value


# Fail limits come before their marginal limits: the marginal check reads them.
THRESHOLD_FIELDS: tuple[Field, ...] = (
    Field("fail_drop", _ratio, FAIL_DROP),
    Field("marginal_drop", _at_most(_ratio, "fail_drop"), MARGINAL_DROP),
    Field("ttft_p50_fail", _increase, TTFT_P50_FAIL),
    Field("ttft_p50_marginal", _at_most(_increase, "ttft_p50_fail"), TTFT_P50_MARGINAL),
    Field("ttft_p99_fail", _increase, TTFT_P99_FAIL),
    Field("ttft_p99_marginal", _at_most(_increase, "ttft_p99_fail"), TTFT_P99_MARGINAL),
    Field("itl_p50_fail", _increase, ITL_P50_FAIL),
    Field("itl_p50_marginal", _at_most(_increase, "itl_p50_fail"), ITL_P50_MARGINAL),
    Field("itl_p99_fail", _increase, ITL_P99_FAIL),
    Field("itl_p99_marginal", _at_most(_increase, "itl_p99_fail"), ITL_P99_MARGINAL),
    Field("error_rate_fail", _ratio, ERROR_RATE_FAIL),
    Field("error_rate_marginal", _at_most(_ratio, "error_rate_fail"), ERROR_RATE_MARGINAL),
    Field("accept_fail_drop", _ratio, ACCEPT_FAIL_DROP),
    Field("accept_marginal_drop", _at_most(_ratio, "accept_fail_drop"), ACCEPT_MARGINAL_DROP),
    Field("tps_floor", number_range(0, 1e6), TPS_FLOOR),
    Field("ttft_floor_s", number_range(0, 60), TTFT_FLOOR_S),
    Field("itl_floor_s", number_range(0, 10), ITL_FLOOR_S),
    Field("accept_floor", number_range(0, 100), ACCEPT_FLOOR),
)

PERF_GATE_FIELDS: tuple[Field, ...] = (
    Field("enabled", boolean(), True),
    Field("prompts_file", _prompts_file, None),
    Field("concurrency", int_range(1, CONCURRENCY_MAX), DEFAULT_CONCURRENCY),
    Field("max_new_tokens", int_range(1, 4096), DEFAULT_MAX_NEW_TOKENS),
    Field("temperature", number_range(0, 2), DEFAULT_TEMPERATURE),
    Field("top_p", _top_p, DEFAULT_TOP_P),
    Field("duration_s", number_range(1, 3600), DEFAULT_DURATION_S),
    Field("min_requests", int_range(1, 100_000), DEFAULT_MIN_REQUESTS),
    Field("request_timeout_s", number_range(1, 3600), DEFAULT_REQUEST_TIMEOUT_S),
    Field("compare_peers", boolean(), True),
    Field("thresholds", None),  # a nested table: validated by parse_perf_gate, naming its fields
)


def _mapping(doc: Any, where: str, fields_: Sequence[Field]) -> dict[str, Any]:
    """`doc` (null: empty) validated by `fields_`; InputError naming `where` and the field."""
    allowed = ", ".join(sorted(known_keys(fields_)))
    raw = {} if doc is None else doc
    if not isinstance(raw, dict):
        raise InputError(f"{where}: must be a mapping of {allowed}, got {shown(doc)}")
    unknown = sorted(str(k) for k in set(raw) - known_keys(fields_))
    if unknown:
        raise InputError(f"{where}.{unknown[0]}: unknown key; allowed: {allowed}")
    try:
        return apply(fields_, raw)
    except Invalid as e:
        raise InputError(f"{where}.{e.field}: {e.problem}") from None


def parse_perf_gate(doc: Any, where: str = "perf_gate", *, base_dir: str | None = None) -> PerfGateSettings:
    """The inventory's `perf_gate` mapping as settings; null or absent: the gate disabled.

    Keys: enabled, prompts_file, concurrency, max_new_tokens, temperature, top_p, duration_s,
    min_requests, request_timeout_s, compare_peers, thresholds (the fields of `Thresholds`).
    A relative `prompts_file` is read from `base_dir` (the inventory's folder), on the
    controller, now: a bad file is refused before any host changes. Raises InputError as
    "<where>.<field>: <problem>", e.g. "perf_gate.thresholds.fail_drop: must be a number 0..1, got 2"."""
    if doc is None:
        return PerfGateSettings()
    values = _mapping(doc, where, PERF_GATE_FIELDS)
    thresholds = Thresholds(**_mapping(doc.get("thresholds"), f"{where}.thresholds", THRESHOLD_FIELDS))
    workload = Workload(**{k: values[k] for k in ("concurrency", "max_new_tokens", "temperature", "top_p",
                                                   "duration_s", "min_requests", "request_timeout_s")})
    path = values["prompts_file"]
    if path is not None:
        full = os.path.join(base_dir, os.path.expanduser(path)) if base_dir else os.path.expanduser(path)
        try:
            prompts = load_prompts(full)
        except InputError as e:
            raise InputError(f"{where}.prompts_file: {e}") from None
        workload = replace(workload, prompts=prompts, prompts_file=full)
    return PerfGateSettings(enabled=values["enabled"], workload=workload, thresholds=thresholds,
                            compare_peers=values["compare_peers"])
