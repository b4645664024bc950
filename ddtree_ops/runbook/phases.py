"""The runbook of one host: what each phase does on it. In which order the phases run, and on
which nodes of a server, is the phase list in engine.py (`DEPLOY`), the one place that says it.

Every phase that changes the host first records its step in the host's journal, so an
interruption anywhere is repaired (rolled back) by the next deploy or rollback. The router and
the performance gate are their own object (traffic.py), held here as `traffic`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..artifacts.patchset import PatchSet
from ..artifacts.units import render_unit
from ..config.schema import is_valid_unit_name
from ..errors import CorruptJournal, LeaseLost, RemoteCommandError, RollbackFailed, UnreachableError, reason
from ..gates.health import HealthFailure, drain, health_gate, soak, wait_until_serving
from ..gates.router import SmgRouter
from ..gates.startup import PhaseTracker, Transition
from ..host.agent.protocol import InstallFile
from ..host.first_contact import FIRST_PAUSE_S, Reached, WindowExceeded, retry_until_reached
from ..host.gpus import GpuApp
from ..host.heal_note import HEAL_STEP, heal_note, unreported_heal
from ..host.journal import journal_problem
from ..host.release_store import LockHolder, b64, new_release_id
from ..host.services import Invocation, UnitState
from ..host.session import HostSession, reconnect_window_s
from ..host.transport import is_connection_trouble
from .drift import backup_paths, changed_error, stand_down
from .events import EventSink, quiet
from .launch_check import identity_problems, launch_line, launch_request, parse_problems, port_problems, ran_as
from .options import DeployOptions
from .plan import HostPlan, compute_plan, read_host
from .preflight import compile_problems, gpu_problems, unit_problems
from .restore_check import check_before_restore
from .serving import JOURNAL_KEY, UNIT_DIR, ServingAt, before_deploy, from_record, server_at
from .steps import StepFailed, StepLog
from .traffic import Traffic

__all__ = ["RUNNING", "DeployOptions", "Release", "Runbook", "StepFailed", "quiet"]

RUNNING = ("active", "activating")
# Journal steps before "stop conflicts": files and the unit may have changed (install, daemon-reload,
# launch check) but no unit was stopped, started, enabled or disabled, and the router was not
# touched. None: the journal was written before any step was (nothing changed at all).
UNTOUCHED_STEPS = (None, "backup", "install")


@dataclass
class Release:
    """A release being deployed on one host. `journal` is what the host's journal records while
    it is in flight: enough to roll it back from anywhere, by this run or the next one."""

    id: str
    journal: dict[str, Any]
    unit_bytes: bytes = b""
    pid: int | None = None
    # What a phase resumed after a lost connection must not do again (Runbook.reconnecting runs
    # the phase once more): the parts of backup-and-install done, the unit's invocation before the
    # restart was sent (set: the restart may have happened), when the wait for the weights began
    # and the start-up phases seen so far (its deadlines count from the first try).
    done: set[str] = field(default_factory=set)
    restart_from: Invocation | None = None
    wait_started: float | None = None
    tracker: PhaseTracker | None = None

    @property
    def previous(self) -> str | None:
        return self.journal.get("previous")


class Runbook:
    """The phases of a deploy and a rollback on one connected host.

    `health_checked=False` is a node of rank >= 1 of a multi-node server: it answers 200 on
    /health whatever its state, so node 0's gate speaks for the server and this node is only
    checked to be running.
    """

    def __init__(self, session: HostSession, report: EventSink = quiet, *, health_checked: bool = True,
                 router: SmgRouter | None = None):
        self.session, self.health_checked = session, health_checked
        self.host = session.host
        self.store, self.services = session.store, session.services
        self.log = StepLog(self.host.name, report)
        self.traffic = Traffic(session, self.log, health_checked=health_checked, router=router)
        self._states_read: dict[str, UnitState] | None = None
        self.warnings: list[str] = []  # what went wrong without failing the run (housekeeping)
        self._drained: set[str] = set()
        self._gpu_strangers: set[int] = set()  # GPU holders preflight found and --force let stay
        self._log_before: list[str] = []  # the unit's log tail just before this run started it

    def phase(self, name: str) -> None:
        self.log.phase(name)

    def step(self, name: str, detail: str = "") -> None:
        self.log.step(name, detail)

    @property
    def steps(self) -> list[dict[str, Any]]:
        """The steps done so far, as the host's result records them."""
        return self.log.records()

    @property
    def last_step(self) -> str:
        return self.log.last_step

    # -- lock ------------------------------------------------------------------------------------
    def lock(self, opts: DeployOptions) -> LockHolder:
        """The host's deploy lock, the request retried through a lost connection (nothing has
        changed yet). A lock a live run holds is final (LockHeldError, exit 5); one whose answer
        was lost with the connection is held by this run's orphaned agent, which the next try
        takes over at once (agent/lock.py)."""
        return self.reconnecting(self.window(opts), lambda: self.store.acquire_lock(
            opts.command, break_tokens=opts.break_tokens), "take the deploy lock")

    def unlock(self, lock: LockHolder) -> None:
        try:
            self.store.release_lock(lock)
        except LeaseLost:
            pass  # the host let the lock go by itself; this run says so already
        except Exception as e:  # the result matters more; a left lock is reported with its holder
            self.log.note(f"warning: could not release the deploy lock: {e}")

    # -- repair ----------------------------------------------------------------------------------
    def read_journal(self) -> dict[str, Any] | None:
        """The host's journal, checked: CorruptJournal (exit 4) for one that cannot be read or
        that this tool did not write, since repairing from a guess could make things worse."""
        facts = self.store.facts([])
        self.report_host_heal(facts.get("host_heal"))
        problem = facts.get("journal_error") or journal_problem(facts.get("journal"))
        if problem:
            path = f"{self.host.state_dir}/journal.json"
            raise CorruptJournal(
                f"{self.host.name}: corrupt journal: {problem}. An earlier run was interrupted and the tool cannot "
                f"tell what it changed. Check the host by hand (`ddtree-ops status --limit {self.host.name}`, "
                f"`ddtree-ops history --host {self.host.name}`), put it right, then move the journal aside "
                f"(`mv {path} {path}.corrupt`) and run again (see docs/guarantees.md, 'corrupt journal').")
        return facts.get("journal")

    def report_host_heal(self, record: Any) -> None:
        """The host healed itself since the last deploy or rollback (its controller was lost): a
        step says what it did, once; the healed release's record marks it seen."""
        heal = unreported_heal(record)
        if not heal:
            return
        self.step(HEAL_STEP, heal_note(heal))
        if not isinstance(heal.get("release"), str):
            return
        try:
            self.store.write_release(heal["release"], host_heal_reported=heal.get("at"))
        except (RemoteCommandError, UnreachableError) as e:
            self.warnings.append(f"the host's heal could not be marked as reported: {e}")

    def repair_interrupted(self, window_s: float = 0.0, *, force: bool = False) -> str | None:
        """A journal means a deploy or a rollback was interrupted: roll that deploy back, or finish
        that rollback, before anything else (reconnecting for up to `window_s` seconds when the
        connection is lost: both can be done again). Returns the release it was about. First the
        restore check (restore_check.py): a host changed under the release is refused, exit 2,
        unless `force` or the interrupted rollback was forced."""
        journal = self.reconnecting(window_s, self.read_journal, "read the journal")
        if not journal:
            return None
        rid = journal["release"]
        what = f"repair the interrupted {journal.get('kind', 'deploy')} of {rid}"
        self.reconnecting(window_s, lambda: check_before_restore(
            self.host, self.step, self.store.journal_restore_check, force=force or bool(journal.get("force")),
            what=what, quiet_when_clean=True), "check before restoring")
        try:
            if journal.get("kind") == "rollback":
                self.step("repair", f"found an interrupted rollback of {', '.join(journal['undo'])} (step "
                                    f"{journal.get('step')!r}); finishing it")
                self.reconnecting(window_s, lambda: self.finish_rollback(journal), "finish the repair")
            else:
                self.step("repair", f"found an interrupted deploy of {rid} (step {journal.get('step')!r}); "
                                    f"rolling it back")
                outcome = f"interrupted at {journal.get('step')}, rolled back"
                self.reconnecting(window_s, lambda: self.roll_back(rid, journal, outcome=outcome), "finish the repair")
        except Exception as e:
            raise RollbackFailed(f"{self.host.name}: repairing the interrupted {journal.get('kind', 'deploy')} of "
                                 f"{rid} failed: {reason(e)}; a person must look") from None
        return rid

    # -- preflight -------------------------------------------------------------------------------
    def preflight(self, ps: PatchSet, opts: DeployOptions, detail: str = "") -> HostPlan:
        """The plan, with every refusal: the plan's own, the host's Python compiling the modules,
        and `systemd-analyze verify` of the new unit. Changes nothing."""
        self.step("preflight", detail)
        facts = read_host(self.session, ps)
        self._states_read = facts["unit_states"]
        plan = compute_plan(self.host, ps, facts, render_unit(self.host, opts.templates_dir), force=opts.force)
        gpu = gpu_problems(self.services, self.store, self.host, self._our_main_pids())
        self._gpu_strangers = set(gpu.strangers)
        refusals = [*plan.refusals, *compile_problems(self.store, self.host, ps, plan.unit_new),
                    *unit_problems(self.store, self.host, plan.unit_new), *([] if opts.force else gpu.refusals),
                    *self.traffic.router_problems()]
        return dataclasses.replace(plan, refusals=tuple(refusals))

    def _our_main_pids(self) -> set[int]:
        """Main PIDs of the units this run manages, as preflight read them (nothing changed since)."""
        return {s.main_pid for s in self.services_before().values() if s.main_pid}

    def wait_gpus_free(self, step: str = "gpus free") -> None:
        """After the old server stopped: wait (at most `health.gpu_free_timeout_s`) until no
        process holds GPU memory; StepFailed naming the holders when that does not happen."""
        t0 = self.session.monotonic()

        def holders() -> list[GpuApp] | None:
            apps = self.services.gpu_apps()
            return None if apps is None else [a for a in apps if a.pid not in self._gpu_strangers]

        apps = holders()
        if apps is None:
            return  # no nvidia-smi: no NVIDIA GPU to wait for
        if apps:
            self.phase("gpus free")
        first = len(apps)
        while apps and self.session.monotonic() - t0 < self.host.health.gpu_free_timeout_s:
            self.session.sleep(min(self.host.health.poll_interval_s, 1.0))
            apps = holders() or []
        if apps:
            held = ", ".join(f"pid {a.pid} ({a.used_mib} MiB)" for a in apps[:4])
            raise StepFailed(step, f"GPU memory still held {self.host.health.gpu_free_timeout_s:g} s after the old "
                                   f"server stopped: {held}")
        if first:
            waited = self.session.monotonic() - t0
            self.step(step, f"waited {waited:.1f} s for {first} process(es) to free GPU memory")

    # -- the release -----------------------------------------------------------------------------
    def services_before(self) -> dict[str, UnitState]:
        """The units as they are before the release: as preflight read them (nothing has changed
        since, under the lock), else read now."""
        if self._states_read is not None:
            return self._states_read
        return self.services.states((self.host.unit, *self.host.conflicts))

    def is_running_as_planned(self, plan: HostPlan, before: dict[str, UnitState]) -> bool:
        """Files and unit already as asked, and the unit serving: a deploy has nothing to do."""
        return not plan.changes and before[self.host.unit].active == "active"

    def begin(self, plan: HostPlan, ps: PatchSet, lock: LockHolder, before: dict[str, UnitState],
              release_id: str | None = None, **journal: Any) -> Release:
        """A new release (no change yet): its id and the journal that will record it."""
        rid = release_id or new_release_id()
        return Release(rid, {"release": rid, "previous": plan.current_release,
                             "active_before": {u: s.active for u, s in before.items()},
                             "enabled_before": {u: s.enabled for u, s in before.items()},
                             "holder": lock.holder, "patchset": ps.label,
                             JOURNAL_KEY: before_deploy(self.host, self._serving_unit_text(plan, before)).record(),
                             **journal})

    def _serving_unit_text(self, plan: HostPlan, before: dict[str, UnitState]) -> str | None:
        """The unit file of the unit serving now (ours, else a conflicting one it replaces), to
        read its port; None when none serves or its file cannot be read (then the inventory's)."""
        serving = next((u for u in (self.host.unit, *self.host.conflicts)
                        if u in before and before[u].active in RUNNING), None)
        if serving is None or serving == self.host.unit:
            return plan.unit_old if serving else None
        try:
            return self.store.unit_text(f"{UNIT_DIR}/{serving}")
        except (RemoteCommandError, UnreachableError):
            return None

    def _journal(self, release: Release, step: str) -> None:
        # The step becomes the release's only once the host has it: a write that failed (a full
        # state dir, a lost connection) was followed by nothing, so the rollback must not think
        # the next step had begun (from "stop conflicts" on, it restarts the old server).
        self.store.journal(**{**release.journal, "step": step})
        release.journal["step"] = step
        self.step(step)

    def _guarded(self, step: str, fn: Callable[[], Any]) -> Any:
        """A step the host refused fails it (StepFailed: rolled back). A lost connection is not the
        step's failure: it goes up to Runbook.reconnecting, which resumes the phase."""
        try:
            return fn()
        except RemoteCommandError as e:
            raise StepFailed(step, str(e)) from None

    # -- backup and install ----------------------------------------------------------------------
    def backup_and_install(self, ps: PatchSet, plan: HostPlan, release: Release, opts: DeployOptions) -> None:
        """Record the release, back up every path it touches (read back), install the files and the
        unit atomically, daemon-reload, stop and disable the conflicting units, enable ours.

        Resumable (run again after a lost connection, `release.done` says what is done): the
        backup is made again only while nothing is installed (the files are still the ones it
        copies); the install writes every file again (each write is atomic and the same bytes, so
        files installed before the cut are rewritten as they are); stopping, disabling and
        enabling units are the same commands again."""
        if "backup" not in release.done:
            self._backup(ps, plan, release, opts)
            release.done.add("backup")
        if "install" not in release.done:
            self._install(ps, plan, release)
            release.done.add("install")
        self._stop_conflicts(release)

    def _backup(self, ps: PatchSet, plan: HostPlan, release: Release, opts: DeployOptions) -> None:
        h, rid, j = self.host, release.id, release.journal
        self.store.write_release(rid, id=rid, created=time.time(), patchset=ps.label,
                                 patchset_digest=ps.digest(), bundle=opts.bundle_id, budget=h.budget,
                                 topk_cap=h.topk_cap, previous=plan.current_release, outcome="in progress",
                                 active_before=j["active_before"], enabled_before=j["enabled_before"],
                                 by=j["holder"]["user"], command=opts.command, rollout=opts.rollout_id,
                                 rollout_args=opts.rollout_args(), **{JOURNAL_KEY: j.get(JOURNAL_KEY)})
        self._journal(release, "backup")
        self.session.hooks.pause("before-backup")
        paths = backup_paths(plan, h.unit_path, check=not opts.force)
        backed_up = self._guarded("backup", lambda: self.store.backup(rid, paths))
        if backed_up.changed:  # nothing was written: stop with the host as preflight saw it
            raise stand_down(self.store, rid, changed_error(h.name, paths, backed_up.changed))
        self.session.hooks.pause("after-backup")

    def _install(self, ps: PatchSet, plan: HostPlan, release: Release) -> None:
        h = self.host
        self._journal(release, "install")
        files = [InstallFile(f.path, b64(pf.source.read_bytes()), pf.sha256, pf.mode)
                 for f, pf in zip(plan.files, ps.files, strict=True)]
        test_pause = self.session.hooks.agent_install_pause()
        self._guarded("install", lambda: self.store.install(files, **test_pause))
        release.unit_bytes = plan.unit_new.encode()
        unit = InstallFile(h.unit_path, b64(release.unit_bytes), hashlib.sha256(release.unit_bytes).hexdigest(), 0o644)
        self._guarded("install unit", lambda: self.store.install([unit]))
        self.session.hooks.pause("after-unit")
        self._guarded("daemon-reload", self.services.daemon_reload)
        # Nothing has stopped yet: a launch line the server would refuse fails here, and the
        # rollback restores the files while the old server keeps serving.
        self._guarded("launch check", lambda: self.check_launch(plan))

    def _stop_conflicts(self, release: Release) -> None:
        h, j = self.host, release.journal
        self._journal(release, "stop conflicts")
        for u in h.conflicts:
            if j["active_before"].get(u) in RUNNING:
                self.drain(u, from_record(h, j.get(JOURNAL_KEY)))
                self.phase("stop")
                self._guarded(f"stop {u}", lambda u=u: self.services.stop(u))
            if j["enabled_before"].get(u) == "enabled":
                self._guarded(f"disable {u}", lambda u=u: self.services.disable(u))
        if j["enabled_before"].get(h.unit) != "enabled":
            self._guarded(f"enable {h.unit}", lambda: self.services.enable(h.unit))
        if any(j["active_before"].get(u) in RUNNING for u in h.conflicts):
            self._guarded("gpus free", self.wait_gpus_free)

    def check_launch(self, plan: HostPlan) -> None:
        """The new ExecStart through the installed server's own argument parser (new files in
        place, nothing started), and its ports free or held by a unit this deploy replaces."""
        h = self.host
        line = launch_line(plan.unit_new)
        if line is None:
            self.step("launch check", "skipped: ExecStart is not `PYTHON -m MODULE ARGS`")
            return
        request = launch_request(line, h, plan.unit_new)
        ports = request.ports
        res = self.store.launch_check(request)
        problems = (identity_problems(res) or parse_problems(line, res)) + port_problems(res["holders"],
                                                                                          self._our_main_pids())
        if problems:
            raise StepFailed("launch check", "; ".join(problems))
        self.step("launch check", f"{line.module} accepts the launch line ({ran_as(res)}); "
                                  f"port{'s' if len(ports) > 1 else ''} {', '.join(map(str, ports))} free or held "
                                  f"by a unit being replaced")

    def drain(self, unit: str, at: ServingAt | None = None, *, must_leave: bool = True) -> None:
        """Let the requests in flight on `unit`'s server finish (at most `health.drain_timeout_s`)
        before it stops; how many were cut is said. A server that does not report its load (not
        listening, or no /v1/loads) is not waited for. Only node 0 of a multi-node server serves
        requests (and is drained, before any node stops); once drained, a unit is not drained again
        in the same operation. `at`: where the server serves when that is not where the inventory
        says (the old server of a deploy that changes the port). `must_leave=False`: a rollback
        stops the unit even when the router cannot be told first."""
        if not self.health_checked or unit in self._drained:
            return
        self._drained.add(unit)
        self.traffic.leave_router(at.worker if at else None, required=must_leave)
        self.phase("drain")
        res = drain(server_at(self.session, at), self.host.health.drain_timeout_s)
        if res.at_start is None:
            return
        cut = f"; {res.remaining} still in flight, cut by the stop" if res.remaining else ""
        self.step("drain", f"{unit}: {res.at_start} request(s) in flight, waited {res.waited_s:.1f} s{cut}")

    # -- restart, wait and gate ------------------------------------------------------------------
    def restart(self, release: Release) -> None:
        """Stop the old server (a redeploy), then start ours. Resumable: once the restart may have
        been sent (`release.restart_from` set), a resumed phase first asks systemd whether the
        unit was started since (a new InvocationID) and then never sends it again: a 1T model
        would load twice."""
        unit = self.host.unit
        if release.restart_from is not None and self._restarted_meanwhile(release):
            return
        self._journal(release, "restart")
        if self.services_before()[unit].active in RUNNING:  # a redeploy: it serves now
            self.drain(unit, from_record(self.host, release.journal.get(JOURNAL_KEY)))
            self.phase("stop")
            self._guarded("restart", lambda: self.services.stop(unit))
            self._guarded("gpus free", self.wait_gpus_free)
        # The unit's log as it is before the start: the previous server's lines name no phase of
        # the new one (startup.PhaseTracker ignores them).
        self._log_before = self._guarded("restart", lambda: self.services.probe(unit)).log
        release.restart_from = self._guarded("restart", lambda: self.services.invocation(unit))
        self.phase("start")
        self._guarded("restart", lambda: self.services.restart(unit))
        release.pid = self.services.main_pid(unit)

    def _restarted_meanwhile(self, release: Release) -> bool:
        """After a lost connection: whether the restart sent before it happened (the unit has a new
        invocation); its MainPID then becomes the release's. A server that systemd's Restart= had
        to start again meanwhile crashed: that fails the restart (rolled back)."""
        unit, before = self.host.unit, release.restart_from
        assert before is not None
        now = self._guarded("restart", lambda: self.services.invocation(unit))
        while now.id == before.id and now.active == "deactivating":  # the restart's stop is under way
            self.session.sleep(self.host.health.poll_interval_s)
            now = self._guarded("restart", lambda: self.services.invocation(unit))
        if now.id == before.id:
            return False
        if now.n_restarts > before.n_restarts:
            raise StepFailed("restart", f"{unit} was started again by systemd (Restart=, {now.n_restarts} time(s)) "
                                        f"while the connection was lost: the new server crashed")
        release.pid = now.main_pid
        self.step("restart", f"sent before the connection was lost; {unit} started (pid {now.main_pid}), not "
                             f"restarted again")
        return True

    def wait_and_gate(self, release: Release, deadline_s: float | None = None) -> None:
        """Wait for the weights to load (/health 200, the process never replaced), then the gate."""
        h = self.host
        self._journal(release, "wait for weights")
        self.session.hooks.pause("wait-for-weights")
        # Resumed after a lost connection: the deadlines count from the first try, and the
        # start-up phases seen then are not seen twice.
        if release.wait_started is None:
            release.wait_started = self.session.monotonic()
            release.tracker = PhaseTracker(frozenset(self._log_before))
        last = [0.0]

        def progress(elapsed: float, line: str) -> None:
            if elapsed - last[0] >= 5 or elapsed < 0.01:
                last[0] = elapsed
                self.log.note(f"waiting {elapsed:5.1f} s: {line}")

        def on_phase(ended: list[Transition], tracker: PhaseTracker, elapsed: float) -> None:
            for t in ended:
                self.step(str(t.ended), f"{t.seconds:.1f} s")
            if ended and tracker.phase is not ended[-1].ended:
                self.phase(str(tracker.phase))

        phase = "wait for weights"
        try:
            took = wait_until_serving(self.session, h.unit, expected_pid=release.pid, deadline_s=deadline_s,
                                      progress=progress, phases=release.tracker, on_phase=on_phase,
                                      started_at=release.wait_started)
            self.step("serving", f"/health 200 after {took:.1f} s")
            self.phase("health gate")
            phase = "health gate"
            gate = health_gate(self.session, h.unit, expected_pid=release.pid)
            self.step("health gate", f"{gate.health_checks}x /health 200, /generate ok"
                      + (f", accept length {gate.accept_length:.2f}" if gate.accept_length is not None else ""))
        except HealthFailure as e:
            raise StepFailed(phase, str(e), e.log) from None
        except RemoteCommandError as e:  # a lost connection goes up to be resumed (Runbook.reconnecting)
            raise StepFailed(phase, str(e)) from None

    def soak(self, release: Release) -> None:
        """Healthy for `health.min_healthy_s` more before the commit (health.soak)."""
        hs = self.host.health
        if hs.min_healthy_s <= 0 or not self.health_checked:
            return
        self.phase("soak")
        t0 = self.session.monotonic()
        try:
            n = soak(self.session, self.host.unit, release.pid)
        except HealthFailure as e:
            raise StepFailed("soak", str(e), e.log) from None
        except RemoteCommandError as e:  # a lost connection goes up to be resumed
            raise StepFailed("soak", str(e)) from None
        self.step("soak", f"healthy for {self.session.monotonic() - t0:.1f} s ({n} generations, min_healthy_s "
                          f"{hs.min_healthy_s:g})")

    def check_running(self, release: Release, step: str = "node check") -> None:
        """The unit is still active as the process that was started (a node without a gate)."""
        h = self.host
        p = self._guarded(step, lambda: self.services.probe(h.unit, lines=20))
        if p.active != "active" or (release.pid and p.main_pid != release.pid):
            raise StepFailed(step, f"{h.name} (rank {h.node_rank}): {h.unit} is {p.active}, MainPID {p.main_pid}",
                             p.log)
        self.step(step, f"{h.unit} active (rank {h.node_rank})")

    # -- commit ----------------------------------------------------------------------------------
    def commit(self, plan: HostPlan, release: Release) -> None:
        """The release becomes current; older releases beyond keep_releases are pruned."""
        h = self.host
        self._journal(release, "commit")
        self.session.hooks.pause("before-commit")
        installed = {f.path: f.new_sha256 for f in plan.files}
        installed[h.unit_path] = hashlib.sha256(release.unit_bytes).hexdigest()
        # The last look: a server that died after the gate must not be committed.
        p = self.services.probe(h.unit, lines=20)
        if p.active != "active" or (release.pid and p.main_pid != release.pid):
            raise StepFailed("commit", f"{h.unit} died after passing the health gate ({p.active}, "
                                       f"MainPID {p.main_pid})", p.log)
        self.store.write_release(release.id, outcome="deployed", installed=installed, deployed_at=time.time(),
                                 **({"perf_gate": self.traffic.perf_result} if self.traffic.perf_result else {}))
        self.store.set_current(release.id)
        self.store.clear_journal()
        # Committed: from here on nothing undoes the release. Housekeeping that fails is said.
        try:
            removed = self.store.prune(h.keep_releases)
        except RemoteCommandError as e:  # a lost connection: the commit phase is resumed, prune again
            self.warnings.append(f"release {release.id} committed, but pruning old releases failed: {e}")
            removed = []
        self.step("committed", f"release {release.id}" + (f"; pruned {', '.join(removed)}" if removed else "")
                  + ("; " + "; ".join(self.warnings) if self.warnings else ""))

    def leave_failed(self, release: Release, failed_step: str, error: str) -> None:
        """--no-rollback: record the failure and leave the host as it is."""
        self.store.journal(**{**release.journal, "step": "failed (--no-rollback)", "error": error})
        self.store.write_release(release.id, outcome="failed, left in place (--no-rollback)",
                                 failed_step=failed_step, error=error)

    # -- rollback --------------------------------------------------------------------------------
    def roll_back(self, rid: str, journal: dict[str, Any], *, outcome: str, failed_step: str | None = None,
                  error: str | None = None) -> None:
        """Undo release `rid`: its backup back in place, the services as they were before it."""
        self.step("rollback", f"restoring the backup of {rid}")
        if self.store.remove_partial(rid):
            self.restore_backup(rid)
        self.services.daemon_reload()
        # Failed or interrupted before "stop conflicts": no unit was stopped, restarted, enabled
        # or disabled, so a server that is still running is left alone (no needless reload of
        # the weights); it only has to pass the health gate.
        untouched = journal.get("step") in UNTOUCHED_STEPS
        self.restore_services(journal.get("active_before") or {}, journal.get("enabled_before") or {},
                              untouched=untouched, at=from_record(self.host, journal.get(JOURNAL_KEY)))
        fields: dict[str, Any] = {"outcome": outcome, "rolled_back_at": time.time()}
        if self.traffic.perf_result:
            fields["perf_gate"] = self.traffic.perf_result
        if failed_step:
            fields.update(failed_step=failed_step, error=error)
        self._record_outcome(rid, fields)
        self._point_current_at(journal.get("previous"))
        self.store.clear_journal()
        self.step("rolled back", f"host back on {journal.get('previous') or 'its pre-ddtree-ops state'}")

    def _record_outcome(self, rid: str, fields: dict[str, Any]) -> None:
        """The release's record says how it ended, if the host can write it: the host is right
        without it (the journal and `current` decide what the next run does), so a state dir that
        is full or read-only costs a warning, not the rollback. A lost connection is retried."""
        try:
            self.store.write_release(rid, **fields)
        except RemoteCommandError as e:
            note = (f"the outcome of release {rid} could not be recorded ({reason(e)}); `history` shows it "
                    f"'in progress'; free space in {self.host.state_dir}")
            self.warnings.append(note)
            self.step("rollback: outcome not recorded", note)

    def _point_current_at(self, rid: str | None) -> None:
        """`current` names `rid`. A write refused by the host (a full disk) is no failure when it
        already does: a deploy that never committed never moved it."""
        try:
            self.store.set_current(rid)
        except RemoteCommandError:
            if self.store.facts([]).get("current") != rid:
                raise

    def roll_back_reconnecting(self, window_s: float, rid: str, journal: dict[str, Any], **kw: Any) -> None:
        """`roll_back`, reconnecting for up to `window_s` seconds when the SSH connection is lost
        (the rollback is idempotent, so it starts again from the beginning)."""
        self.reconnecting(window_s, lambda: self.roll_back(rid, journal, **kw), "roll back")

    def window(self, opts: DeployOptions) -> float:
        """How long a lost connection is retried in this run: `opts.reconnect_s` when set (library
        callers, the fast tier), else the host's `reconnect_window_s` (or DDTREE_OPS_RECONNECT_S)."""
        return opts.reconnect_s if opts.reconnect_s is not None else reconnect_window_s(self.host)

    def reconnecting(self, window_s: float, fn: Callable[[], Any], what: str = "carry on") -> Any:
        """Run `fn` (idempotent), reconnecting and running it again while the connection is lost,
        for up to `window_s` seconds. A reconnect takes the operation's lock again, from the
        operation's own agent if it still holds it. LeaseLost, before `fn` starts or whenever the
        lease runs out: the host goes its own way (it rolls itself back) and nothing more is done
        to it here."""
        self.session.check_lease()
        deadline = self.session.monotonic() + window_s
        while True:
            try:
                return fn()
            except Exception as e:
                if not is_connection_trouble(e):
                    raise  # final: a step the host refused, a lock another run took, a lost lease
                lost = e if isinstance(e, UnreachableError) else UnreachableError(
                    f"{self.host.name}: connection lost: {reason(e)}")
                if self.session.monotonic() >= deadline:
                    raise lost from None
                self.log.note(f"connection lost ({reason(lost)}); reconnecting to {what}")
            reached = self._reconnect_until(deadline, window_s)
            self.step("reconnected", f"after {reached.tries} tr{'y' if reached.tries == 1 else 'ies'} in "
                                     f"{reached.seconds:.1f} s; {what}")

    def _reconnect_until(self, deadline: float, window_s: float) -> Reached[None]:
        """A fresh connection and the lock taken again, retried with a growing pause (sshd may be
        killing every new session for a while) until `deadline` (first_contact.py's rule);
        UnreachableError naming the last cause after that. LeaseLost, LockHeldError and
        HostKeyError end it at once."""
        def note(e: BaseException, pause: float) -> None:
            self.log.note(f"reconnect failed ({reason(e)}); trying again in {pause:g} s")

        try:
            return retry_until_reached(self.session.reconnect, window_s=max(deadline - self.session.monotonic(), 0.0),
                                sleep=self.session.sleep, clock=self.session.monotonic,
                                first_pause_s=FIRST_PAUSE_S, on_retry=note)
        except WindowExceeded as e:
            raise UnreachableError(f"{reason(e.last)} (kept retrying for {window_s:g} s, {e.tries} tries)") from None

    def begin_rollback(self, undo: list[str], to: str | None, to_original: bool, oldest: dict[str, Any],
                       lock: LockHolder, rollout: str | None = None) -> dict[str, Any]:
        """The journal of a rollback, written before its first change: an interrupted rollback is
        finished by the next run (every step of it can be done again)."""
        journal = {"kind": "rollback", "release": undo[0], "undo": list(undo), "to": to, "to_original": to_original,
                   "active_before": oldest.get("active_before") or {},
                   "enabled_before": oldest.get("enabled_before") or {}, "holder": lock.holder, "step": "restore",
                   JOURNAL_KEY: oldest.get(JOURNAL_KEY), "rollout": rollout}
        self.store.journal(**journal)
        return journal

    def finish_rollback(self, journal: dict[str, Any]) -> None:
        """Undo the journal's releases newest first, then the services, then `current`."""
        for rid in journal["undo"]:
            self.step("restore", f"undoing release {rid}")
            self.restore_backup(rid)
            self.store.write_release(rid, outcome="rolled back", rolled_back_at=time.time(),
                                     rollback_rollout=journal.get("rollout"),
                                     rollback_by=(journal.get("holder") or {}).get("user"))
        if journal.get("to_original"):
            self.restore_backup("original")
        journal["step"] = "services"
        self.store.journal(**journal)
        self.session.hooks.pause("rollback-services")
        self.services.daemon_reload()
        self.restore_services(journal["active_before"], journal["enabled_before"],
                              at=from_record(self.host, journal.get(JOURNAL_KEY)))
        self.store.set_current(journal.get("to"))
        self.store.clear_journal()

    def restore_backup(self, rid: str) -> None:
        """Files as release `rid` found them ('original': as before any release), byte for byte;
        a corrupted backup restores nothing."""
        res = self.store.restore(rid)
        if res.refused:
            what = "original backup" if rid == "original" else f"backup of {rid}"
            raise StepFailed("restore", f"{what} is corrupted, refusing to restore it: " + "; ".join(res.problems))

    def restore_services(self, active_before: dict[str, str], enabled_before: dict[str, str], *,
                         untouched: bool = False, at: ServingAt | None = None) -> None:
        """Units enabled and running as they were before the release; `untouched`: the deploy
        stopped before it stopped anything, so what still runs is not restarted, only gated.

        The record (journal or release) decides, not today's inventory: a unit recorded but since
        dropped from `unit`/`conflicts` is restored as recorded all the same; a unit the inventory
        names but the record does not (added since) is left as it is, and a warning says so.

        `at`: where the restored server serves (the record's, not today's inventory: a deploy that
        changed the port leaves the old server on the old one); it is checked and routed there."""
        h = self.host
        recorded = list(dict.fromkeys([*active_before, *enabled_before]))
        bad = [u for u in recorded if not is_valid_unit_name(u)]
        if bad:
            raise StepFailed("rollback", f"the record names {str(bad[0])[:80]!r}, not a valid unit name; "
                                         f"refusing to pass it to systemctl")
        dropped = [u for u in recorded if u not in (h.unit, *h.conflicts)]
        if dropped:
            self.step("rollback: units no longer in the inventory", f"{', '.join(dropped)}: restored as recorded")
        added = [u for u in (h.unit, *h.conflicts) if u not in recorded]
        if added:
            note = (f"{', '.join(added)} not in the record of the release (added to the inventory since): "
                    f"left as {'it is' if len(added) == 1 else 'they are'}")
            self.warnings.append(note)
            self.step("rollback: units not recorded", note)
        was_active = [u for u, s in active_before.items() if s in RUNNING]
        now = self.services.states(tuple(recorded)) if recorded else {}
        for u, e in enabled_before.items():
            if e == "enabled" and now[u].enabled != "enabled":
                self.services.enable(u)
            elif e != "enabled" and now[u].enabled == "enabled":
                self.services.disable(u)
        # Stop what was not running before, first: the units conflict on the port.
        stopped = False
        for u in recorded:
            if u not in was_active and now[u].active in (*RUNNING, "failed"):
                if now[u].active == "active":
                    self.drain(u, must_leave=False)
                self.services.stop(u)
                stopped = True
        kept = self._kept_pids(now, untouched)
        if stopped and any(u not in kept for u in was_active):
            self.wait_gpus_free("rollback: gpus free")
        for u in was_active:
            pid = kept.get(u)
            if not pid and now[u].active == "active":  # it serves, and is about to be restarted
                self.drain(u, must_leave=False)
            self._bring_back(u, pid, at)
        if was_active:  # back in the router (or never out of it: a no-op)
            unrouted = self.traffic.rejoin_router(at.worker if at else None)
            if unrouted:
                self.warnings.append(unrouted)
                self.step("rollback: not routed", unrouted)

    def _kept_pids(self, now: dict[str, UnitState], untouched: bool) -> dict[str, int]:
        """Units still serving as the process that served before the deploy (untouched, or a deploy
        that failed before stopping them, e.g. at deregistration): they are not restarted, only
        gated. This run's own reading before the change tells; a later run knows only `untouched`."""
        before = self._states_read or {}
        return {u: s.main_pid for u, s in now.items()
                if s.active == "active" and s.main_pid
                and (untouched or (u in before and before[u].main_pid == s.main_pid))}

    def _bring_back(self, unit: str, running_pid: int | None, at: ServingAt | None = None) -> None:
        """Restart `unit` (unless it kept running as `running_pid`) and wait until it is healthy."""
        pid = running_pid
        if not pid:
            self.services.restart(unit)
            pid = self.services.main_pid(unit)
        if not self.health_checked:  # a rank >= 1 node: running is all it can tell
            p = self.services.probe(unit, lines=10)
            if p.active not in RUNNING:
                raise StepFailed("rollback health", f"{unit} is {p.active} after the rollback "
                                                    f"(rank {self.host.node_rank})", p.log)
            self.step("rollback: restarted", f"{unit} (rank {self.host.node_rank}; node 0 is health-checked)")
            return
        self.step("rollback: waiting", f"{unit} was never stopped (pid {pid}); not restarted" if running_pid
                  else f"{unit} restarted (pid {pid})")
        try:
            server = server_at(self.session, at)
            took = wait_until_serving(server, unit, expected_pid=pid)
            health_gate(server, unit, expected_pid=pid)
        except HealthFailure as e:
            raise StepFailed("rollback health", f"{unit} is not healthy after the rollback: {e}", e.log) from None
        self.step("rollback: healthy", f"{unit} serving after {took:.1f} s"
                  + ("" if server is self.session else f" at {server.host.base_url}"))
