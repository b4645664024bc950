"""`ddtree-ops tune`: each host of the selection measures its share of the configs, through the same
runbook as a deploy, and is put back as it was.

Per host, top to bottom (a worker thread each; at most `max_unavailable` hosts at once):

    connect → read its current release (where it goes back to) → out of the router
    → for each config of its plan (tune_plan.assign):
          apply it: DFlash is measured as the host runs (its original files); a DDTree config is
          `deploy --budget B --topk-cap K` of the patch set (backup, unit, restart, weight wait, health
          gate; the perf gate off: this measures instead); a deploy that fails is rolled back by its
          runbook, and every workload of that config is a failed row with the reason
          for each workload: measured as the perf gate measures (gates/workload.measure), repeated until
          steady (gates/tune_ranking.stop_repeating)
    → back to the release it ran before (`rollback --to` it, or `--to original`), health-gated
    → into the router again, waiting until it is routed

An interrupt (Ctrl-C, SIGTERM, SIGHUP: cli/signals.py hands it over, as to a rollout) stops every
host at its next event or measurement: a deploy in flight is rolled back by its runbook, and the
host goes back and into the router as above; the rows measured so far are kept. The way back is
never cut short. `--keep best` is not done here: the CLI deploys the pick afterwards as an ordinary
rolling deploy, so the router and max_unavailable rules are the deploy's own.
"""

from __future__ import annotations

import dataclasses
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..artifacts.patchset import PatchSet
from ..config.inventory import Host
from ..config.workload_settings import Workload
from ..errors import DdtreeOpsError, InputError, reason
from ..gates.router import RouterError, SmgRouter
from ..gates.tune_ranking import RepeatRule, stop_repeating, summarise
from ..gates.workload import Measurement, measure
from ..host.session import HostSession
from ..runbook.deploy import deploy_host
from ..runbook.describe import Interrupt, interrupt_label
from ..runbook.events import Event, EventSink, Failed, Note
from ..runbook.options import DeployOptions
from ..runbook.rollback import ORIGINAL, rollback_host
from . import rollout as rollout_mod
from .routing import Routers, router_for
from .tune_plan import HostPlan, TuneConfig, workload_label

# Fields that make two hosts "of one kind": configs measured on one are compared with configs
# measured on the other, so they must serve the same model the same way.
SAME_KIND_FIELDS = ("model_path", "draft_model_path", "tp", "extra_args", "environment", "nnodes")


def check_one_kind(hosts: Sequence[Host]) -> None:
    """InputError unless every host serves alike (SAME_KIND_FIELDS) and none is a multi-node server."""
    for h in hosts:
        if h.multinode:
            raise InputError(f"{h.name}: tune does not handle multi-node servers yet; limit it to single hosts")
    first = hosts[0]
    for h in hosts[1:]:
        for f in SAME_KIND_FIELDS:
            if getattr(h, f, None) != getattr(first, f, None):
                raise InputError(f"tune compares configs measured on different hosts, so they must be of one kind: "
                                 f"{h.name} and {first.name} differ in `{f}`; --limit the tune to one kind")


@dataclass
class TuneOptions:
    patchset: PatchSet
    workloads: list[Workload]
    rule: RepeatRule = field(default_factory=RepeatRule)
    deadline_s: float | None = None
    command: str = "ddtree-ops tune"
    tune_id: str = ""
    rollout_id: str | None = None  # recorded with every release the tune makes


@dataclass
class HostTuneResult:
    host: str
    rows: list[dict[str, Any]]
    start_release: str | None  # None: the original files
    restored: bool
    message: str
    routed: bool | None  # None: no router in front of the host

    def restored_record(self) -> dict[str, Any]:
        return {"host": self.host, "release": self.start_release or ORIGINAL, "ok": self.restored,
                "routed": self.routed, "message": self.message}


def _row(config: TuneConfig, host: str, w: Workload, **fields_: Any) -> dict[str, Any]:
    base = {**config.as_dict(), "host": host, "concurrency": w.concurrency, "temperature": w.temperature,
            "workload": workload_label(w.concurrency, w.temperature), "status": "failed", "reason": None,
            "tok_s": None, "tok_s_spread": None, "repeats": 0, "samples_tok_s": [], "accept_length": None,
            "ttft_p50_s": None, "ttft_p99_s": None, "itl_p50_s": None, "itl_p99_s": None, "error_rate": None}
    base.update(fields_)
    return base


# The line of a failed server's log that says why (SGLang's last exception, an OOM): the row's reason.
_WHY_RE = re.compile(r"(Exception|Error|error|out of memory|failed)[:!]")


def server_said(log: Sequence[str]) -> str | None:
    """The last line of a failed start's log excerpt that names an exception or an error, from its
    message on (without the journal's prefix), at most 300 characters; None when there is none."""
    for line in reversed(log):
        m = _WHY_RE.search(line)
        if m:
            start = line.rfind(" ", 0, m.start()) + 1
            return line[start:].strip()[:300]
    return None


class _Stopped(Exception):
    """A measurement cut short by the interrupt."""


MeasureFn = Callable[[HostSession, Workload, Callable[[], bool]], Measurement]


def measure_server(session: HostSession, w: Workload, should_stop: Callable[[], bool]) -> Measurement:
    """The workload against the host's server, as the perf gate measures it."""
    with session.http() as client:
        return measure(client, w, should_stop=should_stop)


class Tune:
    """Run the host plans; `interrupt` (any thread, a signal handler included) stops them all.
    `measure`: the seam the fast tests put a model of the server's speed in."""

    def __init__(self, plans: list[HostPlan], hosts: dict[str, Host], opts: TuneOptions, *,
                 connect: Callable[[Host], HostSession], routers: Routers = router_for,
                 report: EventSink = lambda e: None, max_parallel: int = 1, measure: MeasureFn = measure_server,
                 admit: Callable[[str], str | None] | None = None):
        """`admit(host)`: None when the host may leave its router now, else why it must wait (the
        router's pool, policy.py); asked again each second while another host is out."""
        self.plans, self.hosts, self.opts = plans, hosts, opts
        self.connect, self.routers, self.report = connect, routers, report
        self.max_parallel = max(1, max_parallel)
        self.measure = measure
        self.admit = admit
        self._interrupts: list[KeyboardInterrupt] = []
        self._out = 0  # hosts out of service (admitted and not yet back)
        self._out_lock = threading.Lock()

    # -- interrupts: the rollout's protocol (rollout.deliver_interrupt) ---------------------------
    def interrupt(self, e: KeyboardInterrupt) -> None:
        self._interrupts.append(e)

    def stopping(self) -> bool:
        return bool(self._interrupts)

    @property
    def interrupted_by(self) -> str | None:
        return interrupt_label(self._interrupts[0]) if self._interrupts else None

    def _sink(self, interruptible: bool) -> EventSink:
        """Events to the watcher; once interrupted, a deploy's next event raises the interrupt inside it
        (its runbook rolls back), once per host, unless it is rolling back already."""
        raised: set[str] = set()
        rolling_back: set[str] = set()

        def sink(event: Event) -> None:
            if isinstance(event, Failed):
                rolling_back.add(event.host)
            self.report(event)
            if interruptible and self._interrupts and event.host not in raised and event.host not in rolling_back:
                raised.add(event.host)
                raise Interrupt(getattr(self._interrupts[0], "signum", signal.SIGINT))
        return sink

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> list[HostTuneResult]:
        rollout_mod._RUNNING.append(self)  # an interrupt is recorded, never raised here
        try:
            gate = threading.Semaphore(self.max_parallel)
            with ThreadPoolExecutor(max_workers=len(self.plans), thread_name_prefix="ddtree-tune") as pool:
                futures = [pool.submit(self._guarded, p, gate) for p in self.plans]
                while not all(f.done() for f in futures):
                    try:
                        time.sleep(0.1)
                    except KeyboardInterrupt as e:  # one no signal handler handed over (a library caller's)
                        self.interrupt(e)
                return [f.result() for f in futures]
        finally:
            rollout_mod._RUNNING.remove(self)

    def _guarded(self, plan: HostPlan, gate: threading.Semaphore) -> HostTuneResult:
        with gate:
            refused = self._admitted(plan.host)
            if refused is not None:
                return HostTuneResult(plan.host, self._failed_rows(plan.configs, plan.host, refused), None, True,
                                      refused, None)
            try:
                return self._host(plan)
            except DdtreeOpsError as e:  # could not connect or read the host: its configs are rows too
                self.report(Note(plan.host, f"not tuned: {reason(e)}"))
                return HostTuneResult(plan.host, self._failed_rows(plan.configs, plan.host, f"not tuned: {reason(e)}"),
                                      None, True, f"not tuned: {reason(e)}", None)
            finally:
                with self._out_lock:
                    self._out -= 1

    def _admitted(self, host: str) -> str | None:
        """Wait until the router's pool lets `host` leave it (None), or say why it never will: an
        interrupt, or a refusal while no other host is out (nothing will come back to make room)."""
        said = False
        while True:
            with self._out_lock:
                if self.stopping():
                    self._out += 1  # balanced by _guarded's finally
                    return f"not measured: interrupted ({self.interrupted_by}) before the host started"
                try:
                    why = self.admit(host) if self.admit is not None else None
                except Exception as e:  # an unreadable router: nothing leaves it on a guess
                    why = f"the router's workers could not be read: {reason(e)}"
                if why is None or self._out == 0:
                    self._out += 1
                    return None if why is None else f"not tuned: {why}"
            if not said:
                self.report(Note(host, f"waits: {why}"))
                said = True
            time.sleep(1.0)

    def _failed_rows(self, configs: Sequence[TuneConfig], host: str, why: str) -> list[dict[str, Any]]:
        return [_row(c, host, w, reason=why) for c in configs for w in self.opts.workloads]

    def _host(self, plan: HostPlan) -> HostTuneResult:
        host = self.hosts[plan.host]
        if self.stopping():
            why = f"not measured: interrupted ({self.interrupted_by}) before the host started"
            return HostTuneResult(plan.host, self._failed_rows(plan.configs, plan.host, why), None, True,
                                  "not started", None)
        session = self.connect(host)
        try:
            start = session.store.history().get("current")
            with self.routers(host) as router:
                return self._on_host(session, plan, start, router)
        finally:
            session.close()

    def _on_host(self, session: HostSession, plan: HostPlan, start: str | None,
                 router: SmgRouter | None) -> HostTuneResult:
        host = session.host
        rows: list[dict[str, Any]] = []
        changed = False
        if router is not None:
            try:
                router.deregister(host.router.worker)
            except RouterError as e:
                why = f"not tuned: it could not be taken out of the router ({e})"
                self.report(Note(host.name, why))
                rows = self._failed_rows(plan.configs, host.name, why)
                return HostTuneResult(host.name, rows, start, True, why, True)
            self.report(Note(host.name, f"out of the router {host.router.url} while tuned"))
        try:
            for i, config in enumerate(plan.configs):
                if self.stopping():
                    rows += self._failed_rows(plan.configs[i:], host.name,
                                              f"not measured: interrupted ({self.interrupted_by})")
                    break
                problem = None
                try:
                    if not config.dflash:
                        changed = True
                        problem = self._apply(session, config)
                    if problem is None:
                        rows += self._measure_all(session, config)
                except DdtreeOpsError as e:  # the host itself is in trouble: no more configs on it
                    rows += self._failed_rows(plan.configs[i:], host.name, f"not measured: {reason(e)}")
                    break
                if problem is not None:
                    rows += [_row(config, host.name, w, reason=problem) for w in self.opts.workloads]
        finally:
            restored, message = self._restore(session, start, changed)
            routed = self._rejoin(session, router) if router is not None else None
        if routed is False:
            message += "; NOT back in the router (see above)"
        return HostTuneResult(host.name, rows, start, restored, message, routed)

    def _deploy_options(self, what: str) -> DeployOptions:
        return DeployOptions(command=f"{self.opts.command} ({what})"[:500], deadline_s=self.opts.deadline_s,
                             perf_gate=False, rollout_id=self.opts.rollout_id)

    def _apply(self, session: HostSession, config: TuneConfig) -> str | None:
        """Deploy `config` (None: it serves; else why not, the host rolled back by its runbook)."""
        host = session.host
        # Each config is a release on the host's chain, and the way back undoes them all: none of
        # their backups may be pruned before the tune is done.
        tuned = dataclasses.replace(host, budget=config.budget, topk_cap=config.topk_cap,
                                    keep_releases=max(host.keep_releases, 100))
        cfg_session = HostSession(tuned, session.link, session.hooks)
        self.report(Note(host.name, f"config {config.label}: deploying"))
        try:
            result = deploy_host(cfg_session, self.opts.patchset, self._deploy_options(f"config {config.label}"),
                                 self._sink(True), router=None)
        except KeyboardInterrupt:
            return f"not measured: interrupted ({self.interrupted_by}) while deploying; rolled back"
        except DdtreeOpsError as e:
            self.report(Note(host.name, f"config {config.label}: failed: {reason(e)}"))
            if e.exit_code not in (2, 3):  # not refused nor rolled back cleanly: stop using this host
                raise
            said = server_said(getattr(getattr(e, "result", None), "log", None) or [])
            return f"deploy failed: {reason(e)}" + (f"; the server said: {said}" if said else "")
        self.report(Note(host.name, f"config {config.label}: serving (release {result.release})"))
        return None

    def _measure_all(self, session: HostSession, config: TuneConfig) -> list[dict[str, Any]]:
        host = session.host
        rows = []
        for i, w in enumerate(self.opts.workloads):
            if self.stopping():
                rows.append(_row(config, host.name, w, reason=f"not measured: interrupted ({self.interrupted_by})"))
                continue
            samples: list[Measurement] = []
            try:
                if i == 0:  # not counted: the first requests after a restart warm the server's caches up
                    self._one(session, dataclasses.replace(w, duration_s=0.0, min_requests=w.concurrency))
                while not stop_repeating([m.output_tps for m in samples], self.opts.rule):
                    samples.append(self._one(session, w))
            except _Stopped:
                rows.append(_row(config, host.name, w, reason=f"not measured: interrupted ({self.interrupted_by})",
                                 **(summarise(samples) if samples else {})))
                continue
            fig = summarise(samples)
            status, why = "ok", None
            if fig["errors"]:
                bad = next(m for m in samples if m.errors)
                status = "failed"
                why = (f"{fig['errors']} of {fig['requests']} requests failed"
                       + (f": {bad.error_examples[0]}" if bad.error_examples else ""))
            rows.append(_row(config, host.name, w, status=status, reason=why, **fig))
            self.report(Note(host.name, f"config {config.label} {workload_label(w.concurrency, w.temperature)}: "
                                        f"{fig['tok_s']:.1f} tok/s (±{(fig['tok_s_spread'] or 0) * 100:.1f} %, "
                                        f"{fig['repeats']} runs)"
                                        + (f", accept length {fig['accept_length']:.2f}"
                                           if fig["accept_length"] is not None else "")
                                        + (f"; FAILED: {why}" if why else "")))
        return rows

    def _one(self, session: HostSession, w: Workload) -> Measurement:
        m = self.measure(session, w, self.stopping)
        if m.stopped:
            raise _Stopped()
        return m

    def _restore(self, session: HostSession, start: str | None, changed: bool) -> tuple[bool, str]:
        """Back to `start` (never interrupted: a half-done way back would need a person)."""
        to = start or ORIGINAL
        try:
            if not changed or session.store.history().get("current") == start:
                return True, f"still on {to}"
            self.report(Note(session.host.name, f"back to {to}"))
            rollback_host(session, to, self._deploy_options(f"back to {to}"), self._sink(False), router=None)
        except DdtreeOpsError as e:
            self.report(Note(session.host.name, f"NOT back to {to}: {reason(e)}"))
            return False, f"NOT back to {to}: {reason(e)}"
        return True, f"back on {to}"

    def _rejoin(self, session: HostSession, router: SmgRouter) -> bool:
        host = session.host
        try:
            router.register(host.router.worker)
        except RouterError as e:
            self.report(Note(host.name, f"NOT back in the router {host.router.url}: {e}; put it back with "
                                        f"POST {host.router.url}/workers {{\"url\": \"{host.router.worker}\"}}"))
            return False
        self.report(Note(host.name, f"routed again by {host.router.url}"))
        return True


# --------------------------------------------------------------------------- the whole tune


def survey(hosts: Sequence[Host], connect: Callable[[Host], HostSession]) -> dict[str, str | None]:
    """Each host's current release (None: its original files), read in parallel before planning."""
    def one(h: Host) -> str | None:
        s = connect(h)
        try:
            return s.store.history().get("current")
        finally:
            s.close()
    with ThreadPoolExecutor(max_workers=min(16, len(hosts)), thread_name_prefix="ddtree-survey") as pool:
        return dict(zip([h.name for h in hosts], pool.map(one, hosts), strict=True))


def keep_record(hosts: Sequence[Host], doc: dict[str, Any], connect: Callable[[Host], HostSession],
                report: EventSink) -> list[str]:
    """The tune's record on every host (tunes/<id>.json beside its releases); what could not be kept."""
    problems: list[str] = []
    for h in hosts:
        try:
            s = connect(h)
            try:
                s.store.write_tune(doc["tune_id"], doc)
            finally:
                s.close()
        except DdtreeOpsError as e:
            problems.append(f"{h.name}: the tune's record was not kept: {reason(e)}")
            report(Note(h.name, problems[-1]))
    return problems


def tune_document(*, tune_id: str, started_at: float, hosts: Sequence[Host], configs: Sequence[TuneConfig],
                  budgets: Sequence[int], topk_caps: Sequence[int], workloads_: Sequence[Workload],
                  results: Sequence[HostTuneResult], objective: Any, notes: Sequence[str],
                  interrupted: str | None, inventory: str) -> dict[str, Any]:
    """The tune's record: what `--json` prints, the report draws and each host keeps."""
    from ..gates.tune_ranking import pick, winners

    rows = [r for res in results for r in res.rows]
    order = {c.label: i for i, c in enumerate(configs)}
    rows.sort(key=lambda r: (r["concurrency"], r["temperature"], order.get(r["config"], 1 << 20)))
    inv = next((c for c in configs if c.inventory), None)
    return {
        "tune_id": tune_id, "started_at": started_at, "finished_at": time.time(), "inventory": inventory,
        "hosts": [h.name for h in hosts], "objective": objective.as_dict(),
        "grid": {"budgets": list(budgets), "topk_caps": list(topk_caps),
                 "inventory_config": {"budget": inv.budget, "topk_cap": inv.topk_cap} if inv else None,
                 "configs": [c.label for c in configs]},
        "workloads": [{"label": workload_label(w.concurrency, w.temperature), "concurrency": w.concurrency,
                       "temperature": w.temperature, "max_new_tokens": w.max_new_tokens, "duration_s": w.duration_s,
                       "top_p": w.top_p, "prompts": len(w.prompts)} for w in workloads_],
        "rows": rows,
        "winners": [w.as_dict() for w in winners(rows, objective)],
        "pick": pick(rows, objective),
        "interrupted": interrupted is not None, "interrupted_by": interrupted,
        "restored": [r.restored_record() for r in results],
        "notes": list(notes),
    }
