"""What the controller says about a host that healed itself: the next deploy or rollback reports
it once (a step, and marks it seen), `status` shows it until then, and the terminal summary and
the HTML report carry it. First on a fake host whose controller is killed at every call and whose
agent then heals it (the real heal, with systemctl answered by the fake), then from data."""

from __future__ import annotations

import pytest

from ddtree_ops.cli.report import PHASE_GROUPS, render_report, step_colour
from ddtree_ops.cli.tables import print_rollout, print_status
from ddtree_ops.fleet.rollout import RolloutResult
from ddtree_ops.host.agent.heal import heal
from ddtree_ops.host.heal_note import HEAL_STEP, heal_note, healed_notes, unreported_heal
from ddtree_ops.runbook.deploy import deploy_host
from ddtree_ops.runbook.phases import DeployOptions
from ddtree_ops.runbook.results import HostResult, Outcome
from ddtree_ops.runbook.rollback import rollback_host
from ddtree_ops.testing.fake_host import DFLASH_UNIT, ControllerKilled, fake_hosts
from ddtree_ops.testing.fake_systemd import run_program as fake_program
from fast_kit import kill_deploy_at_call

OPTS = DeployOptions(reconnect_s=5)
UNIT_DIR = "/etc/systemd/system"
WHY = "lease expired"


def snapshot(fake) -> dict[str, bytes]:
    return fake.tree(fake.host.site_packages, UNIT_DIR)


def current(fake) -> str | None:
    return fake.session().store.history()["current"]


def heal_fake(fake, monkeypatch) -> dict | None:
    """The agent's heal on the fake host's state dir, its systemctl calls answered by the fake."""
    with monkeypatch.context() as m:
        m.setattr("ddtree_ops.host.agent.heal.run_program", lambda argv, timeout: fake_program(fake, argv).as_dict())
        return heal(str(fake.path(fake.host.state_dir)), WHY)


def heal_steps(result) -> list[str]:
    return healed_notes(result.steps)


def test_a_controller_killed_at_any_call_is_healed_by_the_host_and_the_next_run_reports_it_once(
        tmp_path, patchset, versioned_patchset, monkeypatch):
    prior = versioned_patchset(version="0.9.0")
    counting = fake_hosts(tmp_path / "count")[0]
    deploy_host(counting.session(), prior, OPTS)
    start = counting.calls
    deploy_host(counting.session(), patchset, OPTS)
    healed_at = []
    for k in range(1, counting.calls - start + 1):
        fake = fake_hosts(tmp_path / f"k{k}")[0]
        before_release = deploy_host(fake.session(), prior, OPTS).release
        on_prior = snapshot(fake)
        where = kill_deploy_at_call(fake, k, deploy_host, patchset, OPTS)
        had_journal = fake.session().store.facts([])["journal"] is not None

        record = heal_fake(fake, monkeypatch)

        assert (record is not None) == had_journal, where  # control: no journal, nothing done
        if record is None:
            assert heal_steps(deploy_host(fake.session(), patchset, OPTS)) == [], where
            continue
        healed_at.append(record["step"])
        assert record["ok"] and record["healed"], (where, record)
        assert snapshot(fake) == on_prior and current(fake) == before_release, where
        assert fake.units[fake.host.unit].active == "active" and fake.units[DFLASH_UNIT].active == "inactive", where
        assert fake.session().store.facts([])["journal"] is None, where

        first = deploy_host(fake.session(), patchset, OPTS)
        assert heal_steps(first) == [heal_note(dict(record, reported=False))], where
        assert first.steps[0]["step"] == HEAL_STEP and first.outcome == Outcome.DEPLOYED, where
        assert fake.session().store.facts([])["host_heal"]["reported"] is True, where
        assert heal_steps(rollback_host(fake.session(), None, OPTS)) == [], where  # shown once
    assert {"backup", "install", "stop conflicts", "restart", "wait for weights", "commit"} <= set(healed_at)


def test_a_heal_that_failed_is_reported_and_the_deploy_repairs_from_the_kept_journal(tmp_path, patchset,
                                                                                      monkeypatch):
    fake = fake_hosts(tmp_path)[0]
    original = snapshot(fake)
    fake.fault_at_call, fake.calls = ("kill", 20), 0
    with pytest.raises(ControllerKilled):
        deploy_host(fake.session(), patchset, OPTS)
    fake.fault_at_call = None
    with monkeypatch.context() as m:
        m.setattr("ddtree_ops.host.agent.heal.run_program",
                  lambda argv, timeout: {"rc": 1, "stdout": "", "stderr": "Failed to connect to bus"})
        record = heal(str(fake.path(fake.host.state_dir)), WHY)
    assert record["ok"] is False and "Failed to connect to bus" in record["error"]

    r = deploy_host(fake.session(), patchset, OPTS)

    notes = heal_steps(r)
    assert len(notes) == 1 and "the host tried to heal itself" in notes[0] and "Failed to connect" in notes[0]
    assert r.repaired and r.outcome == Outcome.DEPLOYED
    assert rollback_host(fake.session(), None, OPTS).outcome == Outcome.ROLLED_BACK
    assert snapshot(fake) == original


# -- from data -----------------------------------------------------------------------------------

T = 1_780_000_000.0  # 2026-05-28 20:26:40 UTC
HEALED = {"at": T, "why": WHY, "kind": "deploy", "step": "wait for weights", "release": "r2", "previous": "r1",
          "actions": [], "ok": True, "error": None, "healed": True, "reported": False}


def test_the_note_says_when_where_and_what_the_host_is_on_now():
    assert heal_note(HEALED) == ("rolled back by the host at 2026-05-28 20:26:40 UTC: controller lost at wait for "
                                 "weights (release r2); now on r1")
    assert heal_note({**HEALED, "previous": None}).endswith("now on its original files")
    assert heal_note({**HEALED, "kind": "rollback", "step": "services", "previous": "r0"}) == (
        "rollback finished by the host at 2026-05-28 20:26:40 UTC: controller lost at services (undoing r2); "
        "now on r0")
    failed = heal_note({**HEALED, "ok": False, "healed": False, "error": "`systemctl stop x` exited 1"})
    assert failed.startswith("the host tried to heal itself") and "`systemctl stop x` exited 1" in failed


def test_only_a_heal_not_yet_reported_is_shown():
    assert unreported_heal(HEALED) == HEALED
    assert unreported_heal({**HEALED, "reported": True}) is None and unreported_heal(None) is None


def _row(**kw) -> dict:
    return {"host": "h1", "reachable": True, "reason": None, "release": "r1", "patchset": "ps", "budget": 16,
            "topk_cap": 4, "drift": [], "active_unit": DFLASH_UNIT, "health": 200, "avg_accept_length": None, **kw}


def test_status_shows_a_heal_per_host_until_a_run_reported_it(capsys):
    print_status([_row(host_heal=HEALED), _row(host="h2", host_heal={**HEALED, "reported": True}), _row(host="h3")])
    out = capsys.readouterr().out
    assert f"h1: {heal_note(HEALED)}" in out
    assert out.count("rolled back by the host") == 1  # h2's was reported, h3 never healed


def _result(steps: list[dict]) -> RolloutResult:
    return RolloutResult("deploy", [HostResult("h1", Outcome.DEPLOYED, 0, release="r3", steps=steps)], [["h1"]])


def test_the_rollout_summary_says_what_the_host_did_alone(capsys):
    note = heal_note(HEALED)
    print_rollout(_result([{"step": HEAL_STEP, "t": T, "detail": note}, {"step": "committed", "t": T + 60,
                                                                          "detail": "release r3"}]))
    assert f"h1: {note}" in capsys.readouterr().out
    print_rollout(_result([{"step": "committed", "t": T + 60, "detail": "release r3"}]))  # control
    assert "by the host" not in capsys.readouterr().out


def test_the_html_report_puts_the_heal_in_the_host_row_coloured_as_a_rollback():
    note = heal_note(HEALED)
    host = {"host": "h1", "outcome": "deployed", "exit_code": 0, "release": "r3", "message": "",
            "steps": [{"step": HEAL_STEP, "t": T, "detail": note}, {"step": "committed", "t": T + 60, "detail": ""}]}
    page = render_report({"action": "deploy", "hosts": [host]})
    assert "rolled back by the host at 2026-05-28 20:26:40 UTC" in page.split("<h2>Timeline</h2>")[0]
    rollback_colour = next(c for g, c, _ in PHASE_GROUPS if g == "rollback")
    assert step_colour(HEAL_STEP) == rollback_colour != step_colour("committed")
    plain = render_report({"action": "deploy", "hosts": [{**host, "steps": host["steps"][1:]}]})  # control
    assert "by the host" not in plain
