"""Starting a host: boot.sh (package data beside this module) in the host's namespaces."""

from __future__ import annotations

import subprocess
import time
from importlib import resources
from pathlib import Path

from . import prerequisites
from .errors import SandboxError
from .layout import SITE_PACKAGES, SandboxHost
from .processes import _port_open
from .system import SYSTEM_PATH

BOOT_SCRIPT = "boot.sh"
SSHD_START_TIMEOUT_S = 15.0


def boot_script() -> str:
    """The text of boot.sh, as shipped with this package."""
    return resources.files(__package__).joinpath(BOOT_SCRIPT).read_text(encoding="utf-8")


def boot(h: SandboxHost, site_tree: Path) -> None:
    """Run the host's HOST_DIR/boot.sh (written by `prepare_host_files`) until sshd listens;
    records sshd's and the supervisor's PIDs in `h`."""
    d = Path(h.dir)
    (d / "init.pid").unlink(missing_ok=True)
    with open(d / "boot.log", "wb") as log:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", h.netns, "unshare", "--mount", "--propagation", "private",
             "/bin/sh", str(d / BOOT_SCRIPT), str(d), str(site_tree), SITE_PACKAGES, prerequisites.SSHD],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env={"PATH": SYSTEM_PATH, "LANG": "C.UTF-8", "HOME": "/root"},
            start_new_session=True,
        )
    # ip and unshare exec (no fork), so this PID becomes sshd's once the script execs it.
    h.sshd_pid = proc.pid
    deadline = time.monotonic() + SSHD_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SandboxError(f"{h.name}: boot failed:\n{(d / 'boot.log').read_text()[-2000:]}")
        if (d / "init.pid").exists() and _port_open(h.address, 22, 0.2):
            h.init_pid = int((d / "init.pid").read_text().strip() or 0) or None
            return
        time.sleep(0.05)
    raise SandboxError(f"{h.name}: sshd did not listen on {h.address}:22 within {SSHD_START_TIMEOUT_S:.0f} s:\n"
                       f"{(d / 'boot.log').read_text()[-2000:]}")
