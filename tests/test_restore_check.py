"""A rollback never mixes two SGLang releases (issue 29): before any backup is put back, the host is
checked to be as the releases being undone left it (host/agent/restore_check.py), by `rollback`,
by the repair of an interrupted run, by the host's own heal and by an aborted rollout's revert;
`status` names the same drift. Fast tier: fake hosts running the real agent in-process."""

from __future__ import annotations

import hashlib
import json

import pytest

from ddtree_ops.cli.tables import drift_cell
from ddtree_ops.errors import (
    EXIT_BAD_INPUT,
    EXIT_ERROR,
    EXIT_ROLLED_BACK,
    DdtreeOpsError,
    DriftedSinceRelease,
    PreflightError,
)
from ddtree_ops.fleet import status
from ddtree_ops.fleet.actions import rolling_deploy
from ddtree_ops.fleet.rollout import Target
from ddtree_ops.host.agent.heal import heal
from ddtree_ops.host.heal_note import heal_note
from ddtree_ops.runbook.deploy import deploy_host
from ddtree_ops.runbook.phases import DeployOptions
from ddtree_ops.runbook.results import Outcome
from ddtree_ops.runbook.rollback import rollback_host
from ddtree_ops.testing.fake_host import FAKE_CRASH, SGLANG_VERSION, UPSTREAM_BYTES, UPSTREAM_REL, fake_hosts
from ddtree_ops.testing.fake_systemd import run_program as fake_program
from fast_kit import PROBE_REL

OPTS = DeployOptions(reconnect_s=5)
FORCE = DeployOptions(reconnect_s=5, force=True)
UNIT_DIR = "/etc/systemd/system"
WHY = "lease expired"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def host_state(fake) -> tuple:
    """Every file a rollback could write (site-packages, units, the state dir but its lock file,
    which each run takes) and the units' states: 'nothing written' is this, unchanged."""
    files = fake.tree(fake.host.site_packages, UNIT_DIR, fake.host.state_dir)
    files = {p: b for p, b in files.items() if not p.endswith("/deploy.lock")}
    return files, {u: (s.active, s.enabled, s.pid) for u, s in fake.units.items()}


def upgrade_sglang(fake, version: str = "0.5.24") -> None:
    """What `pip install -U sglang` leaves: the dist-info renamed, its Version the new one."""
    sp = fake.path(fake.host.site_packages)
    if (sp / f"sglang-{SGLANG_VERSION}.dist-info").exists():
        (sp / f"sglang-{SGLANG_VERSION}.dist-info").rename(sp / f"sglang-{version}.dist-info")
    (sp / f"sglang-{version}.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\n"
                                                               f"Version: {version}\n")


def site(fake, rel: str) -> str:
    return f"{fake.host.site_packages}/{rel}"


def forget_the_new_fields(fake, rid: str) -> None:
    """The release as an older ddtree-ops recorded it: no `installed`, no SGLang version."""
    path = fake.path(f"{fake.host.state_dir}/releases/{rid}/release.json")
    doc = json.loads(path.read_text())
    for key in ("installed", "sglang_version", "site_packages"):
        doc.pop(key, None)
    path.write_text(json.dumps(doc))


UPGRADED = UPSTREAM_BYTES.replace(b"0.5.23", b"0.5.24")
PATCHED = UPSTREAM_BYTES + b"# patched\n"  # fast_kit's `patchset` replaces UPSTREAM_REL with this
PROBE, HAND = b"PROBE = 1\n", b"HAND = 1\n"  # ... and adds PROBE_REL with PROBE


def test_a_release_records_the_sglang_it_was_installed_onto(fake, patchset):
    rid = deploy_host(fake.session(), patchset, OPTS).release
    rec = next(r for r in fake.session().store.history()["releases"] if r["id"] == rid)
    assert (rec["sglang_version"], rec["site_packages"]) == (SGLANG_VERSION, fake.host.site_packages)
    assert rec["installed"][site(fake, UPSTREAM_REL)] == _sha(PATCHED)


# (name, what changes on the host after the deploy, refused?, what the refusal names)
RULES = [
    ("a replaced file rewritten", lambda f: f.write(site(f, UPSTREAM_REL), UPGRADED), True,
     f"{UPSTREAM_REL} (expected {_sha(PATCHED)[:12]}, found {_sha(UPGRADED)[:12]})"),
    ("a replaced file removed", lambda f: f.path(site(f, UPSTREAM_REL)).unlink(), True,
     f"{UPSTREAM_REL} (expected {_sha(PATCHED)[:12]}, found absent)"),
    ("a file the release added, rewritten", lambda f: f.write(site(f, PROBE_REL), HAND), True,
     f"{PROBE_REL} (expected {_sha(PROBE)[:12]}, found {_sha(HAND)[:12]})"),
    ("a file the release added, removed: the rollback removes it anyway", lambda f: f.path(site(f, PROBE_REL)).unlink(),
     False, None),
    ("the SGLang version changed", upgrade_sglang, True, "SGLang 0.5.24 installed, {rid} was installed onto 0.5.23"),
    ("a file put back as it was before the release: nothing to overwrite",
     lambda f: f.write(site(f, UPSTREAM_REL), UPSTREAM_BYTES), False, None),
]


@pytest.mark.parametrize("name, change, refused, named", RULES, ids=[r[0] for r in RULES])
def test_the_rule_table(fake, patchset, name, change, refused, named):
    rid = deploy_host(fake.session(), patchset, OPTS).release
    change(fake)
    before = host_state(fake)
    if not refused:
        r = rollback_host(fake.session(), None, OPTS)
        assert r.outcome == Outcome.ROLLED_BACK and fake.read(site(fake, UPSTREAM_REL)) == UPSTREAM_BYTES
        assert fake.read(site(fake, PROBE_REL)) is None
        return
    with pytest.raises(DriftedSinceRelease) as e:
        rollback_host(fake.session(), None, OPTS)
    msg = str(e.value)
    assert isinstance(e.value, PreflightError) and e.value.exit_code == EXIT_BAD_INPUT
    assert msg.startswith(f"{fake.host.name}: refusing to roll back: ") and named.format(rid=rid) in msg, msg
    assert "nothing was changed" in msg and f"`ddtree-ops rollback --force --limit {fake.host.name}`" in msg
    assert host_state(fake) == before  # not a byte written, no unit touched
    assert fake.session().store.history()["current"] == rid


def test_force_restores_the_backups_over_an_upgraded_venv_and_says_so(fake, patchset):
    deploy_host(fake.session(), patchset, OPTS)
    fake.write(site(fake, UPSTREAM_REL), UPGRADED)
    upgrade_sglang(fake)
    with pytest.raises(DriftedSinceRelease, match="1 file and the SGLang version changed since release"):
        rollback_host(fake.session(), None, OPTS)

    r = rollback_host(fake.session(), None, FORCE)

    assert r.outcome == Outcome.ROLLED_BACK and r.release is None
    assert fake.read(site(fake, UPSTREAM_REL)) == UPSTREAM_BYTES and fake.read(site(fake, PROBE_REL)) is None
    check = next(s for s in r.steps if s["step"] == "restore check")
    assert check["detail"].startswith("skipped (--force)")


def test_a_release_recorded_without_the_fields_is_rolled_back_and_the_step_says_what_was_not_checked(fake,
                                                                                                     patchset):
    rid = deploy_host(fake.session(), patchset, OPTS).release
    forget_the_new_fields(fake, rid)
    fake.write(site(fake, UPSTREAM_REL), UPGRADED)
    upgrade_sglang(fake)

    r = rollback_host(fake.session(), None, OPTS)

    assert r.outcome == Outcome.ROLLED_BACK and fake.read(site(fake, UPSTREAM_REL)) == UPSTREAM_BYTES
    detail = next(s["detail"] for s in r.steps if s["step"] == "restore check")
    assert f"release {rid} records no sha256 of what it installed" in detail
    assert f"release {rid} records no SGLang version" in detail


def test_to_original_checks_every_release_it_undoes_newest_first(fake, versioned_patchset):
    first = deploy_host(fake.session(), versioned_patchset("1.0.0"), OPTS).release
    second = deploy_host(fake.session(), versioned_patchset("2.0.0", b"# v2\n"), OPTS).release
    pristine_probe = fake.read(site(fake, PROBE_REL))
    fake.write(site(fake, PROBE_REL), HAND)
    with pytest.raises(DriftedSinceRelease) as e:
        rollback_host(fake.session(), "original", OPTS)
    assert f"releases {second}, {first} installed them" in str(e.value)
    assert f"{PROBE_REL} (as {second} installed it" in str(e.value)
    fake.write(site(fake, PROBE_REL), pristine_probe)  # control: as the newest release left it
    assert rollback_host(fake.session(), "original", OPTS).outcome == Outcome.ROLLED_BACK
    assert fake.read(site(fake, UPSTREAM_REL)) == UPSTREAM_BYTES and fake.read(site(fake, PROBE_REL)) is None


def _interrupted_rollback(fake, undo: list[str], *, restored: list[str], force: bool = False) -> None:
    """A rollback of `undo` (to the original files) cut off after restoring the backups of
    `restored`: its journal, as runbook/phases.py begin_rollback writes it."""
    store = fake.session().store
    oldest = next(r for r in store.history()["releases"] if r["id"] == undo[-1])
    for rid in restored:
        assert not store.restore(rid).refused
    store.journal(kind="rollback", release=undo[0], undo=undo, to=None, to_original=True,
                  active_before=oldest["active_before"], enabled_before=oldest["enabled_before"],
                  holder={"user": "bob"}, step="restore", **({"force": True} if force else {}))


def test_a_rollback_cut_off_half_way_is_finished_its_files_being_as_the_restore_left_them(fake, versioned_patchset):
    first = deploy_host(fake.session(), versioned_patchset("1.0.0"), OPTS).release
    second = deploy_host(fake.session(), versioned_patchset("2.0.0", b"# v2\n"), OPTS).release
    _interrupted_rollback(fake, [second, first], restored=[second])

    r = rollback_host(fake.session(), None, OPTS)

    assert r.repaired == second and r.outcome == Outcome.ROLLED_BACK
    assert fake.read(site(fake, UPSTREAM_REL)) == UPSTREAM_BYTES and fake.read(site(fake, PROBE_REL)) is None


def test_the_repair_of_an_interrupted_rollback_is_refused_over_an_upgrade_unless_forced(fake, patchset):
    rid = deploy_host(fake.session(), patchset, OPTS).release
    _interrupted_rollback(fake, [rid], restored=[])
    upgrade_sglang(fake)
    before = host_state(fake)
    with pytest.raises(DriftedSinceRelease, match=f"refusing to repair the interrupted rollback of {rid}: "):
        rollback_host(fake.session(), None, OPTS)
    assert host_state(fake) == before  # the journal stays too

    r = rollback_host(fake.session(), None, FORCE)
    assert r.repaired == rid and fake.read(site(fake, UPSTREAM_REL)) == UPSTREAM_BYTES


def heal_fake(fake, monkeypatch) -> dict | None:
    """The agent's heal on the fake host's state dir, its systemctl calls answered by the fake."""
    with monkeypatch.context() as m:
        m.setattr("ddtree_ops.host.agent.heal.run_program", lambda argv, timeout: fake_program(fake, argv).as_dict())
        return heal(str(fake.path(fake.host.state_dir)), WHY)


def test_the_hosts_heal_restores_nothing_over_an_upgrade_and_says_why(fake, patchset, monkeypatch):
    rid = deploy_host(fake.session(), patchset, OPTS).release
    _interrupted_rollback(fake, [rid], restored=[])
    fake.write(site(fake, UPSTREAM_REL), UPGRADED)
    upgrade_sglang(fake)
    before = host_state(fake)
    fake.events.clear()

    record = heal_fake(fake, monkeypatch)

    assert record["refused"] and not record["healed"] and not record["ok"], record
    assert [e for e in fake.events if e.startswith("systemctl")] == []  # not a unit touched
    after = host_state(fake)
    heal_file = f"{fake.host.state_dir}/host-heal.json"
    assert {p: b for p, b in after[0].items() if not p.endswith(heal_file)} == before[0] and after[1] == before[1]
    saved = json.loads(fake.read(heal_file))
    assert saved["restore_check"]["versions"] == [{"release": rid, "recorded": "0.5.23", "found": "0.5.24"}]
    assert saved["restore_check"]["files"][0]["path"].endswith(UPSTREAM_REL)
    note = heal_note(dict(saved, reported=False))
    assert note.startswith("the host did not heal itself") and "SGLang 0.5.24 installed" in note
    assert "`ddtree-ops rollback --force`" in note

    row = status._read_host(fake.session(), fake.host, None)  # status shows it, with the drift
    assert heal_note(row["host_heal"]) == note
    # The next rollback reports the heal, then refuses as the heal did; --force finishes it.
    with pytest.raises(DriftedSinceRelease):
        rollback_host(fake.session(), None, OPTS)
    r = rollback_host(fake.session(), None, FORCE)
    assert r.repaired == rid and fake.read(site(fake, UPSTREAM_REL)) == UPSTREAM_BYTES


def test_the_hosts_heal_finishes_a_rollback_run_with_force(fake, patchset, monkeypatch):
    rid = deploy_host(fake.session(), patchset, OPTS).release
    _interrupted_rollback(fake, [rid], restored=[], force=True)
    upgrade_sglang(fake)
    record = heal_fake(fake, monkeypatch)
    assert record["ok"] and record["healed"], record
    assert "checked before restoring: skipped, the rollback was run with --force" in record["actions"]
    assert fake.read(site(fake, UPSTREAM_REL)) == UPSTREAM_BYTES


def test_the_hosts_heal_checks_and_restores_when_nothing_changed(fake, patchset, monkeypatch):
    rid = deploy_host(fake.session(), patchset, OPTS).release
    _interrupted_rollback(fake, [rid], restored=[])
    record = heal_fake(fake, monkeypatch)
    assert record["ok"] and "checked before restoring: nothing changed under the release" in record["actions"]
    assert fake.read(site(fake, UPSTREAM_REL)) == UPSTREAM_BYTES and fake.session().store.history()["current"] is None


def test_status_names_the_same_drift_and_fails_on_it(fake, patchset, monkeypatch):
    rid = deploy_host(fake.session(), patchset, OPTS).release
    monkeypatch.setattr(status, "open_session", lambda host, **kw: fake.session())
    monkeypatch.setattr(status, "_http", lambda host, row: row.update(health=200))
    clean = status.host_status(fake.host)
    assert clean["ok"] and clean["drift"] == [] and clean["version_drift"] == []  # control

    fake.write(site(fake, UPSTREAM_REL), UPGRADED)
    upgrade_sglang(fake)
    row = status.host_status(fake.host)

    assert not row["ok"]  # `status` exits 1
    assert row["drift"] == [{"path": site(fake, UPSTREAM_REL), "recorded": _sha(PATCHED), "now": _sha(UPGRADED)}]
    assert row["version_drift"] == [{"release": rid, "recorded": "0.5.23", "now": "0.5.24"}]
    assert drift_cell(row) == "dflash_info.py; SGLang 0.5.24 (release: 0.5.23)"


def test_an_aborted_rollouts_revert_refused_over_an_upgrade_leaves_the_host_on_the_new_release(tmp_path, patchset):
    """fh1 (the canary) deploys; while fh2 deploys, fh1's venv is upgraded and fh2 fails: the
    abort's rollback of fh1 is refused, nothing changed, and fh1's row says it stays (exit 1)."""
    fakes = fake_hosts(tmp_path / "hosts", 2)
    by_name = {f.host.name: f for f in fakes}

    def boot(f, unit):  # fh2's new server: fh1 is upgraded meanwhile, and this one crashes
        if unit != f.host.unit:
            return "serve"
        upgrade_sglang(fakes[0])
        return "crash"

    fakes[1].boot = boot
    targets = [Target(f.host.name, (f.host,)) for f in fakes]
    res = rolling_deploy(targets, patchset, OPTS, batch="1", connect=lambda h: by_name[h.name].session())

    rows = {r.host: r for r in res.results}
    assert res.aborted and rows["fh2"].outcome == Outcome.ROLLED_BACK
    fh1 = rows["fh1"]
    assert fh1.outcome == Outcome.REVERT_REFUSED and fh1.exit_code == EXIT_ERROR, fh1
    assert "NOT rolled back after the abort" in fh1.message and "SGLang 0.5.24 installed" in fh1.message
    assert res.reverted == [] and res.exit_code == EXIT_ROLLED_BACK  # fh2's failure decides the rollout's code
    assert fakes[0].read(site(fakes[0], UPSTREAM_REL)) == PATCHED  # left on the new release
    assert fakes[0].units[fakes[0].host.unit].active == "active"


@pytest.mark.parametrize("node", [0, 1])
def test_one_drifted_node_refuses_the_whole_servers_rollback(fake_server, patchset, node):
    """Node by node (highest rank first), the others would be rolled back and the drifted one not:
    a server on two releases. Every node is checked first; --force rolls them all back."""
    from ddtree_ops.fleet.multinode import deploy_server, rollback_server
    from ddtree_ops.runbook.events import quiet

    by_name = {n.host.name: n for n in fake_server}
    server = Target("server1", tuple(n.host for n in fake_server))
    connect = lambda h: by_name[h.name].session()  # noqa: E731
    assert {r.outcome for r in deploy_server(server, patchset, OPTS, connect=connect, report=quiet)} == {
        Outcome.DEPLOYED}
    upgrade_sglang(fake_server[node])
    before = [host_state(f) for f in fake_server]

    rows = rollback_server(server, None, OPTS, connect=connect, report=quiet)

    assert {(r.outcome, r.exit_code) for r in rows} == {(Outcome.REFUSED, EXIT_BAD_INPUT)}, rows
    assert all("SGLang 0.5.24 installed" in r.message for r in rows)
    assert [host_state(f) for f in fake_server] == before
    rows = rollback_server(server, None, FORCE, connect=connect, report=quiet)
    assert {r.outcome for r in rows} == {Outcome.ROLLED_BACK}
    assert all(f.read(site(f, UPSTREAM_REL)) == UPSTREAM_BYTES for f in fake_server)


def test_a_deploys_repair_of_an_interrupted_deploy_is_refused_over_an_upgrade(fake, patchset, versioned_patchset):
    """A deploy left as it failed (--no-rollback) never committed (no `installed`), but its SGLang
    version was recorded at its backup: the next deploy's repair checks that, and refuses."""
    crashing = versioned_patchset(marker=b"\n# " + FAKE_CRASH + b"\n")
    with pytest.raises(DdtreeOpsError):
        deploy_host(fake.session(), crashing, DeployOptions(reconnect_s=5, no_rollback=True))
    journal = fake.session().store.facts([])["journal"]
    assert journal and journal["step"] == "failed (--no-rollback)"  # control: left to repair
    upgrade_sglang(fake)
    before = host_state(fake)
    with pytest.raises(DriftedSinceRelease, match=f"refusing to repair the interrupted deploy of {journal['release']}: "
                                                  f"the SGLang version changed"):
        deploy_host(fake.session(), patchset, OPTS)
    assert host_state(fake) == before
    r = rollback_host(fake.session(), None, FORCE)
    assert r.repaired == journal["release"] and fake.read(site(fake, UPSTREAM_REL)) == UPSTREAM_BYTES


def test_the_rollback_command_exits_2_and_prints_the_whole_refusal(fake, patchset, capsys):
    from ddtree_ops.cli.tables import print_rollout
    from ddtree_ops.fleet.actions import rolling_rollback

    rid = deploy_host(fake.session(), patchset, OPTS).release
    fake.write(site(fake, UPSTREAM_REL), UPGRADED)
    fake.write(site(fake, PROBE_REL), HAND)
    upgrade_sglang(fake)
    res = rolling_rollback([Target(fake.host.name, (fake.host,))], None, OPTS, connect=lambda h: fake.session())
    assert res.exit_code == EXIT_BAD_INPUT and res.results[0].outcome == Outcome.REFUSED
    print_rollout(res)
    out = " ".join(capsys.readouterr().out.split())  # the terminal's line breaks do not matter
    assert (f"{fake.host.name}: refusing to roll back: 2 files and the SGLang version changed since release {rid} "
            f"installed it: {PROBE_REL} (expected {_sha(PROBE)[:12]}, found {_sha(HAND)[:12]}); {UPSTREAM_REL} "
            f"(expected {_sha(PATCHED)[:12]}, found {_sha(UPGRADED)[:12]}); SGLang 0.5.24 installed, {rid} was "
            f"installed onto 0.5.23.") in out, out
