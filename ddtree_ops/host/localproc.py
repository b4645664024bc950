"""Processes on this machine (the operator's, or the sandbox's)."""

from __future__ import annotations


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22): with the PID,
    it names one process, so a PID reused by another is never taken for it."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


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
