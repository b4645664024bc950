"""The live-traffic phases of one host: its place in the request router, and the canary's
performance gate. Its own object, which the runbook (phases.py) holds and the phase engine
(engine.py) calls: what users of the fleet see during a deploy.

    measure_baseline (before any change) → ... → leave_router (before a serving unit stops) →
    drain → stop → ... → health gate → join_router → perf_gate → soak → commit

Only node 0 of a multi-node server serves requests, so only it is routed and measured.
"""

from __future__ import annotations

import threading
import time
from typing import Any

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

    def _measure(self) -> Measurement:
        """The gate's workload against this host's server (errors are counted, never raised)."""
        with self.session.http() as client:
            return measure(client, self.host.perf_gate.workload)

    def measure_baseline(self, opts: DeployOptions, serving: bool) -> Measurement | None:
        """The workload against the server as it is, before any change (None: nothing serves)."""
        if not self.gate_enabled(opts):
            return None
        if not serving:
            self.log.step("baseline", "skipped: nothing serves on the host before the change")
            return None
        self.log.phase("baseline")
        m = self._measure()
        self.log.step("baseline", _brief(m))
        return m

    def perf_gate(self, baseline: Measurement | None, opts: DeployOptions) -> None:
        """The same workload against the new server (and, side by side, a host not yet updated);
        a fail rolls the host back; a marginal verdict asks, or fails without --accept-marginal."""
        if not self.gate_enabled(opts):
            return
        self.log.phase("perf gate")
        pg = self.host.perf_gate
        peer: dict[str, Any] = {}
        t = None
        if pg.compare_peers and opts.peer_measure is not None:
            def run_peer() -> None:
                try:
                    peer["m"] = opts.peer_measure(self.host.name)
                except Exception as e:  # a peer that cannot be measured is said, not fatal
                    peer["error"] = f"{type(e).__name__}: {e}"
            t = threading.Thread(target=run_peer, name=f"peer-of-{self.host.name}", daemon=True)
            t.start()
        canary = self._measure()
        if t is not None:
            t.join()
        peers = peer.get("m")
        verdict, record = judge(baseline, canary, peers, pg.thresholds)
        if peer.get("error"):
            record["reasons"].append(f"the peer could not be measured: {peer['error']}")
        self.perf_result = record
        summary = verdict.summary() if verdict else record["reasons"][0]
        self.log.step("perf gate", summary)
        if verdict is None or verdict.verdict is Verdict.PASS:
            return
        if verdict.verdict is Verdict.FAIL:
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
