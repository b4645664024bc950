"""What this machine needs to run sandbox hosts: root, the namespace tools, Debian's OpenSSH
server, and systemd itself (PID 1 of each host, booted by systemd-nspawn)."""

from __future__ import annotations

import os
import shutil

from .system import SYSTEM_PATH

SSHD = os.environ.get("DDTREE_OPS_SSHD", "/usr/sbin/sshd")  # Debian's OpenSSH server
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
SYSTEMD = "/usr/lib/systemd/systemd"  # what each container boots as its PID 1


def missing_prerequisites() -> list[str]:
    """What this machine lacks to run sandbox hosts, each with how to get it."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root privileges (network namespaces and containers need root): run as root or with sudo")
    for tool, pkg in (("ip", "iproute2"), ("nsenter", "util-linux"), ("ssh-keygen", "openssh-client"),
                      ("systemd-nspawn", "systemd-container"), ("systemd-escape", "systemd"),
                      ("journalctl", "systemd")):
        if not shutil.which(tool, path=SYSTEM_PATH):
            missing.append(f"`{tool}` (apt-get install -y {pkg})")
    for path, pkg in ((SSHD, "openssh-server"), (SFTP_SERVER, "openssh-sftp-server"), (SYSTEMD, "systemd")):
        if not os.access(path, os.X_OK):
            missing.append(f"{path} (apt-get install -y {pkg})")
    return missing
