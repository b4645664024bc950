"""The phase engine from data (fast tier): a table of node counts, node policies and failure
points -> the events the run emits, in order, and the state every node ends in; for one host and
for two- and three-node servers on fake hosts (ddtree_ops/testing/fake_host.py). A failure is
injected by making one engine phase raise on one node before it does anything there."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from ddtree_ops.errors import DdtreeOpsError
from ddtree_ops.fleet.multinode import deploy_server, rollback_server
from ddtree_ops.fleet.rollout import Target
from ddtree_ops.runbook import engine
from ddtree_ops.runbook.deploy import deploy_host
from ddtree_ops.runbook.engine import Nodes
from ddtree_ops.runbook.events import Event, Failed, Note, PhaseStarted, StepDone
from ddtree_ops.runbook.options import DeployOptions
from ddtree_ops.runbook.results import Outcome, failed_result
from ddtree_ops.runbook.steps import StepFailed
from ddtree_ops.testing.fake_host import fake_hosts

# The steps that show the order of a run across nodes; the others are detail within a phase.
MILESTONES = frozenset({"backup", "restart", "health gate", "node check", "soak", "committed", "rolled back",
                        "restore"})
UNIT_DIR = "/etc/systemd/system"


@dataclass(frozen=True)
class Case:
    name: str
    nodes: int
    fail_phase: str | None  # the engine phase that fails ...
    fail_node: int = 0  # ... on this node (index = rank)
    ctrl_c: bool = False  # KeyboardInterrupt instead of a failed step
    no_rollback: bool = False
    events: tuple[str, ...] = ()  # "host step" of each milestone, "host FAILED step" of a failure
    outcome: Outcome = Outcome.DEPLOYED


CASES = [
    Case("one host deploys", 1, None,
         events=("fh1 backup", "fh1 restart", "fh1 health gate", "fh1 soak", "fh1 committed")),
    Case("one host: a failed perf gate rolls it back", 1, "perf gate",
         events=("fh1 backup", "fh1 restart", "fh1 health gate", "fh1 FAILED perf gate", "fh1 rolled back"),
         outcome=Outcome.ROLLED_BACK),
    Case("one host: Ctrl-C before the restart rolls it back", 1, "restart", ctrl_c=True,
         events=("fh1 backup", "fh1 FAILED interrupted (Ctrl-C) during stop conflicts", "fh1 rolled back"),
         outcome=Outcome.INTERRUPTED),
    Case("one host: --no-rollback leaves it as it is", 1, "soak", no_rollback=True,
         events=("fh1 backup", "fh1 restart", "fh1 health gate"), outcome=Outcome.ROLLBACK_FAILED),
    Case("two nodes deploy: rank 1 restarts first, node 0 is gated, rank 1 checked around the soak", 2, None,
         events=("fh1 backup", "fh2 backup", "fh2 restart", "fh1 restart", "fh1 health gate", "fh2 node check",
                 "fh1 soak", "fh2 node check", "fh1 committed", "fh2 committed")),
    Case("two nodes: node 0 failing its restart rolls both back, rank 0 last", 2, "restart", 0,
         events=("fh1 backup", "fh2 backup", "fh2 restart", "server1 FAILED restart", "fh2 rolled back",
                 "fh1 rolled back"), outcome=Outcome.ROLLED_BACK),
    Case("two nodes: --no-rollback does not apply to a server (every node rolled back)", 2, "soak",
         no_rollback=True,
         events=("fh1 backup", "fh2 backup", "fh2 restart", "fh1 restart", "fh1 health gate", "fh2 node check",
                 "server1 FAILED soak", "fh2 rolled back", "fh1 rolled back"), outcome=Outcome.ROLLED_BACK),
    Case("three nodes deploy", 3, None,
         events=("fh1 backup", "fh2 backup", "fh3 backup", "fh2 restart", "fh3 restart", "fh1 restart",
                 "fh1 health gate", "fh2 node check", "fh3 node check", "fh1 soak", "fh2 node check",
                 "fh3 node check", "fh1 committed", "fh2 committed", "fh3 committed")),
    Case("three nodes: a node failing its install is rolled back with the one before it; the last is untouched",
         3, "backup and install", 1,
         events=("fh1 backup", "server1 FAILED backup and install", "fh2 rolled back", "fh1 rolled back"),
         outcome=Outcome.ROLLED_BACK),
    Case("three nodes: rank 2 dying during the soak rolls all three back, rank 0 last", 3,
         "node check after soak", 2,
         events=("fh1 backup", "fh2 backup", "fh3 backup", "fh2 restart", "fh3 restart", "fh1 restart",
                 "fh1 health gate", "fh2 node check", "fh3 node check", "fh1 soak", "fh2 node check",
                 "server1 FAILED node check after soak", "fh3 rolled back", "fh2 rolled back", "fh1 rolled back"),
         outcome=Outcome.ROLLED_BACK),
    Case("three nodes: Ctrl-C during node 0's gate rolls all three back", 3, "wait and gate", ctrl_c=True,
         events=("fh1 backup", "fh2 backup", "fh3 backup", "fh2 restart", "fh3 restart", "fh1 restart",
                 "server1 FAILED interrupted (Ctrl-C)", "fh3 rolled back", "fh2 rolled back", "fh1 rolled back"),
         outcome=Outcome.INTERRUPTED),
]


def _milestones(events: list[Event]) -> tuple[str, ...]:
    out = []
    for ev in events:
        if isinstance(ev, StepDone) and ev.step in MILESTONES:
            out.append(f"{ev.host} {ev.step}")
        elif isinstance(ev, Failed):
            out.append(f"{ev.host} FAILED {ev.step}")
    return tuple(out)


def _swapped(expected: tuple[str, ...]) -> tuple[str, ...]:
    """The expected events with the first two different neighbours swapped."""
    i = next(k for k in range(len(expected) - 1) if expected[k] != expected[k + 1])
    return (*expected[:i], expected[i + 1], expected[i], *expected[i + 2:])


def _fail_at(monkeypatch, case: Case) -> None:
    """The case's phase raises on its node, before doing anything there."""
    def broken(phase: engine.Phase) -> engine.Phase:
        def run(r: engine.DeployRun, i: int) -> None:
            if i == case.fail_node:
                raise KeyboardInterrupt if case.ctrl_c else StepFailed(phase.name, "injected")
            phase.run(r, i)
        return dataclasses.replace(phase, run=run)

    assert case.fail_phase in {p.name for p in engine.DEPLOY}, case.fail_phase  # a typo must not pass as "no fault"
    monkeypatch.setattr(engine, "DEPLOY", tuple(broken(p) if p.name == case.fail_phase else p for p in engine.DEPLOY))


def _snapshot(fake) -> dict[str, bytes]:
    return fake.tree(fake.host.site_packages, UNIT_DIR)


def _deploy(fakes, ps, opts) -> tuple[list[Outcome], list[Event]]:
    events: list[Event] = []
    if len(fakes) == 1:
        try:
            rows = [deploy_host(fakes[0].session(), ps, opts, events.append)]
        except DdtreeOpsError as e:
            rows = [failed_result(fakes[0].host.name, e, 0.0)]
    else:
        by_name = {f.host.name: f for f in fakes}
        rows = deploy_server(Target("server1", tuple(f.host for f in fakes)), ps, opts,
                             connect=lambda h: by_name[h.name].session(), report=events.append)
    return [r.outcome for r in rows], events


def _run(tmp_path, monkeypatch, patchset, case: Case):
    fakes = fake_hosts(tmp_path / "hosts", case.nodes, multinode=case.nodes > 1)
    before = [_snapshot(f) for f in fakes]
    if case.fail_phase:
        _fail_at(monkeypatch, case)
    outcomes, events = _deploy(fakes, patchset, DeployOptions(reconnect_s=5, no_rollback=case.no_rollback))
    return fakes, before, outcomes, events


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_engine_emits_the_expected_events_and_ends_every_node_as_expected(tmp_path, monkeypatch, patchset, case):
    fakes, before, outcomes, events = _run(tmp_path, monkeypatch, patchset, case)

    assert _milestones(events) == case.events
    assert _milestones(events) != _swapped(case.events)  # control: a wrong expected order is rejected
    assert outcomes == [case.outcome] * case.nodes
    stores = [f.session().store for f in fakes]
    currents = [s.history()["current"] for s in stores]
    journals = [s.facts([])["journal"] for s in stores]
    if case.outcome is Outcome.DEPLOYED:
        assert len(set(currents)) == 1 and currents[0] is not None and journals == [None] * case.nodes
        assert all(f.units[f.host.unit].active == "active" for f in fakes)
    elif case.outcome is Outcome.ROLLBACK_FAILED:  # --no-rollback: left in place, the journal says so
        assert [j["step"] for j in journals] == ["failed (--no-rollback)"]
        assert [_snapshot(f) for f in fakes] != before
    else:  # rolled back: every node byte for byte as before, nothing current, no journal
        assert [_snapshot(f) for f in fakes] == before
        assert currents == [None] * case.nodes and journals == [None] * case.nodes


def test_an_injected_phase_name_that_does_not_exist_is_refused(monkeypatch):
    """Control: a failure point misspelt would otherwise run a clean deploy and pass as one."""
    with pytest.raises(AssertionError):
        _fail_at(monkeypatch, Case("typo", 1, "perf-gate"))


def test_every_phase_start_names_its_host_and_the_live_view_reads_it_by_type(tmp_path, patchset):
    fakes = fake_hosts(tmp_path / "hosts", 2, multinode=True)
    _, events = _deploy(fakes, patchset, DeployOptions(reconnect_s=5))
    started = [(e.host, e.phase) for e in events if isinstance(e, PhaseStarted)]
    assert ("fh1", "health gate") in started and ("fh1", "soak") in started
    assert not any(h == "fh2" and p in ("health gate", "soak") for h, p in started)  # rank 1 is not gated
    assert all(e.text == f"phase: {e.phase}" for e in events if isinstance(e, PhaseStarted))


NODE_ORDERS = [
    (Nodes.ALL, 1, [0]), (Nodes.ALL, 3, [0, 1, 2]),
    (Nodes.RANK0_LAST, 1, [0]), (Nodes.RANK0_LAST, 2, [1, 0]), (Nodes.RANK0_LAST, 3, [1, 2, 0]),
    (Nodes.DESCENDING, 1, [0]), (Nodes.DESCENDING, 3, [2, 1, 0]),
    (Nodes.NODE0, 1, [0]), (Nodes.NODE0, 3, [0]),
    (Nodes.OTHERS, 1, []), (Nodes.OTHERS, 3, [1, 2]),
]


@pytest.mark.parametrize("policy, n, order", NODE_ORDERS)
def test_a_node_policy_gives_its_nodes_in_order(policy, n, order):
    assert policy.order(n) == order
    if len(order) > 1:  # control: the reverse order is a different answer
        assert policy.order(n) != order[::-1]


def test_the_deploy_phase_list_is_the_documented_order():
    assert [(p.name, p.nodes) for p in engine.DEPLOY] == [
        ("backup and install", Nodes.ALL), ("drain", Nodes.NODE0), ("restart", Nodes.RANK0_LAST),
        ("wait and gate", Nodes.NODE0), ("node check", Nodes.OTHERS), ("register", Nodes.NODE0),
        ("perf gate", Nodes.NODE0), ("soak", Nodes.NODE0), ("node check after soak", Nodes.OTHERS),
        ("commit", Nodes.ALL)]
    assert [p.name for p in engine.DEPLOY if p.changes] == ["backup and install"]
    assert engine.ROLLBACK_ORDER is Nodes.DESCENDING


def test_a_server_is_rolled_back_highest_rank_first_and_a_node_that_fails_does_not_stop_the_others(tmp_path,
                                                                                                      patchset):
    fakes = fake_hosts(tmp_path / "hosts", 3, multinode=True)
    by_name = {f.host.name: f for f in fakes}
    target = Target("server1", tuple(f.host for f in fakes))
    assert _deploy(fakes, patchset, DeployOptions(reconnect_s=5))[0] == [Outcome.DEPLOYED] * 3
    fakes[1].fail_next["agent restore"] = "disk full"
    events: list[Event] = []
    rows = rollback_server(target, None, DeployOptions(reconnect_s=5), connect=lambda h: by_name[h.name].session(),
                           report=events.append)
    assert _milestones(events) == ("fh3 restore", "fh2 restore", "fh1 restore")
    assert [r.outcome for r in rows] == [Outcome.ROLLED_BACK, Outcome.ROLLBACK_FAILED, Outcome.ROLLED_BACK]


PLAIN_LINES = [
    (PhaseStarted("fh1", "drain"), "[fh1] phase: drain"),
    (StepDone("fh1", "restart"), "[fh1] restart"),
    (StepDone("fh1", "drain", "2 request(s) in flight"), "[fh1] drain: 2 request(s) in flight"),
    (Failed("server1", "soak", "boom", "rolling back every node"),
     "[server1] FAILED at soak: boom; rolling back every node"),
    (Note("fh2", "connection lost (x); reconnecting"), "[fh2] connection lost (x); reconnecting"),
]


@pytest.mark.parametrize("event, line", PLAIN_LINES)
def test_the_plain_log_prints_each_typed_event_as_the_line_it_printed_before(capsys, event, line):
    from ddtree_ops.cli.liveview import PlainProgress

    PlainProgress().event(event)
    out = capsys.readouterr().err
    assert out == line + "\n"
    assert out != event.text + "\n"  # control: the same text without its host is a different line


def test_a_step_read_back_from_json_keeps_its_fields_and_a_bad_time_drops_it():
    rec = StepDone("fh1", "commit", "release r1", 5.0).record()
    assert StepDone.from_record("fh1", rec) == StepDone("fh1", "commit", "release r1", 5.0)
    for bad_t in ("soon", None, float("nan"), True):
        assert StepDone.from_record("fh1", {**rec, "t": bad_t}) is None
