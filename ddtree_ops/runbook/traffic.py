"""The live-traffic phases of one host: its place in the request router, and the canary's
performance gate. Its own object, which the runbook (phases.py) holds and the phase engine
(engine.py) calls: what users of the fleet see during a deploy.

    measure_baseline (before any change) → ... → leave_router (before a serving unit stops) →
    drain → stop → ... → health gate → join_router → perf_gate → soak → commit

Only node 0 of a multi-node server serves requests, so only it is routed and measured.

The gate measures each of the host's `perf_gate.workloads` in turn (the baseline: one measurement
per workload, in their order; the canary: each beside its peer), judges each with `compare`, and
the worst verdict wins (`worst_of`: the first of the worst on a tie, today's case by default).
The record kept (`perf_result`) is the deciding workload's, in the shape it always had, its
reasons those of every workload named by its label, plus `workload` (which one decided) and
`workloads` (each one's own record).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from ..config.workload_settings import Workload
from ..gates.perfgate import GateVerdict, Verdict, compare
from ..gates.router import RouterError, SmgRouter
from ..gates.workload import Measurement, measure
from ..host.session import HostSession
from .options import DeployOptions
from .steps import StepFailed, StepLog


class Traffic:
    """The router and the performance gate of one host, in one run. `health_checked=False` (a
    node of rank >= 1) neither routes nor measures: every phase here is then a no-op. `router`:
    the client of the router in front of the host (None: no router), built by whoever built the
    runbook."""

    def __init__(self, session: HostSession, log: StepLog, *, health_checked: bool = True,
                 router: SmgRouter | None = None):
        self.session, self.host, self.log, self.health_checked = session, session.host, log, health_checked
        self.router = router
        self._left_router = False  # this run took the host's worker out of the router
        self.perf_result: dict[str, Any] | None = None  # the canary's gate, as recorded and shown

    # -- the router ------------------------------------------------------------------------------
    def _router(self) -> SmgRouter | None:
        return self.router if self.health_checked else None

    def router_problems(self) -> list[str]:
        """Preflight: the router answers with the key we hold, so no serving unit is stopped for
        a deploy that could not take the host out of the router first, or put it back."""
        router = self._router()
        if router is None:
            return []
        try:
            router.check()
        except RouterError as e:
            return [str(e)]  # the router's errors name it already
        return []

    def leave_router(self, worker: str | None = None, *, required: bool = True) -> None:
        """Before a serving unit stops: no new request is sent to this host (requests in flight
        are then drained from the server itself). `worker`: the URL the router knows the serving
        unit by, when that is not the inventory's (the old port of a deploy that changes it).
        `required=False` (a rollback stopping the failed release): a router that cannot be reached
        is said and the stop goes on; the router stops sending to a server whose health fails."""
        router = self._router()
        if router is None or self._left_router:
            return
        self.log.phase("deregister")
        self.session.hooks.pause("before-deregister")
        worker = worker or self.host.router.worker
        try:
            was = router.deregister(worker)
        except RouterError as e:
            if required:
                raise StepFailed("deregister", str(e)) from None
            self.log.step("deregister", f"{worker} could not be taken out of the router ({e}); stopping it anyway")
            return
        self._left_router = True
        self.log.step("deregister",
                      f"{worker} {'taken out of' if was else 'was not in'} the router {self.host.router.url}")

    def join_router(self, worker: str | None = None) -> None:
        """The server passed its health gate: the router sends it requests again, and we wait
        until it does. The inventory says this host is behind the router, so it is registered
        whether or not it was before (a host an earlier failed run left out comes back).
        `worker`: where the server serves when that is not the inventory's worker URL (the old
        server a rollback brought back on its old port)."""
        router = self._router()
        if router is None:
            return
        self.log.phase("register")
        self.session.hooks.pause("before-register")
        worker, t0 = worker or self.host.router.worker, time.monotonic()
        try:
            router.register(worker)
        except RouterError as e:
            raise StepFailed("register", str(e)) from None
        self._left_router = False
        self.log.step("register", f"{worker} routed by {self.host.router.url} after {time.monotonic() - t0:.1f} s")

    def rejoin_router(self, worker: str | None = None) -> str | None:
        """`join_router` at the end of a rollback: the host is healthy on its previous release, so a
        router that cannot take it back (unreachable past router.retry_window_s, a refused key)
        does not make the host a thing to repair; what failed is returned, to be said, and the
        host is left healthy, out of rotation. None: routed."""
        try:
            self.join_router(worker)
        except StepFailed as e:
            w = worker or self.host.router.worker
            return (f"NOT re-registered: {w} is healthy but out of the router {self.host.router.url} ({e}); "
                    f"put it back once the router answers (POST {self.host.router.url}/workers "
                    f"{{\"url\": \"{w}\"}}, or the next deploy of {self.host.name} registers it)")
        return None

    # -- the performance gate --------------------------------------------------------------------
    def gate_enabled(self, opts: DeployOptions) -> bool:
        on = self.host.perf_gate.enabled if opts.perf_gate is None else opts.perf_gate
        return bool(on) and self.health_checked

    def _measure(self, workload: Workload) -> Measurement:
        """`workload` against this host's server (errors are counted, never raised)."""
        with self.session.http() as client:
            return measure(client, workload)

    def measure_baseline(self, opts: DeployOptions, serving: bool) -> tuple[Measurement, ...] | None:
        """Each workload against the server as it is, before any change, one measurement per
        workload in their order (None: nothing serves)."""
        if not self.gate_enabled(opts):
            return None
        if not serving:
            self.log.step("baseline", "skipped: nothing serves on the host before the change")
            return None
        self.log.phase("baseline")
        workloads = self.host.perf_gate.workloads
        found = []
        for w in workloads:
            m = self._measure(w)
            self.log.step("baseline", _brief(m) if len(workloads) == 1 else f"{w.label}: {_brief(m)}")
            found.append(m)
        return tuple(found)

    def _measure_beside_peer(self, workload: Workload, opts: DeployOptions
                             ) -> tuple[Measurement, Measurement | None, str | None]:
        """(canary, peer, why the peer could not be measured): `workload` against the new server
        and, at the same time, against a host not yet updated (when the rollout names one)."""
        peer: dict[str, Any] = {}
        t = None
        if self.host.perf_gate.compare_peers and opts.peer_measure is not None:
            def run_peer() -> None:
                try:
                    peer["m"] = opts.peer_measure(self.host.name, workload)
                except Exception as e:  # a peer that cannot be measured is said, not fatal
                    peer["error"] = f"{type(e).__name__}: {e}"
            t = threading.Thread(target=run_peer, name=f"peer-of-{self.host.name}", daemon=True)
            t.start()
        canary = self._measure(workload)
        if t is not None:
            t.join()
        return canary, peer.get("m"), peer.get("error")

    def perf_gate(self, baseline: Sequence[Measurement] | Measurement | None, opts: DeployOptions) -> None:
        """Each workload against the new server (and, side by side, a host not yet updated),
        judged against its baseline; the worst verdict counts: a fail rolls the host back; a
        marginal verdict asks, or fails without --accept-marginal. `baseline`: measure_baseline's
        (a lone Measurement: the first workload's)."""
        if not self.gate_enabled(opts):
            return
        self.log.phase("perf gate")
        pg = self.host.perf_gate
        bases = _baselines(baseline, len(pg.workloads))
        judged: list[Judged] = []
        for w, b in zip(pg.workloads, bases, strict=True):
            canary, peers, peer_error = self._measure_beside_peer(w, opts)
            verdict, record = judge(b, canary, peers, pg.thresholds)
            if peer_error:
                record["reasons"].append(f"the peer could not be measured: {peer_error}")
            judged.append(Judged(w, verdict, record))
            if len(pg.workloads) > 1:
                self.log.step("perf gate", f"{w.label}: {one_summary(verdict, record)}")
        worst, record, summary = worst_of(judged)
        self.perf_result = record
        self.log.step("perf gate", summary)
        if worst is Verdict.PASS:
            return
        if worst is Verdict.FAIL:
            raise StepFailed("perf gate", summary)
        if opts.marginal == "accept":
            self.log.step("perf gate", "marginal, accepted (--accept-marginal)")
            return
        if opts.marginal == "ask" and opts.ask is not None and opts.ask(
                f"{self.host.name}: the performance gate is marginal: {summary}. Accept and go on?"):
            self.log.step("perf gate", "marginal, accepted by the operator")
            return
        raise StepFailed("perf gate", f"{summary}; a marginal verdict fails without a terminal to ask on "
                                        f"(pass --accept-marginal to accept it)")


def _baselines(baseline: Sequence[Measurement] | Measurement | None, n: int) -> tuple[Measurement | None, ...]:
    """One baseline per workload: None (nothing served) for each, a lone Measurement for the
    first (a caller measuring one workload), a sequence as given."""
    if baseline is None:
        return (None,) * n
    if isinstance(baseline, Measurement):
        return (baseline,) + (None,) * (n - 1)
    if len(baseline) != n:
        raise ValueError(f"{len(baseline)} baseline measurements for {n} workloads")
    return tuple(baseline)


@dataclass(frozen=True)
class Judged:
    """One workload's verdict (None: nothing to compare with) and the record kept of it."""

    workload: Workload
    verdict: GateVerdict | None
    record: dict[str, Any]

    @property
    def rank(self) -> int:
        return self.verdict.verdict.rank if self.verdict else Verdict.PASS.rank


def workload_doc(w: Workload) -> dict[str, Any]:
    """The case a record was measured with, as the record keeps it."""
    return {"label": w.label, "name": w.name, "concurrency": w.concurrency, "temperature": w.temperature,
            "top_p": w.top_p, "max_new_tokens": w.max_new_tokens, "duration_s": w.duration_s,
            "min_requests": w.min_requests}


def one_summary(verdict: GateVerdict | None, record: dict[str, Any]) -> str:
    return verdict.summary() if verdict else record["reasons"][0]


def worst_of(judged: Sequence[Judged]) -> tuple[Verdict, dict[str, Any], str]:
    """(the gate's verdict, the record kept, its one-line summary) over the workloads: the worst
    verdict wins, the first of the worst on a tie. The record is the deciding workload's (its
    verdict, baseline, canary, peers and rows at the top, as consumers read a gate), with
    `workload` naming the case, `workloads` every workload's record, and, when there are several,
    every workload's reasons prefixed by its label, the deciding one's first."""
    if not judged:
        raise ValueError("no workload was judged")
    decider = max(judged, key=lambda j: j.rank)  # max keeps the first of the worst
    verdict = decider.verdict.verdict if decider.verdict else Verdict.PASS
    each = [{**j.record, "workload": workload_doc(j.workload)} for j in judged]
    record = {**decider.record, "workload": workload_doc(decider.workload), "workloads": each}
    if len(judged) == 1:
        return verdict, record, one_summary(decider.verdict, decider.record)
    ordered = [decider] + [j for j in judged if j is not decider]
    record["reasons"] = [f"{j.workload.label}: {r}" for j in ordered for r in j.record["reasons"]]
    verdicts = ", ".join(f"{j.workload.label} {j.verdict.verdict.value if j.verdict else 'pass'}" for j in judged)
    if verdict is Verdict.PASS:
        return verdict, record, f"pass on every workload ({verdicts}): " + "; ".join(
            f"{j.workload.label} {_tps_brief(j)}" for j in judged)
    reasons = decider.record["reasons"]
    more = len(record["reasons"]) - 1
    return verdict, record, (f"{verdict.value} on {decider.workload.label} ({verdicts}): {reasons[0]}"
                             f"{f' (+{more} more)' if more else ''}")


def _tps_brief(j: Judged) -> str:
    """A passing workload's output tok/s against its reference: "output tok/s 200.0 → 204.0 (+2.0 %)"."""
    canary = (j.record.get("canary") or {}).get("output_tps")
    ref = (j.record.get("baseline") or j.record.get("peers") or {}).get("output_tps")
    if ref is None or j.verdict is None:
        return f"output tok/s {canary or 0.0:.1f} (nothing to compare with)"
    change = f" ({(canary - ref) / ref * 100:+.1f} %)".replace("-", "−") if ref else ""
    return f"output tok/s {ref:.1f} → {canary:.1f}{change}"


def judge(baseline: Measurement | None, canary: Measurement, peers: Measurement | None,
          thresholds: Any) -> tuple[GateVerdict | None, dict[str, Any]]:
    """The verdict and the record kept of it. Without a baseline (nothing served before) the peer
    is the reference; without either there is nothing to compare, and the gate passes on the
    canary's own figures, saying so."""
    reference = baseline or peers
    if reference is None:
        return None, {"verdict": Verdict.PASS.value, "baseline": None, "canary": canary.as_dict(), "peers": None,
                      "rows": [], "reasons": ["no baseline (nothing served before the change) and no peer to "
                                              "compare with: the canary's figures are recorded only"]}
    v = compare(reference, canary, thresholds, peers=peers if baseline is not None else None)
    record = v.as_dict()
    if baseline is None:
        record["baseline"], record["peers"] = None, peers.as_dict()
        record["reasons"] = ["no baseline (nothing served before the change): compared with a peer",
                             *record["reasons"]]
    return v, record


def _brief(m: Measurement) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.0f} ms"
    acc = f", accept length {m.accept_length:.2f}" if m.accept_length is not None else ""
    return (f"{m.requests} requests, {m.errors} errors, {m.output_tps:.1f} output tok/s, TTFT p50 {ms(m.ttft_p50_s)}, "
            f"ITL p50 {ms(m.itl_p50_s)}{acc}")
