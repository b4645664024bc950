"""`Services` (systemctl through the host's agent) against systemctl's real output, and the proof
that the fast tier's runbook runs the real `Services` over the one fake host seam.

tests/data/systemctl_show/ holds `systemctl show` output recorded from real systemd (its README
says how and in which unit states); the fake host's systemctl must print the same bytes for the
same states, so what the fast tier parses is what a host prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtree_ops.host import services as services_module
from ddtree_ops.host.services import (
    Services,
    UnitState,
    parse_main_pid,
    parse_probe,
    parse_states,
    probe_argvs,
    states_argv,
)
from ddtree_ops.host.session import HostSession
from ddtree_ops.runbook.deploy import deploy_host
from ddtree_ops.runbook.phases import DeployOptions
from ddtree_ops.testing.fake_host import DDTREE_UNIT, DFLASH_UNIT, FakeLink, FakeUnit

RECORDED = Path(__file__).parent / "data" / "systemctl_show"
UNITS = (DDTREE_UNIT, DFLASH_UNIT, "crashes.service", "no-such-unit.service")
AS_RECORDED = {
    DDTREE_UNIT: UnitState(DDTREE_UNIT, "inactive", "disabled", None),
    DFLASH_UNIT: UnitState(DFLASH_UNIT, "active", "enabled", 72),
    "crashes.service": UnitState("crashes.service", "failed", "static", None),
    "no-such-unit.service": UnitState("no-such-unit.service", "inactive", "unknown", None),
}


def recorded(name: str) -> str:
    return (RECORDED / name).read_text()


def test_the_states_systemd_printed_are_read_per_unit_by_id():
    assert parse_states(recorded("states.txt"), UNITS) == AS_RECORDED
    asked_backwards = tuple(reversed(UNITS))
    assert parse_states(recorded("states.txt"), asked_backwards) == AS_RECORDED


def test_without_the_id_lines_the_same_output_asked_in_another_order_is_misread():
    """Control: the Id lines are what ties a block to its unit; positions alone mislead."""
    no_ids = "".join(ln + "\n" for ln in recorded("states.txt").splitlines() if not ln.startswith("Id="))
    misread = parse_states(no_ids, tuple(reversed(UNITS)))
    assert misread != AS_RECORDED
    assert misread[DFLASH_UNIT].active == "failed"  # crashes.service's block, by position


def test_the_main_pid_and_the_probe_systemd_printed_are_read():
    assert parse_main_pid(recorded("main_pid.txt")) == 72
    probe = parse_probe(recorded("probe.txt"), "line 1\n\nline 2\n")
    assert (probe.active, probe.main_pid, probe.log) == ("active", 72, ["line 1", "line 2"])
    assert parse_main_pid(recorded("main_pid.txt").replace("72", "0")) is None  # control: no process


def _as_recorded(fake) -> None:
    fake.units.clear()
    fake.units.update({DDTREE_UNIT: FakeUnit("inactive", "disabled"), DFLASH_UNIT: FakeUnit("active", "enabled", 72),
                       "crashes.service": FakeUnit("failed", "static")})


def _show(fake, argv: list[str]) -> str:
    return FakeLink(fake).call({"op": "run", "argv": argv, "timeout": 30}, 60)["stdout"]


def test_the_fake_hosts_systemctl_prints_what_systemd_printed_for_the_same_states(fake):
    _as_recorded(fake)
    assert _show(fake, states_argv(UNITS)) == recorded("states.txt")
    assert _show(fake, ["systemctl", "show", "-p", "MainPID", DFLASH_UNIT]) == recorded("main_pid.txt")
    assert _show(fake, probe_argvs(DFLASH_UNIT, 10)[0]) == recorded("probe.txt")
    fake.units[DFLASH_UNIT].active = "failed"  # control: another state prints otherwise
    assert _show(fake, states_argv(UNITS)) != recorded("states.txt")


def test_services_on_a_fake_host_read_its_units_through_the_agents_run_op(fake):
    _as_recorded(fake)
    session = fake.session()
    assert session.services.states(UNITS) == AS_RECORDED
    assert fake.events == ["systemctl states"]  # one agent request, whatever the number of units


def _states_texts_parsed(monkeypatch, session: HostSession, patchset) -> list[str]:
    """The `systemctl show` output `Services.states` parsed during a deploy on `session`."""
    texts: list[str] = []
    real = services_module.parse_states
    monkeypatch.setattr(services_module, "parse_states", lambda text, units: texts.append(text) or real(text, units))
    deploy_host(session, patchset, DeployOptions(reconnect_s=5))
    monkeypatch.setattr(services_module, "parse_states", real)
    return texts


def test_the_fast_tiers_runbook_runs_the_real_services_class(fake, patchset, monkeypatch):
    session = fake.session()
    assert type(session) is HostSession and type(session.services) is Services
    texts = _states_texts_parsed(monkeypatch, session, patchset)
    assert texts and all(t.startswith("MainPID=") for t in texts)  # systemd's own order of properties


def test_a_stand_in_for_services_would_be_caught(fake, patchset, monkeypatch):
    """Control: a session whose `states` answers from memory, as the fast tier's stand-in once did,
    parses no systemctl output at all."""
    session = fake.session()
    session.services.states = lambda units: {u: UnitState(u, fake.units[u].active, fake.units[u].enabled,
                                                          fake.units[u].pid) for u in units}
    assert _states_texts_parsed(monkeypatch, session, patchset) == []


@pytest.mark.parametrize("method, args, argv", [
    ("daemon_reload", (), ["systemctl", "daemon-reload"]),
    ("stop", (DFLASH_UNIT,), ["systemctl", "stop", DFLASH_UNIT]),
    ("restart", (DDTREE_UNIT,), ["systemctl", "restart", DDTREE_UNIT]),
    ("enable", (DDTREE_UNIT,), ["systemctl", "enable", DDTREE_UNIT]),
    ("disable", (DFLASH_UNIT,), ["systemctl", "disable", DFLASH_UNIT]),
])
def test_every_unit_action_is_one_systemctl_run_request_to_the_agent(method, args, argv):
    sent: list[dict] = []

    class Recording:
        def call(self, request, timeout):
            sent.append(request)
            return {"rc": 0, "stdout": "", "stderr": ""}

    getattr(Services(Recording(), "h"), method)(*args)
    assert [(r["op"], r["argv"]) for r in sent] == [("run", argv)]


def test_deadlines_are_read_on_the_seams_clock_not_the_wall_clock(fake, versioned_patchset):
    """A server that never becomes ready fails its 30 s weight-loading deadline at 30 s of the
    link's clock: the fake's sleeps advance it, so the test waits for nothing, and the clock the
    runbook read is the one the seam offers."""
    import time

    from ddtree_ops.errors import DeployFailed
    from ddtree_ops.testing.fake_host import FAKE_HANG

    ps = versioned_patchset(marker=b"\n# " + FAKE_HANG + b"\n")
    t0 = time.monotonic()
    with pytest.raises(DeployFailed) as ei:
        deploy_host(fake.session(), ps, DeployOptions(reconnect_s=5, deadline_s=30))
    assert "not ready after 30 s" in ei.value.result.message
    assert fake.clock >= 30  # the deadline passed on the link's clock ...
    assert time.monotonic() - t0 < 10  # ... while the wall clock barely moved
