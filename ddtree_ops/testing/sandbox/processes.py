"""The processes of a host: finding them by namespace, ending them, waiting for them to serve."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path

from ddtree_ops.host.localproc import pid_alive

from .errors import SandboxError
from .layout import DFLASH_UNIT, SandboxHost
from .namespaces import NETNS_DIR


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
        targets.add(("net", f"net:[{os.stat(f'{NETNS_DIR}/{h.netns}').st_ino}]"))
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


def wait_healthy(hosts: list[SandboxHost], inv, timeout_s: float) -> None:
    """Until every host's server answers /health 200; else a SandboxError with a log tail."""
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
