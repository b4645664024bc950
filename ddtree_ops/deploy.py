"""Plan, deploy and roll back the patch set on one host: the runbook, step by step.

`plan_host` reads the host (no change) and `compute_plan` turns what it read into a `HostPlan`,
a plain value: what each file would become, the unit diff, the units to stop and restart, and
every reason to refuse. `deploy_host` executes a plan top to bottom; each step is recorded in
the host's journal first, so that an interruption at any point is repaired (rolled back) by the
next `deploy` or `rollback`. Any failure after the first change rolls the host back by itself.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from .errors import (DeployFailed, InputError, Interrupted, PreflightError, RemoteCommandError,
                     RollbackFailed, UnreachableError)
from .health import HealthFailure, health_gate, probe_unit, wait_until_serving
from .inventory import Host
from .patchset import PatchSet, check_sglang_version
from .release_store import LockHolder, ReleaseStore, b64, new_release_id
from .services import Services
from .transport import HostConnection
from .units import render_unit, unit_diff, verify_command, verify_problems, verify_unit

Reporter = Callable[[str, str], None]  # (host name, message)


def _quiet(host: str, msg: str) -> None:
    pass


# TEST HOOK, off by default: the fault-matrix tests (tests/test_faults.py) kill or interrupt
# the tool at precise points. With DDTREE_OPS_TEST_PAUSE_AT=<point> and
# DDTREE_OPS_TEST_PAUSE_FILE=<path> in the environment, the deploy writes "<pid> <point>" to
# <path> when it reaches <point> and waits until the file is removed. Points: before-backup,
# after-backup, between-files (the remote agent pauses after the first installed file and
# writes <path> ON THE HOST), after-unit, wait-for-weights (restarted, weights loading),
# before-commit (health gate passed). Without both variables nothing happens.
_TEST_PAUSE_AT = "DDTREE_OPS_TEST_PAUSE_AT"
_TEST_PAUSE_FILE = "DDTREE_OPS_TEST_PAUSE_FILE"


def _test_pause(point: str) -> None:
    path = os.environ.get(_TEST_PAUSE_FILE)
    if not path or os.environ.get(_TEST_PAUSE_AT) != point:
        return
    with open(path, "w") as fh:
        fh.write(f"{os.getpid()} {point}\n")
    deadline = time.monotonic() + 600
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def _test_pause_request() -> dict[str, Any]:
    """The agent's half of the hook: pause after the first file of the install."""
    path = os.environ.get(_TEST_PAUSE_FILE)
    if not path or os.environ.get(_TEST_PAUSE_AT) != "between-files":
        return {}
    return {"test_pause": {"after": 1, "file": path}}


# ---------------------------------------------------------------------------------------------
# the plan (no side effects)


@dataclass(frozen=True)
class FileChange:
    path: str  # absolute on the host
    rel: str  # relative to site-packages
    action: str  # add | replace
    old_sha256: str | None
    new_sha256: str
    status: str  # new | change | same | drift
    note: str = ""


@dataclass(frozen=True)
class HostPlan:
    host: str
    patchset: str
    patchset_digest: str
    budget: int
    topk_cap: int
    sglang_version: str | None
    current_release: str | None
    files: tuple[FileChange, ...]
    unit_path: str
    unit_old: str | None
    unit_new: str
    unit_diff: str
    stop_units: tuple[str, ...]  # conflicting units that are active now
    restart_unit: str
    refusals: tuple[str, ...]  # preflight problems that stop the deploy (nothing changed)
    interrupted: dict | None  # the journal of an interrupted deploy, repaired first
    lock: dict | None

    @property
    def changes(self) -> bool:
        return any(f.status != "same" for f in self.files) or bool(self.unit_diff)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("unit_old")
        d.pop("unit_new")
        return d


# A `${VAR}` reference (the key comes from environment_file) is not a secret and stays readable.
_SECRET_FLAG = re.compile(r"(--(?:api-key|admin-api-key|hf-token|token)(?:=|\s+))(?!\$\{)(\"[^\"]*\"|'[^']*'|\S+)")
_SECRET_ENV = re.compile(r"((?:[A-Za-z0-9_]*(?:KEY|TOKEN|SECRET|PASSWORD)[A-Za-z0-9_]*)=)([^\"\s]+)")


def redact(text: str) -> str:
    """The unit diff is shown and written to JSON: hide API keys, tokens and passwords in it."""
    return _SECRET_ENV.sub(r"\1***", _SECRET_FLAG.sub(r"\1***", text))


def target_path(host: Host, rel: str) -> str:
    return f"{host.site_packages}/{rel}"


def compute_plan(host: Host, ps: PatchSet, facts: dict[str, Any], unit_new: str, *, force: bool = False) -> HostPlan:
    """Pure: the plan for `host` from what `facts` (the remote agent's answer) says is there."""
    refusals: list[str] = []
    version = facts.get("sglang_version")
    if not facts.get("site_packages_exists"):
        refusals.append(f"site-packages {host.site_packages} does not exist")
    elif version is None:
        refusals.append(f"no sglang dist-info in {host.site_packages}: is SGLang installed there?")
    elif not check_sglang_version(ps, version):
        refusals.append(f"SGLang {version} on the host does not satisfy the patch set's sglang{ps.sglang_spec}")
    installed_now = ((facts.get("current_release") or {}).get("installed") or {})
    files = []
    for pf in ps.files:
        path = target_path(host, pf.path)
        f = facts["files"].get(path, {"exists": False})
        old = f.get("sha256") if f.get("exists") else None
        if old == pf.sha256:
            status, note = "same", ""
        elif pf.action == "replace":
            if old is None:
                status, note = "drift", "upstream file missing"
            elif old == pf.base_sha256:
                status, note = "change", "upstream"
            elif installed_now.get(path) == old:
                status, note = "change", f"from release {facts.get('current')}"
            else:
                status, note = "drift", "neither the upstream file nor what the current release installed"
        else:  # add
            if old is None:
                status, note = "new", ""
            elif installed_now.get(path) == old:
                status, note = "change", f"from release {facts.get('current')}"
            else:
                status, note = "drift", "a file of unknown origin is in the way"
        files.append(FileChange(path, pf.path, pf.action, old, pf.sha256, status, note))
        if status == "drift" and not force:
            refusals.append(f"drift: {path} has sha256 {str(old)[:12]} ({note}); --force overrides")
    need_mb = sum(pf.source.stat().st_size for pf in ps.files) * 2 // (1024 * 1024) + 1
    for where, free in (facts.get("free_mb") or {}).items():
        if free < need_mb + host.min_free_mb:
            refusals.append(f"not enough disk for {where}: {free} MB free, need {need_mb + host.min_free_mb} MB")
    unit_old = facts.get("unit_text")
    return HostPlan(
        host=host.name, patchset=ps.label, patchset_digest=ps.digest(), budget=host.budget,
        topk_cap=host.topk_cap, sglang_version=version, current_release=facts.get("current"),
        files=tuple(files), unit_path=host.unit_path, unit_old=unit_old, unit_new=unit_new,
        unit_diff=redact(unit_diff(unit_old, unit_new, host.unit_path)),
        stop_units=tuple(u for u in host.conflicts if (facts.get("units") or {}).get(u) == "active"),
        restart_unit=host.unit, refusals=tuple(refusals), interrupted=facts.get("journal"),
        lock=facts.get("lock"),
    )


def read_host(conn: HostConnection, host: Host, ps: PatchSet) -> dict[str, Any]:
    """Everything the plan needs, read in two round trips."""
    store = ReleaseStore(conn, host)
    facts = store.facts([target_path(host, pf.path) for pf in ps.files])
    facts["units"] = {u: s.active for u, s in Services(conn).states((host.unit, *host.conflicts)).items()}
    return facts


def plan_host(conn: HostConnection, host: Host, ps: PatchSet, *, force: bool = False,
              templates_dir: str | None = None) -> HostPlan:
    facts = read_host(conn, host, ps)
    return compute_plan(host, ps, facts, render_unit(host, templates_dir), force=force)


# ---------------------------------------------------------------------------------------------
# results


@dataclass
class HostResult:
    host: str
    outcome: str  # deployed | unchanged | refused | rolled_back | rollback_failed | locked | unreachable | failed
    exit_code: int
    release: str | None = None
    failed_step: str | None = None
    message: str = ""
    log: list[str] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    repaired: str | None = None  # an interrupted deploy this run repaired first

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class StepFailed(Exception):
    def __init__(self, step: str, message: str, log: list[str] | None = None):
        super().__init__(message)
        self.step, self.log = step, log or []


# ---------------------------------------------------------------------------------------------
# deploy


@dataclass
class DeployOptions:
    force: bool = False
    break_lock: bool = False
    no_rollback: bool = False
    command: str = "ddtree-ops deploy"
    deadline_s: float | None = None
    bundle_id: str | None = None
    # A connection lost during a deploy: keep reconnecting this long to roll the host back.
    reconnect_s: float = field(default_factory=lambda: float(os.environ.get("DDTREE_OPS_RECONNECT_S", "60")))
    templates_dir: str | None = None  # a verified bundle's templates/ (default: the repo's)


class HostDeploy:
    """One deploy (or rollback) run against one connected host."""

    def __init__(self, conn: HostConnection, host: Host, report: Reporter = _quiet):
        self.conn, self.host, self.report = conn, host, report
        self.store = ReleaseStore(conn, host)
        self.svc = Services(conn)
        self.steps: list[dict[str, Any]] = []

    def _step(self, name: str, detail: str = "") -> None:
        self.steps.append({"step": name, "t": time.time(), "detail": detail})
        self.report(self.host.name, f"{name}{': ' + detail if detail else ''}")

    # -- the runbook ---------------------------------------------------------------------------
    def deploy(self, ps: PatchSet, opts: DeployOptions) -> HostResult:
        t0 = time.monotonic()
        h = self.host
        lock = self.store.acquire_lock(opts.command, break_lock=opts.break_lock)
        try:
            repaired = self.repair_interrupted()
            self._step("preflight")
            plan = plan_host(self.conn, h, ps, force=opts.force, templates_dir=opts.templates_dir)
            refusals = list(plan.refusals)
            refusals += self._compile_check(ps)
            refusals += self._verify_unit(plan.unit_new)
            if refusals:
                raise PreflightError(h.name, "preflight refused; nothing was changed:\n  - " + "\n  - ".join(refusals))
            states = self.svc.states((h.unit, *h.conflicts))
            active_before = {u: s.active for u, s in states.items()}
            enabled_before = {u: s.enabled for u, s in states.items()}
            if not plan.changes and active_before.get(h.unit) == "active":
                self._step("unchanged", "files and unit already as asked; nothing to do")
                return HostResult(h.name, "unchanged", 0, release=plan.current_release, steps=self.steps,
                                  seconds=time.monotonic() - t0, repaired=repaired)
            rid = new_release_id()
            journal = {"release": rid, "previous": plan.current_release, "active_before": active_before,
                       "enabled_before": enabled_before, "holder": lock.holder, "patchset": ps.label}
            try:
                self._run_steps(ps, plan, rid, journal, opts)
            except (StepFailed, KeyboardInterrupt) as e:
                interrupted = isinstance(e, KeyboardInterrupt)
                step = self.steps[-1]["step"] if self.steps else "?"
                failed_step = "interrupted (Ctrl-C) during " + step if interrupted else e.step
                message = "interrupted by the operator" if interrupted else str(e)
                log = [] if interrupted else e.log
                if opts.no_rollback and not interrupted:
                    self.store.journal(**journal, step="failed (--no-rollback)", error=message)
                    self.store.write_release(rid, outcome="failed, left in place (--no-rollback)",
                                             failed_step=failed_step, error=message)
                    raise RollbackFailed(f"{h.name}: deploy failed at {failed_step}: {message}; left as is "
                                         f"because of --no-rollback. Run `ddtree-ops rollback --limit {h.name}` "
                                         f"to restore the previous release.")
                self.report(h.name, f"FAILED at {failed_step}: {message}; rolling back")
                try:
                    self._reconnecting(opts.reconnect_s, lambda: self.rollback_release(
                        rid, journal, outcome=f"rolled back ({failed_step})", failed_step=failed_step, error=message))
                except (StepFailed, RemoteCommandError, UnreachableError) as re:
                    raise RollbackFailed(
                        f"{h.name}: deploy failed at {failed_step} ({message}) and the rollback failed too: {re}. "
                        f"The journal on the host records release {rid}; a person must look, then run "
                        f"`ddtree-ops rollback --limit {h.name}`."
                    ) from None
                exc_type = Interrupted if interrupted else DeployFailed
                err = exc_type(f"{h.name}: deploy failed at {failed_step}: {message}; rolled back to "
                               f"{plan.current_release or 'the previous state'}, healthy")
                err.result = HostResult(h.name, "interrupted" if interrupted else "rolled_back", exc_type.exit_code, release=rid,
                                        failed_step=failed_step, message=message, log=log,
                                        steps=self.steps, seconds=time.monotonic() - t0, repaired=repaired)
                raise err
            return HostResult(h.name, "deployed", 0, release=rid, steps=self.steps,
                              seconds=time.monotonic() - t0, repaired=repaired)
        finally:
            self._release_lock(lock)

    def _run_steps(self, ps: PatchSet, plan: HostPlan, rid: str, journal: dict, opts: DeployOptions) -> None:
        unit_bytes = self._install_phase(ps, plan, rid, journal, opts)
        pid = self._restart_phase(journal)
        self._journal_step(journal, "wait for weights")
        _test_pause("wait-for-weights")
        self._wait_and_gate(self.host.unit, pid, opts.deadline_s)
        self._commit_phase(plan, rid, journal, unit_bytes, pid)

    # The phases are separate so that a multi-node server (multinode.py) can install on every
    # node first, restart rank 0 last and gate on node 0 only.
    def _install_phase(self, ps: PatchSet, plan: HostPlan, rid: str, journal: dict, opts: DeployOptions) -> bytes:
        h = self.host
        paths = [{"path": f.path, "kind": "file"} for f in plan.files] + [{"path": h.unit_path, "kind": "unit"}]

        self.store.write_release(rid, id=rid, created=time.time(), patchset=ps.label,
                                 patchset_digest=ps.digest(), bundle=opts.bundle_id, budget=h.budget,
                                 topk_cap=h.topk_cap, previous=plan.current_release, outcome="in progress",
                                 active_before=journal["active_before"], enabled_before=journal["enabled_before"],
                                 by=journal["holder"]["user"],
                                 command=opts.command)
        self._journal_step(journal, "backup")
        _test_pause("before-backup")
        self._guarded("backup", lambda: self.store.call("backup", release_id=rid, paths=paths))
        _test_pause("after-backup")

        self._journal_step(journal, "install")
        files = [{"path": f.path, "content_b64": b64(pf.source.read_bytes()), "sha256": pf.sha256, "mode": pf.mode}
                 for f, pf in zip(plan.files, ps.files)]
        self._guarded("install", lambda: self.store.call("install", files=files, **_test_pause_request()))
        unit_bytes = plan.unit_new.encode()
        self._guarded("install unit", lambda: self.store.call("install", files=[{
            "path": h.unit_path, "content_b64": b64(unit_bytes),
            "sha256": hashlib.sha256(unit_bytes).hexdigest(), "mode": 0o644}]))
        _test_pause("after-unit")
        self._guarded("daemon-reload", self.svc.daemon_reload)

        self._journal_step(journal, "stop conflicts")
        for u in h.conflicts:
            if journal["active_before"].get(u) in ("active", "activating"):
                self._guarded(f"stop {u}", lambda u=u: self.svc.stop(u))
            if journal["enabled_before"].get(u) == "enabled":
                self._guarded(f"disable {u}", lambda u=u: self.svc.disable(u))
        if journal["enabled_before"].get(h.unit) != "enabled":
            self._guarded(f"enable {h.unit}", lambda: self.svc.enable(h.unit))
        return unit_bytes

    def _restart_phase(self, journal: dict) -> int | None:
        h = self.host
        self._journal_step(journal, "restart")
        self._guarded("restart", lambda: self.svc.restart(h.unit))
        return self.svc.main_pid(h.unit)

    def _commit_phase(self, plan: HostPlan, rid: str, journal: dict, unit_bytes: bytes, pid: int | None) -> None:
        h = self.host
        self._journal_step(journal, "commit")
        _test_pause("before-commit")
        installed = {f.path: f.new_sha256 for f in plan.files}
        installed[h.unit_path] = hashlib.sha256(unit_bytes).hexdigest()
        # The last look: a server that died after the gate must not be committed.
        p = probe_unit(self.conn, h.unit, lines=20)
        if p.active != "active" or (pid and p.main_pid != pid):
            raise StepFailed("commit", f"{h.unit} died after passing the health gate ({p.active}, MainPID {p.main_pid})", p.log)
        self.store.write_release(rid, outcome="deployed", installed=installed, deployed_at=time.time())
        self.store.set_current(rid)
        self.store.clear_journal()
        removed = self.store.prune(h.keep_releases)
        self._step("committed", f"release {rid}" + (f"; pruned {', '.join(removed)}" if removed else ""))

    def _journal_step(self, journal: dict, step: str) -> None:
        journal["step"] = step
        self.store.journal(**journal)
        self._step(step)

    def _reconnecting(self, window_s: float, fn: Callable[[], Any]) -> Any:
        """Run `fn` (an idempotent rollback); if the SSH connection is lost, reconnect for up to
        `window_s` seconds and run it again from the start."""
        deadline = time.monotonic() + window_s
        while True:
            try:
                return fn()
            except UnreachableError as e:
                if time.monotonic() >= deadline:
                    raise
                self.report(self.host.name, f"connection lost ({e}); reconnecting to roll back")
            while True:
                time.sleep(1.0)
                try:
                    self.conn.reconnect()
                    break
                except UnreachableError as e:
                    if time.monotonic() >= deadline:
                        raise UnreachableError(f"{e} (kept retrying for {window_s:g} s)") from None

    def _guarded(self, step: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (RemoteCommandError, UnreachableError) as e:
            raise StepFailed(step, str(e)) from None

    def _wait_and_gate(self, unit: str, pid: int | None, deadline_s: float | None) -> None:
        h = self.host
        last = [0.0]

        def progress(elapsed: float, line: str) -> None:
            if elapsed - last[0] >= 5 or elapsed < 0.01:
                last[0] = elapsed
                self.report(h.name, f"waiting {elapsed:5.1f} s: {line}")

        try:
            took = wait_until_serving(self.conn, h, unit, expected_pid=pid, deadline_s=deadline_s, progress=progress)
            self._step("serving", f"/health 200 after {took:.1f} s")
            gate = health_gate(h, self.conn, unit, expected_pid=pid)
            self._step("health gate", f"{gate.health_checks}x /health 200, /generate ok"
                       + (f", accept length {gate.accept_length:.2f}" if gate.accept_length is not None else ""))
        except HealthFailure as e:
            raise StepFailed(self.steps[-1]["step"] if self.steps else "wait", str(e), e.log) from None
        except (RemoteCommandError, UnreachableError) as e:
            raise StepFailed("wait for weights", str(e)) from None

    def _release_lock(self, lock: LockHolder) -> None:
        try:
            self.store.release_lock(lock)
        except Exception as e:  # the result matters more; a left lock is reported with its holder
            self.report(self.host.name, f"warning: could not release the deploy lock: {e}")

    def _compile_check(self, ps: PatchSet) -> list[str]:
        pyfiles = {target_path(self.host, pf.path): b64(pf.source.read_bytes()) for pf in ps.python_files()}
        if not pyfiles:
            return []
        errors = self.store.call("compile", files=pyfiles)["errors"]
        return [f"does not compile with {self.host.python}: {e}" for e in errors]

    def _verify_unit(self, text: str) -> list[str]:
        h = self.host
        res = self.store.call("verify_unit", unit_name=h.unit, text=text,
                              argv=verify_command("@PATH@/" + h.unit, h.unit)[:-1] + ["@PATH@"])
        if res.get("available"):
            problems = verify_problems(res["returncode"], res["stdout"], res["stderr"], h.unit)
            return [f"unit {h.unit} fails systemd-analyze verify on the host: {p}" for p in problems]
        try:  # the host has no systemd-analyze: check here, without the host's executables
            verify_unit(text, h.unit, check_executables=False)
        except InputError as e:
            return [f"unit {h.unit} fails systemd-analyze verify (locally): {e}"]
        return []

    # -- rollback --------------------------------------------------------------------------------
    def rollback_release(self, rid: str, journal: dict, *, outcome: str, failed_step: str | None = None,
                         error: str | None = None) -> None:
        """Undo release `rid` on the host: its backup back in place, the services as they were."""
        h = self.host
        self._step("rollback", f"restoring the backup of {rid}")
        done = self.store.call("remove_partial", release_id=rid)
        if done["backup_complete"]:
            res = self.store.call("restore", backup_dir=self.store.backup_dir(rid))
            if res["refused"]:
                raise StepFailed("rollback", "backup is corrupted, refusing to restore it: " + "; ".join(res["problems"]))
        self.svc.daemon_reload()
        # Failed or interrupted before "stop conflicts": no unit was stopped, restarted, enabled
        # or disabled, so a server that is still running is left alone (no needless reload of
        # the weights); it only has to pass the health gate.
        untouched = journal.get("step") in ("backup", "install")
        self._restore_services(journal.get("active_before") or {}, journal.get("enabled_before") or {},
                               untouched=untouched)
        fields = {"outcome": outcome, "rolled_back_at": time.time()}
        if failed_step:
            fields.update(failed_step=failed_step, error=error)
        self.store.write_release(rid, **fields)
        self.store.set_current(journal.get("previous"))
        self.store.clear_journal()
        self._step("rolled back", f"host back on {journal.get('previous') or 'its pre-ddtree-ops state'}")

    def _restore_services(self, active_before: dict[str, str], enabled_before: dict[str, str], *,
                          untouched: bool = False) -> None:
        """Units enabled and running as they were before the release; `untouched`: the deploy
        stopped before it stopped anything, so what still runs is not restarted, only gated."""
        h = self.host
        was_active = [u for u, s in active_before.items() if s in ("active", "activating")]
        now = self.svc.states((h.unit, *h.conflicts))
        for u, e in enabled_before.items():
            if e == "enabled" and now[u].enabled != "enabled":
                self.svc.enable(u)
            elif e != "enabled" and now[u].enabled == "enabled":
                self.svc.disable(u)
        # Stop what was not running before, first: the units conflict on the port.
        for u in (h.unit, *h.conflicts):
            if u not in was_active and now[u].active in ("active", "activating", "failed"):
                self.svc.stop(u)
        for u in was_active:
            pid = now[u].main_pid if untouched and now[u].active == "active" else None
            self._bring_back(u, pid)

    def _bring_back(self, unit: str, running_pid: int | None) -> None:
        """Restart `unit` (unless it kept running as `running_pid`) and wait until it is healthy."""
        pid = running_pid
        if pid:
            self._step("rollback: waiting", f"{unit} was never stopped (pid {pid}); not restarted")
        else:
            self.svc.restart(unit)
            pid = self.svc.main_pid(unit)
            self._step("rollback: waiting", f"{unit} restarted (pid {pid})")
        try:
            took = wait_until_serving(self.conn, self.host, unit, expected_pid=pid)
            health_gate(self.host, self.conn, unit, expected_pid=pid)
        except HealthFailure as e:
            raise StepFailed("rollback health", f"{unit} is not healthy after the rollback: {e}", e.log) from None
        self._step("rollback: healthy", f"{unit} serving after {took:.1f} s")

    def repair_interrupted(self) -> str | None:
        """A journal means a deploy was interrupted: roll its release back before anything else."""
        facts = self.store.call("facts", site_packages=self.host.site_packages, unit_path=self.host.unit_path, paths=[])
        journal = facts.get("journal")
        if not journal:
            return None
        rid = journal["release"]
        self._step("repair", f"found an interrupted deploy of {rid} (step {journal.get('step')!r}); rolling it back")
        try:
            self.rollback_release(rid, journal, outcome=f"interrupted at {journal.get('step')}, rolled back")
        except (StepFailed, RemoteCommandError, UnreachableError) as e:
            raise RollbackFailed(f"{self.host.name}: repairing the interrupted deploy {rid} failed: {e}; "
                                 f"a person must look") from None
        return rid

    def rollback(self, to: str | None, opts: DeployOptions) -> HostResult:
        """`ddtree-ops rollback`: previous release, a named one, or 'original' (upstream files)."""
        t0 = time.monotonic()
        h = self.host
        lock = self.store.acquire_lock(opts.command, break_lock=opts.break_lock)
        try:
            repaired = self.repair_interrupted()
            if repaired:
                # The host is back on what was current before that deploy; stop there.
                return HostResult(h.name, "rolled_back", 0, release=repaired, steps=self.steps,
                                  seconds=time.monotonic() - t0, repaired=repaired,
                                  message=f"repaired the interrupted deploy {repaired}")
            hist = self.store.history()
            by_id = {r["id"]: r for r in hist["releases"]}
            chain: list[str] = []
            cur = hist["current"]
            while cur:
                chain.append(cur)
                cur = (by_id.get(cur) or {}).get("previous")
            if not chain:
                raise InputError(f"{h.name}: no deployed release to roll back (the host runs its original files)")
            if to is None:
                undo = chain[:1]
            elif to == "original":
                undo = chain
            elif to in chain:
                undo = chain[: chain.index(to)]
                if not undo:
                    raise InputError(f"{h.name}: release {to} is already current")
            else:
                raise InputError(f"{h.name}: release {to!r} is not an ancestor of the current release "
                                 f"{hist['current']} (see `ddtree-ops history --host {h.name}`)")
            for rid in undo:
                if not by_id.get(rid, {}).get("backup_present"):
                    raise InputError(f"{h.name}: the backup of release {rid} was pruned; cannot roll back past it")
            for rid in undo:
                problems = self.store.call("verify_backup", backup_dir=self.store.backup_dir(rid))["problems"]
                if problems:
                    raise RollbackFailed(f"{h.name}: backup of release {rid} is corrupted, refusing to restore it: "
                                         + "; ".join(problems))
            target = undo[-1]
            journal = {"release": target, "previous": by_id[target].get("previous"),
                       "active_before": by_id[target].get("active_before") or {},
                       "enabled_before": by_id[target].get("enabled_before") or {}}
            try:
                for rid in undo:
                    self._step("restore", f"undoing release {rid}")
                    res = self.store.call("restore", backup_dir=self.store.backup_dir(rid))
                    if res["refused"]:
                        raise StepFailed("restore", "backup corrupted: " + "; ".join(res["problems"]))
                    self.store.write_release(rid, outcome="rolled back", rolled_back_at=time.time())
                if to == "original":
                    res = self.store.call("restore", backup_dir=self.store.backup_dir("original"))
                    if res["refused"]:
                        raise StepFailed("restore", "original backup corrupted: " + "; ".join(res["problems"]))
                self.svc.daemon_reload()
                self._restore_services(journal["active_before"], journal["enabled_before"])
                self.store.set_current(journal["previous"] if to != "original" else None)
            except (StepFailed, RemoteCommandError, UnreachableError) as e:
                raise RollbackFailed(f"{h.name}: rollback failed: {e}; a person must look") from None
            now = journal["previous"] if to != "original" else None
            return HostResult(h.name, "rolled_back", 0, release=now, steps=self.steps,
                              seconds=time.monotonic() - t0,
                              message=f"now on {now or 'the original upstream files'}")
        finally:
            self._release_lock(lock)
