"""`Sandbox`: a folder's set of test hosts, brought up, inspected, reset and taken down."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ddtree_ops.config.inventory import load_inventory
from ddtree_ops.host.localproc import pid_alive

from . import container, smg
from .errors import SandboxError
from .hostfiles import _prepare_host_files, host_key_files, inventory_doc, site_mount_unit, write_inventory
from .layout import DDTREE_UNIT, DFLASH_UNIT, SITE_PACKAGES, SSHD_UNIT, SandboxHost
from .namespaces import (
    ALLOC_LOCK,
    NETNS_DIR,
    _free_subnets,
    _is_mountpoint,
    delete_netns,
    make_netns,
    release_netns_mount,
)
from .prerequisites import missing_prerequisites
from .processes import _kill_namespace_processes, _port_open, wait_healthy
from .system import ensure_inotify_instances, file_lock, run
from .wheelcache import sglang_site_tree

# What `down` deletes in the sandbox folder (besides hosts/); the folder goes too when then empty.
_FILES = ("inventory.yaml", "known_hosts", "id_ed25519", "id_ed25519.pub", "sandbox.json", smg.KEY_FILE,
          smg.LOG_FILE)


# The host's folders a reset in place rewrites: nothing may be mounted below them then.
_RESET_PATHS = ("/etc/systemd/system", "/var/lib", "/var/log", "/opt")


class Sandbox:
    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory).resolve()
        self.state_file = self.dir / "sandbox.json"
        self.inventory_path = self.dir / "inventory.yaml"
        self.known_hosts = self.dir / "known_hosts"
        self.client_key = self.dir / "id_ed25519"

    # -- state -------------------------------------------------------------------------------
    def _load_state(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return None

    def _save_state(self, state: dict[str, Any]) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, self.state_file)

    def hosts(self) -> list[SandboxHost]:
        state = self._load_state() or {}
        return [SandboxHost.from_dict(h) for h in state.get("hosts", [])]

    # -- up ----------------------------------------------------------------------------------
    def up(self, n_hosts: int = 2, *, load_seconds: float = 0.5, timeout_s: float = 60.0,
           multinode: int = 0, router: bool = False, shared: tuple[str, ...] = ()) -> list[dict]:
        """`multinode=N`: the last N hosts form one multi-node server (group `server1`).
        `shared`: folders of this machine every host sees read-write at the same path (a test
        suite's temp folder, where the tool's test hooks on a host write their pause markers).
        `router`: a real smg in front of the hosts' servers (see smg.py); the inventory gets a
        `router:` section naming it, and its key is in `router_key_file`."""
        if not 1 <= n_hosts <= 32:
            raise SandboxError(f"--hosts must be 1..32, got {n_hosts}")
        if multinode and not 2 <= multinode <= n_hosts:
            raise SandboxError(f"--multinode must be 2..{n_hosts} (hosts), got {multinode}")
        missing = missing_prerequisites() + ([m] if router and (m := smg.smg_missing()) else [])
        if missing:
            raise SandboxError("cannot create sandbox hosts; missing:\n  - " + "\n  - ".join(missing))
        site_tree = sglang_site_tree()
        said = ensure_inotify_instances()
        if said:
            print(f"sandbox: {said}", file=sys.stderr)
        if self._load_state() is not None:
            self.down()  # running `up` again replaces the previous hosts cleanly
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)

        sid = "%04x" % random.randrange(0x10000)
        state: dict[str, Any] = {
            "id": sid, "created": time.time(), "hosts": [],
            "netns_mount_preexisting": _is_mountpoint(NETNS_DIR),
            "shared": [str(Path(p).resolve()) for p in shared],
        }
        self._save_state(state)  # from here on, `down` can clean up whatever exists
        try:
            self._make_client_key()
            with file_lock(ALLOC_LOCK):
                subnets = _free_subnets(n_hosts)
                hosts = []
                for i, k in enumerate(subnets, start=1):
                    h = SandboxHost(name=f"sbx{i}", subnet=k, netns=f"ddt-{sid}-{i}",
                                    veth=f"ddt{sid}h{i}", dir=str(self.dir / "hosts" / f"sbx{i}"))
                    hosts.append(h)
                    state["hosts"].append(asdict(h))
                    self._save_state(state)
                    make_netns(h)
            doc = inventory_doc(hosts, client_key=self.client_key, known_hosts=self.known_hosts,
                                load_seconds=load_seconds, multinode=multinode)
            router_port = smg.free_port() if router else None
            if router_port:
                smg.write_key(self.router_key_file)
                doc["all"]["vars"]["router"] = {"kind": "smg", "url": f"http://127.0.0.1:{router_port}",
                                                "admin_key_env": smg.ROUTER_KEY_ENV, "timeout_s": 30}
            write_inventory(self.inventory_path, doc)
            inv = load_inventory(self.inventory_path)
            known_lines = [_prepare_host_files(h, inv.hosts[h.name], self.client_key.with_suffix(".pub"))
                           for h in hosts]
            self.known_hosts.write_text("".join(known_lines))
            os.chmod(self.known_hosts, 0o600)
            # Booted side by side: each container waits mostly on its own systemd.
            booting = [(h, container.start(h, site_tree, state["shared"])) for h in hosts]
            state["hosts"] = [asdict(x) for x in hosts]
            self._save_state(state)
            for h, proc in booting:
                container.wait_booted(h, proc)
            wait_healthy(hosts, inv, timeout_s)
            if router_port:
                # Each server once: rank 0 of a multi-node server (the other ranks serve nothing).
                workers = [inv.hosts[h.name].base_url for h in hosts if inv.hosts[h.name].node_rank == 0]
                state["router"] = smg.start(self.dir, workers, router_port)
                self._save_state(state)
                smg.wait_ready(state["router"])
        except BaseException:
            with contextlib.suppress(Exception):
                self.down()
            raise
        return self.status()

    # -- the router (`up(router=True)`) ------------------------------------------------------
    @property
    def router_key_file(self) -> Path:
        return self.dir / smg.KEY_FILE

    def router(self) -> dict[str, Any] | None:
        """The router's record (url, pid, key_file, key_env, log, workers), or None without one."""
        return (self._load_state() or {}).get("router")

    def router_env(self) -> dict[str, str]:
        """{ROUTER_KEY_ENV: key}: the environment a tool run against the sandbox inventory needs
        for its `router:` (empty without a router)."""
        info = self.router()
        return {smg.ROUTER_KEY_ENV: smg.read_key(info["key_file"])} if info else {}

    def router_status(self) -> dict[str, Any] | None:
        """The router's row for `status`: url, pid, up, key_env, key_file, its workers; None
        without a router."""
        info = self.router()
        return smg.status(info) if info else None

    def _make_client_key(self) -> None:
        for p in (self.client_key, self.client_key.with_suffix(".pub")):
            p.unlink(missing_ok=True)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ddtree-ops-sandbox", "-f", str(self.client_key)])

    def _host(self, name: str) -> SandboxHost:
        h = next((x for x in self.hosts() if x.name == name), None)
        if h is None:
            raise SandboxError(f"no sandbox host {name!r} in {self.dir}")
        return h

    def reset_host(self, name: str) -> str:
        """Put one host back in its "before deploy" state: its units, sessions and agents ended,
        its files rebuilt from the inventory, DFlash serving again. Done in place (systemd keeps
        running: seconds faster than a reboot); a host that cannot be reset in place (its
        container gone, a step failing) is rebooted from fresh files. Its host key is kept
        (known_hosts stays valid). Returns how: "in place", or "rebooted: WHY"."""
        inv = load_inventory(self.inventory_path)
        h = self._host(name)
        pub = self.client_key.with_suffix(".pub")
        how = "in place"
        try:
            self._reset_in_place(h, inv.hosts[name], pub)
        except SandboxError as e:
            how = f"rebooted: {e}"
            self._reboot(h, inv.hosts[name], pub)
        wait_healthy([h], inv, 60)
        return how

    def _reset_in_place(self, h: SandboxHost, host, client_pub: Path) -> None:
        if container.leader(h) is None:
            raise SandboxError(f"{h.name}: not running")
        mount = site_mount_unit()
        # Every process a test or the tool left: the units (and their children, by cgroup), the
        # tool's transient units, and every SSH session (sshd's cgroup; the listener comes back).
        container.inside(h, ["systemctl", "stop", DDTREE_UNIT, DFLASH_UNIT, "ddtree-ops-*", "ddtree-sandbox-orphan-*"],
                         check=False)
        for unit in (SSHD_UNIT, DDTREE_UNIT, DFLASH_UNIT):
            container.kill_cgroup(h, unit)
        if container.inside(h, ["systemctl", "stop", mount], check=False).returncode != 0:
            # Busy (a process a test started still holds a file open): detach it; the layers
            # below are written anew and the unit mounts a fresh overlay.
            container.inside(h, ["umount", "-l", SITE_PACKAGES])
        # A mount a test left inside the host (a full-disk tmpfs, say) would outlive a reset in
        # place: such a host is rebooted instead.
        targets = container.inside(h, ["findmnt", "-rn", "-o", "TARGET"]).stdout.split()
        extra = [t for t in targets if any(t.startswith(p + "/") for p in _RESET_PATHS)]
        if extra:
            raise SandboxError(f"{h.name}: mounts left inside: {', '.join(extra[:3])}")
        key = host_key_files(h)
        _prepare_host_files(h, host, client_pub, host_key=key, in_place=True)
        container.inside(h, ["systemctl", "daemon-reload"])
        container.inside(h, ["systemctl", "reset-failed"], check=False)
        container.inside(h, ["systemctl", "start", mount, SSHD_UNIT, DFLASH_UNIT])

    def _reboot(self, h: SandboxHost, host, client_pub: Path) -> None:
        key = host_key_files(h)
        _kill_namespace_processes(h)
        _prepare_host_files(h, host, client_pub, host_key=key)
        state = self._load_state() or {}
        proc = container.start(h, sglang_site_tree(), state.get("shared", []))
        state["hosts"] = [asdict(h) if x["name"] == h.name else x for x in state.get("hosts", [])]
        self._save_state(state)
        container.wait_booted(h, proc)

    # -- inside a host (for tests and status) ------------------------------------------------
    def inside(self, name: str, argv: list[str], check: bool = True):
        """`argv` run as root inside host `name` (not over SSH): a CompletedProcess."""
        return container.inside(self._host(name), argv, check=check)

    def inside_argv(self, name: str, argv: list[str]) -> list[str]:
        """The machine's command line that runs `argv` inside host `name` (for a process the
        caller starts and reads as it runs)."""
        return container.inside_argv(self._host(name), argv)

    def stop_sshd(self, name: str) -> None:
        """The host unreachable over SSH: its sshd unit stopped and every session ended."""
        self.inside(name, ["systemctl", "stop", SSHD_UNIT])
        container.kill_cgroup(self._host(name), SSHD_UNIT)

    def start_sshd(self, name: str) -> None:
        """The host's sshd started again; returns once it listens."""
        h = self._host(name)
        self.inside(name, ["systemctl", "reset-failed", SSHD_UNIT], check=False)
        self.inside(name, ["systemctl", "start", SSHD_UNIT])
        deadline = time.monotonic() + 20
        while not _port_open(h.address, 22, 0.3):
            if time.monotonic() > deadline:
                raise SandboxError(f"{name}: sshd did not listen again within 20 s")
            time.sleep(0.05)

    # -- status ------------------------------------------------------------------------------
    def status(self) -> list[dict]:
        """Per host: the connection facts and whether sshd, the units and /health are up.

        The unit states come over real SSH, checked against the sandbox's known_hosts.
        """
        import httpx

        from ddtree_ops.host.transport import connect

        if self._load_state() is None:
            raise SandboxError(f"no sandbox in {self.dir} (run `ddtree-ops sandbox up --dir {self.dir}`)")
        inv = load_inventory(self.inventory_path)
        rows = []
        for h in self.hosts():
            host = inv.hosts[h.name]
            row: dict[str, Any] = {
                "name": h.name, "address": host.address, "ssh_port": host.ssh_port, "user": host.ssh_user,
                "identity_file": host.identity_file, "known_hosts": host.known_hosts,
                "site_packages": host.site_packages, "unit": host.unit, "conflicts": list(host.conflicts),
                "base_url": host.base_url, "netns": h.netns,
                "sshd_up": pid_alive(h.container_pid) and _port_open(host.address, host.ssh_port, 0.5),
                "ssh_ok": False, "units": {}, "active_unit": None, "health": None, "health_up": False,
            }
            try:
                with connect(host) as conn:
                    row["ssh_ok"] = True
                    for unit in (host.unit, *host.conflicts):
                        row["units"][unit] = (conn.run(["systemctl", "is-active", unit], check=False).stdout.strip()
                                              or "unknown")
                    row["active_unit"] = next((u for u, s in row["units"].items() if s == "active"), None)
            except Exception as e:  # a broken host is a row, not a crash
                row["ssh_error"] = str(e)
            row["unit_up"] = row["units"].get(host.unit) == "active"
            try:
                r = httpx.get(host.base_url + "/health", timeout=2.0)
                row["health"] = r.status_code
                row["health_up"] = r.status_code == 200
            except httpx.HTTPError as e:
                row["health"] = type(e).__name__
            rows.append(row)
        return rows

    # -- down --------------------------------------------------------------------------------
    def down(self) -> dict[str, int]:
        """Stop every process we started (by PID), delete namespaces, leave no mount."""
        state = self._load_state()
        if state is None:
            return {"hosts": 0, "killed": 0}
        killed = smg.stop(state["router"]) if state.get("router") else 0
        for hd in state.get("hosts", []):
            h = SandboxHost.from_dict(hd)
            killed += _kill_namespace_processes(h)
            delete_netns(h)
        release_netns_mount(bool(state.get("netns_mount_preexisting")))
        # Files we created; the folder itself goes too when nothing else is in it.
        shutil.rmtree(self.dir / "hosts", ignore_errors=True)
        for name in _FILES:
            (self.dir / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.dir.rmdir()
        return {"hosts": len(state.get("hosts", [])), "killed": killed}
