"""Each host's files (venv, units, sshd, its /etc overlay) and the sandbox inventory."""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import sys
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from ddtree_ops.config.inventory import Host

from .layout import (
    DDTREE_UNIT,
    DFLASH_UNIT,
    DRAFT_MODEL_PATH,
    MODEL_PATH,
    SANDBOX_RUN,
    SECRETS_CONFIG,
    SERVER_PORT,
    SITE_PACKAGES,
    SSHD_UNIT,
    STANDIN_MODULE,
    VENV_PATH,
    SandboxHost,
)
from ..standin.args import CALIBRATION_CACHE_ENV
from .prerequisites import SFTP_SERVER, SSHD
from .system import SYSTEM_PATH, run

HOST_KEY = "ssh_host_ed25519_key"


def inventory_doc(hosts: list[SandboxHost], *, client_key: Path, known_hosts: Path, load_seconds: float,
                  multinode: int = 0) -> dict[str, Any]:
    """The sandbox inventory: every host in group `sandbox`, or the last `multinode` in `server1`."""
    doc = {
        "all": {
            "vars": {
                "ssh_user": "root",
                "ssh_port": 22,
                "identity_file": str(client_key),
                "known_hosts": str(known_hosts),
                "connect_timeout": 5,
                "python": f"{VENV_PATH}/bin/python",
                "site_packages": SITE_PACKAGES,
                "unit": DDTREE_UNIT,
                "conflicts": [DFLASH_UNIT],
                "state_dir": "/var/lib/ddtree-ops",
                "port": SERVER_PORT,
                "listen_host": "0.0.0.0",
                # The stand-in accepts SGLang's launch flags; a real host runs sglang.launch_server.
                "launch_module": STANDIN_MODULE,
                "model_path": MODEL_PATH,
                "draft_model_path": DRAFT_MODEL_PATH,
                "tp": 8,
                "budget": 16,
                "topk_cap": 4,
                "extra_args": [f"--standin-load-seconds={load_seconds}", "--standin-warmup-seconds=0.2"],
                "health": {"load_deadline_s": 120, "poll_interval_s": 0.2,
                           "consecutive_successes": 2, "request_timeout_s": 10,
                           # No soak by default: the tests that exercise it ask for one.
                           "min_healthy_s": 0},
            },
            "children": {
                "sandbox": {"hosts": {h.name: {"address": h.address} for h in hosts}},
            },
        }
    }
    if multinode:
        doc = multinode_inventory(doc, [h.name for h in hosts[-multinode:]])
    return doc


def write_inventory(path: Path, doc: dict[str, Any]) -> None:
    header = ("# Written by `ddtree-ops sandbox up`: local test hosts in network namespaces.\n"
              "# Edit freely (e.g. fault knobs in extra_args); `sandbox up` rewrites it.\n")
    path.write_text(header + yaml.safe_dump(doc, sort_keys=False))


def multinode_inventory(doc: dict[str, Any], names: list[str], group: str = "server1") -> dict[str, Any]:
    """A copy of a sandbox inventory document where `names` (rank 0 first) form one multi-node
    server: moved from the `sandbox` group into `group` with `multinode: true` and `node_rank`."""
    doc = copy.deepcopy(doc)
    children = doc["all"]["children"]
    hosts = children["sandbox"]["hosts"]
    members = {}
    for rank, n in enumerate(names):
        members[n] = {**(hosts.pop(n) or {}), "node_rank": rank}
    children[group] = {"vars": {"multinode": True}, "hosts": members}
    return doc


# The sandbox hosts have no GPU. Their `nvidia-smi` (on the PATH sshd gives sessions) lists the
# processes that registered GPU memory in GPU_DIR (a file per PID holding "MiB START [SERVER]",
# SERVER: a leftover listed only once that server is gone; the
# stand-in does, and its --standin-orphan-gpu-seconds child), as long as they are alive; only the
# query the tool sends is answered. START is the registrant's start time (field 22 of
# /proc/PID/stat): a killed stand-in leaves its file behind, and once its PID is reused by
# another process (the controller itself, under a busy test run) that process must not be listed.
GPU_BIN = f"{SANDBOX_RUN}/bin"
GPU_DIR = f"{SANDBOX_RUN}/gpu"
NVIDIA_SMI = f"""import os, sys
if "--query-compute-apps=pid,used_memory" not in sys.argv:
    sys.exit("sandbox nvidia-smi: only --query-compute-apps=pid,used_memory --format=csv,noheader,nounits")
d = {GPU_DIR!r}
for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
    try:
        with open(f"/proc/{{name}}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        entry = open(os.path.join(d, name)).read().split()
        mib = int(entry[0]) if entry else 0
    except (OSError, ValueError, IndexError):
        continue
    if len(entry) > 2 and os.path.exists(f"/proc/{{entry[2]}}"):
        continue  # a leftover of a server that still runs: it holds nothing of its own yet
    if fields[0] != "Z" and (len(entry) < 2 or entry[1] == fields[19]):
        print(f"{{name}}, {{mib}}")
"""


def write_secrets_config(h: SandboxHost, options: dict[str, str], *, mode: int = 0o600) -> str:
    """Provision the host's secrets_config as an operator does: SGLang options (`api-key`, ...)
    as a YAML file at SECRETS_CONFIG, every value quoted (an unquoted `0123` would be the YAML
    number 83), mode `mode` (0600: the preflight refuses anything group or others can read), owned
    by root (the sandbox runs as root; the units run as User=root), in a 0700 folder. Returns the
    path on the host for the inventory's `secrets_config`. A reset of the host removes it."""
    local = Path(h.dir) / "var-lib" / Path(SECRETS_CONFIG).relative_to("/var/lib")
    local.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(local.parent, 0o700)
    text = "".join(f"{key}: {json.dumps(str(value))}\n" for key, value in options.items())
    fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("# SGLang --config file: secret options only. Provisioned by the operator, not by ddtree-ops.\n")
        fh.write(text)
    os.chmod(local, mode)
    return SECRETS_CONFIG


def _base_python() -> str:
    """The interpreter the host venv is made from: the base installation, not our venv."""
    return str(Path(sys.base_prefix) / "bin" / "python3")


def _tool_site_packages() -> str:
    """This environment's site-packages: ddtree-ops itself (installed, or the editable install's
    finder for a checkout), torch."""
    return next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))


def _tool_folders() -> list[str]:
    """The tool's site-packages and, for an editable install (whose finder is a .pth file's code),
    the checkout that holds the ddtree_ops package."""
    import ddtree_ops

    folders = [_tool_site_packages(), str(Path(ddtree_ops.__file__).resolve().parents[1])]
    return list(dict.fromkeys(folders))


# The folders of HOST_DIR bound into the host at production paths (see container.py), and the
# sandbox's own folder at SANDBOX_RUN. A reset in place empties them (never deletes them: the
# running container holds each by its inode) and writes them anew; var-log keeps the journal.
BOUND = ("etc-systemd-system", "var-lib", "opt", "run")


@functools.cache
def site_mount_unit() -> str:
    """The name of the mount unit of the host's site-packages (systemd-escape of the path; the
    path is a constant, so asked once per process, not at every host's reset)."""
    return run(["systemd-escape", "--path", "--suffix=mount", SITE_PACKAGES]).stdout.strip()


def _empty(folder: Path, keep: tuple[str, ...] = ()) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for child in folder.iterdir():
        if child.name in keep:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def _prepare_host_files(h: SandboxHost, host: Host, client_pub: Path,
                        host_key: dict[str, bytes] | None = None, *, in_place: bool = False) -> str:
    """HOST_DIR in the state before a DDTree deploy; returns the known_hosts line. `host_key`
    (file name → bytes) keeps the host's key across a reset. `in_place`: the host is running
    (its units and site-packages mount stopped); only the bound folders' contents are rewritten,
    the journal and /etc's overlay stay."""
    from ddtree_ops.artifacts.units import render_unit

    d = Path(h.dir)
    if not in_place:
        shutil.rmtree(d, ignore_errors=True)
        (d / "var-log" / "journal").mkdir(parents=True)
        write_etc_overlay(d / "etc-upper", h)
    for sub in BOUND:
        # site-tree is where the wheel tree is bound in: a new folder would not be that mount.
        _empty(d / sub, keep=("site-tree",))
    run_dir = d / "run"
    for sub in ("bin", "gpu", "site-upper", "site-work", "site-tree"):
        (run_dir / sub).mkdir(exist_ok=sub == "site-tree")
    units = d / "etc-systemd-system"
    (units / "multi-user.target.wants").mkdir()
    # A real venv, relocated by a bind mount to /opt/venv_sglang inside the host.
    venv = d / "opt" / "venv_sglang"
    run([_base_python(), "-m", "venv", "--without-pip", str(venv)])
    for model in (MODEL_PATH, DRAFT_MODEL_PATH):  # what the launch line names, readable by the unit
        folder = d / "opt" / Path(model).relative_to("/opt")
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}\n")
    # site-packages is an overlay inside the host (a mount unit, see container.py): the cached wheel
    # tree below (never written), this host's changes above. Real files to every reader, and a reset
    # is an empty folder instead of copying 6,000 files.
    # The tool's own environment (the whole ddtree_ops package with the stand-in, torch) behind
    # the real files: upstream sglang stays first on sys.path, exactly as in the production venv.
    # Folder lines, not code: the launch check's isolated parse (`python -I -S`) puts a .pth
    # file's folders on sys.path but never runs its `import` lines.
    (run_dir / "site-upper" / "zz-ddtree-ops-sandbox.pth").write_text(
        "".join(f"{p}\n" for p in _tool_folders()))

    # Units: the DFlash server runs; the DDTree unit is there at its old settings, stopped.
    old = replace(host, budget=7, topk_cap=1)
    (units / DDTREE_UNIT).write_text(render_unit(old))
    (units / DFLASH_UNIT).write_text(render_unit(replace(host, template="sglang-dflash.service.j2")))
    os.symlink(f"/etc/systemd/system/{DFLASH_UNIT}", units / "multi-user.target.wants" / DFLASH_UNIT)

    # sshd: own host key, root by key only.
    if host_key:
        for fname, data in host_key.items():
            (run_dir / fname).write_bytes(data)
    else:
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", h.name, "-f", str(run_dir / HOST_KEY)])
    os.chmod(run_dir / HOST_KEY, 0o600)
    shutil.copy(client_pub, run_dir / "authorized_keys")
    (run_dir / "sshd_config").write_text(
        f"ListenAddress {h.address}\nPort 22\n"
        f"HostKey {SANDBOX_RUN}/{HOST_KEY}\n"
        "PidFile /run/sshd.pid\n"
        f"AuthorizedKeysFile {SANDBOX_RUN}/authorized_keys\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPrintMotd no\n"
        "MaxSessions 64\nMaxStartups 64:30:128\n"
        f"Subsystem sftp {SFTP_SERVER}\n"
        f"SetEnv PATH={GPU_BIN}:{SYSTEM_PATH}\n"
    )
    (run_dir / "bin" / "nvidia-smi").write_text(f"#!{sys.executable}\n" + NVIDIA_SMI)
    os.chmod(run_dir / "bin" / "nvidia-smi", 0o755)
    pub = (run_dir / f"{HOST_KEY}.pub").read_text().split()
    return f"{h.address} {pub[0]} {pub[1]}\n"


def host_key_files(h: SandboxHost) -> dict[str, bytes]:
    """The host's sshd key pair (file name → bytes), to keep across a reset."""
    run_dir = Path(h.dir) / "run"
    return {f: (run_dir / f).read_bytes() for f in (HOST_KEY, f"{HOST_KEY}.pub")}


def write_etc_overlay(upper: Path, h: SandboxHost) -> None:
    """The host's own /etc on top of the machine's (an overlay): its machine id and name, its
    sshd unit (Debian's ssh.service masked: it reads the machine's /etc/ssh), the site-packages
    mount, and the runtime folders the sandbox's files need. Sandbox plumbing lives in
    /etc/systemd/system.control so that /etc/systemd/system holds exactly what production has."""
    control = upper / "systemd" / "system.control"
    for sub in ("local-fs.target.wants", "multi-user.target.wants"):
        (control / sub).mkdir(parents=True)
    (upper / "machine-id").write_text(uuid.uuid4().hex + "\n")
    (upper / "hostname").write_text(h.name + "\n")
    # Every unit's environment: the stand-in keeps the payload's calibrations in the host's own
    # volatile /var (testing/standin/calibration.py; gone when the host reboots).
    (upper / "systemd" / "system.conf.d").mkdir(parents=True)
    (upper / "systemd" / "system.conf.d" / "ddtree-sandbox.conf").write_text(
        f"[Manager]\nDefaultEnvironment={CALIBRATION_CACHE_ENV}=/var/cache/ddtree-standin\n")
    (upper / "tmpfiles.d").mkdir()
    (upper / "tmpfiles.d" / "ddtree-sandbox.conf").write_text("d /run/sshd 0755 root root -\n")
    os.symlink("/dev/null", control / "ssh.service")
    (control / SSHD_UNIT).write_text(
        "[Unit]\nDescription=OpenSSH server of the sandbox host\nAfter=network.target\n\n"
        "[Service]\n"
        f"ExecStartPre=/usr/bin/mkdir -p -m 0755 /run/sshd\n"
        f"ExecStart={SSHD} -D -e -f {SANDBOX_RUN}/sshd_config\n"
        "ExecReload=/bin/kill -HUP $MAINPID\n"
        # As Debian's ssh.service: restarting sshd leaves the sessions (and their agents) alone.
        "KillMode=process\nRestart=on-failure\nRestartSec=1\n\n"
        "[Install]\nWantedBy=multi-user.target\n")
    os.symlink(f"../{SSHD_UNIT}", control / "multi-user.target.wants" / SSHD_UNIT)
    mount = site_mount_unit()
    (control / mount).write_text(
        "[Unit]\nDescription=site-packages of the host venv: the sglang wheel below, this host's changes above\n"
        "DefaultDependencies=no\nConflicts=umount.target\nBefore=local-fs.target umount.target\n\n"
        f"[Mount]\nWhat=ddtree-site\nWhere={SITE_PACKAGES}\nType=overlay\n"
        f"Options=lowerdir={SANDBOX_RUN}/site-tree,upperdir={SANDBOX_RUN}/site-upper,"
        f"workdir={SANDBOX_RUN}/site-work\n")
    os.symlink(f"../{mount}", control / "local-fs.target.wants" / mount)
