"""The sandbox hosts themselves, against real processes: systemd, sshd, the stand-in server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ddtree_ops.config.inventory import load_inventory
from ddtree_ops.errors import HostKeyError
from ddtree_ops.host.transport import connect
from kit import run_cli

DFLASH = "sglang-k26-dflash-cg.service"


def _wait(pred, timeout=20.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return pred()


def test_status_json_reports_every_field_and_ssh_checked_against_known_hosts(sandbox):
    r = run_cli("sandbox", "status", "--dir", str(sandbox.dir), "--json")
    assert r.code == 0, r.stderr
    rows = r.json()["hosts"]
    assert [h["name"] for h in rows] == [h.name for h in sandbox.hosts()]
    for row in rows:
        for key in ("name", "address", "ssh_port", "user", "identity_file", "known_hosts", "site_packages",
                    "unit", "base_url", "sshd_up", "unit_up", "health_up"):
            assert key in row
        assert row["sshd_up"] and row["ssh_ok"] and row["health_up"]
        assert row["address"].startswith("10.200.")
        assert row["known_hosts"] == str(sandbox.known_hosts)


def test_each_host_has_the_real_sglang_files_in_its_own_site_packages(fresh_host):
    h = fresh_host.host
    version = fresh_host.ssh([h.python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"]).stdout
    assert version.strip() == "0.5.23"
    snap = fresh_host.snapshot([f"{h.site_packages}/sglang/srt/speculative/dflash_info.py"])
    assert list(snap.values()) == ["71d17803fb088089e1124a58efa5bc46734fd4404c7387a690faadacda50b2d3"]


def test_hosts_do_not_share_files(sandbox, fresh_hosts):
    a, b = fresh_hosts[:2]
    marker = "/var/lib/ddtree-ops-isolation-probe"
    a.ssh(["sh", "-c", f"echo a > {marker}"])
    assert a.read(marker) == b"a\n"
    assert b.read(marker) is None


def test_unknown_host_key_is_refused(fresh_host, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    th = fresh_host.with_vars(tmp_path, known_hosts=str(empty))
    with pytest.raises(HostKeyError, match="not in .*unknown host key"):
        with connect(th.host):
            pass


def test_changed_host_key_is_refused_even_with_accept_new(fresh_host, tmp_path):
    other = tmp_path / "known_hosts"
    # A different, valid ed25519 key recorded for this address: the host "changed" its key.
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True)
    pub = (tmp_path / "k.pub").read_text().split()
    other.write_text(f"{fresh_host.host.address} {pub[0]} {pub[1]}\n")
    th = fresh_host.with_vars(tmp_path, known_hosts=str(other))
    with pytest.raises(HostKeyError, match="CHANGED"):
        with connect(th.host, accept_new_host_keys=True):
            pass
    assert other.read_text().count("\n") == 1  # nothing was recorded


def test_accept_new_host_keys_records_an_unknown_key_then_verifies_it(fresh_host, tmp_path):
    kh = tmp_path / "kh"
    th = fresh_host.with_vars(tmp_path, known_hosts=str(kh))
    with connect(th.host, accept_new_host_keys=True) as conn:
        assert conn.run(["true"]).ok
    recorded = kh.read_text()
    assert recorded.startswith(fresh_host.host.address + " ssh-ed25519 ")
    assert recorded.split()[2] in open(fresh_host.sandbox.known_hosts).read()
    with connect(th.host) as conn:  # now known: plain verification works
        assert conn.run(["true"]).ok


def test_restart_really_replaces_the_process(fresh_host):
    before = fresh_host.main_pid(DFLASH)
    assert before
    fresh_host.ssh(["systemctl", "restart", DFLASH])
    after = _wait(lambda: fresh_host.main_pid(DFLASH) not in (None, before) and fresh_host.main_pid(DFLASH))
    assert after and after != before
    # The PID is the container's: look in its /proc, not this machine's (another process here may
    # have the same number).
    gone = fresh_host.ssh(["sh", "-c", 'test ! -e "/proc/$1" || grep -q "^State:[[:space:]]*Z" "/proc/$1/status"',
                           "sh", str(before)], check=False)
    assert gone.ok, f"the old server {before} still runs in the host after the restart"


def test_restart_policy_respawns_the_server_after_kill_9(fresh_host):
    before = fresh_host.main_pid(DFLASH)
    fresh_host.ssh(["kill", "-9", str(before)])
    after = _wait(lambda: (fresh_host.main_pid(DFLASH) or before) != before and fresh_host.main_pid(DFLASH), timeout=30)
    assert after and after != before
    assert fresh_host.unit_state(DFLASH) == "active"


def test_readiness_timeline_is_refused_then_503_then_200(fresh_host, tmp_path):
    # A slow "weight load" so the three phases can be observed by polling.
    th = fresh_host.with_vars(tmp_path, extra_args=["--standin-load-seconds=2", "--standin-warmup-seconds=1.5"])
    h = th.host
    from dataclasses import replace

    from ddtree_ops.artifacts.units import render_unit
    unit = render_unit(replace(h, template="sglang-dflash.service.j2"))
    th.ssh(["sh", "-c", f"cat > /etc/systemd/system/{DFLASH}"], stdin=unit)
    th.ssh(["systemctl", "daemon-reload"])  # real systemd runs the unit it loaded until told
    th.ssh(["systemctl", "restart", DFLASH])
    seen = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            code = httpx.get(h.base_url + "/health", timeout=1).status_code
        except httpx.ConnectError:
            code = "refused"
        except httpx.TimeoutException:
            code = "timeout"
        if not seen or seen[-1] != code:
            seen.append(code)
        if code == 200:
            break
        time.sleep(0.05)
    assert seen[-3:] == ["refused", 503, 200], seen
    log = th.ssh(["journalctl", "-u", DFLASH, "-n", "200", "--no-pager"]).stdout
    begin, end, ready = (log.rfind(s) for s in ("Load weight begin", "Load weight end", "fired up and ready to roll"))
    assert -1 < begin < end < ready


def test_each_host_runs_real_systemd_as_pid_1_with_journald_and_cgroups(fresh_host):
    th = fresh_host
    state = th.ssh(["systemctl", "is-system-running"], check=False).stdout.strip()
    assert state == "running", th.ssh(["systemctl", "--failed", "--no-legend"], check=False).stdout
    assert th.read("/proc/1/comm") == b"systemd\n"
    # The unit's processes are tracked in its cgroup.
    pid = th.main_pid(DFLASH)
    cgroup = th.ssh(["systemctl", "show", "-p", "ControlGroup", "--value", DFLASH]).stdout.strip()
    assert cgroup == f"/system.slice/{DFLASH}"
    assert f"name=systemd:{cgroup}\n" in th.read(f"/proc/{pid}/cgroup").decode()
    assert "fired up and ready to roll" in th.ssh(["journalctl", "-u", DFLASH, "--no-pager", "-q"]).stdout
    # The machine's own units (its sshd, its timers) are not the host's.
    assert th.unit_state("ssh.service") != "active"


@pytest.mark.parametrize("leftover_mount", [False, True], ids=["reset in place", "mount left: rebooted"])
def test_a_reset_host_is_byte_identical_and_serves_again(sandbox, fresh_host, leftover_mount):
    from kit import host_tree

    th = fresh_host
    before = host_tree(th)
    mount = "mkdir -p /var/lib/leftover && mount -t tmpfs leftover /var/lib/leftover; " if leftover_mount else ""
    th.ssh(["sh", "-c", "echo changed >> /etc/systemd/system/sglang-k26-ddtree.service; "
                        f"echo x > {th.host.site_packages}/sglang/srt/speculative/dflash_info.py; "
                        f"{mount}systemctl stop {DFLASH}"])
    assert host_tree(th) != before  # the control: the change is seen
    leader = sandbox.inside(th.name, ["cat", "/proc/1/stat"]).stdout.split()[21]  # systemd's start time
    how = sandbox.reset_host(th.name)
    rebooted = sandbox.inside(th.name, ["cat", "/proc/1/stat"]).stdout.split()[21] != leader
    assert rebooted == leftover_mount == how.startswith("rebooted"), how
    assert host_tree(th) == before
    # The real wheel is still below the host's changes (a reset must not lose the lower layer).
    version = th.ssh([th.host.python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"]).stdout
    assert version.strip() == "0.5.23"
    assert th.unit_state(DFLASH) == "active" and httpx.get(th.host.base_url + "/health").status_code == 200


def test_server_port_is_per_host(sandbox):
    inv = load_inventory(sandbox.inventory_path)
    for h in inv.hosts.values():
        with socket.create_connection((h.address, h.port), timeout=2):
            pass


def _mounts_mentioning(text: str) -> list[str]:
    with open("/proc/self/mountinfo") as fh:
        return [line for line in fh if text in line]


def _still_runs(pid: int, started: int | None) -> bool:
    """Whether the process this machine knew as `pid`, started at `started` (/proc/PID/stat's start
    time), still runs. A PID alone is not a process: on this machine (pid_max 32768, a busy suite)
    another process may have it a moment after the first one ended."""
    from ddtree_ops.host.localproc import pid_alive, start_time

    return pid_alive(pid) and started is not None and start_time(pid) == started


@pytest.mark.sandbox  # starts its own test hosts
def test_down_leaves_no_process_namespace_or_mount(tmp_path):
    from ddtree_ops.host.localproc import start_time
    from ddtree_ops.testing.sandbox import Sandbox, _namespace_pids

    sb = Sandbox(tmp_path / "own")
    try:
        sb.up(1, load_seconds=0.1)
        (h,) = sb.hosts()
        # The machine's PIDs of the host's processes (its namespace seen from here), with their
        # start times: after the down, a PID may already be another process's.
        procs = {p: start_time(p) for p in _namespace_pids(h)}
        # systemd-nspawn, systemd, journald, sshd, the server (at least)
        assert len(procs) >= 5 and h.container_pid in procs
    finally:
        result = sb.down()
    assert result["hosts"] == 1 and result["killed"] >= 5
    assert not any(_still_runs(p, t) for p, t in procs.items())
    assert not os.path.exists(f"/run/netns/{h.netns}")
    assert not os.path.exists(f"/sys/class/net/{h.veth}")
    assert not _mounts_mentioning(str(tmp_path / "own"))
    assert not (tmp_path / "own").exists()


@pytest.mark.sandbox  # starts its own test hosts
def test_up_again_replaces_the_previous_hosts_cleanly(tmp_path):
    from ddtree_ops.host.localproc import start_time
    from ddtree_ops.testing.sandbox import Sandbox

    sb = Sandbox(tmp_path / "again")
    try:
        sb.up(1, load_seconds=0.1)
        (old,) = sb.hosts()
        old_started = start_time(old.container_pid)
        sb.up(1, load_seconds=0.1)
        (new,) = sb.hosts()
        assert new.netns != old.netns
        assert not os.path.exists(f"/run/netns/{old.netns}") and not _still_runs(old.container_pid, old_started)
        assert sb.status()[0]["health_up"]
    finally:
        sb.down()


def test_up_without_prerequisites_names_them_and_creates_nothing(tmp_path, monkeypatch):
    from ddtree_ops.errors import DdtreeOpsError
    from ddtree_ops.testing.sandbox import Sandbox, SandboxError, prerequisites

    monkeypatch.setattr(prerequisites.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(prerequisites, "SSHD", str(tmp_path / "no-sshd"))
    target = tmp_path / "never"
    with pytest.raises(SandboxError) as e:
        Sandbox(target).up(2)
    msg = str(e.value)
    assert "root privileges" in msg and "openssh-server" in msg and str(tmp_path / "no-sshd") in msg
    assert not target.exists()
    assert isinstance(e.value, DdtreeOpsError) and e.value.exit_code == 2


# ---------------------------------------------------------------------------------------------
# the rig's pieces, without hosts (no root needed)


def test_each_host_path_is_bound_to_the_hosts_own_folder_and_the_tool_is_seen_read_only(tmp_path):
    from ddtree_ops.testing.sandbox import SandboxError, SandboxHost, container

    h = SandboxHost(name="sbx1", subnet=7, netns="ddt-abcd-1", veth="ddtabcdh1", dir=str(tmp_path / "sbx1"))
    argv = container.nspawn_argv(h, Path("/cache/site"), ["/root/.pyenv/versions/3.11.7", "/srv/ddtree"])
    d = tmp_path / "sbx1"
    assert argv[0] == "systemd-nspawn" and argv[-1] == "--boot"
    assert "--network-namespace-path=/run/netns/ddt-abcd-1" in argv
    for want in (f"--bind={d}/etc-systemd-system:/etc/systemd/system", f"--bind={d}/var-lib:/var/lib",
                 f"--bind={d}/opt:/opt", f"--overlay=/etc:{d}/etc-upper:/etc",
                 "--bind-ro=/cache/site:/run/ddtree-sandbox/site-tree", "--bind-ro=/srv/ddtree"):
        assert want in argv, want
    # No host registers with (or needs) the machine's own systemd and D-Bus.
    assert "--keep-unit" in argv and "--register=no" in argv
    container.check_tool_visible(["/srv/ddtree", "/root/.pyenv"])
    with pytest.raises(SandboxError, match="lie under /opt"):
        container.check_tool_visible(["/opt/ddtree/.venv"])


def test_wheel_cache_location(tmp_path):
    from ddtree_ops.testing.sandbox.wheelcache import cache_dir

    rel = "ddtree_ops/testing/sandbox/wheelcache.py"
    checkout, site = tmp_path / "checkout", tmp_path / "site-packages"
    for root in (checkout, site):
        (root / rel).parent.mkdir(parents=True)
        (root / rel).write_text("")
    (checkout / "pyproject.toml").write_text("[project]\nname = 'ddtree-ops'\n")
    home = tmp_path / "home"
    assert cache_dir({"HOME": str(home)}, checkout / rel) == checkout / ".cache"
    assert cache_dir({"HOME": str(home)}, site / rel) == home / ".cache" / "ddtree-ops"
    assert cache_dir({"HOME": str(home), "XDG_CACHE_HOME": str(tmp_path / "xdg")}, site / rel) == \
        tmp_path / "xdg" / "ddtree-ops"
    assert cache_dir({"HOME": str(home), "DDTREE_OPS_CACHE": str(tmp_path / "c")}, checkout / rel) == tmp_path / "c"
    # this checkout: the cache beside pyproject.toml, as before the split
    import ddtree_ops.testing.sandbox.wheelcache as wc

    assert cache_dir({}, wc.__file__) == Path(__file__).resolve().parents[1] / ".cache"


def test_inventory_runs_the_standin_and_groups_a_multinode_server(tmp_path):
    import importlib.util

    import yaml

    from ddtree_ops.testing.sandbox import SandboxHost, inventory_doc

    hosts = [SandboxHost(name=f"sbx{i}", subnet=100 + i, netns=f"n{i}", veth=f"v{i}", dir=str(tmp_path / str(i)))
             for i in (1, 2, 3)]
    doc = inventory_doc(hosts, client_key=tmp_path / "id", known_hosts=tmp_path / "kh", load_seconds=0.3,
                        multinode=2)
    assert doc["all"]["vars"]["launch_module"] == "ddtree_ops.testing.standin"
    assert importlib.util.find_spec(doc["all"]["vars"]["launch_module"] + ".__main__") is not None
    p = tmp_path / "inventory.yaml"
    p.write_text(yaml.safe_dump(doc))
    inv = load_inventory(p)
    assert inv.hosts["sbx1"].address == "10.200.101.2" and inv.hosts["sbx3"].address == "10.200.103.2"
    assert list(doc["all"]["children"]["server1"]["hosts"]) == ["sbx2", "sbx3"]
    assert [inv.hosts[n].node_rank for n in ("sbx2", "sbx3")] == [0, 1]


def test_a_state_file_from_an_earlier_version_still_loads(tmp_path):
    from ddtree_ops.testing.sandbox import SandboxHost

    old = {"name": "sbx1", "index": 1, "subnet": 7, "netns": "ddt-abcd-1", "veth": "ddtabcdh1", "dir": "/x",
           "sshd_pid": 12, "init_pid": 13}
    h = SandboxHost.from_dict(old)
    assert (h.name, h.subnet, h.container_pid, h.address) == ("sbx1", 7, None, "10.200.7.2")
    assert SandboxHost.from_dict({**old, "container_pid": 14}).container_pid == 14


def test_sandbox_nvidia_smi_never_lists_a_process_that_reused_a_registrants_pid(tmp_path):
    """A killed stand-in leaves its 'GPU memory' file behind; when a later process gets its PID
    (under a busy run, the deploying controller itself), the sandbox's nvidia-smi must not report
    that process as holding GPU memory: the file's start time must be the live process's."""
    from ddtree_ops.testing.sandbox.hostfiles import GPU_DIR, NVIDIA_SMI

    with open(f"/proc/{os.getpid()}/stat") as fh:
        start = fh.read().rsplit(")", 1)[1].split()[19]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / str(os.getpid())).write_text(f"1000 {start}")  # the registrant itself
        (tmp_path / str(child.pid)).write_text(f"2000 {start}")  # its PID, now another process
        (tmp_path / "1").write_text("3000")  # an entry without a start time (older stand-in)
        script = NVIDIA_SMI.replace(repr(GPU_DIR), repr(str(tmp_path)))
        out = subprocess.run([sys.executable, "-c", script, "--query-compute-apps=pid,used_memory"],
                             capture_output=True, text=True, check=True).stdout.split("\n")
    finally:
        child.kill()
        child.wait()
    assert f"{os.getpid()}, 1000" in out and "1, 3000" in out
    assert f"{child.pid}, 2000" not in out, out


def test_a_low_inotify_instance_limit_is_raised_and_a_high_one_left_alone(tmp_path):
    from ddtree_ops.testing.sandbox.system import ensure_inotify_instances

    limit = tmp_path / "max_user_instances"
    limit.write_text("128\n")
    said = ensure_inotify_instances(limit, 1024)
    assert said == "fs.inotify.max_user_instances raised from 128 to 1024 (each sandbox host's systemd holds about 8)"
    assert limit.read_text() == "1024\n"
    limit.write_text("8192\n")
    assert ensure_inotify_instances(limit, 1024) is None
    assert limit.read_text() == "8192\n"
    assert ensure_inotify_instances(tmp_path / "absent", 1024) is None
