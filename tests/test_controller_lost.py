"""A controller that dies for good: SIGKILL at each step of a deploy, and no command afterwards.
The host heals itself (its agent, in a systemd unit of its own, outlives the SSH session and,
once the lease has run out, rolls the deploy back), serves its previous release again within the
lease plus a restart, says so in its release store, and the next `status` shows it. Real systemd
on the sandbox hosts (`systemd-run` is what keeps the agent alive)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from test_faults import (
    DDTREE,
    DFLASH,
    JOURNAL_STEP,
    STATE,
    assert_pre_deploy,
    check_half_way,
    current,
    deploy_args,
    healthy,
    journal,
    lock_free,
    pause_env,
    rollback_args,
    slow_load,
    three_files,
    wait_paused,
)

from kit import in_parallel, run_cli, wait_for

pytestmark = pytest.mark.sandbox

LEASE_S, RENEW_S = 6, 2
# The target: back on the previous release within the lease plus the time to restart the old
# server (the stand-in loads in 0.3 s) and what the host's own steps take; generous for 2 cores.
HEAL_WITHIN_S = LEASE_S + 20


def _short_lease(th, tmp: Path, point: str):
    th = slow_load(th, tmp) if point == "wait-for-weights" else th
    return th.with_vars(tmp, lock_lease_s=LEASE_S, lock_renew_s=RENEW_S)


def _host_healed(th) -> bool:
    return journal(th) is None and lock_free(th) and th.unit_state(DFLASH) == "active" and healthy(th)


def _killed_and_left_alone(th, start_cli, tmp: Path, point: str) -> float:
    tmp.mkdir(parents=True, exist_ok=True)
    ps = three_files(tmp, "L")
    run_th = _short_lease(th, tmp, point)
    marker = tmp / "pause"
    p = start_cli(*deploy_args(run_th, ps), env=pause_env(point, marker))
    wait_paused(p, marker)
    check_half_way(th, ps, point)
    rid = journal(th)["release"]

    p.signal(signal.SIGKILL)
    t0 = time.monotonic()
    assert p.wait(30).code == -signal.SIGKILL
    marker.unlink(missing_ok=True)  # a paused agent goes on (and finds its controller gone)
    wait_for(lambda: _host_healed(th), HEAL_WITHIN_S + 30, interval=0.25, what="the host to heal itself")
    took = time.monotonic() - t0
    assert took < HEAL_WITHIN_S, f"healed after {took:.1f} s"
    # Not before the lease ran out, by the host's own record: the lease runs from the last time
    # the agent heard from the controller, which the heartbeat (every RENEW_S) put up to 2 s
    # before the kill. (This read `took >= LEASE_S - 1` from the kill, and failed once at 4.7 s.)
    gone = json.loads(th.read(f"{STATE}/deploy.lock"))  # what the agent recorded as it let the lock go
    assert gone["lease_expired"] and gone["lease_s"] == LEASE_S, gone
    assert gone["expired_at"] - gone["last_heard_at"] >= LEASE_S - 0.01, gone

    assert_pre_deploy(th)
    assert current(th) is None
    hist = run_cli("history", "--host", th.name, "-i", str(th.inventory), "--json").json()
    killed = next(x for x in hist["releases"] if x["id"] == rid)
    assert killed["outcome"].startswith(f"rolled back by the host: controller lost at {JOURNAL_STEP[point]}"), killed
    status = run_cli("status", "-i", str(th.inventory), "--limit", th.name)
    assert status.code == 0, status.stderr
    assert "rolled back by the host" in status.stdout and JOURNAL_STEP[point] in status.stdout, status.stdout
    return took


def test_sigkill_at_each_point_with_no_command_after_the_host_serves_its_previous_release(
        clean_hosts, start_cli, tmp_path):
    points = ["after-backup", "between-files", "after-unit", "wait-for-weights"]
    took: dict[str, object] = {}
    for i in range(0, len(points), len(clean_hosts)):
        batch = points[i:i + len(clean_hosts)]
        took.update(in_parallel({
            pt: (lambda th=th, pt=pt: _killed_and_left_alone(th, start_cli, tmp_path / pt, pt))
            for th, pt in zip(clean_hosts, batch, strict=False)}))
    print("healed after (s): " + ", ".join(f"{pt} {t:.1f}" for pt, t in took.items()))


def test_sigkill_during_a_rollback_with_no_command_after_the_host_finishes_it(clean_host, start_cli, tmp_path):
    th = clean_host.with_vars(tmp_path, lock_lease_s=LEASE_S, lock_renew_s=RENEW_S)
    ps = three_files(tmp_path, "R")
    r = run_cli(*deploy_args(th, ps))
    assert r.code == 0, r.stderr
    rid = current(th)
    marker = tmp_path / "pause"
    p = start_cli(*rollback_args(th), env=pause_env("rollback-services", marker))
    wait_paused(p, marker)
    # Half-way: the files are back, the units are not (DDTree serves the undone release's files).
    assert journal(th)["kind"] == "rollback" and journal(th)["step"] == "services"
    assert th.unit_state(DDTREE) == "active" and th.unit_state(DFLASH) != "active"
    p.signal(signal.SIGKILL)
    t0 = time.monotonic()
    assert p.wait(30).code == -signal.SIGKILL
    marker.unlink(missing_ok=True)
    wait_for(lambda: _host_healed(th), HEAL_WITHIN_S + 30, interval=0.25, what="the host to finish the rollback")
    took = time.monotonic() - t0
    assert took < HEAL_WITHIN_S, f"finished after {took:.1f} s"
    assert_pre_deploy(th)
    hist = run_cli("history", "--host", th.name, "-i", str(th.inventory), "--json").json()
    undone = next(x for x in hist["releases"] if x["id"] == rid)
    assert undone["outcome"].startswith("rolled back"), undone
    heal = json.loads(th.read(f"{STATE}/host-heal.json"))
    assert heal["ok"] and heal["kind"] == "rollback" and "controller lost at services" in heal["why"], heal
