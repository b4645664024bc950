"""Processes on this machine (the operator's, or the sandbox's)."""

from __future__ import annotations


def pid_alive(pid: int | None) -> bool:
    """True while `pid` runs. A zombie counts as gone: orphans are reaped late by PID 1, and
    `kill -0` would still succeed on them."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
