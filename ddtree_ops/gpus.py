"""Who holds GPU memory on a host, and whether a deploy may go on (issue 12, deliverable 2).

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


def foreign_holders(apps: list[GpuApp], procs: dict[str, dict[str, Any]], ours: set[int]) -> list[str]:
    """Descriptions of the GPU processes that are not ours: neither a main process of one of the
    units this deploy manages nor a descendant of one. `procs`: pid → {cmd, ancestors}."""
    out = []
    for a in apps:
        info = procs.get(str(a.pid)) or {}
        if {a.pid, *info.get("ancestors", [])} & ours:
            continue
        out.append(f"pid {a.pid} ({info.get('cmd') or 'gone'}) holds {a.used_mib} MiB")
    return out
