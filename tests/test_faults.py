"""The fault matrix: whatever happens during a deploy, every host ends on one whole
release, old or new, never a mix, and healthy -- or the tool exits 4 and says precisely why.

Real processes only: sandbox hosts (containers with real systemd, sshd, the stand-in SGLang
server), the CLI as a subprocess, SIGKILL/SIGINT sent by PID. To stop the tool at
an exact point these tests run the CLI with test hooks injected (ddtree_ops.testing.hooked_cli;
the product only calls the no-op `ddtree_ops.host.hooks.Hooks` it is given):
DDTREE_OPS_TEST_PAUSE_AT=<point> + DDTREE_OPS_TEST_PAUSE_FILE=<path> make it write <path> and
wait there until the file is removed.

Decisions these tests pin down:
- the deploy lock is an flock held by the host-side agent of the run, which lives as long as the
  run's SSH channel: a run killed with SIGKILL frees it by itself, and the next plain run (no
  flags) finds the journal and repairs; a run still connected is named (user@machine, pid,
  since, command) with the token `--break-lock TOKEN` needs to end it;
- `rollback` after an interrupted deploy repairs it (back to the release that was current before)
  and stops there; `deploy` repairs first, then deploys;
- an API key lives in a 0600 YAML file on the host (`secrets_config`, SGLang's `--config`) and,
  on the operator's side, in the environment variable named by `api_key_env`; the unit only says
  `--config FILE`, the health gate sends the key as a header and nothing prints it. A key in
  `extra_args` is refused by inventory validation (it would land in the unit and `ps`); see
  tests/test_secrets.py for the rest of the secrets work (the key in the server's log, scrubbed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import paramiko
import pytest

from ddtree_ops.testing.pause_points import FAULT, PAUSE_AT, PAUSE_FILE
from kit import _PRISTINE, DFLASH_INFO, host_tree, in_parallel, make_patchset, run_cli, upstream_file, wait_for

DDTREE = "sglang-k26-ddtree.service"
DFLASH = "sglang-k26-dflash-cg.service"
DFLASH_UTILS = "sglang/srt/speculative/dflash_utils.py"
PROBE = "sglang/srt/speculative/ddtree_probe.py"
BIG = "sglang/srt/speculative/dflash_worker_v2.py"  # 132 kB upstream: fills a small disk
STATE = "/var/lib/ddtree-ops"



# ---------------------------------------------------------------------------------------------
# helpers


def three_files(tmp_path: Path, tag: str = "A") -> Path:
    """Two upstream files replaced (so "between two file replacements" exists) and one added."""
    return make_patchset(tmp_path, {
        DFLASH_INFO: upstream_file(DFLASH_INFO) + f"\n# patched {tag}\n".encode(),
        DFLASH_UTILS: upstream_file(DFLASH_UTILS) + f"\n# patched {tag}\n".encode(),
        PROBE: f"PROBE = {tag!r}\n".encode(),
    }, name=f"ps{tag}")


def rels_of(ps: Path) -> list[str]:
    import yaml

    return [f["path"] for f in yaml.safe_load((ps / "manifest.yaml").read_text())["files"]]


def healthy(th) -> bool:
    try:
        return httpx.get(th.host.base_url + "/health", timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


def journal(th) -> dict | None:
    data = th.read(f"{STATE}/journal.json")
    return json.loads(data) if data else None


def lock_holder(th) -> dict:
    data = th.read(f"{STATE}/deploy.lock")
    return json.loads(data) if data else {}


def lock_free(th) -> bool:
    """Nobody holds the host's deploy lock (flock(1) on the host takes it for an instant)."""
    return th.ssh(["flock", "-n", f"{STATE}/deploy.lock", "true"], check=False).exit_code == 0


def current(th) -> str | None:
    data = th.read(f"{STATE}/current")
    return data.decode().strip() if data else None


def assert_pre_deploy(th) -> None:
    """Byte-identical to a freshly reset host: every file, mode, owner, unit and enablement link
    under the unit folder and speculative/ (stale __pycache__ included), DFlash serving, DDTree
    stopped, no journal, no current release."""
    tree = host_tree(th)
    want = _PRISTINE[th.name]
    diff = {p: (want["files"].get(p), tree["files"].get(p))
            for p in set(want["files"]) | set(tree["files"]) if want["files"].get(p) != tree["files"].get(p)}
    assert not diff, f"host differs from its pre-deploy state: {diff}"
    assert tree["mounts"] == want["mounts"]
    assert th.unit_state(DFLASH) == "active" and th.unit_state(DDTREE) != "active"
    assert healthy(th)
    assert journal(th) is None and current(th) is None


def assert_on_release(th, ps: Path) -> None:
    """Every file of the patch set installed byte for byte, DDTree serving, DFlash stopped."""
    h = th.host
    snap = th.snapshot([f"{h.site_packages}/{r}" for r in rels_of(ps)])
    for rel in rels_of(ps):
        from kit import sha256_bytes

        assert snap[f"{h.site_packages}/{rel}"] == sha256_bytes((ps / "files" / rel).read_bytes()), rel
    assert th.unit_state(DDTREE) == "active" and th.unit_state(DFLASH) != "active"
    assert healthy(th)
    assert journal(th) is None


def pause_env(point: str, marker: Path) -> dict:
    return {PAUSE_AT: point, PAUSE_FILE: str(marker)}


def wait_paused(proc, marker: Path, timeout: float = 120) -> int:
    """Wait until the tool (or its remote agent) sits at the pause point; returns the pausing PID."""
    def there():
        if proc.proc.poll() is not None:
            pytest.fail(f"the tool exited ({proc.proc.returncode}) before the pause point:\n{proc.stderr()[-3000:]}")
        return marker.exists() and marker.read_text().strip()
    text = wait_for(there, timeout, what=f"pause marker {marker}")
    return int(text.split()[0])


def let_go(proc, marker: Path, seconds: float, interval: float = 0.05) -> None:
    """For `seconds`, or until the tool ends, every pause at `marker` let go at once (a run that
    retries or resumes reaches its pause point again)."""
    end = time.monotonic() + seconds
    while proc.proc.poll() is None and time.monotonic() < end:
        marker.unlink(missing_ok=True)
        time.sleep(interval)


def agent_alive(th, pid: int, inside: bool = False) -> bool:
    """Whether the host's process `pid` (a PID of the host's own namespace, as the agent writes
    it in a pause marker) lives; over SSH, or with `inside` from the machine (sshd stopped)."""
    argv = ["test", "-d", f"/proc/{pid}"]
    if inside:
        return th.sandbox.inside(th.name, argv, check=False).returncode == 0
    return th.ssh(argv, check=False).exit_code == 0


def interrupt(proc, marker: Path, sig: signal.Signals = signal.SIGINT) -> None:
    """Ctrl-C (or SIGTERM, SIGHUP) at the pause point. The CLI's main thread turns the signal into
    a stop request that the deploying worker honours at its next step boundary (then rolls back);
    so: signal, wait until the tool has taken note, and only then let the paused deploy go on.
    The tool started with the signals at their defaults (kit.CliProcess), whatever pytest inherited."""
    proc.signal(sig)
    wait_for(lambda: "interrupted" in proc.stderr() or proc.proc.poll() is not None, 60,
             what=f"the tool to take note of {sig.name}")
    marker.unlink(missing_ok=True)



def deploy_args(th, ps: Path, *extra: str) -> tuple[str, ...]:
    return ("deploy", "-i", str(th.inventory), "-l", th.name, "-p", str(ps), "--yes", "--json", *extra)


def rollback_args(th, *extra: str) -> tuple[str, ...]:
    return ("rollback", "-i", str(th.inventory), "-l", th.name, "--yes", "--json", *extra)


def host_result(r) -> dict:
    doc = r.json()
    return doc["hosts"][0] if "hosts" in doc else doc


# Where each pause point is in the journal, and what the host looks like there.
JOURNAL_STEP = {"after-backup": "backup", "between-files": "install", "after-unit": "install",
                "wait-for-weights": "wait for weights"}


def old_bytes(rel: str, prior: Path | None) -> bytes:
    """What `rel` holds before the deploy under test: the prior release's file, or upstream."""
    return (prior / "files" / rel).read_bytes() if prior is not None else upstream_file(rel)


def check_half_way(th, ps: Path, point: str, prior: Path | None = None) -> None:
    """Prove the pause really is where its name says (the host is half-deployed there)."""
    h = th.host
    new = {rel: (ps / "files" / rel).read_bytes() for rel in rels_of(ps)}
    if point == "after-backup":
        assert th.read(f"{h.site_packages}/{DFLASH_INFO}") == old_bytes(DFLASH_INFO, prior)
    elif point == "between-files":
        assert th.read(f"{h.site_packages}/{DFLASH_INFO}") == new[DFLASH_INFO]  # replaced
        assert th.read(f"{h.site_packages}/{DFLASH_UTILS}") == old_bytes(DFLASH_UTILS, prior)  # not yet
    elif point == "after-unit":
        assert all(th.read(f"{h.site_packages}/{rel}") == data for rel, data in new.items())
        assert b"--speculative-ddtree-budget 16" in th.read(h.unit_path)
        assert th.unit_state(DFLASH) == "active"
    elif point == "wait-for-weights":
        assert th.unit_state(DFLASH) != "active"
        assert th.unit_state(DDTREE) in ("active", "activating")
        assert not healthy(th)  # weights still loading: no listener yet
    assert (journal(th) or {}).get("step") == JOURNAL_STEP[point]


def slow_load(th, tmp_path, seconds: float = 60):
    """The same host with a weight load long enough to be killed in the middle of it."""
    return th.with_vars(tmp_path, extra_args=th.base_extra_args() + [f"--standin-load-seconds={seconds}"])


# ---------------------------------------------------------------------------------------------
# SIGKILL of the tool at four points: the next run finds the journal and repairs


def _killed_then_repaired(th, start_cli, tmp: Path, point: str, next_cmd: str, prior: Path | None = None):
    tmp.mkdir(parents=True, exist_ok=True)
    before = None
    if prior is not None:  # a release is current before the deploy that gets killed
        r = run_cli(*deploy_args(th, prior))
        assert r.code == 0, r.stderr
        before = host_result(r)["release"]
    ps = three_files(tmp, "K")
    killed_th = slow_load(th, tmp) if point == "wait-for-weights" else th
    marker = tmp / "pause"
    p = start_cli(*deploy_args(killed_th, ps), env=pause_env(point, marker))
    wait_paused(p, marker)
    check_half_way(th, ps, point, prior)
    rid = journal(th)["release"]

    p.signal(signal.SIGKILL)
    assert p.wait(30).code == -signal.SIGKILL
    if point == "between-files":
        # The remote agent paused between the two replacements notices that its controller is
        # gone, touches nothing more, and says so in the lock file: the next run takes over.
        wait_for(lambda: lock_holder(th).get("orphaned_at"), 30, what="the orphaned agent to mark the lock")
        assert th.read(f"{th.host.site_packages}/{DFLASH_UTILS}") == old_bytes(DFLASH_UTILS, prior)
    marker.unlink(missing_ok=True)

    # The killed run's lock died with its connection: a plain run (no flags) repairs.
    assert journal(th)["release"] == rid
    args = rollback_args(th) if next_cmd == "rollback" else deploy_args(th, ps)
    r = run_cli(*args)
    assert r.code == 0, r.stderr
    res = host_result(r)
    assert res["repaired"] == rid, res
    hist = run_cli("history", "--host", th.name, "-i", str(th.inventory), "--json").json()
    killed = next(x for x in hist["releases"] if x["id"] == rid)
    assert killed["outcome"] == f"interrupted at {JOURNAL_STEP[point]}, rolled back"
    assert lock_free(th)
    if next_cmd == "deploy":  # repaired first, then deployed: the new release, whole
        assert res["outcome"] == "deployed" and res["release"] != rid
        assert_on_release(th, ps)
        assert current(th) == res["release"]
    elif prior is not None:  # back to the release current before the killed deploy, and no further
        assert current(th) == before and res["release"] == rid
        assert_on_release(th, prior)
    else:
        assert_pre_deploy(th)
    if current(th):  # leave the host as the next test expects it (also proves `--to original`)
        r = run_cli(*rollback_args(th, "--to", "original"))
        assert r.code == 0, r.stderr
        assert_pre_deploy(th)


def test_sigkill_at_each_point_frees_the_lock_and_the_next_plain_run_repairs(clean_hosts, start_cli, tmp_path):
    """SIGKILL after the backup, between two file replacements, after the unit write and while
    the weights load. The killed run's lock dies with its connection, so the next plain `rollback`
    or `deploy` (no flags) finds the journal and repairs by itself. A `rollback` after an
    interrupted deploy returns to the release current before it and stops."""
    cases = [("after-backup", "rollback", False), ("between-files", "rollback", True),
             ("after-unit", "deploy", False), ("wait-for-weights", "rollback", False)]
    scenarios = {}
    for i, (point, nxt, prior) in enumerate(cases):
        th = clean_hosts[i % len(clean_hosts)]
        tmp = tmp_path / f"{point}"
        pr = three_files(tmp_path / f"prior-{point}", "P") if prior else None
        scenarios[f"{point} → {nxt}"] = (lambda th=th, tmp=tmp, point=point, nxt=nxt, pr=pr:
                                          _killed_then_repaired(th, start_cli, tmp, point, nxt, pr))
    if len(clean_hosts) >= len(cases):
        in_parallel(scenarios)
    else:
        for fn in scenarios.values():
            fn()


# ---------------------------------------------------------------------------------------------
# A fault at a named remote call, one per phase (the fast tier covers every call on fake hosts)

# (kind, call, n): the n-th call of that name fails ("fail": rolled back, exit 3) or the SSH
# connection is cut just before it ("drop": resumed, exit 0); see ddtree_ops/testing/pause_points.py.
PHASE_FAULTS = [
    ("fail", "journal", 1),                  # recording the release, before the backup
    ("drop", "backup", 1),                   # backup
    ("fail", "install", 2),                  # the unit, after the files
    ("drop", "systemctl stop", 1),           # stopping DFlash
    ("fail", "systemctl restart", 1),        # restart
    ("lost-answer", "systemctl restart", 1),  # restart done, its answer lost: not sent again
    ("drop", "probe", 2),                    # waiting for the weights
    ("fail", "set_current", 1),              # commit
    ("fail", "prune", 1),                    # housekeeping after the commit
]


def _starts_since(th, since: str) -> int:
    """How many times systemd started the deployed unit since the host's time `since`."""
    out = th.ssh(["journalctl", "-u", DDTREE, "--since", since, "-o", "cat", "--no-pager"], check=False).stdout
    return sum(1 for line in out.splitlines() if line.startswith("Started "))


def _fault_then_checked(th, tmp: Path, kind: str, call: str, nth: int):
    tmp.mkdir(parents=True, exist_ok=True)
    ps = three_files(tmp, "F")
    since = th.ssh(["date", "+%Y-%m-%d %H:%M:%S"]).stdout.strip()
    r = run_cli(*deploy_args(th, ps), env={FAULT: f"{kind}:{call}:{nth}"})
    res = host_result(r)
    where = f"{kind} at {call} #{nth}: exit {r.code}: {res.get('message')}"
    if call == "prune":  # committed; the housekeeping failure is said, not undone
        assert r.code == 0 and res["outcome"] == "deployed" and "pruning old releases failed" in res["message"], where
        assert_on_release(th, ps)
    elif kind in ("drop", "lost-answer"):  # a lost connection: reconnected, the phase resumed, deployed
        assert r.code == 0 and res["outcome"] == "deployed" and res["reconnects"] == 1, where
        assert_on_release(th, ps)
        assert _starts_since(th, since) == 1, where  # the restart sent once, whatever the cut
        if (kind, call) == ("lost-answer", "systemctl restart"):  # seen in systemd's InvocationID
            assert any("not restarted again" in st["detail"] for st in res["steps"]), res["steps"]
    elif r.code == 3:
        assert res["outcome"] == "rolled_back", where
        assert_pre_deploy(th)
    else:
        assert r.code == 4 and journal(th)["step"], where
        r = run_cli(*rollback_args(th))  # a plain rollback repairs from the journal
        assert r.code == 0, r.stderr
        assert_pre_deploy(th)
    assert lock_free(th), where
    if current(th):
        assert run_cli(*rollback_args(th, "--to", "original")).code == 0
        assert_pre_deploy(th)
    return r.code


def test_a_fault_in_each_phase_ends_on_one_release_healthy_or_exit_4_then_repaired(clean_hosts, tmp_path):
    # One scenario per host at a time (they share the host's state); hosts run in parallel.
    by_host: dict[str, list] = {}
    for i, fault in enumerate(PHASE_FAULTS):
        th = clean_hosts[i % len(clean_hosts)]
        by_host.setdefault(th.name, []).append(
            lambda th=th, i=i, f=fault: _fault_then_checked(th, tmp_path / f"f{i}", *f))
    in_parallel({h: (lambda fns=fns: [fn() for fn in fns]) for h, fns in by_host.items()})


def test_a_fault_during_a_rollback_keeps_the_journal_and_a_plain_rollback_finishes(clean_host, tmp_path):
    th = clean_host
    ps = three_files(tmp_path, "R")
    assert run_cli(*deploy_args(th, ps)).code == 0
    r = run_cli(*rollback_args(th), env={FAULT: "fail:systemctl daemon-reload:1"})
    assert r.code == 4, r.stderr
    assert "rollback failed at services" in host_result(r)["message"]
    assert journal(th)["kind"] == "rollback" and journal(th)["step"] == "services"
    r = run_cli(*rollback_args(th, "--to", "original"))
    assert r.code == 0, r.stderr
    assert host_result(r)["repaired"]
    assert_pre_deploy(th)


# ---------------------------------------------------------------------------------------------
# Ctrl-C, SIGTERM and SIGHUP at the same points: a clean rollback and exit 3

SIGINT, SIGTERM, SIGHUP = signal.SIGINT, signal.SIGTERM, signal.SIGHUP
NAMED = {SIGINT: "Ctrl-C", SIGTERM: "SIGTERM", SIGHUP: "SIGHUP"}  # as results and messages name them
INTERRUPT_POINTS = ["after-backup", "between-files", "after-unit", "wait-for-weights"]
# Which signal at which point: Ctrl-C at every point, and SIGTERM and SIGHUP spread over the same
# points (one handler serves all three: cli/signals.py), each round one deploy per host.
SIGNAL_AT = {"SIGINT": dict.fromkeys(INTERRUPT_POINTS, SIGINT),
             "SIGTERM-SIGHUP": {"after-backup": SIGHUP, "between-files": SIGTERM, "after-unit": SIGHUP,
                                "wait-for-weights": SIGTERM}}


def _interrupted(th, start_cli, tmp: Path, point: str, sig: signal.Signals = SIGINT):
    tmp.mkdir(parents=True, exist_ok=True)
    ps = three_files(tmp, "I")
    run_th = slow_load(th, tmp) if point == "wait-for-weights" else th
    marker = tmp / "pause"
    p = start_cli(*deploy_args(run_th, ps), env=pause_env(point, marker))
    paused_pid = wait_paused(p, marker)
    check_half_way(th, ps, point)
    rid = journal(th)["release"]
    interrupt(p, marker, sig)
    r = p.wait(180)
    assert r.code == 3, r.stderr
    res = host_result(r)
    assert res["outcome"] == "interrupted" and res["release"] == rid
    assert res["failed_step"].startswith(f"interrupted ({NAMED[sig]}) during "), res
    if point == "between-files":  # the agent that paused ended with the operation
        wait_for(lambda: not agent_alive(th, paused_pid), 30, what="the paused agent to exit")
    assert_pre_deploy(th)
    assert lock_free(th)


@pytest.mark.interrupts
@pytest.mark.parametrize("signals", SIGNAL_AT)
def test_sigint_sigterm_or_sighup_at_each_point_rolls_back_cleanly_and_exits_3(clean_hosts, start_cli, tmp_path,
                                                                               signals):
    """Ctrl-C, SIGTERM (a cancelled CI job, `kill`) and SIGHUP (a closed terminal) after the
    backup, between two file replacements, after the unit write and while the weights load: the
    host is rolled back byte for byte, exit 3, the result names the signal."""
    at = SIGNAL_AT[signals]
    hosts = {pt: clean_hosts[i % len(clean_hosts)] for i, pt in enumerate(at)}
    scenarios = {f"{at[pt].name} at {pt}": (lambda pt=pt: _interrupted(hosts[pt], start_cli, tmp_path / pt, pt,
                                                                        at[pt])) for pt in at}
    if len(clean_hosts) >= len(at):
        in_parallel(scenarios)
    else:
        for fn in scenarios.values():
            fn()


def _signal_during_the_rollback(th, start_cli, tmp: Path, first: signal.Signals | None, then: signal.Signals):
    """`first` at the pause after the backup (None: no pause; the deploy fails on its own: its new
    module raises at import, so the server dies while loading), then `then` while the rollback
    waits to reconnect: its connection is cut before its first restore (the sync point: the tool
    says it reconnects, and waits a second before it does). The rollback is not cut short."""
    tmp.mkdir(parents=True, exist_ok=True)
    ps = three_files(tmp, "R") if first else make_patchset(tmp, {
        "sglang/srt/speculative/ddtree_raises.py": b"raise RuntimeError('boom at import')\n",
        DFLASH_INFO: upstream_file(DFLASH_INFO) + b"\n# R\n"})
    marker = tmp / "pause"
    env = {FAULT: "drop:restore:1"}
    if first:
        env.update(pause_env("after-backup", marker))
    p = start_cli(*deploy_args(th, ps), env=env)
    if first:
        wait_paused(p, marker)
        interrupt(p, marker, first)
    r, res = _signal_while_reconnecting(p, then, "reconnecting to roll back")
    noted = f"interrupted again ({NAMED[then]})" if first else f"interrupted ({NAMED[then]})"
    # Taken note of while the rollback ran, and the rollback went on to its end.
    assert noted in r.stderr and r.stderr.index(noted) < r.stderr.index(f"[{th.name}] rolled back"), r.stderr
    if first:
        assert res["outcome"] == "interrupted" and res["failed_step"].startswith(f"interrupted ({NAMED[first]})")
    else:
        assert res["outcome"] == "rolled_back" and res["failed_step"] == "wait for weights", res
    assert_pre_deploy(th)
    assert lock_free(th)


def _signal_while_reconnecting(p, sig: signal.Signals, says: str):
    """Once the run's rollback waits to reconnect (its stderr `says` so), `sig`; the run must then
    finish its rollback and exit 3. Returns its result and its host row."""
    wait_for(lambda: says in p.stderr() or p.proc.poll() is not None, 120, what="the rollback to lose its connection")
    p.signal(sig)
    r = p.wait(180)
    assert r.code == 3, r.stderr
    return r, host_result(r)


def _signal_during_a_rollback_command(th, start_cli, tmp: Path, _unused: None, sig: signal.Signals):
    """`ddtree-ops rollback` after a deploy, `sig` while it waits to reconnect (its connection cut
    before its first restore): it runs to its end, exit 3, the host on its previous release."""
    tmp.mkdir(parents=True, exist_ok=True)
    r = run_cli(*deploy_args(th, three_files(tmp, "C")))
    assert r.code == 0, r.stderr
    p = start_cli(*rollback_args(th), env={FAULT: "drop:restore:1"})
    r, res = _signal_while_reconnecting(p, sig, "reconnecting to")
    noted = f"interrupted ({NAMED[sig]}): stopping; hosts in flight finish their rollback"
    assert noted in r.stderr and r.stderr.index(noted) < r.stderr.rindex(f"[{th.name}] rollback: healthy"), r.stderr
    assert res["outcome"] == "interrupted" and "during the rollback, which ran to its end" in res["message"], res
    assert_pre_deploy(th)
    assert lock_free(th)


@pytest.mark.interrupts
def test_a_signal_during_a_rollback_does_what_a_second_ctrl_c_does_the_rollback_finishes(clean_hosts, start_cli,
                                                                                        tmp_path):
    """A second SIGTERM after a first, a second Ctrl-C after a first (what it has always done),
    SIGHUP after Ctrl-C, SIGTERM while a deploy that failed on its own rolls back, and SIGTERM or
    SIGHUP during a `rollback` command: each is noted, the rollback finishes, exit 3, the host
    byte-identical to its previous release."""
    during_deploy, during_command = _signal_during_the_rollback, _signal_during_a_rollback_command
    cases = {"SIGTERM, SIGTERM": (during_deploy, SIGTERM, SIGTERM), "Ctrl-C, Ctrl-C": (during_deploy, SIGINT, SIGINT),
             "Ctrl-C, SIGHUP": (during_deploy, SIGINT, SIGHUP), "failed, SIGTERM": (during_deploy, None, SIGTERM),
             "rollback, SIGTERM": (during_command, None, SIGTERM), "rollback, SIGHUP": (during_command, None, SIGHUP)}
    by_host: dict[str, list] = {}  # one scenario at a time per host; hosts in parallel
    for i, (name, (fn, first, then)) in enumerate(cases.items()):
        th = clean_hosts[i % len(clean_hosts)]
        by_host.setdefault(th.name, []).append((name, lambda th=th, fn=fn, i=i, first=first, then=then: fn(
            th, start_cli, tmp_path / f"r{i}", first, then)))
    in_parallel({" then ".join(n for n, _ in runs): (lambda runs=runs: [fn() for _, fn in runs])
                 for runs in by_host.values()})


# The documented bound (README, docs/guarantees.md): while the weights load, the worker honours a
# signal at its next progress line (one every 5 s), a poll (0.2 s here) and a probe later.
ROLLBACK_STARTS_WITHIN_S = 6.0


def _sigterm_while_the_weights_load(th, start_cli, tmp: Path, after_s: float) -> tuple[float, float]:
    """SIGTERM `after_s` seconds into the weight wait, the tool running freely (no pause point).
    Returns the seconds from the signal to the rollback's first step and to the tool's exit."""
    tmp.mkdir(parents=True, exist_ok=True)
    p = start_cli(*deploy_args(slow_load(th, tmp), three_files(tmp, "B")))
    wait_for(lambda: f"[{th.name}] wait for weights" in p.stderr() or p.proc.poll() is not None, 120,
             what="the weight wait")
    time.sleep(after_s)
    t0 = time.time()
    p.signal(SIGTERM)
    r = p.wait(120)
    exited = time.time() - t0
    assert r.code == 3, r.stderr
    res = host_result(r)
    assert res["failed_step"].startswith("interrupted (SIGTERM) during "), res  # a start-up phase
    first = next(s["t"] for s in res["steps"] if s["step"] == "rollback") - t0
    assert_pre_deploy(th)
    return first, exited


@pytest.mark.interrupts
def test_sigterm_while_the_weights_load_starts_the_rollback_within_the_documented_bound(
        clean_hosts, start_cli, tmp_path, record_property):
    offsets = [0.5, 2.5, 4.5][:max(1, len(clean_hosts))]  # spread over the 5 s between two progress lines
    scenarios = {f"+{o:g} s": (lambda i=i, o=o: _sigterm_while_the_weights_load(
        clean_hosts[i % len(clean_hosts)], start_cli, tmp_path / f"b{i}", o)) for i, o in enumerate(offsets)}
    got = in_parallel(scenarios)
    record_property("measured", "SIGTERM while the weights load → first rollback step "
                    + ", ".join(f"{v[0]:.2f}" for v in got.values()) + " s; exit 3 after "
                    + ", ".join(f"{v[1]:.2f}" for v in got.values()) + " s")
    assert max(v[0] for v in got.values()) < ROLLBACK_STARTS_WITHIN_S, got


# ---------------------------------------------------------------------------------------------
# two operators at once; host keys; hostile inventory values; quoting


@pytest.mark.interrupts
def test_two_operators_at_once_one_gets_exit_5_naming_the_other(clean_host, start_cli, tmp_path):
    th = clean_host
    ps = three_files(tmp_path)
    m1, m2 = tmp_path / "pause1", tmp_path / "pause2"
    p1 = start_cli(*deploy_args(th, ps), env=pause_env("before-backup", m1))
    p2 = start_cli(*deploy_args(th, ps), env=pause_env("before-backup", m2))
    # Both race for the lock (flock on the host); the winner stops before its backup.
    loser = wait_for(lambda: next((p for p in (p1, p2) if p.proc.poll() is not None), None), 120,
                     what="one of the two deploys to give up")
    winner, marker = (p2, m2) if loser is p1 else (p1, m1)
    r = loser.wait()
    assert r.code == 5, r.stderr
    msg = host_result(r)["message"]
    assert f"pid {winner.pid}, host-side agent pid" in msg, msg
    assert "running `ddtree-ops deploy" in msg
    token = lock_holder(th)["token"]
    assert f"--break-lock {token}" in msg
    wait_paused(winner, marker)
    interrupt(winner, marker)  # the winner is rolled back: the host is as before
    assert winner.wait(180).code == 3
    assert_pre_deploy(th)


def test_two_concurrent_break_locks_exactly_one_proceeds_and_the_broken_run_touches_nothing(
        clean_host, start_cli, tmp_path):
    """A run still connected holds the lock (paused before its backup). Two operators pass its
    token to --break-lock at the same moment: exactly one ends the holder and deploys (repairing
    the holder's journal first); the other is refused (exit 5). The broken run, resumed, finds
    the lock changed hands and stops with exit 4 without touching the host."""
    th = clean_host
    ps = three_files(tmp_path)
    held = tmp_path / "held"
    holder = start_cli(*deploy_args(th, ps), env=pause_env("before-backup", held))
    wait_paused(holder, held)
    token = lock_holder(th)["token"]
    breakers = [start_cli(*deploy_args(th, ps, "--break-lock", token)) for _ in range(2)]
    codes = sorted(b.wait(300).code for b in breakers)
    assert codes == [0, 5], [b.wait().stderr for b in breakers]
    winner = next(b for b in breakers if b.wait().code == 0)
    res = host_result(winner.wait())
    assert res["outcome"] == "deployed" and res["repaired"], res
    assert_on_release(th, ps)
    held.unlink()  # the broken run carries on: its agent is gone, and the lock changed hands
    r = holder.wait(180)
    assert r.code == 4, r.stderr
    assert "taken by another run" in host_result(r)["message"]
    assert_on_release(th, ps)
    assert current(th) == res["release"]
    assert lock_free(th)
    r = run_cli(*rollback_args(th, "--to", "original"))
    assert r.code == 0, r.stderr
    assert_pre_deploy(th)


def test_changed_or_unknown_host_key_is_refused_with_exit_2(clean_host, tmp_path):
    th = clean_host
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True)
    pub = (tmp_path / "k.pub").read_text().split()
    changed = tmp_path / "known_hosts_changed"
    changed.write_text(f"{th.host.address} {pub[0]} {pub[1]}\n")
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    ps = three_files(tmp_path)
    for kh, expect in ((changed, "has CHANGED"), (empty, "unknown host key"),
                       (tmp_path / "missing", "does not exist")):
        t = th.with_vars(tmp_path, known_hosts=str(kh))
        extra = ("--accept-new-host-keys",) if kh is changed else ()  # never accepts a changed key
        r = run_cli(*deploy_args(t, ps, *extra))
        assert r.code == 2, r.stderr
        assert expect in host_result(r)["message"], r.stdout
    assert changed.read_text().count("\n") == 1  # nothing recorded
    assert th.ssh(["test", "-e", STATE], check=False).exit_code != 0  # never got as far as the host


HOSTILE = [
    ("unit", "sglang;reboot.service"),
    ("conflicts", ["dflash.service; rm -rf /"]),
    ("site_packages", "/opt/venv sglang/lib/python3.11/site-packages"),
    ("state_dir", "/var/lib/../../etc"),
    ("python", "/opt/venv_sglang/bin/python\n/bin/sh"),
    ("budget", "16; rm -rf /"),
    ("topk_cap", "$(reboot)"),
    ("extra_args", ["--x=$(touch /tmp/pwned)"]),
    ("environment", {"A": 'x"; rm -rf /'}),
    ("model_path", "/models/../../etc/shadow"),
    ("address", "10.0.0.1; rm -rf /"),
]


def test_hostile_inventory_values_are_rejected_with_exit_2_naming_file_host_and_field(sandbox, tmp_path):
    from ddtree_ops.config.inventory import load_inventory
    from ddtree_ops.errors import InventoryError
    from kit import TestHost

    th = TestHost("sbx1", sandbox, Path(sandbox.inventory_path))
    ps = three_files(tmp_path)
    for i, (field, value) in enumerate(HOSTILE):
        t = th.with_vars(tmp_path, **{field: value})
        with pytest.raises(InventoryError) as ei:
            load_inventory(t.inventory)
        e = ei.value
        assert (e.file, e.host, e.field, e.exit_code) == (str(t.inventory), "sbx1", field, 2), (field, str(e))
        if i % 4 == 0:  # and through the CLI, a few of them (each run costs a second)
            r = run_cli(*deploy_args(t, ps))
            assert r.code == 2
            assert f"{t.inventory}: host 'sbx1': field '{field}'" in r.json()["message"], r.stdout


def test_remote_commands_quote_every_value(clean_host, tmp_path):
    """Values full of shell syntax reach the host verbatim and nothing in them runs; and every
    command line the tool sends (here: plan, unit state, probe, lock, history with a unit name
    and a conflict that validation (and the unit renderer) would refuse) is a fully quoted argv."""
    import dataclasses

    from ddtree_ops.artifacts.patchset import load_patchset
    from ddtree_ops.host.channel import agent_argv
    from ddtree_ops.host.session import session_to
    from ddtree_ops.host.transport import connect, shell_join
    from ddtree_ops.runbook.plan import read_host

    th = clean_host
    mark = tmp_path / "pwned"  # /tmp is the same folder inside the sandbox host
    values = [f"a;touch {mark}1", f"$(touch {mark}2)", f"`touch {mark}3`", f"x && touch {mark}4",
              f"| touch {mark}5", "it's", 'say "hi"', "two  spaces", "new\nline", "*", "~", "$HOME",
              "\\", "-n", "--", "", "ünï"]
    with connect(th.host) as conn:
        out = conn.run(["printf", "%s\\0", *values]).stdout
    assert out.split("\0")[:-1] == values

    hostile = dataclasses.replace(th.host, unit=f"evil;touch {mark}6.service",
                                  conflicts=(f"$(touch {mark}7).service",))
    sent: list[str] = []
    real = paramiko.Channel.exec_command

    def recording(self, command):
        sent.append(command)
        return real(self, command)

    paramiko.Channel.exec_command = recording
    try:
        with session_to(hostile) as session:
            facts = read_host(session, load_patchset(str(three_files(tmp_path))))
            session.services.state(hostile.unit)
            session.services.probe(hostile.conflicts[0])
            store = session.store
            store.release_lock(store.acquire_lock("quoting test"))
            store.history()
    finally:
        paramiko.Channel.exec_command = real
    assert set(facts["units"].values()) <= {"unknown", "inactive"}  # names arrived whole: unknown units
    # The whole operation (facts, unit states, probe, lock, unlock, history) went to ONE agent
    # process as JSON over one channel: the only command line is the agent's, a quoted argv.
    assert sent == [shell_join(agent_argv(th.host.agent_python))], sent
    assert not list(tmp_path.glob("pwned*")), "a value was executed by a shell"


# ---------------------------------------------------------------------------------------------
# a full disk during backup and during install


FILL = ('f="$1/zz-filler"; dd if=/dev/zero of="$f" bs=4k 2>/dev/null || true; '
        's=$(stat -c %s "$f"); truncate -s $((s > $2 ? s - $2 : 0)) "$f"')


def _disk_full_during_backup(th, start_cli, tmp: Path):
    tmp.mkdir(parents=True, exist_ok=True)
    ps = make_patchset(tmp, {BIG: upstream_file(BIG) + b"\n# big\n", PROBE: b"P = 1\n"}, name="big")
    th.ssh(["sh", "-c", f"mkdir -p {STATE} && mount -t tmpfs -o size=2m,mode=0700 ddtree-full {STATE}"])
    try:
        # Too little room for the backup up front: refused in preflight, nothing changed.
        r = run_cli(*deploy_args(th, ps))
        assert r.code == 2, r.stderr
        assert "not enough disk for state_dir" in host_result(r)["message"]
        # Room at preflight, gone by the backup (someone filled the disk meanwhile).
        t = th.with_vars(tmp, min_free_mb=0)
        marker = tmp / "pause"
        p = start_cli(*deploy_args(t, ps), env=pause_env("before-backup", marker))
        wait_paused(p, marker)
        th.ssh(["sh", "-c", FILL, "sh", STATE, str(48 * 1024)])  # 48 kB left; the backup needs 134
        marker.unlink()
        r = p.wait(180)
        assert r.code == 3, r.stderr
        res = host_result(r)
        assert res["failed_step"] == "backup" and "No space left on device" in res["message"], res
        assert any("was never stopped" in s.get("detail", "") for s in res["steps"]), res["steps"]  # not restarted
        assert th.ssh(["sh", "-c", f"ls {STATE}/releases/*/backup* 2>/dev/null | wc -l"]).stdout.strip() == "0"
    finally:
        th.ssh(["umount", "-l", STATE], check=False)
    assert_pre_deploy(th)


def _disk_full_during_install(th, start_cli, tmp: Path):
    tmp.mkdir(parents=True, exist_ok=True)
    # The small new module first, then the 132 kB replacement that no longer fits.
    ps = make_patchset(tmp, {PROBE: b"P = 1\n", BIG: upstream_file(BIG) + b"\n# big\n"}, name="big")
    spec = f"{th.host.site_packages}/sglang/srt/speculative"
    th.ssh(["sh", "-c", 'set -e; t=$(mktemp -d /run/ddt-copy.XXXXXX); cp -a "$1/." "$t/"; '
            'mount -t tmpfs -o size=3m ddtree-full "$1"; cp -a "$t/." "$1/"; rm -rf "$t"', "sh", spec])
    try:
        marker = tmp / "pause"
        p = start_cli(*deploy_args(th, ps), env=pause_env("after-backup", marker))
        wait_paused(p, marker)
        th.ssh(["sh", "-c", FILL, "sh", spec, str(64 * 1024)])
        marker.unlink()
        r = p.wait(180)
        assert r.code == 3, r.stderr
        res = host_result(r)
        assert res["failed_step"] == "install" and "No space left on device" in res["message"], res
        # Restored on the full disk itself: the added module removed, the big file never
        # replaced (and not rewritten: there is no room for a temp copy).
        tree = host_tree(th)["files"]
        want = _PRISTINE[th.name]["files"]
        assert {p: v for p, v in tree.items() if "zz-filler" not in p} == want
    finally:
        th.ssh(["umount", "-l", spec], check=False)
    assert_pre_deploy(th)


def test_disk_full_during_backup_or_install_is_refused_or_restored(clean_hosts, start_cli, tmp_path):
    scenarios = {
        "backup": lambda: _disk_full_during_backup(clean_hosts[0], start_cli, tmp_path / "backup"),
        "install": lambda: _disk_full_during_install(clean_hosts[-1], start_cli, tmp_path / "install"),
    }
    if len(clean_hosts) >= 2:
        in_parallel(scenarios)
    else:
        for fn in scenarios.values():
            fn()


# ---------------------------------------------------------------------------------------------
# health that lies: flapping /health, a server that dies after the gate


def _flapping(th, tmp: Path):
    tmp.mkdir(parents=True, exist_ok=True)
    t = th.with_vars(tmp, extra_args=th.base_extra_args() + ["--standin-health-flaps"])
    r = run_cli(*deploy_args(t, three_files(tmp, "F")))
    assert r.code == 3, r.stderr
    res = host_result(r)
    # /health had already answered 200 once (the wait); one 200 is not enough, 503 came next.
    assert "/health answered 503 after" in res["message"] and "(flapping or unhealthy)" in res["message"], res
    assert_pre_deploy(th)


def _dies_before_commit(th, start_cli, tmp: Path):
    tmp.mkdir(parents=True, exist_ok=True)
    marker = tmp / "pause"
    p = start_cli(*deploy_args(th, three_files(tmp, "D")), env=pause_env("before-commit", marker))
    wait_paused(p, marker)
    pid = th.main_pid(DDTREE)
    assert pid and healthy(th)  # declared healthy by the gate
    th.ssh(["kill", "-9", str(pid)])
    wait_for(lambda: th.main_pid(DDTREE) != pid or th.unit_state(DDTREE) != "active", 60,
             what="the server to be gone")
    marker.unlink()
    r = p.wait(180)
    assert r.code == 3, r.stderr
    res = host_result(r)
    assert res["failed_step"] == "commit" and "died after passing the health gate" in res["message"], res
    assert_pre_deploy(th)


def test_flapping_health_and_a_death_after_the_gate_roll_back(clean_hosts, start_cli, tmp_path):
    """/health 200, 503, 200, ...: the gate wants consecutive successes, so the deploy rolls back.
    A server that dies after it was declared healthy but before commit: rolled back too."""
    scenarios = {
        "flapping": lambda: _flapping(clean_hosts[0], tmp_path / "flap"),
        "dies before commit": lambda: _dies_before_commit(clean_hosts[-1], start_cli, tmp_path / "dies"),
    }
    if len(clean_hosts) >= 2:
        in_parallel(scenarios)
    else:
        for fn in scenarios.values():
            fn()


# ---------------------------------------------------------------------------------------------
# backups: private, restored with mode and owner, refused when corrupted; no secrets printed


def test_private_backups_restored_mode_and_owner_corrupted_backup_refused_no_secret_printed(
        clean_host, tmp_path):
    th = clean_host
    secret = "sk-ddtree-faults-" + os.urandom(6).hex()
    # The key lives in a 0600 YAML file on the host (SGLang's --config); the unit only names the file.
    secrets = "/var/lib/sglang-secrets/ddtree-secrets.yaml"
    th.ssh(["sh", "-c", 'umask 077; mkdir -p /var/lib/sglang-secrets; cat > "$1"', "sh", secrets],
           stdin=f"api-key: '{secret}'\n")
    t = th.with_vars(tmp_path, api_key_env="DDTREE_FAULTS_API_KEY", secrets_config=secrets)
    env = {"DDTREE_FAULTS_API_KEY": secret}
    key_body = "".join(Path(th.host.identity_file).read_text().splitlines()[1:-1])
    outputs = []

    def cli(*args, code=0):
        r = run_cli(*args, env=env)
        outputs.append(r.stdout + r.stderr)
        assert r.code == code, r.stdout + r.stderr
        return r

    h = t.host
    target = f"{h.site_packages}/{DFLASH_INFO}"
    t.ssh(["sh", "-c", 'chown 1234:2345 "$1" && chmod 0640 "$1"', "sh", target])
    ps = three_files(tmp_path, "S")
    cli("plan", "-i", str(t.inventory), "-l", t.name, "-p", str(ps), "--json")
    cli("plan", "-i", str(t.inventory), "-l", t.name, "-p", str(ps))
    rel = host_result(cli(*deploy_args(t, ps)))["release"]
    # The server really wants the key: the gate passed because it sent it as a header.
    assert httpx.post(h.base_url + "/generate", json={"text": "x"}, timeout=10).status_code == 401

    # The state dir, its releases and backups: owner only.
    loose = t.ssh(["find", STATE, "-perm", "/077"]).stdout.split()
    assert not loose, f"readable by others: {loose}"
    assert t.ssh(["stat", "-c", "%a", STATE]).stdout.strip() == "700"
    # The replaced file kept its owner; the backup holds the original bytes.
    assert t.ssh(["stat", "-c", "%u:%g", target]).stdout.strip() == "1234:2345"

    # Corrupt the backup copy of dflash_info.py: rollback refuses and says which file (exit 4).
    manifest = json.loads(t.read(f"{STATE}/releases/{rel}/backup/manifest.json"))
    entry = next(e for e in manifest["entries"] if e["path"] == target)
    stored = f"{STATE}/releases/{rel}/backup/{entry['stored']}"
    good = t.read(stored)
    t.ssh(["sh", "-c", 'printf "tampered" >> "$1"', "sh", stored])
    r = cli(*rollback_args(t), code=4)
    msg = host_result(r)["message"]
    assert "corrupted, refusing to restore it" in msg and target in msg and entry["sha256"][:12] in msg, msg
    assert_on_release(t, ps)  # nothing was touched
    # Repair the backup: the rollback restores bytes, mode and owner.
    t.ssh(["sh", "-c", 'base64 -d > "$1"', "sh", stored], stdin=__import__("base64").b64encode(good).decode())
    cli(*rollback_args(t))
    assert t.read(target) == upstream_file(DFLASH_INFO)
    assert t.ssh(["stat", "-c", "%a %u:%g", target]).stdout.strip() == "640 1234:2345"
    t.ssh(["sh", "-c", 'chown 0:0 "$1" && chmod 0644 "$1"', "sh", target])
    assert_pre_deploy(th)

    # Nothing printed -- logs, tables, JSON -- holds the API key or the SSH private key.
    state = t.ssh(["sh", "-c", f"grep -rl -- {secret} {STATE} || true"]).stdout.split()
    for out in outputs:
        assert secret not in out
        assert key_body[:40] not in out
    assert f"--config {secrets}" in outputs[0]  # the unit names the file, not the key
    unit = t.read(h.unit_path).decode() if t.read(h.unit_path) else ""
    assert secret not in unit
    assert not state, f"the API key is stored in {state}"


# ---------------------------------------------------------------------------------------------
# the SSH connection cut mid-transfer (sshd of the host stopped).


@pytest.fixture
def sshd_control(sandbox):
    """Stop a host's sshd (its unit stopped, every session ended) and start it again; a host left
    stopped is started again at teardown."""
    stopped: set[str] = set()

    def stop(name: str) -> None:
        sandbox.stop_sshd(name)
        stopped.add(name)

    def start(name: str) -> None:
        sandbox.start_sshd(name)
        stopped.discard(name)

    yield stop, start
    for name in sorted(stopped):
        sandbox.start_sshd(name)


def _lock_seen_inside(th) -> dict:
    """The host's lock file read from the machine (its sshd may be stopped); {} while the agent
    rewrites it (truncated, then written)."""
    try:
        return json.loads(th.sandbox.inside(th.name, ["cat", f"{STATE}/deploy.lock"]).stdout)
    except ValueError:
        return {}


def _connection_cut(th, start_cli, sshd_control, tmp: Path, comes_back_after: float | None):
    stop, start = sshd_control
    tmp.mkdir(parents=True, exist_ok=True)
    ps = three_files(tmp, "C")
    marker = tmp / "pause"
    env = pause_env("between-files", marker)
    env["DDTREE_OPS_RECONNECT_S"] = "60" if comes_back_after is not None else "3"
    p = start_cli(*deploy_args(th, ps), env=env)
    agent = wait_paused(p, marker)
    stop(th.name)
    # The agent outlives the SSH session (a unit of its own): it finds its controller gone.
    wait_for(lambda: _lock_seen_inside(th).get("orphaned_at"), 30, what="the remote agent to lose its connection")
    assert agent_alive(th, agent, inside=True)
    marker.unlink(missing_ok=True)
    if comes_back_after is not None:
        # The tool keeps reconnecting; sshd is back in a few seconds: the install resumes (every
        # file written again, atomically) and the deploy ends on the one whole new release.
        time.sleep(comes_back_after)
        start(th.name)
        let_go(p, marker, 240, interval=0.1)  # the resumed install pauses again
        r = p.wait(10)
        assert r.code == 0, r.stderr
        res = host_result(r)
        assert res["outcome"] == "deployed" and res["reconnects"] >= 1, res
        assert "reconnecting to resume backup and install" in r.stderr
        assert_on_release(th, ps)
        assert run_cli(*rollback_args(th, "--to", "original")).code == 0
        assert_pre_deploy(th)
    else:
        # sshd stays down past the reconnect window: exit 4, the report says what to do.
        r = p.wait(240)
        assert r.code == 4, r.stderr
        msg = host_result(r)["message"]
        assert "rollback failed too" in msg and "journal on the host records release" in msg, msg
        assert f"ddtree-ops rollback --limit {th.name}" in msg
        start(th.name)
        # Half-installed while unreachable, and the journal says so...
        assert th.read(f"{th.host.site_packages}/{DFLASH_INFO}") == (ps / "files" / DFLASH_INFO).read_bytes()
        assert th.read(f"{th.host.site_packages}/{DFLASH_UTILS}") == upstream_file(DFLASH_UTILS)
        assert journal(th)["step"] == "install"
        # ...so the next plain run (the lost connection took the lock with it) repairs it.
        r = run_cli(*rollback_args(th))
        assert r.code == 0, r.stderr
        assert host_result(r)["repaired"]
        assert_pre_deploy(th)


def test_sshd_stopped_mid_transfer_is_retried_or_fails_cleanly(clean_hosts, start_cli, sshd_control, tmp_path):
    scenarios = {
        "back after 3 s": lambda: _connection_cut(clean_hosts[0], start_cli, sshd_control, tmp_path / "a", 3.0),
        "stays down": lambda: _connection_cut(clean_hosts[-1], start_cli, sshd_control, tmp_path / "b", None),
    }
    if len(clean_hosts) >= 2:
        in_parallel(scenarios)
    else:
        for fn in scenarios.values():
            fn()
