"""The rules that keep an SSH outage, a full state dir or a broken lock from ending in a false
exit 4 (fast tier, fake hosts): the reconnect loop tells a struggling connection (retried with a
growing pause inside the window) from a final answer; every reason is named; a journal without
a step, or at a step before "stop conflicts", means no unit was touched; the outcome record is
best effort once the host is right; after a lock taken over, the advice is `status`, never
`rollback`. The same faults on real hosts: tests/test_outage_corpus.py."""

from __future__ import annotations

import errno

import paramiko
import pytest

from ddtree_ops.errors import (
    DeployFailed,
    HostKeyError,
    LockHeldError,
    RemoteCommandError,
    RollbackFailed,
    UnreachableError,
    reason,
)
from ddtree_ops.host.transport import is_connection_trouble
from ddtree_ops.runbook import phases
from ddtree_ops.runbook.deploy import deploy_host
from ddtree_ops.runbook.phases import DeployOptions, Runbook
from ddtree_ops.testing.fake_host import DFLASH_UNIT, FAKE_CRASH, FakeLink

OPTS = DeployOptions(reconnect_s=30)
CRASHING = b"\n# " + FAKE_CRASH + b"\n"


def flaky_reconnects(monkeypatch, troubles: list[BaseException]) -> list[str]:
    """The fake link's reconnect raises each of `troubles` in turn (a handshake broken by an sshd
    that kills every new session), then connects; returns what was tried."""
    real = FakeLink.reconnect
    tried: list[str] = []

    def reconnect(self):
        tried.append("try")
        if troubles:
            raise troubles.pop(0)
        real(self)

    monkeypatch.setattr(FakeLink, "reconnect", reconnect)
    return tried


HANDSHAKE_TROUBLES = [EOFError(), paramiko.SSHException(), ConnectionResetError(errno.ECONNRESET, "reset by peer"),
                      OSError(None, "Socket is closed"), RemoteCommandError("fh1: remote step 'hello' timed out")]


def test_a_reconnect_handshake_broken_every_which_way_is_retried_and_the_rollback_ends_in_exit_3(
        fake, versioned_patchset, monkeypatch):
    before = fake.tree(fake.host.site_packages, "/etc/systemd/system")
    tried = flaky_reconnects(monkeypatch, list(HANDSHAKE_TROUBLES))
    fake.drop_connection_at.add("agent remove_partial")  # the rollback's first call
    with pytest.raises(DeployFailed) as ei:
        deploy_host(fake.session(), versioned_patchset(marker=CRASHING), OPTS)
    assert ei.value.exit_code == 3
    assert len(tried) == len(HANDSHAKE_TROUBLES) + 1
    assert fake.tree(fake.host.site_packages, "/etc/systemd/system") == before
    assert fake.units[DFLASH_UNIT].active == "active"


def test_control_the_old_rule_retrying_only_unreachable_ends_in_exit_4(fake, versioned_patchset, monkeypatch):
    """The same outage under the old rule (only UnreachableError is a lost connection): exit 4,
    and even then the reason is named (it was "failed too: ." with a bare EOFError)."""
    old_rule = lambda e: isinstance(e, UnreachableError)  # noqa: E731
    monkeypatch.setattr(phases, "is_connection_trouble", old_rule)
    monkeypatch.setattr("ddtree_ops.host.first_contact.is_connection_trouble", old_rule)
    monkeypatch.setattr("ddtree_ops.host.session.is_connection_trouble", lambda e: False)
    flaky_reconnects(monkeypatch, [EOFError()])
    fake.drop_connection_at.add("agent remove_partial")
    with pytest.raises(RollbackFailed) as ei:
        deploy_host(fake.session(), versioned_patchset(marker=CRASHING), OPTS)
    assert ei.value.exit_code == 4
    assert "the rollback failed too: EOFError." in str(ei.value), str(ei.value)


@pytest.mark.parametrize("final", [HostKeyError("fh1: the host key of 127.0.0.1 has CHANGED"),
                                   LockHeldError("fh1: the deploy lock was taken by another run")])
def test_a_final_answer_while_reconnecting_is_not_retried(fake, versioned_patchset, monkeypatch, final):
    tried = flaky_reconnects(monkeypatch, [final, EOFError()])
    fake.drop_connection_at.add("agent remove_partial")
    with pytest.raises(RollbackFailed) as ei:
        deploy_host(fake.session(), versioned_patchset(marker=CRASHING), OPTS)
    assert tried == ["try"], tried
    assert str(final) in str(ei.value)


def test_a_connection_that_never_comes_back_ends_after_the_window_with_growing_pauses_and_the_cause(
        fake, versioned_patchset, monkeypatch):
    troubles = [EOFError() for _ in range(100)]
    tried = flaky_reconnects(monkeypatch, troubles)
    fake.drop_connection_at.add("agent remove_partial")
    t0 = fake.clock
    with pytest.raises(RollbackFailed) as ei:
        deploy_host(fake.session(), versioned_patchset(marker=CRASHING), DeployOptions(reconnect_s=20))
    msg = str(ei.value)
    assert "EOF" in msg and "kept retrying for 20 s" in msg, msg
    # 0.5, 1, 2, 4, 4, ... s: a handful of tries in 20 s, not one a second.
    assert 5 <= len(tried) <= 9, tried
    assert fake.clock - t0 >= 20


def test_after_the_lock_was_taken_over_the_advice_is_status_never_rollback(fake, versioned_patchset):
    """--break-lock by another operator: the broken run's reconnect finds the lock in other hands.
    That run may have repaired or deployed since; `rollback` would undo its work."""
    other = fake.session()
    fake.drop_connection_at.add("agent remove_partial")
    real = FakeLink.reconnect

    def reconnect_after_a_breaker(self):
        other.store.acquire_lock("deploy --break-lock")
        real(self)

    FakeLink.reconnect = reconnect_after_a_breaker
    try:
        with pytest.raises(RollbackFailed) as ei:
            deploy_host(fake.session(), versioned_patchset(marker=CRASHING), OPTS)
    finally:
        FakeLink.reconnect = real
    msg = str(ei.value)
    assert "taken by another run" in msg and "owns the host now" in msg, msg
    assert f"ddtree-ops status --limit {fake.host.name}" in msg
    assert "then run `ddtree-ops rollback" not in msg, msg


@pytest.mark.parametrize("lost_at", ["agent install", "systemctl restart sglang-k26-ddtree.service",
                                     "probe sglang-k26-ddtree.service"])
def test_a_phase_whose_reconnect_finds_the_lock_taken_leaves_the_host_to_that_run(fake, patchset, monkeypatch,
                                                                                  lost_at):
    """The connection is lost in the middle of the deploy and, while it is down, another operator
    breaks the lock: the resumed phase's reconnect finds the lock in other hands. The host is that
    run's now: nothing is resumed and nothing rolled back (not a single request after the reconnect
    but the lock's), exit 4 with the advice to look first."""
    other = fake.session()
    fake.drop_connection_at.add(lost_at)
    real = FakeLink.reconnect

    def reconnect_after_a_breaker(self):
        other.store.acquire_lock("deploy --break-lock")
        real(self)

    monkeypatch.setattr(FakeLink, "reconnect", reconnect_after_a_breaker)
    with pytest.raises(RollbackFailed) as ei:
        deploy_host(fake.session(), patchset, OPTS)
    msg = str(ei.value)
    assert ei.value.exit_code == 4 and "taken by another run" in msg and "Do not run `rollback` blindly" in msg, msg
    after = fake.events[fake.events.index("reconnect") + 1:]
    assert after == ["agent lock", "agent unlock"], after  # the re-take, refused; the unlock of its own token
    assert fake.session().store.facts([])["lock"]["token"] == other.store.held.token  # still the breaker's


def test_a_reconnect_whose_lock_answer_was_lost_takes_its_own_later_generation_back(fake, versioned_patchset,
                                                                                      monkeypatch):
    """The reply to a re-take of the lock is lost with the connection (the host took it: one
    generation on, this run's token): the next try is this run's own, not another run's."""
    from ddtree_ops.host.release_store import ReleaseStore

    real = ReleaseStore._relock
    lost = []

    def relock_reply_lost(self, generation):
        res = real(self, generation)
        if not lost:
            lost.append(res.holder["generation"])
            self.agent.down = "connection lost after the lock was taken (fake)"
            raise UnreachableError(f"{self.host.name}: connection lost during remote step 'lock'")
        return res

    monkeypatch.setattr(ReleaseStore, "_relock", relock_reply_lost)
    fake.drop_connection_at.add("agent remove_partial")
    with pytest.raises(DeployFailed):
        deploy_host(fake.session(), versioned_patchset(marker=CRASHING), OPTS)
    assert lost and fake.units[DFLASH_UNIT].active == "active"


def test_control_without_the_own_generation_rule_the_lost_lock_answer_reads_as_another_run(
        fake, versioned_patchset, monkeypatch):
    from ddtree_ops.host import release_store

    monkeypatch.setattr(release_store, "_ours_later", lambda seen, held: False)
    real = release_store.ReleaseStore._relock
    lost = []

    def relock_reply_lost(self, generation):
        res = real(self, generation)
        if not lost:
            lost.append(1)
            self.agent.down = "connection lost after the lock was taken (fake)"
            raise UnreachableError(f"{self.host.name}: connection lost during remote step 'lock'")
        return res

    monkeypatch.setattr(release_store.ReleaseStore, "_relock", relock_reply_lost)
    fake.drop_connection_at.add("agent remove_partial")
    with pytest.raises(RollbackFailed, match="taken by another run"):
        deploy_host(fake.session(), versioned_patchset(marker=CRASHING), OPTS)


# -- reasons --------------------------------------------------------------------------------------

@pytest.mark.parametrize("exc, says", [(EOFError(), "EOFError"), (paramiko.SSHException(), "SSHException"),
                                       (UnreachableError(""), "UnreachableError"),
                                       (OSError("boom"), "OSError: boom"),
                                       (RemoteCommandError("fh1: disk full"), "fh1: disk full")])
def test_every_reason_is_named_even_for_an_exception_without_text(exc, says):
    assert reason(exc) == says
    assert str(EOFError()) == ""  # the control: what the message printed before


@pytest.mark.parametrize("exc, trouble", [(EOFError(), True), (paramiko.SSHException("x"), True),
                                          (ConnectionResetError(), True), (TimeoutError(), True),
                                          (UnreachableError("x"), True),
                                          (paramiko.BadHostKeyException("h", paramiko.RSAKey.generate(1024),
                                                                        paramiko.RSAKey.generate(1024)), False),
                                          (HostKeyError("x"), False), (LockHeldError("x"), False),
                                          (RemoteCommandError("x"), False), (ValueError("x"), False),
                                          (FileNotFoundError(errno.ENOENT, "x"), False)])
def test_connection_trouble_is_told_from_a_final_answer(exc, trouble):
    assert is_connection_trouble(exc) is trouble


# -- a journal with no step means nothing was touched -----------------------------------------------

def _rolled_back_with_journal_step(fake, versioned_patchset, step):
    """A release begun (nothing changed) whose journal says `step` (None: no step at all), rolled
    back by a later run (which knows only the journal): the unit actions that rollback sent."""
    session = fake.session()
    rb = Runbook(session)
    ps = versioned_patchset(marker=b"\n# quiet\n")
    lock = rb.lock(OPTS)
    plan = rb.preflight(ps, OPTS)
    rel = rb.begin(plan, ps, lock, rb.services_before())
    journal = dict(rel.journal)
    if step is None:
        journal.pop("step", None)
    else:
        journal["step"] = step
    rb.unlock(lock)
    later = Runbook(fake.session())  # a later run repairs: it knows only the journal
    later.lock(OPTS)
    fake.events.clear()
    later.roll_back(rel.id, journal, outcome="rolled back (test)")
    return [e for e in fake.events if e.startswith("systemctl ") and e.split()[1] != "states"]


@pytest.mark.parametrize("step", [None, "backup", "install"])
def test_a_journal_without_a_step_or_before_stop_conflicts_leaves_the_units_alone(fake, versioned_patchset, step):
    actions = _rolled_back_with_journal_step(fake, versioned_patchset, step)
    assert not [a for a in actions if a.split()[1] in ("stop", "restart", "start", "disable", "enable")], actions
    assert fake.units[DFLASH_UNIT].active == "active"


def test_control_a_journal_at_stop_conflicts_restarts_the_old_server(fake, versioned_patchset):
    actions = _rolled_back_with_journal_step(fake, versioned_patchset, "stop conflicts")
    assert any(a.split()[1] == "restart" for a in actions), actions


def disk_full_at(fake, calls: dict[str, set[int]]) -> None:
    """The n-th call named `name` (for each n in calls[name]) is refused as a full disk would be."""
    real_call = fake._call
    seen: dict[str, int] = {}

    def call(name):
        seen[name] = seen.get(name, 0) + 1
        if seen[name] in calls.get(name, ()):
            fake.events.append(name)
            raise RemoteCommandError(f"{fake.host.name}: remote step {name!r} failed: [Errno 28] No space left on "
                                     f"device")
        real_call(name)

    fake._call = call


def test_a_journal_write_that_failed_does_not_count_as_the_next_step(fake, versioned_patchset):
    """The state dir fills after the backup: the "stop conflicts" journal write fails, so nothing
    was stopped, and the rollback does not restart the old server (and ends in exit 3)."""
    disk_full_at(fake, {"agent journal": {3}})  # backup, install, then stop conflicts
    old_pid = fake.units[DFLASH_UNIT].pid
    with pytest.raises(DeployFailed) as ei:
        deploy_host(fake.session(), versioned_patchset(marker=b"\n# quiet\n"), OPTS)
    assert "No space left" in str(ei.value)
    assert fake.units[DFLASH_UNIT].pid == old_pid, "the old server was restarted"


def test_a_full_state_dir_costs_the_outcome_record_a_warning_not_the_rollback(fake, versioned_patchset):
    """Full after the backup: the journal write, then the rollback's outcome record and its
    `current` write all refused. The host is right without them (the journal cleared by an
    unlink, `current` already names the previous release): exit 3, a warning says what is missing."""
    disk_full_at(fake, {"agent journal": {3}, "agent release_write": {2}, "agent set_current": {1}})
    with pytest.raises(DeployFailed) as ei:
        deploy_host(fake.session(), versioned_patchset(marker=b"\n# quiet\n"), OPTS)
    msg = str(ei.value)
    assert ei.value.exit_code == 3 and "outcome of release" in msg and "could not be recorded" in msg, msg
    facts = fake.session().store.facts([])
    assert facts["journal"] is None and facts["current"] is None


def test_control_a_current_pointer_that_is_wrong_and_cannot_be_written_is_still_a_failure(fake, versioned_patchset):
    """A committed release whose journal could not be cleared: `current` names it, the rollback
    must move it back, and a full disk that refuses that is exit 4 (a person must free space)."""
    disk_full_at(fake, {"agent journal": {7}, "agent set_current": {2}})  # commit's clear; the rollback's write
    with pytest.raises(RollbackFailed) as ei:
        deploy_host(fake.session(), versioned_patchset(marker=b"\n# quiet\n"), OPTS)
    assert "No space left" in str(ei.value)


# -- before the first change ------------------------------------------------------------------------

def test_a_connection_lost_during_preflight_is_reconnected_and_the_deploy_goes_on(fake, versioned_patchset):
    fake.drop_connection_at.add("agent compile")
    r = deploy_host(fake.session(), versioned_patchset(marker=b"\n# quiet\n"), OPTS)
    assert r.outcome == "deployed" and fake.reconnects == 1, r
    assert fake.session().store.facts([])["lock"] is None


def test_control_a_preflight_refusal_is_final_not_a_lost_connection(fake, versioned_patchset):
    from ddtree_ops.errors import PreflightError

    fake.fail_next["agent compile"] = "the host's Python is broken"
    with pytest.raises((PreflightError, RemoteCommandError)):
        deploy_host(fake.session(), versioned_patchset(marker=b"\n# quiet\n"), OPTS)
    assert fake.reconnects == 0


def _interrupted_deploy(fake, versioned_patchset) -> str:
    """A deploy whose controller died at `wait for weights`: the journal says so."""
    from fast_kit import kill_deploy_at_call

    ps = versioned_patchset(marker=b"\n# quiet\n")
    fake.fault_at_call, fake.calls = ("kill", 10**6), 0
    deploy_host(fake.session(), ps, OPTS)  # to count the calls of a whole deploy
    n = next(i for i, e in enumerate(fake.events, 1) if e == "probe sglang-k26-ddtree.service")
    from ddtree_ops.runbook.rollback import rollback_host

    rollback_host(fake.session(), "original", OPTS)
    fake.events.clear()
    kill_deploy_at_call(fake, n, deploy_host, ps, OPTS)
    return fake.session().store.facts([])["journal"]["release"]


def test_a_connection_lost_while_repairing_an_interrupted_deploy_is_reconnected(fake, versioned_patchset):
    rid = _interrupted_deploy(fake, versioned_patchset)
    fake.drop_connection_at.add("agent remove_partial")  # the repair's first call
    r = deploy_host(fake.session(), versioned_patchset(marker=b"\n# quiet\n"), OPTS)
    assert r.repaired == rid and r.outcome == "deployed" and fake.reconnects >= 1, r


def test_control_without_a_window_the_same_loss_while_repairing_is_exit_4(fake, versioned_patchset):
    _interrupted_deploy(fake, versioned_patchset)
    fake.drop_connection_at.add("agent remove_partial")
    with pytest.raises(RollbackFailed, match="repairing the interrupted deploy"):
        deploy_host(fake.session(), versioned_patchset(marker=b"\n# quiet\n"), DeployOptions(reconnect_s=0))
