"""An SSH blip before the first change costs nothing, on real sandbox hosts (real sshd, real systemd).

Two kinds of outage, as a flaky network or an sshd restart makes them: every sshd session killed
for 2.5 s with the listener kept (ddtree_ops.testing.ssh_outage: a connection is accepted, then
dies in its handshake), and sshd stopped for 5 s (connection refused). Each is timed from the
command's first contact with the host, never from its start (a CLI that took more than 5 s to start
on a loaded machine once met sshd back at its first try): the killing from the first session that
opens, the stopped sshd from the first try refused (the `connect-retry` pause point). `deploy`,
`rollback` and `status` ride it out (exit 0) and report the tries;
the same outage past a short `reconnect_window_s` is exit 1 naming the window, with nothing
changed; a host key that turns out changed once sshd is back ends the retries at once (exit 2).
A blip after the first change (the run resumes) is tests/test_outage_corpus.py's.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from test_faults import (
    STATE,
    assert_on_release,
    assert_pre_deploy,
    deploy_args,
    host_result,
    let_go,
    pause_env,
    rollback_args,
    three_files,
    wait_paused,
)

from ddtree_ops.testing.ssh_outage import SshOutage
from kit import in_parallel

KILLED_S = 2.5
STOPPED_S = 5.0


def _status_args(th) -> tuple[str, ...]:
    return ("status", "-i", str(th.inventory), "-l", th.name, "--json")


def _through_killed_sessions(th, start_cli, args: tuple[str, ...]):
    """Every sshd session of the host killed for KILLED_S from `args`' first contact on, however
    long the command takes to start; (result, sessions killed)."""
    outage = SshOutage(th.sandbox, th.name).start(KILLED_S, from_first_contact=True)
    try:
        r = start_cli(*args).wait(240)
    finally:
        killed = outage.wait()
    return r, killed


def _through_stopped_sshd(th, start_cli, tmp: Path, args: tuple[str, ...], env: dict | None = None, *,
                          outlasts: bool = True):
    """sshd stopped before `args` starts; once a try has met it stopped (the connect-retry pause
    point: an event, not a guess at how long the CLI takes to start), still stopped for STOPPED_S,
    then started again; (result, seconds from sshd's start to the command's end). `outlasts`: the
    command must still be trying then; else sshd stays down until the command has ended (an
    outage longer than its window)."""
    tmp.mkdir(parents=True, exist_ok=True)
    marker = tmp / "pause-connect-retry"
    th.sandbox.stop_sshd(th.name)
    try:
        p = start_cli(*args, env={**(env or {}), **pause_env("connect-retry", marker)})
        wait_paused(p, marker)
        let_go(p, marker, STOPPED_S)
        assert p.proc.poll() is None or not outlasts, f"gave up while sshd was down:\n{p.stderr()[-2000:]}"
        if not outlasts:
            let_go(p, marker, 120)
    finally:
        th.sandbox.start_sshd(th.name)
    back = time.monotonic()
    let_go(p, marker, 240)
    r = p.wait(10)
    return r, time.monotonic() - back


def _tries(r) -> int:
    return host_result(r)["connect_tries"]


def _deploy_killed_then_rollback_stopped(th, start_cli, tmp: Path) -> None:
    ps = three_files(tmp, "K")
    r, killed = _through_killed_sessions(th, start_cli, deploy_args(th, ps))
    assert r.code == 0, r.stderr[-3000:]
    assert killed > 0 and _tries(r) > 1, (killed, host_result(r))
    assert_on_release(th, ps)
    r, _ = _through_stopped_sshd(th, start_cli, tmp / "rollback", rollback_args(th, "--to", "original"))
    assert r.code == 0, r.stderr[-3000:]
    assert _tries(r) > 1 and host_result(r)["outcome"] == "rolled_back", host_result(r)
    assert_pre_deploy(th)


def _deploy_stopped_then_rollback_killed(th, start_cli, tmp: Path) -> None:
    ps = three_files(tmp, "S")
    r, _ = _through_stopped_sshd(th, start_cli, tmp / "deploy", deploy_args(th, ps))
    assert r.code == 0, r.stderr[-3000:]
    assert _tries(r) > 1, host_result(r)
    assert_on_release(th, ps)
    r, killed = _through_killed_sessions(th, start_cli, rollback_args(th, "--to", "original"))
    assert r.code == 0, r.stderr[-3000:]
    assert killed > 0 and _tries(r) > 1, (killed, host_result(r))
    assert_pre_deploy(th)


def _status_both_ways(th, start_cli, tmp: Path) -> None:
    r, killed = _through_killed_sessions(th, start_cli, _status_args(th))
    assert r.code == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert killed > 0 and _tries(r) > 1 and host_result(r)["reachable"], host_result(r)
    r, _ = _through_stopped_sshd(th, start_cli, tmp / "stopped", _status_args(th))
    assert r.code == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert _tries(r) > 1 and host_result(r)["reachable"], host_result(r)


def _past_the_window_then_a_changed_key(th, start_cli, tmp: Path) -> None:
    # sshd down longer than a 2 s window: exit 1, the window named, nothing changed.
    short = th.with_vars(tmp, reconnect_window_s=2)
    ps = three_files(tmp, "W")
    t0 = time.monotonic()
    r, _ = _through_stopped_sshd(short, start_cli, tmp / "past", deploy_args(short, ps), outlasts=False)
    res = host_result(r)
    assert r.code == 1 and res["outcome"] == "unreachable", r.stderr[-3000:]
    assert "reconnect window (2 s" in res["message"] and "nothing was changed" in res["message"], res["message"]
    assert res["connect_tries"] >= 3, res  # growing pauses, not one try
    assert time.monotonic() - t0 < STOPPED_S + 30
    assert th.ssh(["test", "-e", STATE], check=False).exit_code != 0  # not even a lock file was written
    assert_pre_deploy(th)
    # A changed host key once sshd is back ends the retries at once (exit 2), long inside the window.
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "k")], check=True)
    pub = (tmp / "k.pub").read_text().split()
    changed = tmp / "known_hosts_changed"
    changed.write_text(f"{th.host.address} {pub[0]} {pub[1]}\n")
    wrong = th.with_vars(tmp, known_hosts=str(changed))
    r, after_back = _through_stopped_sshd(wrong, start_cli, tmp / "key", deploy_args(wrong, ps),
                                          env={"DDTREE_OPS_RECONNECT_S": "120"})
    assert r.code == 2 and "has CHANGED" in host_result(r)["message"], r.stderr[-3000:]
    assert after_back < 15, f"{after_back:.1f} s after sshd was back: the changed key was retried"
    assert_pre_deploy(th)


def test_an_ssh_outage_just_before_deploy_rollback_or_status_is_ridden_out_and_the_tries_reported(
        clean_hosts, start_cli, tmp_path):
    scenarios = [_deploy_killed_then_rollback_stopped, _deploy_stopped_then_rollback_killed, _status_both_ways,
                 _past_the_window_then_a_changed_key]
    jobs: dict[str, list] = {}
    for i, fn in enumerate(scenarios):
        th = clean_hosts[i % len(clean_hosts)]
        (tmp_path / f"s{i}").mkdir()
        jobs.setdefault(th.name, []).append(lambda fn=fn, th=th, i=i: fn(th, start_cli, tmp_path / f"s{i}"))
    in_parallel({name: (lambda fns=fns: [f() for f in fns]) for name, fns in jobs.items()})
