"""Preflight's checks of a host, each a list of refusals (empty: go on). They read the host
through its release store and services and change nothing; `Runbook.preflight` gathers them with
the plan's own refusals and the router's."""

from __future__ import annotations

from dataclasses import dataclass

from ..artifacts.patchset import PatchSet
from ..artifacts.unit_service import service_exec
from ..artifacts.units import verify_command, verify_problems, verify_unit
from ..config.inventory import Host
from ..errors import InputError
from ..host.agent.protocol import Compile
from ..host.gpus import describe, foreign_apps
from ..host.release_store import ReleaseStore, b64
from ..host.services import Services
from .plan import target_path


def compile_problems(store: ReleaseStore, host: Host, ps: PatchSet, unit_text: str) -> list[str]:
    """The patch set's Python modules, compiled by the venv's interpreter (its version decides
    the syntax) as the unit's User=/Group= from `unit_text` (the unit being installed)."""
    pyfiles = {target_path(host, pf.path): b64(pf.source.read_bytes()) for pf in ps.python_files()}
    if not pyfiles:
        return []
    svc = service_exec(unit_text)
    reply = store.compile(Compile(pyfiles, host.python, user=svc.user, group=svc.group,
                                  supplementary_groups=list(svc.supplementary_groups)))
    if reply.failed:  # most often a wrong `python` (the venv's interpreter is not where the inventory says)
        return [f"python {host.python}: cannot compile the patch set's modules with it: {reply.failed}"]
    return [f"does not compile with {host.python}: {e}" for e in reply.errors]


def unit_problems(store: ReleaseStore, host: Host, text: str) -> list[str]:
    """`systemd-analyze verify` of the new unit on the host, or here when the host has none."""
    res = store.verify_unit(host.unit, text, verify_command("@PATH@/" + host.unit, host.unit)[:-1] + ["@PATH@"])
    if res.available:
        problems = verify_problems(res.returncode, res.stdout, res.stderr, host.unit)
        return [f"unit {host.unit} fails systemd-analyze verify on the host: {p}" for p in problems]
    try:  # without the host's executables, which only the host has
        verify_unit(text, host.unit, check_executables=False)
    except InputError as e:
        return [f"unit {host.unit} fails systemd-analyze verify (locally): {e}"]
    return []


@dataclass(frozen=True)
class GpuCheck:
    refusals: list[str]
    strangers: frozenset[int]  # PIDs of the foreign holders (with --force they stay, and are not waited for)


def gpu_problems(services: Services, store: ReleaseStore, host: Host, our_main_pids: set[int]) -> GpuCheck:
    """GPU memory held by something that is not one of our units: the new server would not fit
    after the old one stops."""
    apps = services.gpu_apps()
    if not apps:
        return GpuCheck([], frozenset())
    procs = store.proc_info([a.pid for a in apps])
    units = ", ".join((host.unit, *host.conflicts))
    foreign = foreign_apps(apps, procs, our_main_pids)
    return GpuCheck([f"GPU memory: {describe(a, procs)}, and it is not a process of {units}: the new server could "
                     f"run out of GPU memory. Stop it, or pass --force" for a in foreign],
                    frozenset(a.pid for a in foreign))
