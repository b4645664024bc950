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
