"""The runbook on fake hosts (fast tier): order of steps, automatic rollback from every step,
journal repair, lock, --no-rollback, Ctrl-C, the rollback command and multi-node ordering.
The release store is the real remote agent (in-process, rooted in a temp folder); units and the
server are in memory. See ddtree_ops/testing/fake_host.py."""

from __future__ import annotations

import dataclasses

import pytest

from ddtree_ops.errors import (
    CorruptJournal,
    DdtreeOpsError,
    DeployFailed,
    InputError,
    Interrupted,
    LockHeldError,
    PreflightError,
    RollbackFailed,
)
from ddtree_ops.fleet.multinode import deploy_server, rollback_server
from ddtree_ops.fleet.rollout import Target
from ddtree_ops.host.gpus import GpuApp
from ddtree_ops.host.journal import journal_problem
from ddtree_ops.runbook.deploy import deploy_host
from ddtree_ops.runbook.events import StepDone, quiet
from ddtree_ops.runbook.phases import DeployOptions
from ddtree_ops.runbook.results import Outcome
from ddtree_ops.runbook.rollback import rollback_host
from ddtree_ops.testing.fake_host import (
    DFLASH_UNIT,
    FAKE_CRASH,
    FAKE_HANG,
    UPSTREAM_BYTES,
    UPSTREAM_REL,
    FakeLink,
    fake_hosts,
)
from fast_kit import PROBE_REL, kill_deploy_at_call

OPTS = DeployOptions(reconnect_s=5)
UNIT_DIR = "/etc/systemd/system"


def site(fake, rel: str) -> str:
    return f"{fake.host.site_packages}/{rel}"


def snapshot(fake) -> dict[str, bytes]:
    """What a rollback must restore byte for byte: site-packages and the unit folder."""
    return fake.tree(fake.host.site_packages, UNIT_DIR)


def journal_steps(result) -> list[str]:
    return [s["step"] for s in result.steps]


def current(fake) -> str | None:
    return fake.session().store.history()["current"]


def test_deploy_runs_the_runbook_in_order_and_leaves_the_host_on_the_release(fake, patchset):
    before = snapshot(fake)
    r = deploy_host(fake.session(), patchset, OPTS)

    assert r.outcome == Outcome.DEPLOYED and r.exit_code == 0
    assert journal_steps(r) == ["preflight", "backup", "install", "launch check", "stop conflicts", "restart",
                                "wait for weights", "starting", "weights", "cuda graphs", "warm-up", "serving",
                                "health gate", "soak", "commit", "committed"]
    ev = fake.events
    order = ["agent lock", "agent compile", "agent verify_unit", "agent backup", "agent install",
             "systemctl daemon-reload", "agent launch_check", f"systemctl stop {DFLASH_UNIT}",
             f"systemctl disable {DFLASH_UNIT}",
             f"systemctl enable {fake.host.unit}", f"systemctl restart {fake.host.unit}", "http GET /health",
             "http POST /generate", "agent set_current", "agent unlock"]
    positions = [ev.index(e) for e in order]
    assert positions == sorted(positions), ev
    assert ev[:ev.index("agent backup")].count("systemctl states") == 1  # read once, kept as "before"
    assert fake.read(site(fake, PROBE_REL)) == b"PROBE = 1\n"
    assert fake.read(site(fake, UPSTREAM_REL)) == UPSTREAM_BYTES + b"# patched\n"
    assert b"--speculative-ddtree-budget 16" in fake.read(f"{UNIT_DIR}/{fake.host.unit}")
    assert fake.units[DFLASH_UNIT].active == "inactive" and fake.units[DFLASH_UNIT].enabled == "disabled"
    assert fake.units[fake.host.unit].active == "active" and fake.units[fake.host.unit].enabled == "enabled"
    hist = fake.session().store.history()
    assert hist["current"] == r.release and hist["releases"][-1]["outcome"] == "deployed"
    facts = fake.session().store.facts([])
    assert facts["journal"] is None and facts["lock"] is None
    assert snapshot(fake) != before


def test_a_second_deploy_of_the_same_files_changes_nothing(fake, patchset):
    first = deploy_host(fake.session(), patchset, OPTS)
    fake.events.clear()
    again = deploy_host(fake.session(), patchset, OPTS)
    assert again.outcome == Outcome.UNCHANGED and again.release == first.release
    assert not [e for e in fake.events if e.startswith(("agent install", "agent backup", "systemctl restart"))]


@pytest.mark.parametrize("fault, failed_step", [
    ({"fail": "agent backup"}, "backup"),
    ({"fail": "agent install"}, "install"),
    ({"fail": "systemctl daemon-reload"}, "daemon-reload"),
    ({"fail": f"systemctl stop {DFLASH_UNIT}"}, f"stop {DFLASH_UNIT}"),
    ({"marker": FAKE_CRASH}, "wait for weights"),
    ({"marker": FAKE_HANG, "deadline_s": 0.2}, "wait for weights"),
    ({"accept_length": 0.5}, "health gate"),
    ({"generate_fails_after": 2}, "soak"),  # passes the gate (1 generation), fails the soak's second
])
def test_a_failure_at_any_step_rolls_the_host_back_byte_for_byte(fake, versioned_patchset, fault, failed_step):
    before = snapshot(fake)
    if "fail" in fault:
        fake.fail_next[fault["fail"]] = "injected fault"
    if "accept_length" in fault:
        fake.host = dataclasses.replace(fake.host,
                                        health=dataclasses.replace(fake.host.health, min_accept_length=2.0))
        fake.accept_lengths[fake.host.unit] = fault["accept_length"]
    if "generate_fails_after" in fault:
        fake.generate_fails_after[fake.host.unit] = fault["generate_fails_after"]
    ps = versioned_patchset(marker=b"\n# " + fault.get("marker", b"") + b"\n")
    opts = DeployOptions(reconnect_s=5, deadline_s=fault.get("deadline_s"))

    with pytest.raises(DeployFailed) as ei:
        deploy_host(fake.session(), ps, opts)

    r = ei.value.result
    assert r.outcome == Outcome.ROLLED_BACK and r.exit_code == 3
    assert r.failed_step.startswith(failed_step) or failed_step in r.failed_step, r.failed_step
    assert snapshot(fake) == before
    assert fake.units[DFLASH_UNIT].active == "active" and fake.units[DFLASH_UNIT].enabled == "enabled"
    assert fake.units[fake.host.unit].active != "active"
    assert current(fake) is None and fake.session().store.facts([])["journal"] is None
    assert fake.session().store.history()["releases"][-1]["outcome"].startswith("rolled back")


def test_a_failed_rollback_keeps_the_journal_and_the_next_deploy_repairs_it_first(fake, versioned_patchset, patchset):
    before = snapshot(fake)
    fake.fail_next["agent restore"] = "disk gone"
    with pytest.raises(RollbackFailed) as ei:
        deploy_host(fake.session(), versioned_patchset(marker=b"\n# " + FAKE_CRASH + b"\n"), OPTS)
    assert ei.value.exit_code == 4 and "a person must look" in str(ei.value)
    journal = fake.session().store.facts([])["journal"]
    assert journal and journal["step"] == "wait for weights"

    r = deploy_host(fake.session(), patchset, OPTS)
    assert r.repaired == journal["release"] and r.outcome == Outcome.DEPLOYED
    assert journal_steps(r)[:3] == ["repair", "rollback", "rollback: waiting"]
    rolled = rollback_host(fake.session(), None, OPTS)
    assert rolled.outcome == Outcome.ROLLED_BACK and snapshot(fake) == before


def test_a_lost_connection_during_the_rollback_is_reconnected_and_the_rollback_finishes(fake, versioned_patchset):
    before = snapshot(fake)
    fake.drop_connection_at.add("agent remove_partial")
    with pytest.raises(DeployFailed):
        deploy_host(fake.session(), versioned_patchset(marker=b"\n# " + FAKE_CRASH + b"\n"), OPTS)
    assert fake.reconnects == 1 and snapshot(fake) == before


def test_a_held_lock_refuses_the_deploy_and_changes_nothing(fake, patchset):
    before = snapshot(fake)
    fake.session().store.acquire_lock("someone else's deploy")
    with pytest.raises(LockHeldError) as ei:
        deploy_host(fake.session(), patchset, OPTS)
    assert ei.value.exit_code == 5 and "someone else's deploy" in str(ei.value)
    assert snapshot(fake) == before


def test_a_preflight_refusal_changes_nothing(fake, versioned_patchset):
    before = snapshot(fake)
    fake.write(site(fake, UPSTREAM_REL), b"# drifted\n")
    with pytest.raises(PreflightError) as ei:
        deploy_host(fake.session(), versioned_patchset(), OPTS)
    assert "drift" in str(ei.value) and ei.value.exit_code == 2
    assert not [e for e in fake.events if e.startswith(("agent backup", "agent install", "systemctl"))
                and e != "systemctl states"]
    assert snapshot(fake) == {**before, site(fake, UPSTREAM_REL): b"# drifted\n"}


def test_no_rollback_leaves_the_failed_release_in_place(fake, versioned_patchset):
    with pytest.raises(RollbackFailed) as ei:
        deploy_host(fake.session(), versioned_patchset(marker=b"\n# " + FAKE_CRASH + b"\n"),
                    DeployOptions(no_rollback=True))
    assert "--no-rollback" in str(ei.value)
    assert FAKE_CRASH in fake.read(site(fake, PROBE_REL))
    assert fake.session().store.facts([])["journal"]["step"] == "failed (--no-rollback)"


def test_ctrl_c_in_the_middle_rolls_back(fake, patchset):
    before = snapshot(fake)

    def report(event):
        if isinstance(event, StepDone) and event.step == "restart":
            raise KeyboardInterrupt

    with pytest.raises(Interrupted) as ei:
        deploy_host(fake.session(), patchset, OPTS, report)
    assert ei.value.result.outcome == Outcome.INTERRUPTED and ei.value.exit_code == 3
    assert snapshot(fake) == before and fake.units[DFLASH_UNIT].active == "active"


def test_rollback_steps_back_one_release_then_to_the_original_files(fake, versioned_patchset):
    before = snapshot(fake)
    r1 = deploy_host(fake.session(), versioned_patchset("1.0.0"), OPTS)
    after_r1 = snapshot(fake)
    r2 = deploy_host(fake.session(), versioned_patchset("2.0.0"), OPTS)
    assert current(fake) == r2.release

    back = rollback_host(fake.session(), None, OPTS)
    assert back.release == r1.release and snapshot(fake) == after_r1 and current(fake) == r1.release
    with pytest.raises(InputError, match="already current"):
        rollback_host(fake.session(), r1.release, OPTS)
    with pytest.raises(InputError, match="not an ancestor"):
        rollback_host(fake.session(), "20990101T000000Z-nope", OPTS)

    orig = rollback_host(fake.session(), "original", OPTS)
    assert orig.release is None and snapshot(fake) == before and current(fake) is None
    assert fake.units[DFLASH_UNIT].active == "active" and fake.units[DFLASH_UNIT].enabled == "enabled"
    with pytest.raises(InputError, match="no deployed release"):
        rollback_host(fake.session(), None, OPTS)


def test_a_corrupted_backup_is_refused_before_anything_is_restored(fake, versioned_patchset):
    deploy_host(fake.session(), versioned_patchset("1.0.0"), OPTS)
    r2 = deploy_host(fake.session(), versioned_patchset("2.0.0"), OPTS)
    stored = sorted(fake.path(f"{fake.host.state_dir}/releases/{r2.release}/backup/files").iterdir())[0]
    stored.write_bytes(b"tampered")
    now = snapshot(fake)
    with pytest.raises(RollbackFailed, match="corrupted"):
        rollback_host(fake.session(), None, OPTS)
    assert snapshot(fake) == now and current(fake) == r2.release


def _connect(nodes):
    by_name = {n.host.name: n for n in nodes}
    return lambda host: by_name[host.name].session()


def test_a_multinode_server_restarts_rank_0_last_and_gates_on_node_0_only(fake_server, patchset):
    n0, n1 = fake_server
    order: list[str] = []
    for n in fake_server:
        n.events = _Recorder(order, n.host.name)
    target = Target("server1", (n0.host, n1.host))
    rows = deploy_server(target, patchset, OPTS, connect=_connect(fake_server), report=quiet)

    assert [r.outcome for r in rows] == [Outcome.DEPLOYED, Outcome.DEPLOYED]
    assert len({r.release for r in rows}) == 1
    restarts = [e for e in order if "systemctl restart sglang-k26-ddtree" in e]
    assert restarts == ["fh2: systemctl restart sglang-k26-ddtree.service",
                        "fh1: systemctl restart sglang-k26-ddtree.service"]
    assert any(e.startswith("fh1: http GET /health") for e in order)
    assert not any(e.startswith("fh2: http") for e in order)
    assert b"--node-rank 1" in n1.read(f"{UNIT_DIR}/{n1.host.unit}")


def test_a_multinode_failure_rolls_every_node_back_rank_0_last(fake_server, versioned_patchset):
    n0, n1 = fake_server
    before = [snapshot(n) for n in fake_server]
    order: list[str] = []
    for n in fake_server:
        n.events = _Recorder(order, n.host.name)
    target = Target("server1", (n0.host, n1.host))
    rows = deploy_server(target, versioned_patchset(marker=b"\n# " + FAKE_CRASH + b"\n"), OPTS,
                         connect=_connect(fake_server), report=quiet)

    assert [r.outcome for r in rows] == [Outcome.ROLLED_BACK, Outcome.ROLLED_BACK]
    assert [snapshot(n) for n in fake_server] == before
    restores = [e.split(":")[0] for e in order if e.endswith("agent restore")]
    assert restores == ["fh2", "fh1"]
    back = rollback_server(target, None, OPTS, connect=_connect(fake_server), report=quiet)
    assert [r.outcome for r in back] == [Outcome.REFUSED, Outcome.REFUSED]  # nothing left to roll back


class _Recorder(list):
    """A fake host's event list that also appends 'host: event' to one shared, ordered list."""

    def __init__(self, shared: list[str], host: str):
        super().__init__()
        self.shared, self.host = shared, host

    def append(self, item: str) -> None:
        super().append(item)
        self.shared.append(f"{self.host}: {item}")


# ---------------------------------------------------------------------------------------------
# one transaction scope: a fault at ANY remote call


def _calls_of_a_clean_deploy(tmp_path, ps) -> int:
    probe = fake_hosts(tmp_path / "count")[0]
    deploy_host(probe.session(), ps, OPTS)
    return probe.calls


def _units(fake) -> dict[str, tuple[str, str]]:
    return {n: (u.active, u.enabled) for n, u in fake.units.items()}


def _restarts(fake) -> int:
    """How many times the host started the deployed unit (a restart the connection lost before it
    reached the host is not one)."""
    return fake.started.count(fake.host.unit)


def _remote_call(fake, k: int) -> str:
    """The name of the k-th remote call the host saw (`calls` counts agent requests only)."""
    return [e for e in fake.events if not e.startswith(("http ", "reconnect"))][k - 1]


def _reconnects_after(fake, k: int) -> int:
    """A connection lost at the very last call (the lock given back) needs no reconnect."""
    return 0 if _remote_call(fake, k) == "agent unlock" else 1


@pytest.mark.parametrize("kind", ["drop", "lost-answer"])
def test_a_connection_lost_at_any_remote_call_of_a_deploy_is_resumed_and_deploys_with_one_restart(
        tmp_path, patchset, kind):
    """Cut before the call reaches the host ("drop") or after the host did it, its answer lost
    ("lost-answer"): before the first change the step is tried again, after it the phase resumes
    from where the host is; every cut ends deployed, and the server is started once (a restart
    whose answer was lost is seen in the unit's new invocation and not sent again)."""
    n = _calls_of_a_clean_deploy(tmp_path, patchset)
    assert n > 20
    for k in range(1, n + 1):
        fake = fake_hosts(tmp_path / f"{kind}{k}")[0]
        fake.fault_at_call = (kind, k)
        r = deploy_host(fake.session(), patchset, OPTS)
        fake.fault_at_call = None
        where = f"{kind} at call {k}"
        assert r.outcome is Outcome.DEPLOYED and current(fake) == r.release, where
        assert fake.session().store.facts([])["journal"] is None, where
        assert fake.units[fake.host.unit].active == "active" and _restarts(fake) == 1, where
        assert fake.reconnects == _reconnects_after(fake, k), where


def _restart_call(tmp_path, ps) -> int:
    """The index of the `systemctl restart` among a clean deploy's remote calls."""
    probe = fake_hosts(tmp_path / "restart-index")[0]
    deploy_host(probe.session(), ps, OPTS)
    return [e for e in probe.events if not e.startswith("http ")].index(f"systemctl restart {probe.host.unit}") + 1


def test_a_restart_whose_answer_was_lost_is_not_sent_again_and_its_server_is_the_release(tmp_path, patchset):
    k = _restart_call(tmp_path, patchset)
    fake = fake_hosts(tmp_path / "lost")[0]
    fake.fault_at_call = ("lost-answer", k)
    r = deploy_host(fake.session(), patchset, OPTS)
    assert r.outcome is Outcome.DEPLOYED and _restarts(fake) == 1
    said = [s["detail"] for s in r.steps if s["step"] == "restart"]
    assert any("sent before the connection was lost" in d and "not restarted again" in d for d in said), said
    assert [s["step"] for s in r.steps].count("reconnected") == 1


def test_a_restart_the_connection_lost_before_it_reached_the_host_is_sent_after_the_reconnect(tmp_path, patchset):
    k = _restart_call(tmp_path, patchset)
    fake = fake_hosts(tmp_path / "drop")[0]
    fake.fault_at_call = ("drop", k)
    r = deploy_host(fake.session(), patchset, OPTS)
    assert r.outcome is Outcome.DEPLOYED and _restarts(fake) == 1
    assert not any("sent before the connection was lost" in s["detail"] for s in r.steps)


def test_a_server_systemd_restarted_while_the_connection_was_lost_fails_the_restart_and_rolls_back(
        tmp_path, patchset, monkeypatch):
    """It crashed and Restart= brought it back: its PID now is not the one that was started, so the
    resumed phase cannot tell a healthy server from a crashing one. Rolled back, exit 3."""
    k = _restart_call(tmp_path, patchset)
    fake = fake_hosts(tmp_path / "respawned")[0]
    before = snapshot(fake)
    fake.fault_at_call = ("lost-answer", k)
    real = FakeLink.reconnect

    def respawned_meanwhile(self):
        fake.units[fake.host.unit].n_restarts += 1
        real(self)

    monkeypatch.setattr(FakeLink, "reconnect", respawned_meanwhile)
    with pytest.raises(DeployFailed) as ei:
        deploy_host(fake.session(), patchset, OPTS)
    assert ei.value.exit_code == 3 and ei.value.result.failed_step == "restart"
    assert "started again by systemd (Restart=, 1 time(s))" in ei.value.result.message
    assert snapshot(fake) == before and fake.units[DFLASH_UNIT].active == "active"


@pytest.mark.parametrize("kind", ["fail"])
def test_a_fault_at_any_remote_call_of_a_deploy_ends_on_one_release_or_exit_4(tmp_path, patchset, kind):
    n = _calls_of_a_clean_deploy(tmp_path, patchset)
    assert n > 20  # the deploy really makes that many remote calls
    seen = set()
    for k in range(1, n + 1):
        fake = fake_hosts(tmp_path / f"{kind}{k}")[0]
        before, units_before = snapshot(fake), _units(fake)
        fake.fault_at_call = (kind, k)
        try:
            r = deploy_host(fake.session(), patchset, OPTS)
        except DdtreeOpsError as e:
            code, result = e.exit_code, getattr(e, "result", None)
        else:
            code, result = 0, r
        fake.fault_at_call = None
        journal = fake.session().store.facts([])["journal"]
        where = f"fault ({kind}) at call {k} ({fake.events[k - 1]}): exit {code}"
        if code == 0:  # the fault hit housekeeping after the commit: committed, and it says so
            assert current(fake) == result.release and fake.units[fake.host.unit].active == "active", where
            assert journal is None, where
        elif code == 4:
            assert journal and journal.get("step"), where
        else:
            assert snapshot(fake) == before and _units(fake) == units_before, where
            assert current(fake) is None and journal is None, where
            assert code in (1, 2, 3, 5), where
        seen.add(code)
    assert 3 in seen and 0 in seen  # faults after the first change were rolled back; housekeeping kept


@pytest.mark.parametrize("node, kind", [(0, "drop"), (1, "drop"), (1, "lost-answer")])
def test_a_connection_lost_at_any_remote_call_of_a_multinode_deploy_is_resumed_on_that_node(tmp_path, patchset, node,
                                                                                            kind):
    """The same for a server of two nodes: the node that lost its connection reconnects and
    resumes its phase; the server ends deployed, each node started once."""
    counting = fake_hosts(tmp_path / "count", 2, multinode=True)
    deploy_server(Target("server1", tuple(n.host for n in counting)), patchset, OPTS, connect=_connect(counting),
                  report=quiet)
    for k in range(1, counting[node].calls + 1):
        nodes = fake_hosts(tmp_path / f"n{node}{kind}-{k}", 2, multinode=True)
        nodes[node].fault_at_call = (kind, k)
        rows = deploy_server(Target("server1", tuple(n.host for n in nodes)), patchset, OPTS,
                             connect=_connect(nodes), report=quiet)
        nodes[node].fault_at_call = None
        where = f"{kind} on node {node} at call {k}: {[(r.outcome, r.message) for r in rows]}"
        assert [r.outcome for r in rows] == [Outcome.DEPLOYED] * 2, where
        assert {current(n) for n in nodes} == {rows[0].release}, where
        assert [_restarts(n) for n in nodes] == [1, 1], where
        assert nodes[node].reconnects == _reconnects_after(nodes[node], k), where


@pytest.mark.parametrize("node, kind", [(0, "fail"), (1, "fail")])
def test_a_fault_at_any_remote_call_of_a_multinode_deploy_rolls_every_node_back_or_exits_4(tmp_path, patchset, node,
                                                                                            kind):
    counting = fake_hosts(tmp_path / "count", 2, multinode=True)
    target = Target("server1", tuple(n.host for n in counting))
    deploy_server(target, patchset, OPTS, connect=_connect(counting), report=quiet)
    n_calls = counting[node].calls
    codes = set()
    for k in range(1, n_calls + 1):
        nodes = fake_hosts(tmp_path / f"n{node}{kind}-{k}", 2, multinode=True)
        before = [snapshot(n) for n in nodes]
        nodes[node].fault_at_call = (kind, k)
        rows = deploy_server(Target("server1", tuple(n.host for n in nodes)), patchset, OPTS,
                             connect=_connect(nodes), report=quiet)
        nodes[node].fault_at_call = None
        where = f"fault on node {node} at call {k} ({nodes[node].events[k - 1]}): {[r.outcome for r in rows]}"
        assert len({r.outcome for r in rows}) == 1, where  # the nodes end together
        code = rows[0].exit_code
        codes.add(code)
        if code == 0:
            assert len({current(n) for n in nodes}) == 1 and current(nodes[0]) == rows[0].release, where
        elif code == 4:
            assert any(n.session().store.facts([])["journal"] for n in nodes), where
        else:
            assert [snapshot(n) for n in nodes] == before, where
            assert all(current(n) is None and n.session().store.facts([])["journal"] is None for n in nodes), where
    assert 3 in codes


def _deployed(where, ps):
    fake = fake_hosts(where)[0]
    original = snapshot(fake)
    release = deploy_host(fake.session(), ps, OPTS).release
    return fake, original, release


@pytest.mark.parametrize("kind", ["fail", "drop"])
def test_a_fault_at_any_remote_call_of_a_rollback_ends_on_a_release_or_exits_4_and_the_next_run_finishes(
        tmp_path, patchset, kind):
    fake, _, _ = _deployed(tmp_path / "count", patchset)
    start = fake.calls
    rollback_host(fake.session(), None, OPTS)
    n_calls = fake.calls - start
    codes = set()
    for k in range(1, n_calls + 1):
        fake, original, release = _deployed(tmp_path / f"rb{kind}{k}", patchset)
        on_release = snapshot(fake)
        first = len(fake.events)
        fake.fault_at_call, fake.calls = (kind, k), 0
        try:
            rollback_host(fake.session(), None, OPTS)
            code = 0
        except DdtreeOpsError as e:
            code = e.exit_code
        fake.fault_at_call = None
        where = f"fault ({kind}) at rollback call {k} ({fake.events[first + k - 1]}): exit {code}"
        codes.add(code)
        journal = fake.session().store.facts([])["journal"]
        if code == 0:
            assert snapshot(fake) == original and current(fake) is None and journal is None, where
            assert fake.units[DFLASH_UNIT].active == "active", where
        elif code == 4:  # the journal names the step, and a plain rollback finishes the job
            assert journal and journal["kind"] == "rollback" and journal["step"] in ("restore", "services"), where
            finished = rollback_host(fake.session(), None, OPTS)
            assert finished.repaired == release, where
            assert snapshot(fake) == original and current(fake) is None, where
            assert fake.units[DFLASH_UNIT].active == "active", where
        else:  # refused or unreachable before any change: still on the release
            assert code in (1, 5), where
            assert snapshot(fake) == on_release and current(fake) == release and journal is None, where
    # A dropped connection is reconnected and the rollback finished (0); a failed step stops it (4).
    assert 0 in codes and (4 in codes) == (kind == "fail")


@pytest.mark.parametrize("then", ["rollback", "deploy"])
def test_a_controller_killed_at_any_call_frees_the_lock_and_a_plain_run_repairs(tmp_path, patchset,
                                                                                 versioned_patchset, then):
    """SIGKILL of the controller at every remote call of a deploy (no handler runs, its agent
    process and lock die with its connection); then a plain `rollback` or `deploy`, no flags."""
    prior = versioned_patchset(version="0.9.0")
    counting, _, _ = _deployed(tmp_path / "count", prior)
    start = counting.calls
    deploy_host(counting.session(), patchset, OPTS)
    n_calls = counting.calls - start
    for k in range(1, n_calls + 1):
        fake, _, before_release = _deployed(tmp_path / f"k{then}{k}", prior)
        on_prior = snapshot(fake)
        where = kill_deploy_at_call(fake, k, deploy_host, patchset, OPTS)
        committed = current(fake) != before_release
        if then == "rollback":
            r = rollback_host(fake.session(), None, OPTS)
            if r.repaired or committed:  # back to the release before the killed deploy, and no further
                assert current(fake) == before_release and snapshot(fake) == on_prior, where
            else:  # killed before its first change: an ordinary rollback of the prior release
                assert current(fake) is None, where
        else:
            r = deploy_host(fake.session(), patchset, OPTS)
            # killed after its commit: already on the release, so the plain deploy has nothing to do
            assert r.outcome == (Outcome.UNCHANGED if committed and not r.repaired else Outcome.DEPLOYED), where
            assert current(fake) == r.release, where
        assert fake.units[fake.host.unit].active == "active" or fake.units[DFLASH_UNIT].active == "active", where
        assert fake.session().store.facts([])["lock"] is None, where  # nobody holds it now


@pytest.mark.parametrize("still_held", [True, False])
def test_a_reconnect_takes_the_lock_again_and_stops_if_another_run_took_it(fake, versioned_patchset, still_held):
    """The lock lives in the agent process, which a lost connection ends: the rollback after a
    reconnect takes it again; if another run took it meanwhile (even one that has finished since:
    it may have repaired or deployed), exit 4, touching nothing."""
    other = fake.session()
    fake.drop_connection_at.add("agent remove_partial")
    real_reconnect = type(other).reconnect

    def reconnect_after_someone_else_locked(self):
        lock = other.store.acquire_lock("a second operator")
        if not still_held:
            other.store.release_lock(lock)
        real_reconnect(self)

    type(other).reconnect = reconnect_after_someone_else_locked
    try:
        with pytest.raises(RollbackFailed) as ei:
            deploy_host(fake.session(), versioned_patchset(marker=b"\n# " + FAKE_CRASH + b"\n"), OPTS)
    finally:
        type(other).reconnect = real_reconnect
    assert "taken by another run" in str(ei.value) and ei.value.exit_code == 4
    assert fake.session().store.facts([])["journal"]["step"] == "wait for weights"


@pytest.mark.parametrize("content", [b'{"release": "2026', b"\xff\xfe", b"[1, 2]", b'{"release": "../x", "step": "s"}',
                                     b'{"release": "r1", "step": "install", "active_before": ["a"]}',
                                     b'{"release": "r1", "step": "x", "kind": "mystery"}'])
def test_a_corrupt_or_foreign_journal_stops_with_exit_4_and_the_way_out_and_changes_nothing(fake, patchset, content):
    setup = fake.session().store
    setup.release_lock(setup.acquire_lock("set up the state dir"))
    fake.write(f"{fake.host.state_dir}/journal.json", content, 0o600)
    before = snapshot(fake)
    for run in (lambda: deploy_host(fake.session(), patchset, OPTS), lambda: rollback_host(fake.session(), None, OPTS)):
        with pytest.raises(CorruptJournal) as ei:
            run()
        msg = str(ei.value)
        assert ei.value.exit_code == 4 and "corrupt journal" in msg and "journal.json.corrupt" in msg
        assert snapshot(fake) == before


def test_journal_problem_accepts_what_the_tool_writes_and_names_what_it_did_not():
    ok = {"release": "20261130T000000Z-abcdef", "step": "install", "previous": None,
          "active_before": {"a.service": "active"}, "enabled_before": {"a.service": "enabled"}}
    assert journal_problem(None) is None and journal_problem(ok) is None
    assert journal_problem({**ok, "kind": "rollback", "undo": ["r2", "r1"], "to": None}) is None
    assert "undo" in journal_problem({**ok, "kind": "rollback", "undo": []})
    assert "previous" in journal_problem({**ok, "previous": 7})
    assert "step" in journal_problem({k: v for k, v in ok.items() if k != "step"})



# ---------------------------------------------------------------------------------------------
# the launch line is checked before anything stops


@pytest.mark.parametrize("problem", ["parser", "port"])
def test_a_launch_line_the_server_would_refuse_fails_before_anything_stops(fake, patchset, problem):
    before, dflash_pid = snapshot(fake), fake.units[DFLASH_UNIT].pid
    if problem == "parser":
        fake.launch_refusal = "launch_server.py: error: unrecognized arguments: --bogus-flag"
    else:
        fake.port_holders[fake.host.port] = [{"pid": 4242, "cmd": "python3 -m http.server", "ancestors": [1]}]
    with pytest.raises(DeployFailed) as ei:
        deploy_host(fake.session(), patchset, OPTS)
    res = ei.value.result
    assert ei.value.exit_code == 3 and res.failed_step == "launch check"
    assert ("--bogus-flag" if problem == "parser" else "pid 4242 (python3 -m http.server)") in res.message
    assert not any(e.startswith(f"systemctl stop {DFLASH_UNIT}") for e in fake.events)  # never stopped
    assert fake.units[DFLASH_UNIT].pid == dflash_pid and fake.units[DFLASH_UNIT].active == "active"
    assert snapshot(fake) == before and current(fake) is None


def test_a_port_held_by_the_unit_being_replaced_is_fine(fake, patchset):
    pid = fake.units[DFLASH_UNIT].pid
    fake.port_holders[fake.host.port] = [{"pid": pid + 7, "cmd": "python3 worker", "ancestors": [pid, 1]}]
    assert deploy_host(fake.session(), patchset, OPTS).outcome == Outcome.DEPLOYED


# ---------------------------------------------------------------------------------------------
# draining before a stop, without a router


def test_in_flight_requests_finish_before_the_serving_unit_stops(fake, patchset):
    fake.in_flight = {DFLASH_UNIT: 3}
    r = deploy_host(fake.session(), patchset, OPTS)
    drains = [s["detail"] for s in r.steps if s["step"] == "drain"]
    assert drains and drains[0].startswith(f"{DFLASH_UNIT}: 3 request(s) in flight") and "cut" not in drains[0]
    ev = fake.events
    last_look = max(i for i, e in enumerate(ev) if e == "http GET /v1/loads")
    assert last_look < ev.index(f"systemctl stop {DFLASH_UNIT}") and fake.in_flight[DFLASH_UNIT] == 0


def test_a_drain_that_does_not_end_is_bounded_and_says_how_many_were_cut(tmp_path, patchset):
    fake = fake_hosts(tmp_path / "h", health={"drain_timeout_s": 0})[0]
    fake.in_flight, fake.stuck_requests = {DFLASH_UNIT: 2}, True
    r = deploy_host(fake.session(), patchset, OPTS)
    assert r.outcome == Outcome.DEPLOYED
    [detail] = [s["detail"] for s in r.steps if s["step"] == "drain"]
    assert "2 still in flight, cut by the stop" in detail


def test_a_rollback_drains_the_release_it_stops(fake, patchset):
    deploy_host(fake.session(), patchset, OPTS)
    fake.in_flight = {fake.host.unit: 1}
    r = rollback_host(fake.session(), None, OPTS)
    assert any(s["step"] == "drain" and s["detail"].startswith(fake.host.unit) for s in r.steps), r.steps
    assert fake.in_flight[fake.host.unit] == 0


# ---------------------------------------------------------------------------------------------
# GPUs free before start


def _gpu(fake, pid, mib, cmd="python3 -m sglang.launch_server", ancestors=(1,)):
    fake.gpu_apps = (fake.gpu_apps or []) + [GpuApp(pid, mib)]
    fake.procs[pid] = {"cmd": cmd, "ancestors": list(ancestors)}


def test_the_new_server_starts_only_after_the_old_one_gave_its_gpu_memory_back(fake, patchset):
    old = fake.units[DFLASH_UNIT].pid
    _gpu(fake, old, 90000)
    _gpu(fake, 5001, 2000, cmd="sglang::scheduler_TP1", ancestors=(old, 1))  # a worker of the old server
    fake.gpu_linger = {old: 1, 5001: 3}  # still exiting for a few looks after the stop
    r = deploy_host(fake.session(), patchset, OPTS)
    assert r.outcome == Outcome.DEPLOYED
    [detail] = [s["detail"] for s in r.steps if s["step"] == "gpus free"]
    assert "for 2 process(es)" in detail
    ev = fake.events
    stop, start = ev.index(f"systemctl stop {DFLASH_UNIT}"), ev.index(f"systemctl restart {fake.host.unit}")
    looks = [i for i, e in enumerate(ev) if e == "nvidia-smi" and stop < i < start]
    assert len(looks) >= 4 and fake.gpu_apps == []


def test_gpu_memory_held_by_a_stranger_is_refused_in_preflight_and_force_lets_it_stay(fake, patchset):
    _gpu(fake, 777, 1000, cmd="python3 leftover_eval.py")
    before = snapshot(fake)
    with pytest.raises(PreflightError) as ei:
        deploy_host(fake.session(), patchset, OPTS)
    assert "pid 777 (python3 leftover_eval.py) holds 1000 MiB" in str(ei.value) and "--force" in str(ei.value)
    assert snapshot(fake) == before
    r = deploy_host(fake.session(), patchset, dataclasses.replace(OPTS, force=True))
    assert r.outcome == Outcome.DEPLOYED and [a.pid for a in fake.gpu_apps] == [777]


def test_gpu_memory_that_is_never_given_back_fails_the_start_and_rolls_back(tmp_path, patchset):
    fake = fake_hosts(tmp_path / "h", health={"gpu_free_timeout_s": 0})[0]
    old = fake.units[DFLASH_UNIT].pid
    _gpu(fake, old, 90000)
    fake.gpu_linger = {old: 10**6}
    with pytest.raises(DeployFailed) as ei:
        deploy_host(fake.session(), patchset, OPTS)
    assert ei.value.result.failed_step == "gpus free" and f"pid {old} (90000 MiB)" in ei.value.result.message
    assert fake.units[DFLASH_UNIT].active == "active" and current(fake) is None
