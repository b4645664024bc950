"""Running the machine's own tools (ip, unshare, ssh-keygen, ...) and a cross-process file lock."""

from __future__ import annotations

import contextlib
import fcntl
import socket
import subprocess
from pathlib import Path

from .errors import SandboxError

# The tools the sandbox runs come from the system, never from a venv or a user's PATH.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SYSTEM_ENV = {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"}


def run(argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    """`argv` with the system PATH; a failure (when `check`) is a SandboxError naming it."""
    r = subprocess.run(argv, capture_output=True, text=True, env=dict(SYSTEM_ENV), **kw)
    if check and r.returncode != 0:
        raise SandboxError(f"command failed ({r.returncode}): {' '.join(argv)}\n{r.stderr.strip()}")
    return r


@contextlib.contextmanager
def file_lock(path: Path | str):
    """An exclusive flock on `path` (created with its folder) for the `with` block."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def port_open(addr: str, port: int, timeout: float) -> bool:
    """Whether something accepts a TCP connection at addr:port."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return True
    except OSError:
        return False


# Each sandbox host's systemd (PID 1, journald, udevd, logind, ...) holds about 8 inotify
# instances, and the kernel's default per-user limit is 128: 16 hosts at once (the suite runs four
# workers' sandboxes beside the collection's, the gate's and the fault tests' own) and the next
# container's systemd fails to boot ("Failed to create inotify object: Too many open files").
# The usual fix for systemd in containers (kind, k3d, podman): raise the limit.
INOTIFY_INSTANCES = Path("/proc/sys/fs/inotify/max_user_instances")
INOTIFY_INSTANCES_WANTED = 1024


def ensure_inotify_instances(path: Path = INOTIFY_INSTANCES, wanted: int = INOTIFY_INSTANCES_WANTED) -> str | None:
    """Raise fs.inotify.max_user_instances to `wanted` when it is lower (root only); the line that
    says so, or None when nothing changed. A limit that cannot be raised is left as it is: the
    boot's own error then names it."""
    try:
        now = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    if now >= wanted:
        return None
    try:
        path.write_text(f"{wanted}\n")
    except OSError as e:
        return f"fs.inotify.max_user_instances is {now} and could not be raised ({e.strerror}): at most {now // 8} " \
               f"sandbox hosts can boot at once"
    return f"fs.inotify.max_user_instances raised from {now} to {wanted} (each sandbox host's systemd holds about 8)"
