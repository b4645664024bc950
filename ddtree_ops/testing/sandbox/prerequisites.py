"""What this machine needs to run sandbox hosts, and where the systemctl replacement is."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from .system import SYSTEM_PATH

SSHD = os.environ.get("DDTREE_OPS_SSHD", "/usr/sbin/sshd")  # Debian's OpenSSH server
SFTP_SERVER = "/usr/lib/openssh/sftp-server"


def missing_prerequisites() -> list[str]:
    """What this machine lacks to run sandbox hosts, each with how to get it."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root privileges (network and mount namespaces need root): run as root or with sudo")
    for tool, pkg in (("ip", "iproute2"), ("unshare", "util-linux"), ("nsenter", "util-linux"),
                      ("mount", "mount"), ("ssh-keygen", "openssh-client")):
        if not shutil.which(tool, path=SYSTEM_PATH):
            missing.append(f"`{tool}` (apt-get install -y {pkg})")
    if not os.access(SSHD, os.X_OK):
        missing.append(f"OpenSSH server {SSHD} (apt-get install -y openssh-server)")
    if not os.access(SFTP_SERVER, os.X_OK):
        missing.append(f"sftp-server {SFTP_SERVER} (apt-get install -y openssh-sftp-server)")
    if not systemctl3():
        missing.append("systemctl3 from docker-systemctl-replacement (pip install 'ddtree-ops[sandbox]')")
    for target in ("/usr/bin/systemctl", "/usr/bin/journalctl"):
        if not os.path.exists(target):
            missing.append(f"{target} to mount the replacement over (apt-get install -y systemd)")
    return missing


def _script(name: str) -> str | None:
    """A docker-systemctl-replacement script: beside this interpreter (its venv), else on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def systemctl3() -> str | None:
    return _script("systemctl3")


def journalctl3() -> str | None:
    return _script("journalctl3")
