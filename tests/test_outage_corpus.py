"""The outage corpus on sandbox hosts: faults the tool can put right itself end in exit 0 or 3
with the host on one whole release and serving, never in exit 4.

- An SSH outage (every sshd session of the host killed for 2.5 s, the listener kept:
  ddtree_ops.testing.ssh_outage) at each pause point of a deploy and of a rollback, once each (the
  suite's time; REPEATS raises it when the reconnect code changes): the run reconnects (the handshake
  fails every which way meanwhile) and resumes where it was: every one ends in exit 0, the deploy on
  its new release, and a cut after the restart (while the weights load, before the commit) with the
  server's PID unchanged: no second restart. A summary of how each ended is printed.
- A phase several lease periods long (a soak of 4 leases, the lease shortened to 2 s): exit 0,
  the lock held by the same agent throughout.
- The state dir full after the backup: exit 3, the outcome record missing with a warning.
The controls (the old reconnect rule ends in exit 4) are in the fast tier: tests/test_outage_rules.py.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_faults import (
    DDTREE,
    FILL,
    STATE,
    assert_on_release,
    assert_pre_deploy,
    current,
    deploy_args,
    host_result,
    journal,
    let_go,
    lock_holder,
    pause_env,
    rollback_args,
    three_files,
    wait_paused,
)

from ddtree_ops.testing.ssh_outage import SshOutage
from kit import in_parallel, run_cli, wait_for

OUTAGE_S = 2.5
DEPLOY_POINTS = ("before-backup", "after-backup", "between-files", "after-unit", "wait-for-weights", "before-commit")
ROLLBACK_POINTS = ("rollback-services",)
REPEATS = 1


@dataclass
class Ended:
    scenario: str
    host: str
    code: int
    seconds: float
    killed: int
    reconnects: int
    message: str
    causes: frozenset[str] = frozenset()

    def line(self) -> str:
        return (f"{self.scenario:34s} {self.host:5s} exit {self.code}  {self.seconds:5.1f} s  "
                f"{self.killed:3d} sessions killed  {self.reconnects} failed reconnect(s)  {self.message[:70]}")


def _outage_at(th, start_cli, tmp: Path, args: tuple[str, ...], point: str,
               at_pause=lambda: None) -> tuple[object, int, float]:
    """Run `args` paused at `point`, call `at_pause`, start the outage, let the run go on into it;
    its result."""
    marker = tmp / f"pause-{point}"
    t0 = time.monotonic()
    p = start_cli(*args, env={**pause_env(point, marker), "DDTREE_OPS_RECONNECT_S": "60"})
    wait_paused(p, marker)
    at_pause()
    outage = SshOutage(th.sandbox, th.name).start(OUTAGE_S)  # returns once the run's session is gone
    # Let it go on, also when a retry after the reconnect reaches the same pause point again.
    let_go(p, marker, 240 - (time.monotonic() - t0), interval=0.1)
    if p.proc.poll() is None:
        pytest.fail(f"{point}: still running after 240 s:\n{p.stderr()[-3000:]}")
    r = p.wait(10)
    killed = outage.wait()
    return r, killed, time.monotonic() - t0


def _causes(stderr: str) -> frozenset[str]:
    """What broke each failed reconnect, as the tool's notes name it (host and address cut)."""
    found = re.findall(r"reconnect failed \((.*?)\); trying again", stderr)
    return frozenset(re.sub(r"\d+\.\d+\.\d+\.\d+(:\d+)?", "HOST", re.sub(r"^\S+: ", "", c))[:60] for c in found)


def _no_empty_reason(r) -> None:
    msg = host_result(r).get("message", "") if r.stdout.strip() else ""
    assert "failed too: ." not in r.stderr + msg and ": ." not in msg, r.stderr[-2000:]


# Pause points after the restart: the server the run started must be the one that serves.
AFTER_RESTART = ("wait-for-weights", "before-commit")


def _deploy_through_outage(th, start_cli, tmp: Path, point: str, rep: int) -> Ended:
    tmp.mkdir(parents=True, exist_ok=True)
    ps = three_files(tmp, f"O{rep}")
    started: list[int | None] = []
    at_pause = (lambda: started.append(th.main_pid(DDTREE))) if point in AFTER_RESTART else (lambda: None)
    r, killed, took = _outage_at(th, start_cli, tmp, deploy_args(th, ps), point, at_pause)
    assert r.code == 0, f"{point}: exit {r.code}\n{r.stderr[-3000:]}"
    _no_empty_reason(r)
    assert killed > 0, "the outage killed no session: it tested nothing"
    assert host_result(r)["reconnects"] >= 1 and "reconnected" in [s["step"] for s in host_result(r)["steps"]]
    assert_on_release(th, ps)
    if started:  # resumed, not restarted: the server that was loading at the cut is the one serving
        assert started[0] and th.main_pid(DDTREE) == started[0], (started, th.main_pid(DDTREE))
    assert run_cli(*rollback_args(th, "--to", "original")).code == 0
    assert_pre_deploy(th)
    return Ended(f"deploy, outage at {point} #{rep}", th.name, r.code, took, killed,
                 r.stderr.count("reconnect failed"), host_result(r).get("message", ""), _causes(r.stderr))


def _rollback_through_outage(th, start_cli, tmp: Path, point: str, rep: int) -> Ended:
    tmp.mkdir(parents=True, exist_ok=True)
    ps = three_files(tmp, f"R{rep}")
    assert run_cli(*deploy_args(th, ps)).code == 0
    r, killed, took = _outage_at(th, start_cli, tmp, rollback_args(th), point)
    assert r.code == 0, f"{point}: exit {r.code}\n{r.stderr[-3000:]}"
    _no_empty_reason(r)
    assert killed > 0
    assert current(th) is None and journal(th) is None  # finished by this run
    assert_pre_deploy(th)
    return Ended(f"rollback, outage at {point} #{rep}", th.name, r.code, took, killed,
                 r.stderr.count("reconnect failed"), host_result(r).get("message", ""), _causes(r.stderr))


def test_an_ssh_outage_at_every_step_of_a_deploy_and_a_rollback_is_resumed_and_ends_in_exit_0(clean_hosts, start_cli,
                                                                                              tmp_path):
    jobs = [(_deploy_through_outage, point, rep) for point in DEPLOY_POINTS for rep in range(REPEATS)]
    jobs += [(_rollback_through_outage, point, rep) for point in ROLLBACK_POINTS for rep in range(REPEATS)]
    per_host: dict[str, list] = {th.name: [] for th in clean_hosts}
    for i, job in enumerate(jobs):
        per_host[clean_hosts[i % len(clean_hosts)].name].append(job)
    by_name = {th.name: th for th in clean_hosts}

    def host_runs(name: str) -> list[Ended]:
        th = by_name[name]
        return [fn(th, start_cli, tmp_path / f"{name}-{point}-{rep}", point, rep) for fn, point, rep in per_host[name]]

    results = in_parallel({name: (lambda n=name: host_runs(n)) for name in per_host})
    ended = [e for runs in results.values() for e in runs]
    print("\nSSH outage corpus (%d runs, outage %.1f s each):" % (len(ended), OUTAGE_S))
    for e in sorted(ended, key=lambda e: e.scenario):
        print("  " + e.line())
    print(f"  exit 0: {sum(e.code == 0 for e in ended)} of {len(ended)}")
    print("  what broke the reconnects: " + "; ".join(sorted({c for e in ended for c in e.causes})))
    assert len(ended) == len(jobs)


# ---------------------------------------------------------------------------------------------
# a phase several lease periods long


def test_a_soak_of_four_lease_periods_ends_in_exit_0_with_the_lock_held_throughout(clean_host, start_cli, tmp_path):
    """The lease shortened to 2 s (renewed every 1 s), a soak of 8 s with one look every 3 s (the
    runbook asks the agent nothing for longer than a lease): the heartbeat keeps the lock."""
    th = clean_host.with_vars(tmp_path, lock_renew_s=1, lock_lease_s=2,
                              health={**_health(clean_host), "min_healthy_s": 8, "soak_interval_s": 3})
    ps = three_files(tmp_path, "L")
    p = start_cli(*deploy_args(th, ps))
    wait_for(lambda: "soak" in p.stderr() or p.proc.poll() is not None, 120, what="the soak to start")
    seen, looks = set(), 0
    while p.proc.poll() is None:
        h = lock_holder(th)
        if h:
            looks += 1
            seen.add((h.get("token"), h.get("generation"), h.get("agent_pid"), bool(h.get("lease_expired"))))
        time.sleep(0.5)
    assert looks >= 8, f"the lock was looked at {looks} times only: the soak was not watched"
    r = p.wait(10)
    assert r.code == 0, r.stderr[-3000:]
    assert any("healthy for" in s.get("detail", "") and "min_healthy_s 8" in s.get("detail", "")
               for s in host_result(r)["steps"]), host_result(r)["steps"]
    # One holder (token, generation, agent) through the soak: never lost, never re-taken.
    assert len({s for s in seen if s[0]}) == 1 and not any(s[3] for s in seen), seen
    assert_on_release(th, ps)
    assert run_cli(*rollback_args(th, "--to", "original")).code == 0
    assert_pre_deploy(th)


def _health(th) -> dict:
    import yaml

    inv = yaml.safe_load(Path(th.inventory).read_text())
    return dict(inv.get("all", {}).get("vars", {}).get("health") or {})


# ---------------------------------------------------------------------------------------------
# the state dir full after the backup


def test_the_state_dir_full_after_the_backup_ends_in_exit_3_with_the_host_right(clean_host, start_cli, tmp_path):
    th = clean_host
    ps = three_files(tmp_path, "D")
    th.ssh(["sh", "-c", f"mkdir -p {STATE} && mount -t tmpfs -o size=4m,mode=0700 ddtree-full {STATE}"])
    try:
        t = th.with_vars(tmp_path, min_free_mb=0)
        marker = tmp_path / "pause"
        p = start_cli(*deploy_args(t, ps), env=pause_env("after-backup", marker))
        wait_paused(p, marker)
        th.ssh(["sh", "-c", FILL, "sh", STATE, "0"])  # not a byte left
        marker.unlink()
        r = p.wait(180)
        assert r.code == 3, r.stderr[-3000:]
        res = host_result(r)
        assert "No space left on device" in res["message"], res
        assert "could not be recorded" in res["message"], res
        assert any("was never stopped" in s.get("detail", "") for s in res["steps"]), res["steps"]
        assert journal(th) is None and current(th) is None
    finally:
        th.ssh(["umount", "-l", STATE], check=False)
    assert_pre_deploy(th)
