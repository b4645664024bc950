"""The processes of a host: found by its network namespace, ended by PID, waited for to serve."""

from __future__ import annotations

import contextlib
import os
import signal
import time

from ddtree_ops.host.localproc import pid_alive

from . import container
from .errors import SandboxError
from .layout import DFLASH_UNIT, SandboxHost
from .namespaces import NETNS_DIR
from .system import port_open as _port_open

__all__ = ["_kill_namespace_processes", "_namespace_pids", "_port_open", "wait_healthy"]


def _ns_id(pid: int | str, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def _namespace_pids(h: SandboxHost) -> list[int]:
    """PIDs living in this host's network namespace (every process of its container), plus
    systemd-nspawn itself."""
    try:
        target = f"net:[{os.stat(f'{NETNS_DIR}/{h.netns}').st_ino}]"
    except OSError:
        target = None
    me = os.getpid()
    pids = [h.container_pid] if h.container_pid and pid_alive(h.container_pid) else []
    if target is None:
        return pids
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me and int(entry) not in pids and _ns_id(entry, "net") == target:
            pids.append(int(entry))
    return pids


def _kill_namespace_processes(h: SandboxHost) -> int:
    """Halt the container (systemd stops its units), then SIGTERM and SIGKILL whatever is left in
    the host's namespace; returns how many processes there were."""
    ended: set[int] = set(_namespace_pids(h))
    container.halt(h)  # one that does not halt in time is killed below
    for sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGKILL):
        pids = [p for p in _namespace_pids(h) if pid_alive(p)]
        if not pids:
            break
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
            ended.add(p)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            # Our own children (systemd-nspawn) must be reaped here, not by PID 1.
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
        tail = container.journal_tail(pending[name], DFLASH_UNIT)
        raise SandboxError(f"{name}: server not healthy within {timeout_s:.0f} s; last log lines:\n{tail}")
