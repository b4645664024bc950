"""`plan` as a dry run of a deploy: every check deploy makes that does not change the host.

Deploy's own preflight runs as it is (Runbook.preflight: drift, SGLang's version, the launch
paths, secrets_config, disk, the venv compiling the modules, `systemd-analyze verify`, GPU memory,
the router and its key), and then the launch check deploy makes after installing, here against
the new files staged in a scratch folder on the host (host/agent/launch_check.py; never in
site-packages, removed afterwards whatever happened), with the ports it binds. A held deploy lock
is what deploy meets first: `locked` carries the message it would stop with (exit 5). The host's
files, units and state folder are as they were (the sandbox test compares them).
"""

from __future__ import annotations

import dataclasses

from ..artifacts.patchset import PatchSet
from ..errors import EXIT_BAD_INPUT, EXIT_LOCKED, EXIT_OK
from ..gates.router import SmgRouter
from ..host.release_store import b64, lock_message
from ..host.session import HostSession
from .launch_check import identity_problems, launch_line, launch_request, parse_problems, port_problems, ran_as
from .options import DeployOptions
from .phases import Runbook
from .plan import HostPlan


def dry_run_host(session: HostSession, ps: PatchSet, opts: DeployOptions,
                 router: SmgRouter | None = None) -> HostPlan:
    """The host's plan with every refusal deploy would give, and what was checked; changes nothing."""
    # Ranks >= 1 of a multi-node server are neither routed nor gated (engine.health_gated).
    rb = Runbook(session, router=router, health_checked=session.host.node_rank == 0)
    # Read only, so a lost connection is reconnected and the checks start again.
    plan = rb.reconnecting(rb.window(opts), lambda: rb.preflight(ps, opts), "plan")
    refusals, checked = list(plan.refusals), []
    if session.connect_tries > 1:
        checked.append(f"reached after {session.connect_tries} tries (SSH)")
    if not any(r.startswith(f"python {rb.host.python} ") for r in refusals):  # else the parse cannot run
        launch = rb.reconnecting(rb.window(opts), lambda: launch_dry_run(rb, plan, ps), "plan")
        refusals += [f"launch check: {p}" for p in launch.problems]
        checked += launch.checked
    checked += router_checked(rb, refusals)
    held = plan.lock if isinstance(plan.lock, dict) and plan.lock.get("held") else None
    return dataclasses.replace(plan, refusals=tuple(refusals), checked=tuple(checked),
                               locked=lock_message(rb.host.name, held) if held else None)


@dataclasses.dataclass(frozen=True)
class LaunchDryRun:
    problems: list[str]  # deploy's launch-check refusals, word for word
    checked: list[str]


def launch_dry_run(rb: Runbook, plan: HostPlan, ps: PatchSet) -> LaunchDryRun:
    """Deploy's launch check, with the patch set's files staged beside site-packages instead of
    installed in it; the ports' holders judged by deploy's rule (free, or a unit it replaces)."""
    line = launch_line(plan.unit_new)
    if line is None:
        return LaunchDryRun([], ["launch check skipped: ExecStart is not `PYTHON -m MODULE ARGS`"])
    overlay = {pf.path: b64(pf.source.read_bytes()) for pf in ps.files}
    request = dataclasses.replace(launch_request(line, rb.host, plan.unit_new), overlay=overlay)
    res = rb.store.launch_check(request)
    ours = {s.main_pid for s in rb.services_before().values() if s.main_pid}
    parse = identity_problems(res) or parse_problems(line, res)
    ports = port_problems(res["holders"], ours)
    checked = [] if parse else [f"launch line: {line.module} accepts it with the new files ({ran_as(res)})"]
    if not ports:
        checked.append(f"port{'s' if len(request.ports) > 1 else ''} {', '.join(map(str, request.ports))}: free or "
                       f"held by a unit being replaced")
    return LaunchDryRun(parse + ports, checked)


def router_checked(rb: Runbook, refusals: list[str]) -> list[str]:
    """The router line when preflight found it answering with our key: the worker a deploy
    would register there."""
    settings = rb.host.router
    if settings is None or rb.traffic.router is None or any(r.startswith(f"router {settings.url}:") for r in refusals):
        return []
    key = f"the key in ${settings.admin_key_env}" if settings.admin_key_env else "no key"
    return [f"router {settings.url}: GET /workers accepted with {key}; would register {settings.worker}"]


def plan_exit_code(plans: list[HostPlan], error_codes: list[int]) -> int:
    """What deploy would exit with, the worst over the hosts: 5 where another run holds the lock
    (deploy meets it first), 2 where a check refuses, else a host's error (unreachable: 1)."""
    codes = [EXIT_LOCKED if p.locked else EXIT_BAD_INPUT if p.refusals else EXIT_OK for p in plans]
    return max([*codes, *error_codes, EXIT_OK])
