"""SIGINT, SIGTERM and SIGHUP end the tool the way Ctrl-C does (fast tier: the handlers of
ddtree_ops/cli/signals.py in this process, a rollout on a fake host, the CLI waiting on a host
that never answers). Every test sets the dispositions it needs itself: what the test run
inherited (a background job ignores SIGINT) must not decide its outcome."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from ddtree_ops.cli.signals import HANDLED, handled_now, signals_as_interrupts
from ddtree_ops.fleet.actions import rolling_deploy, rolling_rollback
from ddtree_ops.fleet.rollout import Progress, Target
from ddtree_ops.host.hooks import Hooks
from ddtree_ops.runbook.describe import Interrupt, interrupt_label
from ddtree_ops.runbook.events import Event, Failed, StepDone
from ddtree_ops.runbook.options import DeployOptions
from ddtree_ops.runbook.results import Outcome
from ddtree_ops.testing.fake_host import FAKE_CRASH, fake_hosts, fake_inventory
from kit import INTERRUPT_SIGNALS, default_dispositions

pytestmark = pytest.mark.interrupts

UNIT_DIR = "/etc/systemd/system"
NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}


@pytest.fixture
def dispositions():
    """Set SIGINT, SIGTERM and SIGHUP for this test (`set_to(disposition)`); what the test run
    had comes back afterwards."""
    before = {s: signal.getsignal(s) for s in INTERRUPT_SIGNALS}

    def set_to(disposition) -> None:
        for s in INTERRUPT_SIGNALS:
            signal.signal(s, disposition)

    yield set_to
    for s, old in before.items():
        signal.signal(s, old)


# ---------------------------------------------------------------------------------------------
# the handlers


@pytest.mark.parametrize("sig", INTERRUPT_SIGNALS, ids=lambda s: s.name)
def test_each_signal_raises_an_interrupt_naming_it_and_the_old_handler_comes_back(dispositions, sig):
    dispositions(signal.SIG_DFL)
    with signals_as_interrupts() as handled:
        assert handled == HANDLED
        with pytest.raises(Interrupt) as ei:
            os.kill(os.getpid(), sig)
            time.sleep(5)  # the handler runs in this (main) thread at once; never reached
    e = ei.value
    assert isinstance(e, KeyboardInterrupt) and e.signum == sig and e.exit_code == 128 + sig
    assert interrupt_label(e) == NAMES[sig]
    assert signal.getsignal(sig) == signal.SIG_DFL  # the control: ours is gone again


def test_an_inherited_ignore_stays_for_sigint_and_sighup_but_sigterm_is_always_handled(dispositions):
    dispositions(signal.SIG_IGN)  # as `nohup cmd &` starts the tool
    with signals_as_interrupts() as handled:
        assert handled == (signal.SIGTERM,)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN == signal.getsignal(signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGHUP)  # ignored: nothing happens
        with pytest.raises(Interrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    # The control: inherited defaults, every one of the three is handled.
    assert handled_now({s: signal.SIG_DFL for s in HANDLED}) == HANDLED


def test_outside_the_main_thread_nothing_is_installed(dispositions):
    dispositions(signal.SIG_DFL)
    seen = []
    t = threading.Thread(target=lambda: seen.append(signals_as_interrupts().__enter__()))
    t.start()
    t.join()
    assert seen == [()] and all(signal.getsignal(s) == signal.SIG_DFL for s in HANDLED)


@pytest.mark.parametrize("raised, code, said", [(Interrupt(signal.SIGTERM), 143, "interrupted (SIGTERM)\n"),
                                               (KeyboardInterrupt(), 130, "interrupted (Ctrl-C)\n"),
                                               (None, 0, "")], ids=["SIGTERM", "Ctrl-C", "control: no interrupt"])
def test_an_interrupt_before_a_command_guards_itself_is_still_named_with_its_exit_code(
        dispositions, monkeypatch, capsys, raised, code, said):
    """Typer turns a KeyboardInterrupt outside a command's `guard` (while arguments are parsed, or
    the command imports what it needs) into a silent exit 130; `main` says which signal it was."""
    import typer

    from ddtree_ops.cli import commands

    dispositions(signal.SIG_DFL)
    app = typer.Typer()

    @app.command()
    def slow_start():
        if raised is not None:
            raise raised

    @app.command()
    def other():  # two commands: a group, as the tool's (and `slow-start` one of its own: no plugins)
        pass

    monkeypatch.setattr(commands, "app", app)
    monkeypatch.setattr(sys, "argv", ["ddtree-ops", "slow-start"])
    with pytest.raises(SystemExit) as ei:
        commands.main()
    assert (ei.value.code or 0, capsys.readouterr().err) == (code, said)


# ---------------------------------------------------------------------------------------------
# a rollout on a fake host: where a signal lands, what it does


class Watch(Progress):
    """Records the rollout's notes and events; `on_failed(event)` runs (in the worker) when a
    host's run fails, before its rollback."""

    def __init__(self, on_failed=None):
        self.notes: list[str] = []
        self.events: list[Event] = []
        self.on_failed = on_failed
        self._lock = threading.Lock()

    def note(self, msg: str) -> None:
        with self._lock:
            self.notes.append(msg)

    def event(self, event: Event) -> None:
        self.events.append(event)
        if isinstance(event, Failed) and self.on_failed:
            self.on_failed(event)

    def noted(self, prefix: str, timeout: float = 10) -> None:
        """Wait until the main thread has taken note of a signal (its handler runs there)."""
        deadline = time.monotonic() + timeout
        while not any(n.startswith(prefix) for n in list(self.notes)):
            assert time.monotonic() < deadline, f"no note {prefix!r}: {self.notes}"
            time.sleep(0.01)


class SignalAt(Hooks):
    """Sends `sig` to this process when the deploy reaches `point`, and goes on once the rollout
    has taken note: the signal lands in the main thread while a worker deploys."""

    def __init__(self, point: str, sig: signal.Signals, watch: Watch):
        self.point, self.sig, self.watch = point, sig, watch

    def pause(self, point: str) -> None:
        if point == self.point:
            os.kill(os.getpid(), self.sig)
            self.watch.noted(f"interrupted ({NAMES[self.sig]})")


def deploy(fake, ps, watch: Watch, hooks: Hooks | None = None):
    """A rollout of `ps` on `fake` with the CLI's handlers. A signal that escapes the rollout
    fails the test (uncaught, it would end the whole pytest session)."""
    try:
        with signals_as_interrupts():
            return rolling_deploy([Target(fake.host.name, (fake.host,))], ps, DeployOptions(reconnect_s=5),
                                  connect=lambda host: fake.session(hooks or Hooks()), progress=watch)
    except KeyboardInterrupt as e:
        pytest.fail(f"{e!r} escaped the rollout instead of being handed to it")


def snapshot(fake) -> dict[str, bytes]:
    return fake.tree(fake.host.site_packages, UNIT_DIR)


@pytest.mark.parametrize("sig", INTERRUPT_SIGNALS, ids=lambda s: s.name)
def test_a_signal_during_a_deploy_rolls_the_host_back_exit_3_naming_the_signal(dispositions, fake, patchset, sig):
    dispositions(signal.SIG_DFL)
    before = snapshot(fake)
    watch = Watch()
    res = deploy(fake, patchset, watch, SignalAt("after-backup", sig, watch))
    row = res.results[0]
    assert res.exit_code == 3 and row.outcome == Outcome.INTERRUPTED, row
    assert row.failed_step == f"interrupted ({NAMES[sig]}) during install", row
    assert res.abort_reason == ("interrupted by the operator (Ctrl-C)" if sig == signal.SIGINT
                                else f"interrupted by {sig.name}")
    assert snapshot(fake) == before and fake.units[fake.host.conflicts[0]].active == "active"


@pytest.mark.parametrize("second", INTERRUPT_SIGNALS, ids=lambda s: s.name)
def test_a_second_signal_during_the_rollback_is_noted_and_the_rollback_finishes(dispositions, fake, patchset,
                                                                                second):
    """As a second Ctrl-C: the rollback under way is not cut short. The control: the first
    signal of the same run did stop the deploy."""
    dispositions(signal.SIG_DFL)
    before = snapshot(fake)

    def again(event: Failed) -> None:
        os.kill(os.getpid(), second)
        watch.noted(f"interrupted again ({NAMES[second]})")

    watch = Watch(on_failed=again)
    res = deploy(fake, patchset, watch, SignalAt("after-unit", signal.SIGTERM, watch))
    row = res.results[0]
    assert res.exit_code == 3 and row.outcome == Outcome.INTERRUPTED, row
    assert row.failed_step.startswith("interrupted (SIGTERM) during "), row
    assert [s["step"] for s in row.steps][-1] == "rolled back"
    assert snapshot(fake) == before and fake.units[fake.host.conflicts[0]].active == "active"


def test_a_first_signal_while_a_failed_deploy_rolls_back_does_not_cut_the_rollback_short(
        dispositions, fake, versioned_patchset):
    """The deploy failed on its own (the new server crashes while loading) and is rolling back
    when SIGTERM arrives: the rollback finishes, the host is as before, the row says why it
    failed (rolled back, not interrupted)."""
    dispositions(signal.SIG_DFL)
    before = snapshot(fake)

    def terminate(event: Failed) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        watch.noted("interrupted (SIGTERM)")

    watch = Watch(on_failed=terminate)
    res = deploy(fake, versioned_patchset(marker=b"\n# " + FAKE_CRASH + b"\n"), watch)
    row = res.results[0]
    assert res.exit_code == 3 and row.outcome == Outcome.ROLLED_BACK, row
    assert row.failed_step == "wait for weights" and [s["step"] for s in row.steps][-1] == "rolled back", row
    assert snapshot(fake) == before and fake.units[fake.host.conflicts[0]].active == "active"


class SignalAtStep(Watch):
    """Sends `sig` (from the worker) when the run reports the step `step`, then goes on once the
    rollout has taken note."""

    def __init__(self, step: str, sig: signal.Signals | None):
        super().__init__()
        self.step, self.sig = step, sig

    def event(self, event: Event) -> None:
        super().event(event)
        if self.sig is not None and isinstance(event, StepDone) and event.step == self.step:
            os.kill(os.getpid(), self.sig)
            self.noted(f"interrupted ({NAMES[self.sig]})")
            self.sig = None


@pytest.mark.parametrize("sig", [*INTERRUPT_SIGNALS, None], ids=[*(s.name for s in INTERRUPT_SIGNALS), "control"])
def test_a_signal_during_a_rollback_command_lets_it_finish_then_exit_3(dispositions, fake, patchset, sig):
    """Cut short, a rollback would leave its journal and exit 4 (a person must look); so it runs to
    its end, the host is on its previous files, healthy, and the row says it was interrupted."""
    dispositions(signal.SIG_DFL)
    before = snapshot(fake)
    assert deploy(fake, patchset, Watch()).exit_code == 0
    watch = SignalAtStep("restore", sig)
    with signals_as_interrupts():
        res = rolling_rollback([Target(fake.host.name, (fake.host,))], None, DeployOptions(reconnect_s=5),
                               connect=lambda host: fake.session(), progress=watch)
    row = res.results[0]
    if sig is None:
        assert (row.outcome, res.exit_code) == (Outcome.ROLLED_BACK, 0), row
    else:
        assert (row.outcome, res.exit_code) == (Outcome.INTERRUPTED, 3), row
        assert row.message.startswith(f"interrupted by {'the operator (Ctrl-C)' if sig == signal.SIGINT else sig.name}"
                                      " during the rollback, which ran to its end"), row
    assert snapshot(fake) == before and fake.session().store.facts([]).get("journal") is None


def test_targets_queued_when_the_signal_comes_never_start(dispositions, tmp_path, patchset):
    dispositions(signal.SIG_DFL)
    first, second = fake_hosts(tmp_path / "hosts", 2)
    by_name = {h.host.name: h for h in (first, second)}
    untouched = snapshot(second)
    watch = Watch()
    hooks = SignalAt("after-backup", signal.SIGTERM, watch)
    with signals_as_interrupts():
        res = rolling_deploy([Target(h.host.name, (h.host,)) for h in (first, second)], patchset,
                             DeployOptions(reconnect_s=5), canary=0, forks=1, progress=watch,
                             connect=lambda host: by_name[host.name].session(hooks))
    rows = {r.host: r for r in res.results}
    assert rows[first.host.name].outcome == Outcome.INTERRUPTED and res.exit_code == 3
    assert (rows[second.host.name].outcome, rows[second.host.name].message) == (
        Outcome.SKIPPED, "not started: interrupted by SIGTERM"), rows
    assert snapshot(second) == untouched and "agent journal" not in second.events  # never touched


class SignalOnNote(Watch):
    """Sends `sig` from the main thread itself while it announces the canary batch: a moment when
    the rollout's main thread is not waiting on its workers."""

    def __init__(self, sig: signal.Signals):
        super().__init__()
        self.sig = sig

    def note(self, msg: str) -> None:
        super().note(msg)
        if msg.startswith("canary:"):
            os.kill(os.getpid(), self.sig)


def test_a_signal_anywhere_in_the_rollouts_main_thread_is_handed_over_not_raised_there(dispositions, fake,
                                                                                       patchset):
    """Raised there, it would end the rollout's bookkeeping and leave its workers deploying
    un-interrupted; handed over, the canary (announced, not yet started) never starts, and the
    run does not pass for a success: exit 1, nothing changed."""
    dispositions(signal.SIG_DFL)
    before = snapshot(fake)
    res = deploy(fake, patchset, SignalOnNote(signal.SIGTERM))
    row = res.results[0]
    assert (row.outcome, row.message, res.exit_code) == (Outcome.SKIPPED, "not started: interrupted by SIGTERM",
                                                         1), row
    assert res.aborted and res.abort_reason == "interrupted by SIGTERM"
    assert snapshot(fake) == before and "agent journal" not in fake.events


class DeadTerminal(Watch):
    """A view on a terminal that closed (SIGHUP's usual cause): every write fails with EIO."""

    def __init__(self, broken: bool = True):
        super().__init__()
        self.broken = broken

    def _write(self) -> None:
        if self.broken:
            raise OSError(5, "Input/output error")

    def start(self, hosts, batches) -> None:
        self._write()

    def state(self, host: str, state: str) -> None:
        self._write()

    def note(self, msg: str) -> None:
        super().note(msg)
        self._write()

    def event(self, event: Event) -> None:
        super().event(event)
        self._write()

    def stop(self) -> None:
        self._write()


@pytest.mark.parametrize("broken", [True, False], ids=["terminal gone", "control: terminal alive"])
def test_sighup_from_a_closed_terminal_still_rolls_back_though_nothing_can_be_shown(dispositions, fake, patchset,
                                                                                    broken):
    dispositions(signal.SIG_DFL)
    before = snapshot(fake)
    view = DeadTerminal(broken)
    res = deploy(fake, patchset, view, SignalAt("after-unit", signal.SIGHUP, view))
    row = res.results[0]
    assert res.exit_code == 3 and row.outcome == Outcome.INTERRUPTED and row.failed_step.startswith(
        "interrupted (SIGHUP) during "), row
    assert snapshot(fake) == before and fake.units[fake.host.conflicts[0]].active == "active"
    assert len(view.events) > 5  # the view was told everything; its failures changed nothing


# ---------------------------------------------------------------------------------------------
# the real CLI in a subprocess, started with the dispositions a background job or nohup gives it


def ignoring(*sigs: signal.Signals):
    """`preexec_fn`: the child starts with the three at their defaults, then `sigs` ignored (as
    `trap '' INT` or nohup would hand them down)."""
    def preexec() -> None:
        default_dispositions()
        for s in sigs:
            signal.signal(s, signal.SIG_IGN)
    return preexec


@dataclass
class SilentHost:
    """One host that accepts TCP and never says a word: `plan` waits there for the SSH banner."""

    inventory: Path
    listener: socket.socket
    accepted: list[socket.socket] = field(default_factory=list)

    def wait_connected(self) -> None:
        """Until the tool has connected: past its start-up, inside the command (no fixed sleep)."""
        self.listener.settimeout(60)
        self.accepted.append(self.listener.accept()[0])  # kept open: the tool waits on it


@pytest.fixture
def silent_host(tmp_path):
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    kh = tmp_path / "known_hosts"
    kh.write_text("")
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump(fake_inventory(1, ssh_port=lsock.getsockname()[1], known_hosts=str(kh),
                                                 connect_timeout=60)))
    host = SilentHost(inv, lsock)
    yield host
    for s in [*host.accepted, lsock]:
        s.close()


def plan_waiting(host: SilentHost, preexec) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "ddtree_ops", "plan", "-i", str(host.inventory)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=preexec)
    host.wait_connected()
    return proc


def ended_by(proc: subprocess.Popen, sig: signal.Signals) -> tuple[int | None, str]:
    """Send `sig`; the exit code within 20 s (None: still running, then killed) and stderr."""
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=20)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return None, err


def test_started_with_sigint_and_sighup_ignored_the_tool_keeps_them_ignored_and_sigterm_still_ends_it(silent_host):
    proc = plan_waiting(silent_host, ignoring(signal.SIGINT, signal.SIGHUP, signal.SIGTERM))
    try:
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None, proc.stderr.read()  # nohup's choice, kept
        code, err = ended_by(proc, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 143 and "interrupted (SIGTERM)" in err and "Traceback" not in err, err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_the_control_with_defaults_inherited_sigint_and_sighup_end_the_tool(silent_host, sig):
    code, err = ended_by(plan_waiting(silent_host, default_dispositions), sig)
    assert code == 128 + sig and f"interrupted ({NAMES[sig]})" in err, err
