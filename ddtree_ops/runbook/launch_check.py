"""Is the new launch line known to work, before anything stops? (Issue 12, deliverable 3.)

Once the new files and unit are installed, and before the running server (DFlash, or the unit
itself) is stopped, the host's agent checks two things:

* the rendered ExecStart is accepted by the installed server's OWN argument parser: for
  `PYTHON -m sglang.launch_server ARGS`, SGLang's `ServerArgs.add_cli_args` parser (with its
  `--config` merge, as `prepare_server_args` does it), run by the host's Python with the new files
  in place and the server not started; for any other launcher module, `PYTHON -m MODULE
  --parse-only ARGS` (a custom launcher, such as the sandbox's stand-in, must offer that);
* the server's port (and, on rank 0 of a multi-node server, the dist-init port) is free, or held
  by a process of a unit this deploy replaces.

The parse runs the venv's code, so it runs as the unit's own process would: its User=, Group=,
supplementary groups, Environment=/EnvironmentFile= and WorkingDirectory= (read from the unit
being installed, `launch_request`), isolated (`python -I -S`, the venv's site-packages put on
sys.path without running any .pth file). Only a root unit's parse runs as root. A User= or Group=
the host does not have is refused by name (`identity_problems`).

A refusal is a failed step before "stop conflicts": the rollback restores the files and leaves
the old server running, untouched (exit 3). The functions here are pure: the request, and the
problems found in the agent's answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..artifacts.unit_service import service_exec
from ..artifacts.units import exec_start_words
from ..config.inventory import Host
from ..config.redaction import SECRET_NAME_WORDS
from ..host.agent.protocol import LaunchCheck
from ..host.gpus import of_our_units

# Launcher modules whose arguments SGLang's own ServerArgs parser decides.
SGLANG_LAUNCHERS = ("sglang.launch_server",)


@dataclass(frozen=True)
class LaunchLine:
    python: str
    module: str
    args: tuple[str, ...]

    @property
    def sglang(self) -> bool:
        return self.module in SGLANG_LAUNCHERS


def launch_line(unit_text: str) -> LaunchLine | None:
    """`PYTHON -m MODULE ARGS...` from the unit's ExecStart; None for any other shape (not
    checked: the step says so)."""
    words = exec_start_words(unit_text)
    if not words or len(words) < 3 or words[1] != "-m" or not words[0].startswith("/"):
        return None
    return LaunchLine(words[0], words[2], tuple(words[3:]))


def ports_to_check(host: Host) -> list[int]:
    """The server's port, and on rank 0 of a multi-node server the dist-init port it hosts."""
    ports = [host.port]
    if host.multinode and host.node_rank == 0 and host.dist_init_addr:
        tail = host.dist_init_addr.rsplit(":", 1)[-1]
        if tail.isdigit() and int(tail) not in ports:
            ports.append(int(tail))
    return ports


def launch_request(line: LaunchLine, host: Host, unit_text: str) -> LaunchCheck:
    """The agent's request: the launch line, the ports, and the identity and environment the
    unit's [Service] section gives its process, which the parse takes on the host."""
    svc = service_exec(unit_text)
    return LaunchCheck(
        line.python, line.module, list(line.args), ports_to_check(host), line.sglang,
        scrub_files=list(host.secret_files), secret_words=list(SECRET_NAME_WORDS),
        site_packages=host.site_packages, user=svc.user, group=svc.group,
        supplementary_groups=list(svc.supplementary_groups), environment=list(svc.environment),
        environment_files=list(svc.environment_files), working_directory=svc.working_directory)


def identity_problems(answer: dict[str, Any]) -> list[str]:
    """The unit's identity or environment could not be taken on the host (a User= it does not
    have, an unreadable EnvironmentFile=): the server could not start either."""
    refused = answer.get("refused")
    return [f"the launch check cannot run as the unit's process would: {refused}"] if refused else []


def ran_as(answer: dict[str, Any]) -> str:
    """How the parse ran, for the step's line: `as User=sglang (uid 999), isolated`."""
    who = answer.get("ran_as") or {}
    if "uid" not in who:
        return "isolated"
    return f"as User={who.get('user')} (uid {who['uid']}), isolated"


def parse_problems(line: LaunchLine, answer: dict[str, Any]) -> list[str]:
    """The parser's verdict: its exit status and the last lines it printed on refusal."""
    if answer["rc"] == 0:
        return []
    who = "SGLang's argument parser" if line.sglang else f"{line.module} --parse-only"
    lines = [ln for ln in (answer.get("stderr") or answer.get("stdout") or "").splitlines() if ln.strip()]
    said = " | ".join(lines[-3:]) or "(nothing printed)"
    return [f"{who} refuses the new launch line (exit {answer['rc']}): {said[-600:]}"]


def port_problems(holders: dict[str, list[dict[str, Any]]], ours: set[int]) -> list[str]:
    """A port held by a process that is not one of the units this deploy replaces (nor a child of
    one) would make the new server fail to bind after the old one stopped."""
    problems = []
    for port, procs in sorted(holders.items(), key=lambda kv: int(kv[0])):
        foreign = [p for p in procs if not of_our_units(p["pid"], p.get("ancestors", []), ours)]
        if foreign:
            who = ", ".join(f"pid {p['pid']} ({p.get('cmd') or '?'})" for p in foreign[:3])
            problems.append(f"port {port} is held by {who}, not by a unit this deploy replaces; the new server "
                            f"could not bind it")
    return problems
