"""Waiting for a restarted SGLang server and deciding whether it is good.

SGLang's start-up contract (0.5.23): while weights load there is no listener (connection
refused); then HTTP is up but /health answers 503 during warm-up; then 200. `/model_info` and
`/server_info` answer 200 early, so they are never taken for readiness. A crash while loading
ends the process long before any deadline, so the unit's state and MainPID are watched on every
poll and the wait stops at once when the process is gone or replaced (a `Restart=` respawn).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import httpx

from ..config.inventory import HealthSettings, Host
from ..config.redaction import scrub_lines
from ..config.secrets import known_secrets
from ..host.bounded_http import BodyTooLarge, DeadlineExceeded, json_body
from ..host.services import UnitProbe
from .startup import Phase, PhaseTracker, Transition


class _Units(Protocol):
    def probe(self, unit: str, lines: int = 30) -> UnitProbe: ...


class ServerAccess(Protocol):
    """What the health checks need of a host session: its units, HTTP to it, and time."""

    host: Host
    services: _Units

    def http(self) -> httpx.Client: ...

    def sleep(self, seconds: float) -> None: ...

    def monotonic(self) -> float: ...

# Start-up milestones worth showing on the progress line, in the order they appear.
_MILESTONES = ("Load weight begin", "Load weight end", "Memory pool end", "CUDA graph begin", "CUDA graph end",
               "Capture cuda graph begin", "Capture cuda graph end", "fired up and ready to roll",
               "Initialization failed", "Traceback", "Error")


class HealthFailure(Exception):
    """The server did not become healthy; `log` holds the unit's last lines."""

    def __init__(self, message: str, log: list[str] | None = None):
        super().__init__(message)
        self.log = log or []


def latest_milestone(log: list[str]) -> str | None:
    for line in reversed(log):
        if any(m in line for m in _MILESTONES):
            return line.strip()[-160:]
    return None


def health_status(client: httpx.Client, timeout: float | None = None) -> int | str:
    """HTTP status of /health, or 'refused'/'timeout'/... while there is no usable listener.
    `timeout` None: the client's own (httpx takes an explicit None as no timeout at all)."""
    try:
        return client.get("/health", timeout=_or_default(timeout)).status_code
    except httpx.ConnectError:
        return "refused"
    except (DeadlineExceeded, BodyTooLarge) as e:  # a server that trickles, or sends without end
        return f"{'timeout' if isinstance(e, DeadlineExceeded) else 'refused answer'} ({e.reason})"
    except httpx.TimeoutException:
        return "timeout"
    except httpx.HTTPError as e:
        return type(e).__name__


def _or_default(timeout: float | None) -> Any:
    return httpx.USE_CLIENT_DEFAULT if timeout is None else timeout


def phase_deadlines(hs: HealthSettings) -> dict[Phase, tuple[str, float]]:
    """Each start-up phase's deadline, with the inventory field that sets it."""
    return {Phase.WEIGHTS: ("health.weights_deadline_s", hs.weights_deadline_s),
            Phase.CUDA_GRAPHS: ("health.cuda_graphs_deadline_s", hs.cuda_graphs_deadline_s),
            Phase.WARMUP: ("health.warmup_deadline_s", hs.warmup_deadline_s)}


def wait_until_serving(session: ServerAccess, unit: str, *, expected_pid: int | None,
                       deadline_s: float | None = None,
                       progress: Callable[[float, str], None] | None = None,
                       phases: PhaseTracker | None = None,
                       on_phase: Callable[[list[Transition], PhaseTracker, float], None] | None = None,
                       started_at: float | None = None) -> float:
    """Poll until /health is 200; fail at once when the unit dies or respawns, or when a start-up
    phase (from SGLang's log lines, `phases`) outlasts its deadline. Returns seconds. `on_phase`
    hears, every poll, which phases ended and where the server is. `started_at` (on the session's
    clock): when the wait began, for a wait resumed after a lost connection (the deadlines and the
    seconds returned count from then)."""
    host = session.host
    deadline_s = deadline_s or host.health.load_deadline_s
    tracker = phases or PhaseTracker()
    limits = phase_deadlines(host.health)
    start = session.monotonic() if started_at is None else started_at
    with session.http() as client:
        while True:
            elapsed = session.monotonic() - start
            p = session.services.probe(unit)
            if p.active not in ("active", "activating", "reloading"):
                raise HealthFailure(f"{unit} is {p.active} after {elapsed:.1f} s (the server exited while starting)",
                                    p.log)
            if expected_pid and p.main_pid and p.main_pid != expected_pid:
                raise HealthFailure(f"{unit} restarted while starting (MainPID {expected_pid} → {p.main_pid}): "
                                    f"the server crashed and Restart= respawned it", p.log)
            status = health_status(client, timeout=min(5.0, host.health.request_timeout_s))
            # Scrubbed whole, before the milestone is cut to its last characters.
            lines = scrub_lines(p.log, known_secrets(host))
            if status == 200:
                if on_phase:
                    on_phase(tracker.finish(elapsed), tracker, elapsed)
                return elapsed
            ended = tracker.update(lines, elapsed, http_up=isinstance(status, int))
            if on_phase:
                on_phase(ended, tracker, elapsed)
            if progress:
                progress(elapsed, f"{tracker.phase} {tracker.in_phase(elapsed):.0f} s; /health {status}; "
                                  f"{latest_milestone(lines) or 'starting'}")
            field, limit = limits.get(tracker.phase, ("", None))
            if limit is not None and tracker.in_phase(elapsed) > limit:
                raise HealthFailure(f"{unit} has been in start-up phase '{tracker.phase}' for "
                                    f"{tracker.in_phase(elapsed):.0f} s, longer than {field} ({limit:g} s)", p.log)
            if elapsed > deadline_s:
                raise HealthFailure(f"{unit} not ready after {deadline_s:.0f} s (deadline; last /health: {status})",
                                    p.log)
            session.sleep(host.health.poll_interval_s)


@dataclass
class GateResult:
    health_checks: int
    text: str
    accept_length: float | None


def health_gate(session: ServerAccess, unit: str, expected_pid: int | None = None) -> GateResult:
    """`/health` 200 N times in a row, then a sampled `/generate` must return text, then
    (optionally) the average accept length must reach the inventory's minimum; and the unit
    must still be the process that started."""
    hs = session.host.health
    with session.http() as client:
        ok = 0
        attempts = 0
        max_attempts = hs.consecutive_successes * 3 + 5
        while ok < hs.consecutive_successes:
            attempts += 1
            status = health_status(client)
            if status == 200:
                ok += 1
            else:
                raise HealthFailure(f"/health answered {status} after {ok} consecutive 200s (flapping or unhealthy)")
            if attempts > max_attempts:
                raise HealthFailure("/health gate did not settle")
            if ok < hs.consecutive_successes:
                session.sleep(hs.poll_interval_s)
        text = generated_text(client, hs)
        accept = None
        if hs.min_accept_length is not None:
            try:
                info = json_body(client.get("/server_info"))
                accept = float(info["internal_states"][0]["avg_spec_accept_length"])
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
                raise HealthFailure(f"/server_info has no avg_spec_accept_length ({type(e).__name__})") from None
            if accept < hs.min_accept_length:
                raise HealthFailure(f"avg accept length {accept:.2f} < min_accept_length {hs.min_accept_length}")
    p = session.services.probe(unit, lines=10)
    if p.active != "active" or (expected_pid and p.main_pid != expected_pid):
        raise HealthFailure(f"{unit} died after passing the health gate ({p.active}, MainPID {p.main_pid})", p.log)
    return GateResult(ok, text, accept)


def generated_text(client: httpx.Client, hs: HealthSettings) -> str:
    """One sampled `/generate` of the inventory's prompt; HealthFailure unless it returns text."""
    try:
        r = client.post("/generate", json={
            "text": hs.generate_prompt,
            "sampling_params": {"temperature": 0.7, "top_p": 0.9, "top_k": 50,
                                "max_new_tokens": hs.generate_max_new_tokens},
        })
    except (DeadlineExceeded, BodyTooLarge) as e:  # its message names the URL and the bound
        raise HealthFailure(f"POST /generate failed: {e}") from None
    except httpx.HTTPError as e:
        raise HealthFailure(f"POST /generate failed: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise HealthFailure(f"POST /generate answered {r.status_code}: {r.text[:200]}")
    try:
        body = json_body(r)
    except ValueError:
        raise HealthFailure("POST /generate returned no JSON") from None
    text = body.get("text") if isinstance(body, dict) else None
    if not isinstance(text, str) or not text.strip():
        raise HealthFailure("POST /generate returned no text")
    return text


def soak(session: ServerAccess, unit: str, expected_pid: int | None) -> int:
    """After the gates and before the commit: the server stays healthy for `health.min_healthy_s`
    (Nomad's min_healthy_time), one /health and one /generate every `soak_interval_s`, and stays
    the process that started. Catches a server that passes a gate and then hangs or dies.
    Counted in rounds, so the time is the sleeps' and a fake clock runs it at once. Returns the
    number of generations."""
    hs = session.host.health
    rounds = math.ceil(hs.min_healthy_s / hs.soak_interval_s) if hs.min_healthy_s > 0 else 0
    with session.http() as client:
        for i in range(rounds):
            session.sleep(hs.soak_interval_s)
            where = f"{(i + 1) * hs.soak_interval_s:.0f} s into the {hs.min_healthy_s:g} s soak"
            status = health_status(client)
            if status != 200:
                raise HealthFailure(f"/health answered {status} {where}")
            try:
                generated_text(client, hs)
            except HealthFailure as e:
                raise HealthFailure(f"{e} ({where})") from None
            p = session.services.probe(unit, lines=10)
            if p.active != "active" or (expected_pid and p.main_pid != expected_pid):
                raise HealthFailure(f"{unit} is {p.active}, MainPID {p.main_pid}, {where}", p.log)
    return rounds


def in_flight(client: httpx.Client, timeout: float | None = None) -> int | None:
    """Requests running or waiting in the server, summed over its data-parallel ranks, from
    SGLang 0.5.23's `/v1/loads?include=core` (`num_running_reqs` + `num_waiting_reqs` per rank);
    None when the server does not answer it (not serving, or too old to have it)."""
    try:
        r = client.get("/v1/loads", params={"include": "core"}, timeout=_or_default(timeout))
        if r.status_code != 200:
            return None
        loads = json_body(r).get("loads")
        return sum(int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0)) for x in loads)
    except (httpx.HTTPError, ValueError, TypeError, AttributeError):
        return None


@dataclass
class DrainResult:
    waited_s: float
    at_start: int | None  # in flight when the drain began (None: the server did not say)
    remaining: int | None  # still in flight when it ended: cut by the stop


def drain(session: ServerAccess, timeout_s: float) -> DrainResult:
    """Wait (at most `timeout_s`) until the serving server has no request running or waiting.
    Without a router in front nothing stops new requests from arriving: this only lets the ones
    in flight finish before the stop, and says how many were cut."""
    host = session.host
    t0 = session.monotonic()
    with session.http() as client:
        first = now = in_flight(client, timeout=min(5.0, host.health.request_timeout_s))
        while now and session.monotonic() - t0 < timeout_s:
            session.sleep(min(host.health.poll_interval_s, 1.0))
            now = in_flight(client, timeout=min(5.0, host.health.request_timeout_s))
    return DrainResult(session.monotonic() - t0, first, now)
