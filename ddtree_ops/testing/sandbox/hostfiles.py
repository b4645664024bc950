"""Each host's files (venv, units, sshd, systemctl wrappers, boot.sh) and the sandbox inventory."""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from ddtree_ops.config.inventory import Host

from .boot import BOOT_SCRIPT, boot_script
from .layout import (
    DDTREE_UNIT,
    DFLASH_UNIT,
    SECRETS_CONFIG,
    SERVER_PORT,
    SITE_PACKAGES,
    STANDIN_MODULE,
    VENV_PATH,
    SandboxHost,
)
from .prerequisites import SFTP_SERVER, journalctl3, systemctl3
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
                "model_path": "/models/Kimi-K2.6",
                "draft_model_path": "/models/Kimi-K2.6-DFlash",
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
# processes that registered GPU memory in GPU_DIR (a file per PID holding "MiB START": the
# stand-in does, and its --standin-orphan-gpu-seconds child), as long as they are alive; only the
# query the tool sends is answered. START is the registrant's start time (field 22 of
# /proc/PID/stat): a killed stand-in leaves its file behind, and once its PID is reused by
# another process (the controller itself, under a busy test run) that process must not be listed.
GPU_BIN = "/run/ddtree-sandbox/bin"
GPU_DIR = "/run/ddtree-sandbox/gpu"
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
    finder for a checkout), torch, the systemctl replacement."""
    return next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))


def _prepare_host_files(h: SandboxHost, host: Host, client_pub: Path,
                        host_key: dict[str, bytes] | None = None) -> str:
    """(Re)create HOST_DIR in the state before a DDTree deploy; returns the known_hosts line.
    `host_key` (file name → bytes) keeps the host's key across a reset."""
    from ddtree_ops.artifacts.units import render_unit

    d = Path(h.dir)
    shutil.rmtree(d, ignore_errors=True)
    for sub in ("etc-systemd-system/multi-user.target.wants", "var-log/journal", "var-lib",
                "opt", "ssh", "bin"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    # A real venv, relocated by a bind mount to /opt/venv_sglang inside the host.
    venv = d / "opt" / "venv_sglang"
    run([_base_python(), "-m", "venv", "--without-pip", str(venv)])
    # site-packages is an overlay inside the host (boot.sh): the cached wheel tree below (never
    # written), this host's changes above. Real files to every reader, and a reset is an empty
    # folder instead of copying 6,000 files.
    (d / "site-upper").mkdir()
    (d / "site-work").mkdir()
    # The tool's own environment (the whole ddtree_ops package with the stand-in, torch) behind
    # the real files: upstream sglang stays first on sys.path, exactly as in the production venv.
    (d / "site-upper" / "zz-ddtree-ops-sandbox.pth").write_text(
        f"import site; site.addsitedir({_tool_site_packages()!r})\n")

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
        os.chmod(d / "ssh" / HOST_KEY, 0o600)
    else:
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", h.name, "-f", str(d / "ssh" / HOST_KEY)])
    shutil.copy(client_pub, d / "ssh" / "authorized_keys")
    (d / "ssh" / "sshd_config").write_text(
        f"ListenAddress {h.address}\nPort 22\n"
        f"HostKey /run/ddtree-sandbox/{HOST_KEY}\n"
        "PidFile /run/sshd.pid\n"
        "AuthorizedKeysFile /run/ddtree-sandbox/authorized_keys\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPrintMotd no\n"
        "MaxSessions 64\nMaxStartups 64:30:128\n"
        f"Subsystem sftp {SFTP_SERVER}\n"
        f"SetEnv PATH={GPU_BIN}:{SYSTEM_PATH}\n"
    )
    (d / "bin" / "systemctl").write_text(
        f"#!/bin/sh\nexec {sys.executable} {systemctl3()} -c MinimumYield=0.1 \"$@\"\n")
    (d / "bin" / "journalctl").write_text(f"#!/bin/sh\nexec {sys.executable} {journalctl3()} \"$@\"\n")
    (d / "bin" / "nvidia-smi").write_text(f"#!{sys.executable}\n" + NVIDIA_SMI)
    for f in ("systemctl", "journalctl", "nvidia-smi"):
        os.chmod(d / "bin" / f, 0o755)
    (d / BOOT_SCRIPT).write_text(boot_script())
    pub = (d / "ssh" / f"{HOST_KEY}.pub").read_text().split()
    return f"{h.address} {pub[0]} {pub[1]}\n"
