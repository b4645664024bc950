"""The programs the agent's `run` op runs on a host (systemctl, journalctl, nvidia-smi), answered
from a fake host's in-memory units and GPU holders, in the programs' own output formats, so the
real `Services` parses them in the fast tier as it parses a host's.

`systemctl show` prints what real systemd prints (recorded from systemd 252 in
tests/data/systemctl_show/): one block per unit asked, blocks separated by a blank line, the
service's properties (MainPID) before the unit's (Id, ActiveState, UnitFileState) whatever order
`-p` asked them in, and for a unit that does not exist `ActiveState=inactive`, an empty
`UnitFileState=` and `MainPID=0`. Unit actions always succeed here (a real `systemctl stop` of a
unit that does not exist exits 5; the runbook only acts on units it read first).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..host.gpus import GpuApp, of_our_units


class SystemdUnit(Protocol):
    """What systemd knows of one unit, as these programs print it (fake_host.FakeUnit)."""

    active: str
    enabled: str
    pid: int | None
    ready: bool
    invocation: str
    n_restarts: int


class SystemdHost(Protocol):
    """The host these programs run on: what they read and the unit actions they take
    (fake_host.FakeHost). A protocol of its own, so this module needs nothing of fake_host,
    which imports it."""

    @property
    def units(self) -> Mapping[str, SystemdUnit]: ...

    gpu_apps: list[GpuApp] | None
    procs: dict[int, dict[str, Any]]
    gpu_linger: dict[int, int]
    ended_pids: set[int]

    def start(self, unit: str) -> None: ...

    def stop(self, unit: str) -> None: ...

    def set_enabled(self, unit: str, enabled: bool) -> None: ...

    def tick(self) -> None: ...


# The order systemd prints properties in: the Service interface's, then the Unit interface's.
SHOW_ORDER = ("MainPID", "NRestarts", "Id", "ActiveState", "UnitFileState", "InvocationID")


@dataclass(frozen=True)
class Answer:
    rc: int
    stdout: str = ""
    stderr: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"rc": self.rc, "stdout": self.stdout, "stderr": self.stderr}


def answer_run(fake: SystemdHost, request: dict[str, Any]) -> dict[str, Any]:
    """The agent's `run` reply: one program (`argv`) or several in a row (`argvs`). A unit probe
    (its state and its log tail) is a look by the health wait, once per poll: time passes for every
    loading server first."""
    if "argvs" in request:
        if any(a[0] == "journalctl" for a in request["argvs"]):
            fake.tick()
        return {"results": [run_program(fake, list(a)).as_dict() for a in request["argvs"]]}
    return run_program(fake, list(request["argv"])).as_dict()


def run_program(fake: SystemdHost, argv: list[str]) -> Answer:
    if argv[0] == "systemctl":
        return _systemctl(fake, argv[1:])
    if argv[0] == "journalctl":
        return _journalctl(fake, argv[1:])
    if argv[0] == "nvidia-smi":
        return _nvidia_smi(fake)
    return Answer(127, stderr=f"{argv[0]}: not found")


def event_name(request: dict[str, Any]) -> str:
    """How the fake host's `events` name a `run` request: by what the runbook asked of systemd."""
    argvs = request.get("argvs") or [request["argv"]]
    if any(a[0] == "journalctl" for a in argvs):
        return f"probe {argvs[0][-1]}"
    argv = argvs[0]
    if argv[0] != "systemctl":
        return argv[0]
    if argv[1] == "show":
        props, _ = _show_args(argv[2:])
        if "InvocationID" in props:
            return "systemctl show InvocationID"
        return "systemctl show MainPID" if props == ["MainPID"] else "systemctl states"
    return " ".join(argv)


# -- systemctl -----------------------------------------------------------------------------------

def _show_args(args: list[str]) -> tuple[list[str], list[str]]:
    """`-p P` pairs, then the units."""
    props, i = [], 0
    while i + 1 < len(args) and args[i] == "-p":
        props.append(args[i + 1])
        i += 2
    return props, args[i:]


def _show_block(fake: SystemdHost, unit: str, props: list[str]) -> str:
    u = fake.units.get(unit)
    values = {"Id": unit, "ActiveState": u.active if u else "inactive", "UnitFileState": u.enabled if u else "",
              "MainPID": str((u.pid if u else None) or 0), "NRestarts": str(u.n_restarts if u else 0),
              "InvocationID": u.invocation if u else ""}
    return "".join(f"{p}={values[p]}\n" for p in SHOW_ORDER if p in props)


def _systemctl(fake: SystemdHost, args: list[str]) -> Answer:
    verb, rest = args[0], args[1:]
    if verb == "show":
        props, units = _show_args(rest)
        return Answer(0, "\n".join(_show_block(fake, u, props) for u in units))
    if verb == "daemon-reload":
        return Answer(0)
    if verb == "is-active":  # the state on stdout; exit 0 only when active
        u = fake.units.get(rest[0])
        state = u.active if u else "inactive"
        return Answer(0 if state == "active" else 3, state + "\n")
    unit = rest[0]
    if verb == "stop":
        fake.stop(unit)
    elif verb == "restart":
        fake.start(unit)
    elif verb in ("enable", "disable"):
        fake.set_enabled(unit, verb == "enable")
    else:
        return Answer(1, stderr=f"Unknown command verb {verb}.")
    return Answer(0)


def _journalctl(fake: SystemdHost, args: list[str]) -> Answer:
    """`journalctl -u UNIT -n N --no-pager`: the unit's state as its last log line."""
    unit = args[args.index("-u") + 1]
    u = fake.units.get(unit)
    if u is None:
        return Answer(0, "-- No entries --\n")
    state = "ready" if u.ready else "loading" if u.active == "active" else u.active
    return Answer(0, f"{unit}: pid {u.pid} {state}\n")


# -- nvidia-smi ----------------------------------------------------------------------------------

def _nvidia_smi(fake: SystemdHost) -> Answer:
    """`--query-compute-apps=pid,used_memory --format=csv,noheader,nounits`. A process of a stopped
    unit leaves the list after `gpu_linger` more looks (a worker still exiting); a process of a
    serving unit, or nobody's (a stranger), stays."""
    if fake.gpu_apps is None:
        return Answer(127, stderr="nvidia-smi: not found")
    for a in list(fake.gpu_apps):
        if not of_our_units(a.pid, fake.procs.get(a.pid, {}).get("ancestors", []), fake.ended_pids):
            continue
        left = fake.gpu_linger.get(a.pid, 0)
        if left <= 0:
            fake.gpu_apps.remove(a)
        else:
            fake.gpu_linger[a.pid] = left - 1
    return Answer(0, "".join(f"{a.pid}, {a.used_mib}\n" for a in fake.gpu_apps))
