"""Local test hosts that behave like CT200, without a GPU.

Each sandbox host is a network namespace (its own address, 10.200.K.2) plus a private mount
namespace in which the production paths exist unchanged:

    /etc/systemd/system   → DIR/hosts/NAME/etc-systemd-system   (units)
    /var/log, /var/lib    → per-host folders (journal files, the ddtree-ops state dir)
    /opt                  → per-host folder holding /opt/venv_sglang, a real venv whose
                            site-packages has the real sglang 0.5.23 files and dist-info
                            (an overlay: the cached wheel tree below, the host's changes above)
    /run                  → a fresh tmpfs (sshd privsep dir, systemctl lock and status files)
    /usr/lib/systemd/system → an empty tmpfs (the machine's own units stay invisible)
    /usr/bin/systemctl, /usr/bin/journalctl → docker-systemctl-replacement wrappers

In there run Debian's sshd (its own ed25519 host key; root login by a generated key only) and
the systemctl replacement's init loop (so `Restart=` works). The host starts in the state
before a DDTree deploy: upstream files only, the DFlash unit active, the DDTree unit file
present at its old settings (budget 7, topk cap 1) and stopped. `down` ends every process in
the host's namespaces by PID, deletes the namespaces and leaves no mount behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from .errors import SandboxError
from .inventory import Host, load_inventory
from .localproc import pid_alive

SGLANG_VERSION = "0.5.23"
VENV_PATH = "/opt/venv_sglang"
PY_TAG = f"python{sys.version_info.major}.{sys.version_info.minor}"
SITE_PACKAGES = f"{VENV_PATH}/lib/{PY_TAG}/site-packages"
DDTREE_UNIT = "sglang-k26-ddtree.service"
DFLASH_UNIT = "sglang-k26-dflash-cg.service"
SERVER_PORT = 30000
REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(os.environ.get("DDTREE_OPS_CACHE", REPO_ROOT / ".cache"))
# Paths we mount over inside a host: the sandbox folder must not live under them.
_MOUNTED_OVER = ("/etc/systemd/system", "/var/log", "/var/lib", "/opt", "/run", "/usr/lib/systemd/system")
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ALLOC_LOCK = "/run/lock/ddtree-ops-sandbox.lock"
SSHD = os.environ.get("DDTREE_OPS_SSHD", "/usr/sbin/sshd")  # Debian's OpenSSH server


@dataclass
class SandboxHost:
    name: str
    index: int
    subnet: int  # K in 10.200.K.0/24
    netns: str
    veth: str
    dir: str
    sshd_pid: int | None = None
    init_pid: int | None = None

    @property
    def address(self) -> str:
        return f"10.200.{self.subnet}.2"

    @property
    def gateway(self) -> str:
        return f"10.200.{self.subnet}.1"


# ---------------------------------------------------------------------------------------------
# prerequisites


def missing_prerequisites() -> list[str]:
    """What this machine lacks to run sandbox hosts, each with how to get it."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root privileges (network and mount namespaces need root): run as root or with sudo")
    for tool, pkg in (("ip", "iproute2"), ("unshare", "util-linux"), ("nsenter", "util-linux"),
                      ("mount", "mount"), ("ssh-keygen", "openssh-client")):
        if not shutil.which(tool, path=_SYSTEM_PATH):
            missing.append(f"`{tool}` (apt-get install -y {pkg})")
    if not os.access(SSHD, os.X_OK):
        missing.append(f"OpenSSH server {SSHD} (apt-get install -y openssh-server)")
    if not os.access("/usr/lib/openssh/sftp-server", os.X_OK):
        missing.append("sftp-server /usr/lib/openssh/sftp-server (apt-get install -y openssh-sftp-server)")
    if not _systemctl3():
        missing.append("systemctl3 from docker-systemctl-replacement (pip install 'ddtree-ops[sandbox]')")
    for target in ("/usr/bin/systemctl", "/usr/bin/journalctl"):
        if not os.path.exists(target):
            missing.append(f"{target} to mount the replacement over (apt-get install -y systemd)")
    return missing


def _systemctl3() -> str | None:
    beside = Path(sys.executable).parent / "systemctl3"
    if beside.exists():
        return str(beside)
    return shutil.which("systemctl3")


def _journalctl3() -> str | None:
    beside = Path(sys.executable).parent / "journalctl3"
    return str(beside) if beside.exists() else shutil.which("journalctl3")


def _run(argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    env = {"PATH": _SYSTEM_PATH, "LANG": "C.UTF-8"}
    r = subprocess.run(argv, capture_output=True, text=True, env=env, **kw)
    if check and r.returncode != 0:
        raise SandboxError(f"command failed ({r.returncode}): {' '.join(argv)}\n{r.stderr.strip()}")
    return r


# ---------------------------------------------------------------------------------------------
# the sglang wheel, cached between runs


def sglang_site_tree() -> Path:
    """A folder holding `sglang/` and `sglang-0.5.23.dist-info/` extracted from the real wheel.

    Downloaded once with `pip download --no-deps` (the only network use, a package registry)
    and kept under .cache/ so later runs and CI re-runs need no download.
    """
    extracted = CACHE_DIR / f"sglang-{SGLANG_VERSION}-site"
    if (extracted / ".complete").exists():
        return extracted
    wheels = CACHE_DIR / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    with _file_lock(CACHE_DIR / ".sglang.lock"):
        if (extracted / ".complete").exists():
            return extracted
        found = sorted(wheels.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if not found:
            r = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels),
                 f"sglang=={SGLANG_VERSION}"],
                capture_output=True, text=True,
            )
            found = sorted(wheels.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
            if r.returncode != 0 or not found:
                raise SandboxError(
                    f"could not download sglang=={SGLANG_VERSION} with pip (needed for the test hosts' "
                    f"site-packages): {r.stderr.strip()[-500:]}"
                )
        tmp = extracted.with_name(extracted.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with zipfile.ZipFile(found[0]) as zf:
            zf.extractall(tmp)
        (tmp / ".complete").write_text(found[0].name + "\n")
        shutil.rmtree(extracted, ignore_errors=True)
        tmp.rename(extracted)
    return extracted


@contextlib.contextmanager
def _file_lock(path: Path | str):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------
# the sandbox


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
        return [SandboxHost(**h) for h in state.get("hosts", [])]

    # -- up ----------------------------------------------------------------------------------
    def up(self, n_hosts: int = 2, *, load_seconds: float = 0.5, timeout_s: float = 60.0,
           multinode: int = 0) -> list[dict]:
        """`multinode=N`: the last N hosts form one multi-node server (group `server1`)."""
        if not 1 <= n_hosts <= 32:
            raise SandboxError(f"--hosts must be 1..32, got {n_hosts}")
        if multinode and not 2 <= multinode <= n_hosts:
            raise SandboxError(f"--multinode must be 2..{n_hosts} (hosts), got {multinode}")
        missing = missing_prerequisites()
        if missing:
            raise SandboxError("cannot create sandbox hosts; missing:\n  - " + "\n  - ".join(missing))
        for p in _MOUNTED_OVER:
            if self.dir == Path(p) or str(self.dir).startswith(p + "/"):
                raise SandboxError(f"--dir {self.dir} lies under {p}, which each host mounts over; choose another folder")
        if self._load_state() is not None:
            self.down()  # running `up` again replaces the previous hosts cleanly
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        site_tree = sglang_site_tree()

        sid = "%04x" % random.randrange(0x10000)
        state: dict[str, Any] = {
            "id": sid, "created": time.time(), "hosts": [],
            "netns_mount_preexisting": _is_mountpoint("/run/netns"),
        }
        self._save_state(state)  # from here on, `down` can clean up whatever exists
        try:
            self._make_client_key()
            with _file_lock(_ALLOC_LOCK):
                subnets = _free_subnets(n_hosts)
                hosts = []
                for i, k in enumerate(subnets, start=1):
                    h = SandboxHost(name=f"sbx{i}", index=i, subnet=k, netns=f"ddt-{sid}-{i}",
                                    veth=f"ddt{sid}h{i}", dir=str(self.dir / "hosts" / f"sbx{i}"))
                    hosts.append(h)
                    state["hosts"].append(asdict(h))
                    self._save_state(state)
                    self._make_netns(h)
            self._write_inventory(hosts, load_seconds, multinode)
            inv = load_inventory(self.inventory_path)
            known_lines = []
            for h in hosts:
                known_lines.append(self._prepare_host_files(h, inv.hosts[h.name], site_tree))
            self.known_hosts.write_text("".join(known_lines))
            os.chmod(self.known_hosts, 0o600)
            for h in hosts:
                self._boot(h)
                state["hosts"] = [asdict(x) for x in hosts]
                self._save_state(state)
            self._wait_ready(hosts, inv, timeout_s)
        except BaseException:
            with contextlib.suppress(Exception):
                self.down()
            raise
        return self.status()

    def _make_client_key(self) -> None:
        for p in (self.client_key, self.client_key.with_suffix(".pub")):
            p.unlink(missing_ok=True)
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ddtree-ops-sandbox", "-f", str(self.client_key)])

    def _make_netns(self, h: SandboxHost) -> None:
        _run(["ip", "netns", "add", h.netns])
        _run(["ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns])
        _run(["ip", "addr", "add", f"{h.gateway}/24", "dev", h.veth])
        _run(["ip", "link", "set", h.veth, "up"])
        _run(["ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0"])
        _run(["ip", "-n", h.netns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", h.netns, "link", "set", "lo", "up"])

    def _write_inventory(self, hosts: list[SandboxHost], load_seconds: float, multinode: int = 0) -> None:
        doc = {
            "all": {
                "vars": {
                    "ssh_user": "root",
                    "ssh_port": 22,
                    "identity_file": str(self.client_key),
                    "known_hosts": str(self.known_hosts),
                    "connect_timeout": 5,
                    "python": f"{VENV_PATH}/bin/python",
                    "site_packages": SITE_PACKAGES,
                    "unit": DDTREE_UNIT,
                    "conflicts": [DFLASH_UNIT],
                    "state_dir": "/var/lib/ddtree-ops",
                    "port": SERVER_PORT,
                    "listen_host": "0.0.0.0",
                    # The stand-in accepts SGLang's launch flags; a real host runs sglang.launch_server.
                    "launch_module": "ddtree_ops.standin_server",
                    "model_path": "/models/Kimi-K2.6",
                    "draft_model_path": "/models/Kimi-K2.6-DFlash",
                    "tp": 8,
                    "budget": 16,
                    "topk_cap": 4,
                    "extra_args": [f"--standin-load-seconds={load_seconds}", "--standin-warmup-seconds=0.2"],
                    "health": {"load_deadline_s": 120, "poll_interval_s": 0.2,
                               "consecutive_successes": 2, "request_timeout_s": 10},
                },
                "children": {
                    "sandbox": {"hosts": {h.name: {"address": h.address} for h in hosts}},
                },
            }
        }
        if multinode:
            doc = multinode_inventory(doc, [h.name for h in hosts[-multinode:]])
        header = ("# Written by `ddtree-ops sandbox up`: local test hosts in network namespaces.\n"
                  "# Edit freely (e.g. fault knobs in extra_args); `sandbox up` rewrites it.\n")
        self.inventory_path.write_text(header + yaml.safe_dump(doc, sort_keys=False))

    def _prepare_host_files(self, h: SandboxHost, host: Host, site_tree: Path,
                            host_key: dict[str, bytes] | None = None) -> str:
        from .units import render_unit

        d = Path(h.dir)
        shutil.rmtree(d, ignore_errors=True)
        for sub in ("etc-systemd-system/multi-user.target.wants", "var-log/journal", "var-lib",
                    "opt", "ssh", "bin"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        # A real venv, relocated by a bind mount to /opt/venv_sglang inside the host.
        venv = d / "opt" / "venv_sglang"
        _run([sys.executable if not hasattr(sys, "base_prefix") else
              str(Path(sys.base_prefix) / "bin" / "python3"), "-m", "venv", "--without-pip", str(venv)])
        # site-packages is an overlay inside the host: the cached wheel tree below (never
        # written), this host's changes above. Real files to every reader, and a reset is an
        # empty folder instead of copying 6,000 files.
        (d / "site-upper").mkdir()
        (d / "site-work").mkdir()
        # The tool's own environment (torch, the stand-in) behind the real files: upstream sglang
        # stays first on sys.path, exactly as in the production venv.
        tool_site = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
        (d / "site-upper" / "zz-ddtree-ops-sandbox.pth").write_text(f"import site; site.addsitedir({tool_site!r})\n")

        # Units: the DFlash server runs; the DDTree unit is there at its old settings, stopped.
        old = replace(host, budget=7, topk_cap=1)
        (d / "etc-systemd-system" / DDTREE_UNIT).write_text(render_unit(old))
        (d / "etc-systemd-system" / DFLASH_UNIT).write_text(
            render_unit(replace(host, template="sglang-dflash.service.j2")))
        os.symlink(f"/etc/systemd/system/{DFLASH_UNIT}",
                   d / "etc-systemd-system" / "multi-user.target.wants" / DFLASH_UNIT)

        # sshd: own host key, root by key only.
        if host_key:
            for fname, data in host_key.items():
                (d / "ssh" / fname).write_bytes(data)
            os.chmod(d / "ssh" / "ssh_host_ed25519_key", 0o600)
        else:
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", h.name, "-f",
                  str(d / "ssh" / "ssh_host_ed25519_key")])
        shutil.copy(self.client_key.with_suffix(".pub"), d / "ssh" / "authorized_keys")
        (d / "ssh" / "sshd_config").write_text(
            f"ListenAddress {h.address}\nPort 22\n"
            "HostKey /run/ddtree-sandbox/ssh_host_ed25519_key\n"
            "PidFile /run/sshd.pid\n"
            "AuthorizedKeysFile /run/ddtree-sandbox/authorized_keys\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPrintMotd no\n"
            "MaxSessions 64\nMaxStartups 64:30:128\n"
            "Subsystem sftp /usr/lib/openssh/sftp-server\n"
            f"SetEnv PATH={_SYSTEM_PATH}\n"
        )
        systemctl3, journalctl3 = _systemctl3(), _journalctl3()
        (d / "bin" / "systemctl").write_text(
            f"#!/bin/sh\nexec {sys.executable} {systemctl3} -c MinimumYield=0.1 \"$@\"\n")
        (d / "bin" / "journalctl").write_text(f"#!/bin/sh\nexec {sys.executable} {journalctl3} \"$@\"\n")
        for f in ("systemctl", "journalctl"):
            os.chmod(d / "bin" / f, 0o755)
        (d / "boot.sh").write_text(_BOOT_SCRIPT.format(dir=d, sshd=SSHD, site_tree=site_tree, site_packages=SITE_PACKAGES, sshd_pidfile=d / "sshd.pid", init_pidfile=d / "init.pid"))
        pub = (d / "ssh" / "ssh_host_ed25519_key.pub").read_text().split()
        return f"{h.address} {pub[0]} {pub[1]}\n"

    def _boot(self, h: SandboxHost) -> None:
        d = Path(h.dir)
        log = open(d / "boot.log", "wb")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", h.netns, "unshare", "--mount", "--propagation", "private",
             "/bin/sh", str(d / "boot.sh")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env={"PATH": _SYSTEM_PATH, "LANG": "C.UTF-8", "HOME": "/root"},
            start_new_session=True,
        )
        log.close()
        # ip and unshare exec (no fork), so this PID becomes sshd's once the script execs it.
        h.sshd_pid = proc.pid
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SandboxError(f"{h.name}: boot failed:\n{(d / 'boot.log').read_text()[-2000:]}")
            if (d / "init.pid").exists() and _port_open(h.address, 22, 0.2):
                h.init_pid = int((d / "init.pid").read_text().strip() or 0) or None
                return
            time.sleep(0.05)
        raise SandboxError(f"{h.name}: sshd did not listen on {h.address}:22 within 15 s:\n"
                           f"{(d / 'boot.log').read_text()[-2000:]}")

    def _wait_ready(self, hosts: list[SandboxHost], inv, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        pending = {h.name: h for h in hosts}
        while pending and time.monotonic() < deadline:
            for name in list(pending):
                try:
                    r = httpx.get(inv.hosts[name].base_url + "/health", timeout=1.0)
                    if r.status_code == 200:
                        del pending[name]
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        if pending:
            name = next(iter(pending))
            log = Path(pending[name].dir) / "var-log" / "journal" / f"{DFLASH_UNIT}.log"
            tail = log.read_text()[-1500:] if log.exists() else "(no log)"
            raise SandboxError(f"{name}: server not healthy within {timeout_s:.0f} s; last log lines:\n{tail}")

    def reset_host(self, name: str) -> None:
        """Put one host back in its "before deploy" state: every process in it ended, its files
        rebuilt from the inventory, booted again. Its host key is kept (known_hosts stays valid)."""
        inv = load_inventory(self.inventory_path)
        state = self._load_state() or {}
        hosts = self.hosts()
        h = next((x for x in hosts if x.name == name), None)
        if h is None:
            raise SandboxError(f"no sandbox host {name!r} in {self.dir}")
        _kill_namespace_processes(h)
        key_dir = Path(h.dir) / "ssh"
        saved = {f: (key_dir / f).read_bytes() for f in ("ssh_host_ed25519_key", "ssh_host_ed25519_key.pub")}
        self._prepare_host_files(h, inv.hosts[name], sglang_site_tree(), host_key=saved)
        (Path(h.dir) / "init.pid").unlink(missing_ok=True)
        self._boot(h)
        state["hosts"] = [asdict(x) for x in hosts]
        self._save_state(state)
        self._wait_ready([h], inv, 60)

    # -- status ------------------------------------------------------------------------------
    def status(self) -> list[dict]:
        """Per host: the connection facts and whether sshd, the units and /health are up.

        The unit states come over real SSH, checked against the sandbox's known_hosts.
        """
        import httpx

        from .transport import connect

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
                "sshd_up": pid_alive(h.sshd_pid) and _port_open(host.address, host.ssh_port, 0.5),
                "ssh_ok": False, "units": {}, "active_unit": None, "health": None, "health_up": False,
            }
            try:
                with connect(host) as conn:
                    row["ssh_ok"] = True
                    for unit in (host.unit, *host.conflicts):
                        row["units"][unit] = conn.run(["systemctl", "is-active", unit], check=False).stdout.strip() or "unknown"
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
        killed = 0
        for hd in state.get("hosts", []):
            h = SandboxHost(**hd)
            killed += _kill_namespace_processes(h)
            if _netns_exists(h.netns):
                _run(["ip", "netns", "del", h.netns], check=False)
            if _link_exists(h.veth):
                _run(["ip", "link", "del", h.veth], check=False)
        if not state.get("netns_mount_preexisting") and _is_mountpoint("/run/netns"):
            with contextlib.suppress(OSError):
                if not os.listdir("/run/netns"):
                    _run(["umount", "/run/netns"], check=False)
        # Files we created; the folder itself goes too when nothing else is in it.
        shutil.rmtree(self.dir / "hosts", ignore_errors=True)
        for name in ("inventory.yaml", "known_hosts", "id_ed25519", "id_ed25519.pub", "sandbox.json"):
            (self.dir / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.dir.rmdir()
        return {"hosts": len(state.get("hosts", [])), "killed": killed}


def multinode_inventory(doc: dict[str, Any], names: list[str], group: str = "server1") -> dict[str, Any]:
    """A copy of a sandbox inventory document where `names` (rank 0 first) form one multi-node
    server: moved from the `sandbox` group into `group` with `multinode: true` and `node_rank`."""
    import copy

    doc = copy.deepcopy(doc)
    children = doc["all"]["children"]
    hosts = children["sandbox"]["hosts"]
    members = {}
    for rank, n in enumerate(names):
        members[n] = {**(hosts.pop(n) or {}), "node_rank": rank}
    children[group] = {"vars": {"multinode": True}, "hosts": members}
    return doc


_BOOT_SCRIPT = """\
# Runs as PID of the host (ip netns exec + unshare --mount): private mounts, then sshd.
set -eu
H={dir}
mount --make-rprivate /
mount --bind "$H/etc-systemd-system" /etc/systemd/system
mount --bind "$H/var-log" /var/log
mount --bind "$H/var-lib" /var/lib
mount --bind "$H/opt" /opt
mount -t overlay ddtree-site -o lowerdir={site_tree},upperdir="$H/site-upper",workdir="$H/site-work" {site_packages}
mount -t tmpfs -o mode=0755 ddtree-run /run
mkdir -p /run/sshd /run/systemd /run/lock /run/ddtree-sandbox
cp "$H/ssh/ssh_host_ed25519_key" "$H/ssh/authorized_keys" "$H/ssh/sshd_config" /run/ddtree-sandbox/
chmod 600 /run/ddtree-sandbox/ssh_host_ed25519_key
mount -t tmpfs -o mode=0755 ddtree-units /usr/lib/systemd/system
mount --bind "$H/bin/systemctl" /usr/bin/systemctl
mount --bind "$H/bin/journalctl" /usr/bin/journalctl
cd /
# The supervisor: starts the enabled units and restarts them per Restart=.
setsid systemctl -c InitLoopSleep=1 init </dev/null >/var/log/systemctl-init.log 2>&1 &
echo $! > {init_pidfile}
exec {sshd} -D -e -f /run/ddtree-sandbox/sshd_config
"""


def _free_subnets(n: int) -> list[int]:
    out = _run(["ip", "-o", "-4", "addr", "show"]).stdout
    used = set()
    for line in out.splitlines():
        for tok in line.split():
            if tok.startswith("10.200."):
                with contextlib.suppress(ValueError, IndexError):
                    used.add(int(tok.split(".")[2]))
    free = [k for k in range(1, 250) if k not in used]
    if len(free) < n:
        raise SandboxError(f"not enough free 10.200.K.0/24 subnets for {n} hosts")
    return free[:n]


def _netns_exists(name: str) -> bool:
    return os.path.exists(f"/run/netns/{name}")


def _link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def _is_mountpoint(path: str) -> bool:
    try:
        with open("/proc/self/mountinfo") as fh:
            return any(line.split()[4] == path for line in fh)
    except OSError:
        return False


def _port_open(addr: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return True
    except OSError:
        return False



def _ns_id(pid: int | str, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def _namespace_pids(h: SandboxHost) -> list[int]:
    """PIDs living in this host's network namespace or in sshd's mount namespace."""
    targets = set()
    with contextlib.suppress(OSError):
        targets.add(("net", f"net:[{os.stat(f'/run/netns/{h.netns}').st_ino}]"))
    if h.sshd_pid and pid_alive(h.sshd_pid):
        mnt = _ns_id(h.sshd_pid, "mnt")
        if mnt and mnt != _ns_id("self", "mnt"):
            targets.add(("mnt", mnt))
    if not targets:
        return []
    me = os.getpid()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        for kind, ident in targets:
            if _ns_id(entry, kind) == ident:
                pids.append(int(entry))
                break
    return pids


def _kill_namespace_processes(h: SandboxHost) -> int:
    """SIGTERM, then SIGKILL, every process in the host's namespaces; returns how many ended.

    Rescans between rounds: the supervisor may fork a restart while we are stopping it.
    """
    ended: set[int] = set()
    for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGKILL, signal.SIGKILL):
        pids = [p for p in _namespace_pids(h) if pid_alive(p)]
        if not pids:
            break
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
            ended.add(p)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            # Our own children (the boot process) must be reaped here, not by PID 1.
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass
            if not any(pid_alive(p) for p in pids):
                break
            time.sleep(0.05)
    return len(ended)
