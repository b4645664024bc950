"""The performance gate between servers named by URL: the deploy's canary gate (the workload of
workload.py, the verdict of perfgate.py, the `perf_gate:` settings) for an orchestrator that
rolls out by itself (`ddtree-ops gate`; Argo Rollouts through gate_service.py).

  parse_url(text, role)             a server's base URL, checked: http or https, a host, no more
  GateRequest.of(bases, canaries)   the two sides, each URL checked
  run_gate(request, settings)       probe every server, measure them all side by side, judge
  combine(measurements)             several baselines as one reference

Every server is measured at the same time, with the same workload, each by a thread of its own
(as the deploy measures its canary beside a peer): both sides see the same cluster, the same
noisy neighbours. Each canary is judged on its own against the baselines (`combine`), and the
worst canary's verdict is the gate's: one slow replica among several fails the gate, where a mean
of the canaries would hide it.

Bounded: a probe of `GET /health` first, every server at once, each within `probe_timeout_s`
(an unreachable or silent server ends the run there, with no verdict: `NoVerdict`); then the
measurement, stopped at `duration_s + request_timeout_s` (and a margin) at the latest: a request
started in the window has finished or timed out by then; a server too slow to reach
`min_requests` in time is judged on what finished. `bound_s(workload)` is one workload's bound,
`run_bound_s(settings)` the whole run's, what the operator and the service's callers are told.

Several workloads (`perf_gate.workloads`, as the deploy's gate measures them): the servers are
probed once, then each workload is measured on every server side by side and judged, one after
the other; the worst workload's verdict is the gate's (the first of the worst on a tie), and the
outcome is that workload's, with every workload's in `cases`.
"""

from __future__ import annotations

import ipaddress
import re
import threading
import time
import urllib.parse
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import httpx

from ..config.perfgate_settings import Thresholds
from ..config.workload_settings import Workload
from ..errors import InputError, NoVerdict, shown
from ..host.http import url_client
from .perfgate import GateVerdict, Verdict, compare, format_rows
from .workload import ERROR_EXAMPLES, STOP_GRACE_S, Measurement, measure

PROBE_TIMEOUT_S = 10.0  # GET /health; never more than the workload's own request timeout
# The measurement is cut this long after a request started at the window's end would have timed
# out: such a request then always counts (a success or a timeout), never cut by the race.
CUT_MARGIN_S = 1.0
BOUND_SLACK_S = 1.0  # thread joins and the verdict, after the workers' grace
SERVERS_PER_SIDE_MAX = 8  # each server is measured by `concurrency` streams of this process
URL_MAX_CHARS = 2048
_HOST_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$")
BASELINE, CANARY = "baseline", "canary"


# --------------------------------------------------------------------------- input

def parse_url(text: Any, role: str) -> str:
    """`text` as a server's base URL, normalised (scheme and host lower case, no trailing "/"):
    http or https, a host name or an IP address, an optional port and path prefix (a server behind
    a path-routing proxy). Refused: credentials (`user:pass@`: the API key goes in a header,
    never in a URL that logs and AnalysisRuns show), a query, a fragment. InputError naming
    `role`."""
    def bad(why: str) -> InputError:
        return InputError(f"{role} {shown(text)}: {why}")

    if not isinstance(text, str) or not text:
        raise bad("must be a URL such as http://10.0.0.5:30000")
    if len(text) > URL_MAX_CHARS or any(c.isspace() or not c.isprintable() for c in text):
        raise bad(f"must be a URL of at most {URL_MAX_CHARS} printable characters, without spaces")
    try:
        u = urllib.parse.urlsplit(text)
        port = u.port  # a port that is not a number (or over 65535) raises here
    except ValueError as e:
        raise bad(f"not a URL ({e})") from None
    if u.scheme.lower() not in ("http", "https"):
        raise bad("must be an http:// or https:// URL")
    if "@" in u.netloc:
        raise bad("credentials in a URL are refused (give the server's API key with --api-key-env)")
    if u.query or u.fragment or text.endswith(("?", "#")):
        raise bad("must be the server's base URL, without a query or fragment")
    host = (u.hostname or "").lower()
    if not _valid_host(host):
        raise bad("needs a host name or an IP address")
    if port == 0:
        raise bad("port 0 is not a server's port")
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc += f":{port}"
    return f"{u.scheme.lower()}://{netloc}{u.path.rstrip('/')}"


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(_HOST_RE.match(host)) and len(host) <= 253


@dataclass(frozen=True)
class GateRequest:
    """The servers to compare: the baseline (the release serving now) and the canary (the new
    one), each one URL or several."""

    baselines: tuple[str, ...]
    canaries: tuple[str, ...]

    @classmethod
    def of(cls, baselines: Sequence[Any], canaries: Sequence[Any]) -> GateRequest:
        """Each URL checked (parse_url); each side one to SERVERS_PER_SIDE_MAX servers, no server
        twice. InputError naming the side and the URL."""
        sides = []
        for role, given in ((BASELINE, baselines), (CANARY, canaries)):
            if not given:
                raise InputError(f"no {role}: give the URL of a {role} server (--{role} URL)")
            if len(given) > SERVERS_PER_SIDE_MAX:
                raise InputError(f"{len(given)} {role} servers: at most {SERVERS_PER_SIDE_MAX}")
            sides.append(tuple(parse_url(u, role) for u in given))
        seen: dict[str, str] = {}
        for role, urls in zip((BASELINE, CANARY), sides, strict=True):
            for url in urls:
                if url in seen:
                    raise InputError(f"{url} is given twice (as {seen[url]} and as {role}): a server is "
                                     f"measured once, on one side")
                seen[url] = role
        return cls(sides[0], sides[1])

    def servers(self) -> list[tuple[str, str]]:
        """(role, url) of every server, baselines first."""
        return [(BASELINE, u) for u in self.baselines] + [(CANARY, u) for u in self.canaries]


@dataclass(frozen=True)
class GateSettings:
    """What the gate sends and how it judges: the `perf_gate:` workload and thresholds (an
    inventory's, or the built-in ones), `source` saying which, for the operator; `api_key` goes to
    every server as a Bearer token."""

    workload: Workload = field(default_factory=Workload)
    thresholds: Thresholds = field(default_factory=Thresholds)
    api_key: str | None = field(default=None, repr=False)
    source: str = "the built-in defaults"
    # Every workload measured, in order; given, its first is `workload`; empty: `workload` alone.
    workloads: tuple[Workload, ...] = ()

    def __post_init__(self) -> None:
        cases = tuple(self.workloads) or (self.workload,)
        object.__setattr__(self, "workloads", cases)
        object.__setattr__(self, "workload", cases[0])


def probe_timeout_s(workload: Workload) -> float:
    return min(PROBE_TIMEOUT_S, workload.request_timeout_s)


def bound_s(workload: Workload) -> float:
    """The most one run of the gate takes, from its start to its verdict: the probe, the
    measurement window, a last request's timeout, the workers' grace after a stop, and slack."""
    return probe_timeout_s(workload) + cut_after_s(workload) + STOP_GRACE_S + BOUND_SLACK_S


def run_bound_s(settings: GateSettings) -> float:
    """The most one run of the gate takes over every workload: one probe, each workload's
    measurement window, last request's timeout and grace, and slack once (one workload:
    `bound_s` of it)."""
    return (probe_timeout_s(settings.workload) + BOUND_SLACK_S
            + sum(cut_after_s(w) + STOP_GRACE_S for w in settings.workloads))


def cut_after_s(workload: Workload) -> float:
    """When the measurement is stopped, from its start, if it has not ended by itself."""
    return workload.duration_s + workload.request_timeout_s + CUT_MARGIN_S


# --------------------------------------------------------------------------- the result

@dataclass(frozen=True)
class Measured:
    role: str  # BASELINE or CANARY
    url: str
    measurement: Measurement

    def as_dict(self) -> dict[str, Any]:
        return {"role": self.role, "url": self.url, "measurement": self.measurement.as_dict()}


@dataclass(frozen=True)
class Judged:
    """One canary's verdict against the baselines."""

    url: str
    verdict: GateVerdict

    def as_dict(self) -> dict[str, Any]:
        v = self.verdict
        return {"url": self.url, "verdict": v.verdict.value, "summary": v.summary(), "reasons": list(v.reasons),
                "rows": [r.as_dict() for r in v.rows]}


@dataclass(frozen=True)
class GateOutcome:
    """The gate's verdict: the worst canary's. `baseline` is the reference every canary was judged
    against (several baselines: `combine`d). Over several workloads: the worst workload's outcome
    (its baseline, canaries and servers), `verdict` the gate's, `cases` every workload's outcome,
    `settings` the run's (all its workloads)."""

    verdict: Verdict
    baseline: Measurement
    canaries: tuple[Judged, ...]
    servers: tuple[Measured, ...]
    settings: GateSettings
    elapsed_s: float
    notes: tuple[str, ...] = ()
    cases: tuple[GateOutcome, ...] = ()  # one per workload, when there are several

    @property
    def worst(self) -> Judged:
        return max(self.canaries, key=lambda j: j.verdict.verdict.rank)  # the first of the worst on a tie

    @property
    def decider(self) -> GateOutcome:
        """The workload's outcome that decided (itself with one workload)."""
        return max(self.cases, key=lambda c: c.verdict.rank) if self.cases else self

    def _verdicts(self) -> str:
        return ", ".join(f"{c.settings.workload.label} {c.verdict.value}" for c in self.cases)

    def reasons(self) -> list[str]:
        """Every canary's reasons, each named by its URL when there are several (and by its
        workload when there are several, the deciding workload's first)."""
        if self.cases:
            d = self.decider
            return [f"{c.settings.workload.label}: {r}" for c in (d, *(c for c in self.cases if c is not d))
                    for r in c.reasons()]
        if len(self.canaries) == 1:
            return list(self.canaries[0].verdict.reasons)
        return [f"{j.url}: {r}" for j in self.canaries for r in j.verdict.reasons]

    def summary(self) -> str:
        """One line: the worst canary's summary ("fail: output tok/s 212.0 → 150.3 (−29.1 %, ...)");
        over several workloads, which one decided ("fail on c1 T0 (c4 T0.7 pass, c1 T0 fail): ...")."""
        if self.cases:
            d = self.decider
            if self.verdict is Verdict.PASS:
                return f"pass on every workload ({self._verdicts()})"
            reasons = self.reasons()
            more = f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else ""
            first = reasons[0].split(": ", 1)[1] if reasons else d.summary()
            return f"{self.verdict.value} on {d.settings.workload.label} ({self._verdicts()}): {first}{more}"
        w = self.worst
        if len(self.canaries) == 1:
            return w.verdict.summary()
        return f"{self.verdict.value}: worst of {len(self.canaries)} canaries {w.url}: {w.verdict.summary()}"

    def report(self) -> str:
        """What the operator reads: the verdict, the servers, a table per canary, the notes (and
        that per workload, when there are several)."""
        if self.cases:
            lines = [self.summary(), f"{len(self.cases)} workloads, one after the other, {self.elapsed_s:.1f} s"]
            for c in self.cases:
                lines += ["", f"== workload {c.settings.workload.label}: {c.verdict.value}", c.report()]
            return "\n".join(lines)
        w = self.settings.workload
        base = ", ".join(m.url for m in self.servers if m.role == BASELINE)
        several = " (mean per server)" if sum(m.role == BASELINE for m in self.servers) > 1 else ""
        lines = [self.summary(),
                 f"baseline {base}{several}; {w.duration_s:g} s of {w.concurrency} streams per server, side by "
                 f"side, {self.elapsed_s:.1f} s; thresholds: {self.settings.source}"]
        for j in self.canaries:
            lines += ["", f"canary {j.url}: {j.verdict.verdict.value}", format_rows(j.verdict.rows)]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """The verdict as JSON; over several workloads, the deciding workload's document with the
        gate's verdict, summary, reasons, notes, bound and time, and `workloads`: each one's."""
        if self.cases:
            return {**self.decider.as_dict(), "verdict": self.verdict.value, "summary": self.summary(),
                    "reasons": self.reasons(), "notes": list(self.notes), "bound_s": run_bound_s(self.settings),
                    "elapsed_s": round(self.elapsed_s, 3), "workloads": [c.as_dict() for c in self.cases]}
        w = self.settings.workload
        return {"verdict": self.verdict.value, "summary": self.summary(), "reasons": self.reasons(),
                "baseline": self.baseline.as_dict(), "canary": self.worst.verdict.canary.as_dict(),
                "rows": [r.as_dict() for r in self.worst.verdict.rows],
                "canaries": [j.as_dict() for j in self.canaries], "servers": [m.as_dict() for m in self.servers],
                "thresholds": self.settings.thresholds.as_dict(), "settings_from": self.settings.source,
                "workload": {"label": w.label, "name": w.name, "prompts": len(w.prompts),
                             "prompts_file": w.prompts_file, "concurrency": w.concurrency,
                             "max_new_tokens": w.max_new_tokens, "temperature": w.temperature, "top_p": w.top_p,
                             "duration_s": w.duration_s, "min_requests": w.min_requests,
                             "request_timeout_s": w.request_timeout_s},
                "bound_s": bound_s(w), "elapsed_s": round(self.elapsed_s, 3), "notes": list(self.notes)}


def combine(measurements: Sequence[Measurement]) -> Measurement:
    """Several servers' measurements as one reference: counts summed (so the error rate is the
    pooled one), wall time summed (server-seconds: output tok/s is then per server, what a release
    changes, whatever the number of replicas), each latency percentile and the accept length the
    mean over the servers that have one. One measurement comes back as it is."""
    if len(measurements) == 1:
        return measurements[0]

    def mean(values: Sequence[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return sum(known) / len(known) if known else None

    examples: list[str] = []
    for m in measurements:
        examples += [e for e in m.error_examples if e not in examples]
    return Measurement(
        requests=sum(m.requests for m in measurements), errors=sum(m.errors for m in measurements),
        output_tokens=sum(m.output_tokens for m in measurements), wall_s=sum(m.wall_s for m in measurements),
        ttft_p50_s=mean([m.ttft_p50_s for m in measurements]), ttft_p99_s=mean([m.ttft_p99_s for m in measurements]),
        itl_p50_s=mean([m.itl_p50_s for m in measurements]), itl_p99_s=mean([m.itl_p99_s for m in measurements]),
        accept_length=mean([m.accept_length for m in measurements]),
        error_examples=tuple(examples[:ERROR_EXAMPLES]), stopped=any(m.stopped for m in measurements))


# --------------------------------------------------------------------------- running it

def run_gate(request: GateRequest, settings: GateSettings, *, transport: httpx.BaseTransport | None = None,
             should_stop: Callable[[], bool] | None = None,
             progress: Callable[[str], None] | None = None) -> GateOutcome:
    """Probe every server, then for each workload measure them all side by side and judge each
    canary against the baselines; the worst workload decides. NoVerdict when a server does not
    answer its probe, when a baseline had no successful request (nothing to compare with: a
    broken baseline would pass any canary), or when `should_stop` (the service stopping) cut the
    run. Ctrl-C (KeyboardInterrupt in the calling thread) stops every measurement and is raised.
    `transport`: a test's MockTransport; None for the network."""
    t0 = time.monotonic()
    servers = request.servers()
    _probe_all(servers, settings, transport)
    cases = []
    for w in settings.workloads:
        one = replace(settings, workload=w, workloads=(w,))
        if progress is not None:
            of = f" (workload {w.label}, {len(cases) + 1} of {len(settings.workloads)})" \
                if len(settings.workloads) > 1 else ""
            progress(f"measuring {len(request.baselines)} baseline and {len(request.canaries)} canary server(s) side "
                     f"by side: {w.duration_s:g} s of {w.concurrency} streams each{of} (at most "
                     f"{run_bound_s(settings):g} s in all)")
        cases.append(_measure_case(servers, one, transport, should_stop, several=len(settings.workloads) > 1))
    if len(cases) == 1:
        return replace(cases[0], elapsed_s=time.monotonic() - t0)
    decider = max(cases, key=lambda c: c.verdict.rank)
    notes = tuple(f"{c.settings.workload.label}: {n}" for c in cases for n in c.notes)
    return replace(decider, settings=settings, elapsed_s=time.monotonic() - t0, notes=notes, cases=tuple(cases))


def _measure_case(servers: Sequence[tuple[str, str]], settings: GateSettings,
                  transport: httpx.BaseTransport | None, should_stop: Callable[[], bool] | None, *,
                  several: bool) -> GateOutcome:
    """One workload (`settings.workload`) on every server at once, each canary judged; `several`:
    the run has other workloads (a NoVerdict names this one)."""
    t0, w = time.monotonic(), settings.workload
    found = _measure_all([u for _, u in servers], settings, transport, should_stop,
                         deadline=time.monotonic() + cut_after_s(w))
    if should_stop is not None and should_stop():
        raise NoVerdict("stopped before the measurement ended; no verdict")
    measured = tuple(Measured(role, url, m) for (role, url), m in zip(servers, found, strict=True))
    for m in measured:
        if m.role == BASELINE and m.measurement.requests == m.measurement.errors:
            why = m.measurement.error_examples[0] if m.measurement.error_examples else "no request finished"
            raise NoVerdict(f"baseline {m.url}: no successful request ({why}){' with ' + w.label if several else ''}; "
                            f"nothing to compare the canary with, no verdict")
    reference = combine([m.measurement for m in measured if m.role == BASELINE])
    judged = tuple(Judged(m.url, compare(reference, m.measurement, settings.thresholds))
                   for m in measured if m.role == CANARY)
    notes = tuple(f"{m.role} {m.url}: cut at the gate's bound after {m.measurement.requests} finished request(s); "
                  f"judged on those" for m in measured if m.measurement.stopped)
    verdict = max((j.verdict.verdict for j in judged), key=lambda v: v.rank)
    return GateOutcome(verdict, reference, judged, measured, settings, time.monotonic() - t0, notes)


def _client(url: str, settings: GateSettings, transport: httpx.BaseTransport | None) -> httpx.Client:
    return url_client(url, key=settings.api_key, timeout=probe_timeout_s(settings.workload), transport=transport)


def _probe(url: str, settings: GateSettings, transport: httpx.BaseTransport | None) -> str | None:
    """Why the server at `url` cannot be measured, or None: it answers GET /health with 200."""
    timeout = probe_timeout_s(settings.workload)
    try:
        with _client(url, settings, transport) as client:
            r = client.get("/health", timeout=timeout)
    except httpx.TimeoutException:
        return f"no answer to GET /health within {timeout:g} s"
    except httpx.ConnectError as e:
        return f"cannot connect ({_cut(str(e))})"
    except httpx.HTTPError as e:
        return f"GET /health failed ({type(e).__name__}: {_cut(str(e))})"
    if r.status_code == 200:
        return None
    hint = {401: ": the server wants an API key (--api-key-env)", 403: ": the API key was refused",
            503: ": not ready (loading its weights?)"}.get(r.status_code, "")
    return f"GET /health answered HTTP {r.status_code}{hint}"


def _cut(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _probe_all(servers: Sequence[tuple[str, str]], settings: GateSettings,
               transport: httpx.BaseTransport | None) -> None:
    """Every server probed at once; NoVerdict naming each one that failed."""
    found: list[str | None] = [None] * len(servers)

    def one(i: int, url: str) -> None:
        found[i] = _probe(url, settings, transport)

    _in_threads([lambda i=i, u=u: one(i, u) for i, (_, u) in enumerate(servers)], "gate-probe", None)
    failed = [f"{role} {url}: {why}" for (role, url), why in zip(servers, found, strict=True) if why]
    if failed:
        raise NoVerdict("; ".join(failed) + "; no verdict")


def _measure_all(urls: Sequence[str], settings: GateSettings, transport: httpx.BaseTransport | None,
                 should_stop: Callable[[], bool] | None, *, deadline: float) -> list[Measurement]:
    """measure() against every server at once, each stopped at `deadline` at the latest."""
    stop = threading.Event()

    def cancelled() -> bool:
        return stop.is_set() or time.monotonic() >= deadline or (should_stop is not None and should_stop())

    found: list[Measurement | None] = [None] * len(urls)

    def one(i: int, url: str) -> None:
        with _client(url, settings, transport) as client:
            found[i] = measure(client, settings.workload, should_stop=cancelled)

    _in_threads([lambda i=i, u=u: one(i, u) for i, u in enumerate(urls)], "gate-measure", stop)
    assert all(m is not None for m in found)
    return [m for m in found if m is not None]


def _in_threads(jobs: Sequence[Callable[[], None]], name: str, stop: threading.Event | None) -> None:
    """Run `jobs` at once, each in a daemon thread, and wait for them all. A job's exception (a
    bug: measure() counts every request's failure) is raised here. Ctrl-C in this thread sets
    `stop`, waits the measurements' grace for the jobs, and is raised."""
    crashed: list[BaseException] = []

    def run(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # raised in the calling thread below
            crashed.append(e)
            if stop is not None:
                stop.set()

    threads = [threading.Thread(target=run, args=(j,), name=f"{name}-{i}", daemon=True) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.05)  # a bounded join: Ctrl-C reaches this thread while it waits
    except KeyboardInterrupt:
        if stop is not None:
            stop.set()
        end = time.monotonic() + STOP_GRACE_S + 0.5
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        raise
    if crashed:
        raise crashed[0]
