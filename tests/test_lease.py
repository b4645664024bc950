"""The deploy lock's lease on sandbox hosts, with the real CLI as a child process: a controller
stopped (SIGSTOP) during the weight wait loses the lock within the lease and a second deploy takes
it and finishes; the stopped one, continued, stops with exit 4 and touches nothing. A controller
stopped for less than the lease, or held in a phase that makes no agent call for several leases,
carries on as if nothing happened.

SIGSTOP cannot be caught or ignored, and SIGCONT always resumes a stopped process, so no inherited
disposition changes what these tests see; the CLI is started with SIGINT, SIGTERM and SIGHUP at
their defaults all the same (kit.CliProcess).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from ddtree_ops.testing.pause_points import PAUSE_AT, PAUSE_FILE
from kit import DFLASH_INFO, host_tree, make_patchset, run_cli, upstream_file, wait_for

pytestmark = pytest.mark.sandbox

LEASE_S, RENEW_S = 8, 2
STATE = "/var/lib/ddtree-ops"
OLD_LOCK_FREED_AFTER_S = 593  # measured before the lease: a stopped controller's lock, by the idle timeout


def patchset(tmp: Path, tag: str) -> Path:
    return make_patchset(tmp, {DFLASH_INFO: upstream_file(DFLASH_INFO) + f"\n# lease test {tag}\n".encode(),
                               "sglang/srt/speculative/ddtree_probe.py": f"PROBE = {tag!r}\n".encode()},
                         name=f"lease{tag}")


def leased(th, tmp: Path, load_s: float | None = None):
    """The host with a short lease (and, with `load_s`, a weight load that long)."""
    extra = {"extra_args": th.base_extra_args() + [f"--standin-load-seconds={load_s}"]} if load_s else {}
    return th.with_vars(tmp, lock_lease_s=LEASE_S, lock_renew_s=RENEW_S, **extra)


def deploy_args(th, ps: Path) -> tuple[str, ...]:
    return ("deploy", "-i", str(th.inventory), "-l", th.name, "-p", str(ps), "--yes", "--json")


def result(r) -> dict:
    doc = r.json()
    return doc["hosts"][0] if "hosts" in doc else doc


def lock_file(th) -> dict:
    data = th.read(f"{STATE}/deploy.lock")
    return json.loads(data) if data else {}


def lock_free(th) -> bool:
    return th.ssh(["flock", "-n", f"{STATE}/deploy.lock", "true"], check=False).exit_code == 0


def paused_at_weights(start_cli, th, ps: Path, marker: Path):
    p = start_cli(*deploy_args(th, ps), env={PAUSE_AT: "wait-for-weights", PAUSE_FILE: str(marker)})
    wait_for(lambda: marker.exists() or p.proc.poll() is not None, 120, what="the deploy to reach the weight wait")
    assert p.proc.poll() is None, p.stderr()[-3000:]
    return p


@pytest.mark.interrupts
def test_a_stopped_controller_loses_the_lock_within_the_lease_and_comes_back_to_exit_4(clean_host, start_cli,
                                                                                       tmp_path, record_property):
    first_th = leased(clean_host, tmp_path, load_s=60)
    marker = tmp_path / "pause"
    first = paused_at_weights(start_cli, first_th, patchset(tmp_path, "A"), marker)
    first.signal(signal.SIGSTOP)  # a frozen laptop: no handler runs, no heartbeat, no FIN
    stopped_at = time.monotonic()
    marker.unlink()  # once continued, it would go on with the weight wait
    assert not lock_free(first_th)
    held = lock_file(first_th)
    in_unit = first_th.ssh(["test", "-d", "/run/systemd/system"], check=False).exit_code == 0
    if in_unit:  # a host run by systemd: the agent left the SSH session for a transient unit of its own
        assert held["agent_unit"].startswith("ddtree-ops-agent-"), held
    wait_for(lambda: lock_free(first_th), LEASE_S + 90, interval=0.25, what="the stopped controller's lock to go")
    freed_s = time.monotonic() - stopped_at
    record_property("measured", f"lock free {freed_s:.1f} s after SIGSTOP (lease {LEASE_S} s; "
                                f"{OLD_LOCK_FREED_AFTER_S} s before the lease); the agent ran in "
                                f"{held['agent_unit'] if in_unit else 'the SSH session (no systemd)'}")
    assert freed_s < LEASE_S + 60  # the lease, plus the host's own rollback (restart of DFlash)
    gone = lock_file(first_th)
    assert gone["lease_expired"] and gone["lost_at_step"] == "wait for weights"

    ps2 = patchset(tmp_path, "B")
    second = run_cli(*deploy_args(leased(clean_host, tmp_path), ps2))
    assert second.code == 0, second.stderr
    release = result(second)["release"]
    tree = host_tree(clean_host)

    first.signal(signal.SIGCONT)
    back = first.wait(120)
    assert back.code == 4, back.stderr
    assert "lease expired" in back.stderr and f"ddtree-ops status --limit {clean_host.name}" in back.stderr
    assert host_tree(clean_host) == tree  # touched nothing: no rollback of what the second deployed
    assert clean_host.read(f"{STATE}/current").decode().strip() == release


@pytest.mark.interrupts
def test_a_controller_stopped_for_less_than_the_lease_carries_on(clean_host, start_cli, tmp_path):
    th = leased(clean_host, tmp_path, load_s=4)
    marker = tmp_path / "pause"
    p = paused_at_weights(start_cli, th, patchset(tmp_path, "C"), marker)
    p.signal(signal.SIGSTOP)  # silent for 2.5 s: no request, no renewal, as a network gone that long
    marker.unlink()
    time.sleep(2.5)
    p.signal(signal.SIGCONT)
    r = p.wait(180)
    assert r.code == 0, r.stderr
    assert result(r)["outcome"] == "deployed" and not lock_file(th).get("lease_expired")


def test_a_phase_without_agent_calls_keeps_the_lock_for_several_leases(clean_host, start_cli, tmp_path):
    th = leased(clean_host, tmp_path, load_s=2)
    marker = tmp_path / "pause"
    p = paused_at_weights(start_cli, th, patchset(tmp_path, "D"), marker)
    time.sleep(2.5 * LEASE_S)  # the runbook asks the host nothing; only the heartbeat speaks
    assert not lock_free(th) and not lock_file(th).get("lease_expired")
    marker.unlink()
    r = p.wait(180)
    assert r.code == 0, r.stderr
    assert result(r)["outcome"] == "deployed"
