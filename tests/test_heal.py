"""The host heals itself (host/agent/heal.py), run here on temp folders made by the agent's own
ops, with `systemctl` and `nvidia-smi` stand-ins on PATH (testing/fake_systemctl.py) that log every
argv and keep the units' states: an interrupted deploy is rolled back at every step, an
interrupted rollback is finished, and a journal it must not act on is left alone."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from pathlib import Path

import pytest

from ddtree_ops.host.agent.backup import op_backup
from ddtree_ops.host.agent.facts import op_facts
from ddtree_ops.host.agent.heal import HEAL_RECORD, heal, heal_journal_problem, heal_parse_states
from ddtree_ops.host.agent.install import op_install
from ddtree_ops.host.agent.protocol import (
    Backup,
    BackupPath,
    Facts,
    Install,
    InstallFile,
    Journal,
    ReleaseWrite,
    SetCurrent,
)
from ddtree_ops.host.agent.statedir import ensure_state_dir, read_current
from ddtree_ops.host.agent.store import op_journal, op_release_write, op_set_current
from ddtree_ops.host.agent_source import agent_source
from ddtree_ops.host.journal import journal_problem
from ddtree_ops.testing.fake_systemctl import FakeSystemctl

DDTREE, DFLASH = "sglang-k26-ddtree.service", "sglang-k26-dflash-cg.service"
DEPLOY_STEPS = ("backup", "install", "stop conflicts", "restart", "wait for weights", "commit")
WHY = "lease expired: no heartbeat for 30 s"


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


class Host:
    """A host's files and state dir under `root`, changed only through the agent's own ops, as a
    deploy does it step by step; its units live in the fake systemctl's state."""

    def __init__(self, root: Path, systemctl: FakeSystemctl):
        self.root, self.systemctl = root, systemctl
        self.state = str(root / "state")
        self.mod = root / "site" / "pkg" / "mod.py"  # an upstream file a release replaces
        self.new = root / "site" / "pkg" / "ddtree.py"  # a module a release adds
        self.unit = root / "etc" / "systemd" / "system" / DDTREE  # the unit a release adds
        self.mod.parent.mkdir(parents=True)
        self.unit.parent.mkdir(parents=True)
        self.mod.write_bytes(b"UPSTREAM = 1\n")
        self.mod.chmod(0o640)
        ensure_state_dir(self.state)

    def files(self) -> dict[str, tuple[bytes, int] | None]:
        """Content and mode of every path a release touches (None: absent)."""
        return {str(p): (p.read_bytes(), p.stat().st_mode & 0o7777) if p.exists() else None
                for p in (self.mod, self.new, self.unit)}

    def units_before(self) -> tuple[dict[str, str], dict[str, str]]:
        units = self.systemctl.units()
        active = {u: units.get(u, {}).get("active", "inactive") for u in (DDTREE, DFLASH)}
        enabled = {u: units.get(u, {}).get("enabled") or "unknown" for u in (DDTREE, DFLASH)}
        return active, enabled

    def set_units(self, **units: dict[str, str]) -> None:
        doc = self.systemctl.read()
        for name, state in units.items():
            unit = {"ddtree": DDTREE, "dflash": DFLASH}[name]
            doc["units"].setdefault(unit, {"active": "inactive", "enabled": "", "pid": 0}).update(state)
        self.systemctl.write(doc)

    def journal(self) -> dict | None:
        p = Path(self.state) / "journal.json"
        return json.loads(p.read_text()) if p.exists() else None

    def release(self, rid: str) -> dict:
        return json.loads((Path(self.state) / "releases" / rid / "release.json").read_text())

    def heal_record(self) -> dict | None:
        p = Path(self.state) / HEAL_RECORD
        return json.loads(p.read_text()) if p.exists() else None

    def deploy(self, rid: str, content: bytes, upto: str | None = None, *, partial_backup: bool = False) -> dict:
        """A deploy of `content` as release `rid`, as runbook/phases.py runs it, stopped just after
        it journalled `upto` (None: committed). Its journal."""
        active, enabled = self.units_before()
        j = {"release": rid, "previous": read_current(self.state), "active_before": active,
             "enabled_before": enabled, "holder": {"user": "alice"}, "patchset": "ps"}
        op_release_write(ReleaseWrite(self.state, rid, {"id": rid, "created": time.time(), "outcome": "in progress",
                                                       "previous": j["previous"], "active_before": active,
                                                       "enabled_before": enabled}))
        for step in DEPLOY_STEPS:
            j["step"] = step
            op_journal(Journal(self.state, journal=j))
            self._do(step, rid, content, last=step == upto, partial_backup=partial_backup)
            if step == upto:
                return j
        op_release_write(ReleaseWrite(self.state, rid, {"outcome": "deployed"}))
        op_set_current(SetCurrent(self.state, rid))
        op_journal(Journal(self.state, clear=True))
        return j

    def _do(self, step: str, rid: str, content: bytes, *, last: bool, partial_backup: bool) -> None:
        if step == "backup":
            op_backup(Backup(self.state, rid, [BackupPath(str(self.mod)), BackupPath(str(self.new)),
                                               BackupPath(str(self.unit), "unit")]))
            if last and partial_backup:  # the copy was cut short: it never became the release's backup
                backup = Path(self.state) / "releases" / rid / "backup"
                backup.rename(backup.with_name("backup.partial"))
        elif step == "install":
            files = [(self.mod, content), (self.new, content)] if not last else [(self.mod, content)]
            op_install(Install(self.state, [InstallFile(str(p), base64.b64encode(d).decode(), _sha(d))
                                            for p, d in files]))
            if not last:
                op_install(Install(self.state, [InstallFile(str(self.unit), base64.b64encode(b"[Service]\n").decode(),
                                                            _sha(b"[Service]\n"))]))
        elif step == "stop conflicts":
            self.set_units(dflash={"active": "inactive", "enabled": "disabled"}, ddtree={"enabled": "enabled"})
        elif step == "restart":
            self.set_units(ddtree={"active": "activating" if last else "active", "pid": 2000})
        elif step == "commit" and last:  # cut between `current` and the journal's removal
            op_release_write(ReleaseWrite(self.state, rid, {"outcome": "deployed"}))
            op_set_current(SetCurrent(self.state, rid))


@pytest.fixture
def systemctl(tmp_path, monkeypatch) -> FakeSystemctl:
    """Before any release: DFlash serving and enabled, no DDTree unit."""
    fake = FakeSystemctl.install(tmp_path / "bin", {DFLASH: {"active": "active", "enabled": "enabled", "pid": 500}})
    for k, v in fake.env().items():
        monkeypatch.setenv(k, v)
    return fake


@pytest.fixture
def host(tmp_path, systemctl) -> Host:
    return Host(tmp_path / "host", systemctl)


def _restart_after_stop(actions: list[str], stopped: str, started: str) -> bool:
    return actions.index(f"stop {stopped}") < actions.index(f"restart {started}")


# What the heal asks systemd, by the release the host was on and the step the deploy reached.
# A first deploy replaced DFlash: nothing stopped yet (backup, install) leaves DFlash serving;
# from "stop conflicts" on, DFlash is enabled and restarted, and a DDTree that runs is stopped
# first. A redeploy over r0 restarts DDTree (now on r0's files) once it may have been touched.
_FIRST = {"backup": ["daemon-reload"], "install": ["daemon-reload"],
          "stop conflicts": ["daemon-reload", f"disable {DDTREE}", f"enable {DFLASH}", f"restart {DFLASH}"]}
_FIRST.update(dict.fromkeys(("restart", "wait for weights", "commit"),
                            ["daemon-reload", f"disable {DDTREE}", f"enable {DFLASH}", f"stop {DDTREE}",
                             f"restart {DFLASH}"]))
_REDEPLOY = {"backup": ["daemon-reload"], "install": ["daemon-reload"]}
_REDEPLOY.update(dict.fromkeys(DEPLOY_STEPS[2:], ["daemon-reload", f"restart {DDTREE}"]))
EXPECTED_ACTIONS = {None: _FIRST, "r0": _REDEPLOY}
SERVES = {None: (DFLASH, DDTREE), "r0": (DDTREE, DFLASH)}  # (the unit that serves before, the other)


@pytest.mark.parametrize("previous", [None, "r0"])
@pytest.mark.parametrize("step", DEPLOY_STEPS)
def test_an_interrupted_deploy_is_rolled_back_by_the_host_at_every_step(host, systemctl, step, previous):
    if previous:
        host.deploy("r0", b"R0 = 1\n")
    before, units_before = host.files(), systemctl.units()
    serving, other = SERVES[previous]
    host.deploy("r1", b"R1 = 1\n", upto=step)
    changed = host.files() != before or systemctl.units() != units_before
    assert changed or step == "backup"  # control: from install on the deploy had changed the host
    systemctl.log_path.write_text("")

    record = heal(host.state, WHY)

    assert record["ok"] and record["healed"], record
    assert host.files() == before  # byte for byte, modes too
    assert systemctl.actions() == EXPECTED_ACTIONS[previous][step]
    units = systemctl.units()
    assert units[serving]["active"] == "active" and units[serving]["enabled"] == "enabled"
    assert units.get(other, {}).get("active", "inactive") == "inactive"
    if step in ("backup", "install"):  # never stopped: the server that serves is not reloaded
        assert units[serving]["pid"] == units_before[serving]["pid"]
    assert host.journal() is None and read_current(host.state) == previous
    outcome = host.release("r1")
    assert outcome["outcome"] == f"rolled back by the host: controller lost at {step}"
    assert abs(outcome["rolled_back_at"] - time.time()) < 60
    saved = host.heal_record()
    assert {k: saved[k] for k in ("why", "step", "release", "previous", "ok", "error")} == {
        "why": WHY, "step": step, "release": "r1", "previous": previous, "ok": True, "error": None}
    assert saved["actions"] == record["actions"] and saved["actions"][-1] == "journal cleared"


def test_a_backup_cut_short_restores_nothing_and_leaves_the_server_alone(host, systemctl):
    before = host.files()
    host.deploy("r1", b"R1 = 1\n", upto="backup", partial_backup=True)
    assert (Path(host.state) / "releases" / "r1" / "backup.partial").is_dir()  # control: a partial copy is there
    record = heal(host.state, WHY)
    assert record["ok"] and host.files() == before
    assert not (Path(host.state) / "releases" / "r1" / "backup.partial").exists()
    assert any("no complete backup of r1" in a for a in record["actions"])
    assert systemctl.actions() == ["daemon-reload"] and systemctl.units()[DFLASH]["pid"] == 500


def test_the_new_unit_is_stopped_before_the_old_one_starts_on_the_shared_port(host, systemctl):
    """The units conflict on the port: the fake fails a unit started while the other holds it."""
    systemctl.update(ports={DDTREE: 30000, DFLASH: 30000})
    host.deploy("r1", b"R1 = 1\n", upto="wait for weights")
    record = heal(host.state, WHY)
    assert record["ok"], record
    assert _restart_after_stop(systemctl.actions(), DDTREE, DFLASH)
    assert systemctl.units()[DFLASH]["active"] == "active"


def test_the_fake_fails_a_unit_started_while_another_holds_its_port(systemctl):
    """Control for the test above: the other order would have left DFlash failed."""
    import subprocess

    systemctl.update(ports={DDTREE: 30000, DFLASH: 30000},
                     units={DDTREE: {"active": "active", "enabled": "enabled", "pid": 2000},
                            DFLASH: {"active": "inactive", "enabled": "enabled", "pid": 0}})
    subprocess.run(["systemctl", "restart", DFLASH], check=True)
    assert systemctl.units()[DFLASH]["active"] == "failed"
    assert not _restart_after_stop([f"restart {DFLASH}", f"stop {DDTREE}"], DDTREE, DFLASH)


def _rollback_journal(host: Host, undo: list[str], to: str | None, *, to_original: bool = False) -> dict:
    oldest = host.release(undo[-1])
    j = {"kind": "rollback", "release": undo[0], "undo": undo, "to": to, "to_original": to_original,
         "active_before": oldest["active_before"], "enabled_before": oldest["enabled_before"],
         "holder": {"user": "bob"}, "step": "restore"}
    op_journal(Journal(host.state, journal=j))
    return j


def test_an_interrupted_rollback_is_finished_by_the_host(host, systemctl):
    host.deploy("r0", b"R0 = 1\n")
    on_r0, units_r0 = host.files(), systemctl.units()
    host.deploy("r1", b"R1 = 1\n")
    assert host.files() != on_r0  # control: r1 changed the files
    _rollback_journal(host, ["r1"], "r0")
    systemctl.log_path.write_text("")

    record = heal(host.state, WHY)

    assert record["ok"] and record["kind"] == "rollback" and record["previous"] == "r0", record
    assert host.files() == on_r0 and read_current(host.state) == "r0" and host.journal() is None
    assert systemctl.actions() == ["daemon-reload", f"restart {DDTREE}"]  # r1 was a redeploy of DDTree
    assert {u: s["active"] for u, s in systemctl.units().items()} == {u: s["active"] for u, s in units_r0.items()}
    assert host.release("r1")["outcome"] == "rolled back (finished by the host: controller lost at restore)"
    assert host.heal_record()["kind"] == "rollback"


def test_an_interrupted_rollback_to_the_original_files_is_finished_newest_first(host, systemctl):
    pristine = host.files()
    host.deploy("r0", b"R0 = 1\n")
    host.deploy("r1", b"R1 = 1\n")
    _rollback_journal(host, ["r1", "r0"], None, to_original=True)
    systemctl.log_path.write_text("")
    record = heal(host.state, WHY)
    assert record["ok"], record
    assert host.files() == pristine and read_current(host.state) is None
    restores = [a.split(":")[0] for a in record["actions"] if a.startswith("restore")]
    assert restores == ["restore backup of r1", "restore backup of r0", "restore original files"]
    assert _restart_after_stop(systemctl.actions(), DDTREE, DFLASH)
    assert systemctl.units()[DFLASH]["active"] == "active"


@pytest.mark.parametrize("text", [b'{"release": "r1", "step": "rest', b'["r1"]',
                                  b'{"release": "r1", "step": "restart", "kind": "upgrade"}'])
def test_a_corrupt_journal_is_never_acted_on(host, systemctl, text):
    before = host.files()
    host.deploy("r1", b"R1 = 1\n", upto="restart")
    path = Path(host.state) / "journal.json"
    good = path.read_bytes()
    path.write_bytes(text)
    state_before = sorted(p.name for p in Path(host.state).iterdir())
    systemctl.log_path.write_text("")

    record = heal(host.state, WHY)

    assert record["healed"] is False and record["error"].startswith("corrupt journal"), record
    assert path.read_bytes() == text and systemctl.calls() == []
    assert sorted(p.name for p in Path(host.state).iterdir()) == state_before  # no record written either
    path.write_bytes(good)  # control: the journal as the deploy wrote it is acted on
    assert heal(host.state, WHY)["healed"] and host.files() == before


def test_a_journal_left_by_no_rollback_is_left_as_it_is(host, systemctl):
    j = host.deploy("r1", b"R1 = 1\n", upto="wait for weights")
    op_journal(Journal(host.state, journal=dict(j, step="failed (--no-rollback)", error="health gate failed")))
    journal_bytes, files = (Path(host.state) / "journal.json").read_bytes(), host.files()
    systemctl.log_path.write_text("")

    record = heal(host.state, WHY)

    assert record["healed"] is False and record["ok"] and "--no-rollback" in record["actions"][0]
    assert (Path(host.state) / "journal.json").read_bytes() == journal_bytes and host.files() == files
    assert systemctl.calls() == [] and host.heal_record() is None
    op_journal(Journal(host.state, journal=j))  # control: the same deploy journalled at its step is healed
    assert heal(host.state, WHY)["healed"]


def test_no_journal_is_nothing_to_do(host, systemctl):
    assert heal(host.state, WHY) is None and systemctl.calls() == [] and host.heal_record() is None
    host.deploy("r1", b"R1 = 1\n", upto="install")
    assert heal(host.state, WHY) is not None  # control


def test_a_failing_systemctl_is_recorded_and_the_journal_kept_for_the_next_run(host, systemctl):
    host.deploy("r1", b"R1 = 1\n", upto="restart")
    journal = host.journal()
    systemctl.update(fail={f"stop {DDTREE}": 1})

    record = heal(host.state, WHY)  # returns: never raises

    assert record["ok"] is False and record["healed"] is False
    assert f"systemctl stop {DDTREE}` exited 1" in record["error"]
    assert host.journal() == journal and read_current(host.state) is None
    assert host.release("r1")["outcome"] == "in progress"
    assert host.heal_record()["ok"] is False and host.heal_record()["error"] == record["error"]
    assert f"restart {DFLASH}" not in systemctl.actions()  # not started while DDTree may hold the port
    systemctl.update(fail={})  # control: the same heal, systemctl working, succeeds from the kept journal
    assert heal(host.state, WHY)["ok"] and host.journal() is None


def test_a_unit_that_does_not_come_back_is_recorded_as_a_failed_heal(host, systemctl):
    host.deploy("r1", b"R1 = 1\n", upto="restart")
    systemctl.update(start_as={DFLASH: "failed"})
    record = heal(host.state, WHY)
    assert record["ok"] is False and f"{DFLASH} is failed" in record["error"] and host.journal() is not None
    systemctl.update(start_as={})  # control
    assert heal(host.state, WHY)["ok"]


def test_an_unexpected_error_is_recorded_not_raised(host, systemctl, monkeypatch):
    host.deploy("r1", b"R1 = 1\n", upto="restart")

    def broken(argv, timeout):
        raise RuntimeError("no fork: resource temporarily unavailable")

    with monkeypatch.context() as m:
        m.setattr("ddtree_ops.host.agent.heal.run_program", broken)
        record = heal(host.state, WHY)
    assert record["ok"] is False and record["error"].startswith("RuntimeError: no fork")
    assert host.heal_record()["error"] == record["error"] and host.journal() is not None
    assert heal(host.state, WHY)["ok"]  # control: the same heal with systemctl reachable


def test_a_unit_name_that_is_not_one_never_reaches_systemctl(host, systemctl):
    j = host.deploy("r1", b"R1 = 1\n", upto="restart")
    op_journal(Journal(host.state, journal=dict(j, active_before={"--root=/ x.service": "active"})))
    record = heal(host.state, WHY)
    assert record["ok"] is False and "not a valid unit name" in record["error"]
    assert not [c for c in systemctl.calls() if "--root=/ x.service" in c]
    op_journal(Journal(host.state, journal=j))  # control
    assert heal(host.state, WHY)["ok"]


class SleepClock:
    """The heal module's `time` with a clock that moves only when the heal sleeps (as the fake
    host's link does): a wait's bound is read on it, whatever this machine's load."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name):
        return getattr(time, name)


def test_gpu_memory_of_the_stopped_server_is_waited_for_within_a_bound(host, systemctl, monkeypatch):
    """On the heal's clock (on this machine's, the first nvidia-smi under load could take longer
    than the bound, and the wait end after one look)."""
    host.deploy("r1", b"R1 = 1\n", upto="wait for weights")
    systemctl.update(gpu_apps=[{"pid": 2000, "used_mib": 70000}])
    clock = SleepClock()
    monkeypatch.setattr("ddtree_ops.host.agent.heal.time", clock)
    t0 = time.monotonic()
    record = heal(host.state, WHY, gpu_wait_s=0.3)
    assert time.monotonic() - t0 < 30 and record["ok"]
    assert 0.3 <= clock.now < 30  # it waited out the bound, and no longer
    assert any(a.startswith("GPU memory still held after 0.3 s") for a in record["actions"]), record["actions"]
    assert sum(c[0] == "nvidia-smi" for c in systemctl.calls()) >= 2


def test_free_gpus_are_not_waited_for(host, systemctl, monkeypatch):
    """Control for the test above, on the same clock (on this machine's, one nvidia-smi of a
    loaded machine could take a second)."""
    host.deploy("r1", b"R1 = 1\n", upto="wait for weights")
    clock = SleepClock()
    monkeypatch.setattr("ddtree_ops.host.agent.heal.time", clock)
    record = heal(host.state, WHY, gpu_wait_s=30)
    assert record["ok"] and any(a.startswith("gpus free after 0.0 s") for a in record["actions"]), record["actions"]
    assert clock.now == 0.0 and sum(c[0] == "nvidia-smi" for c in systemctl.calls()) == 1


# -- the journal's rules, and the record in facts ---------------------------------------------------

GOOD = {"release": "r1", "step": "restart", "active_before": {DFLASH: "active"}, "enabled_before": {}}
JOURNALS = [None, GOOD, [1], {**GOOD, "release": "../x"}, {**GOOD, "release": ""}, {**GOOD, "step": 3},
            {**GOOD, "active_before": {DFLASH: 1}}, {**GOOD, "enabled_before": []}, {**GOOD, "kind": "upgrade"},
            {**GOOD, "kind": "rollback", "undo": ["r1"], "to": None}, {**GOOD, "kind": "rollback", "undo": []},
            {**GOOD, "kind": "rollback", "undo": [".x"]}, {**GOOD, "kind": "rollback", "undo": ["r1"], "to": 5},
            {**GOOD, "previous": 7}, {**GOOD, "previous": "r0"}]


@pytest.mark.parametrize("journal", JOURNALS, ids=[str(i) for i in range(len(JOURNALS))])
def test_the_host_judges_a_journal_as_the_controller_does(journal):
    assert heal_journal_problem(journal) == journal_problem(journal)


def test_the_journal_rules_tell_good_from_bad():
    """Control for the test above: the corpus holds both, so agreeing is not agreeing on None."""
    verdicts = [journal_problem(j) is None for j in JOURNALS]
    assert verdicts.count(True) == 4 and verdicts.count(False) == len(JOURNALS) - 4


def test_systemctl_show_blocks_are_matched_by_id_in_any_order():
    text = f"MainPID=0\nId={DFLASH}\nActiveState=failed\nUnitFileState=enabled\n\nId={DDTREE}\nActiveState=active\n"
    states = heal_parse_states(text, [DDTREE, DFLASH, "other.service"])
    assert states == {DDTREE: {"active": "active", "enabled": "unknown"},
                      DFLASH: {"active": "failed", "enabled": "enabled"},
                      "other.service": {"active": "unknown", "enabled": "unknown"}}


def test_the_host_reads_real_systemd_output_as_the_controller_does():
    """systemctl show as systemd 252 printed it (tests/data/systemctl_show/states.txt)."""
    from ddtree_ops.host.services import parse_states

    text = (Path(__file__).parent / "data" / "systemctl_show" / "states.txt").read_text()
    units = [DDTREE, DFLASH, "crashes.service", "no-such-unit.service"]
    ours, theirs = heal_parse_states(text, units), parse_states(text, units)
    assert ours == {u: {"active": s.active, "enabled": s.enabled} for u, s in theirs.items()}
    assert ours[DFLASH] == {"active": "active", "enabled": "enabled"}
    assert ours["no-such-unit.service"]["enabled"] == "unknown"  # control: an empty value is not a state


UNIT_NAMES = [DDTREE, "a@b.service", "x.timer", "--root=/ x.service", "x.service\n", "x", "x.exe", "a@b@c.service",
              "../x.service", "x" * 250 + ".service", "x" * 252 + ".service", 7, None]


def test_the_host_takes_a_unit_name_as_the_inventory_does():
    from ddtree_ops.config.schema import is_valid_unit_name
    from ddtree_ops.host.agent.heal import _HEAL_UNIT_RE

    ours = [isinstance(u, str) and len(u) <= 255 and bool(_HEAL_UNIT_RE.fullmatch(u)) for u in UNIT_NAMES]
    assert ours == [is_valid_unit_name(u) for u in UNIT_NAMES]
    assert True in ours and False in ours  # control: both kinds are in the list
    # `$` would also match before a final newline: a name with one is refused by both.
    assert not is_valid_unit_name("x.service\n") and not _HEAL_UNIT_RE.fullmatch("x.service\n")


def test_an_unreadable_heal_record_is_said_not_guessed(host, systemctl):
    host.deploy("r1", b"R1 = 1\n", upto="restart")
    heal(host.state, WHY)
    assert "error" not in _facts(host)["host_heal"] or _facts(host)["host_heal"]["error"] is None  # control
    (Path(host.state) / HEAL_RECORD).write_bytes(b'{"at": 17')
    seen = _facts(host)["host_heal"]
    assert seen["ok"] is False and HEAL_RECORD + " cannot be read" in seen["error"] and not seen["reported"]


def _facts(host: Host) -> dict:
    return op_facts(Facts(host.state, str(host.root / "site"), str(host.unit)))


def test_facts_carry_the_last_heal_until_a_run_marks_it_reported(host, systemctl):
    assert _facts(host)["host_heal"] is None  # control: no heal, nothing
    host.deploy("r1", b"R1 = 1\n", upto="restart")
    heal(host.state, WHY)
    seen = _facts(host)["host_heal"]
    assert seen["release"] == "r1" and seen["ok"] and seen["reported"] is False
    op_release_write(ReleaseWrite(host.state, "r1", {"host_heal_reported": seen["at"]}))
    assert _facts(host)["host_heal"]["reported"] is True


def test_a_later_heal_of_a_release_already_reported_is_news_again(host, systemctl):
    """A run reported a failed heal and was lost in turn before it repaired: the host heals again."""
    host.deploy("r1", b"R1 = 1\n", upto="restart")
    systemctl.update(fail={"daemon-reload": 1})
    first = heal(host.state, WHY)
    op_release_write(ReleaseWrite(host.state, "r1", {"host_heal_reported": first["at"]}))
    assert _facts(host)["host_heal"]["reported"] is True  # control: the first one is marked seen
    systemctl.update(fail={})
    second = heal(host.state, WHY)
    assert second["ok"] and _facts(host)["host_heal"]["reported"] is False


def test_the_joined_agent_source_heals_in_its_one_namespace(host, systemctl):
    """As the host runs it: every module in one namespace, no package."""
    before = host.files()
    host.deploy("r1", b"R1 = 1\n", upto="commit")
    namespace: dict = {"__name__": "ddtree_agent"}
    exec(compile(agent_source(), "ddtree_agent", "exec", dont_inherit=True), namespace)
    record = namespace["heal"](host.state, WHY)
    assert record["ok"] and host.files() == before and "heal_record_facts" in namespace
