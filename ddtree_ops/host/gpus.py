"""Who holds GPU memory on a host, and whether a deploy may go on.

A server that stopped does not always give its GPU memory back at once (a worker process still
exiting, an orphan of an earlier crash), and a new server started meanwhile dies of out-of-memory
while loading. So: preflight refuses GPU memory held by a process that is not one of the units
this deploy manages (unless --force), and after the old server stops the deploy waits, bounded,
until no process holds GPU memory before it starts the new one. The host's `nvidia-smi` is asked
(`--query-compute-apps=pid,used_memory --format=csv,noheader,nounits`); a host without it has
no NVIDIA GPU to check and is not waited for. These functions are pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QUERY = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]


@dataclass(frozen=True)
class GpuApp:
    pid: int
    used_mib: int


def parse_gpu_apps(text: str) -> list[GpuApp]:
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits` → apps
    (a line it cannot read, such as `[N/A]` memory, counts with 0 MiB; a process is still there)."""
    apps = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2 or not parts[0].isdigit():
            continue
        apps.append(GpuApp(int(parts[0]), int(parts[1]) if parts[1].isdigit() else 0))
    return apps


def of_our_units(pid: int, ancestors: list[int], main_pids: set[int]) -> bool:
    """A process is one of our units' when it is a unit's main process or descends from one (a
    server's workers are its children). Used for GPU holders and for port holders alike."""
    return bool({pid, *ancestors} & main_pids)


def foreign_apps(apps: list[GpuApp], procs: dict[str, dict[str, Any]], ours: set[int]) -> list[GpuApp]:
    """The GPU processes that are not ours. `procs`: pid → {cmd, ancestors} (a gone one: absent)."""
    return [a for a in apps if not of_our_units(a.pid, (procs.get(str(a.pid)) or {}).get("ancestors", []), ours)]


def describe(app: GpuApp, procs: dict[str, dict[str, Any]]) -> str:
    return f"pid {app.pid} ({(procs.get(str(app.pid)) or {}).get('cmd') or 'gone'}) holds {app.used_mib} MiB"

