"""systemctl on the host: unit states, restart/stop/enable/disable, and a probe of one unit.

Real systemd (the sandbox hosts run systemd 252 as PID 1); only a small, stable part of it is
used: `show -p PROP` (several units at once), `journalctl -u -n`, and the actions.
The host's agent runs them (argv, no shell); nothing here opens an SSH channel of its own.
What systemctl prints is parsed by the pure functions at the top (one parser per output).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config.redaction import SECRET_NAME_WORDS
from ..errors import RemoteCommandError
from .agent.protocol import Run, RunReply, RunResult
from .channel import ask_reply
from .gpus import QUERY, GpuApp, parse_gpu_apps

if TYPE_CHECKING:
    from .channel import AgentTransport


@dataclass(frozen=True)
class UnitState:
    unit: str
    active: str  # active, inactive, failed, activating, unknown
    enabled: str  # enabled, disabled, static, unknown
    main_pid: int | None


@dataclass
class UnitProbe:
    """A unit as the health wait sees it: state, MainPID and the last lines of its log."""

    active: str
    main_pid: int | None
    log: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Invocation:
    """Which run of a unit this is: systemd gives every start of a unit a new InvocationID (empty
    for a unit never started), and counts the restarts its Restart= made (NRestarts). A resumed
    deploy tells from these whether the restart it sent before the connection was lost happened."""

    id: str
    active: str
    main_pid: int | None
    n_restarts: int


# ---------------------------------------------------------------------------------------------
# parsing systemctl's output (pure)


def parse_main_pid(text: str) -> int | None:
    """The PID from `systemctl show -p MainPID` output (`MainPID=1234`); None for 0 or nothing."""
    for line in text.splitlines():
        if line.startswith("MainPID="):
            value = line.split("=", 1)[1].strip()
            return (int(value) or None) if value.isdigit() else None
    return None


def first_word(text: str) -> str:
    """`is-active`/`is-enabled` answer on their first line; an empty answer is 'unknown'."""
    lines = text.strip().splitlines()
    return lines[0].strip() if lines and lines[0].strip() else "unknown"


# `states` asks for every unit in one systemctl call; `show` prints one block of KEY=VALUE
# lines per unit, blocks separated by a blank line, in the order asked.
STATE_PROPERTIES = ("Id", "ActiveState", "UnitFileState", "MainPID")


def states_argv(units: tuple[str, ...] | list[str]) -> list[str]:
    return ["systemctl", "show", *[a for p in STATE_PROPERTIES for a in ("-p", p)], *units]


def parse_show_blocks(text: str) -> list[dict[str, str]]:
    blocks: list[dict[str, str]] = [{}]
    for line in text.splitlines():
        if not line.strip():
            if blocks[-1]:
                blocks.append({})
            continue
        key, sep, value = line.partition("=")
        if sep:
            blocks[-1][key.strip()] = value.strip()
    return [b for b in blocks if b]


def parse_states(text: str, units: tuple[str, ...] | list[str]) -> dict[str, UnitState]:
    """`systemctl show -p Id -p ActiveState -p UnitFileState -p MainPID U...` → a state per asked
    unit. A block is matched by its Id where the manager prints one, else by position; a unit
    without a block, or a property left empty (a unit that does not exist), is 'unknown'."""
    blocks = parse_show_blocks(text)
    by_id = {b["Id"]: b for b in blocks if b.get("Id")}
    out = {}
    for i, u in enumerate(units):
        b = by_id.get(u) or (blocks[i] if len(blocks) == len(units) and not by_id else {})
        out[u] = UnitState(u, b.get("ActiveState") or "unknown", b.get("UnitFileState") or "unknown",
                           parse_main_pid("MainPID=" + b.get("MainPID", "")))
    return out


# systemd's own lines about a unit kept in a log tail: enough for "Main process exited,
# code=killed" and "Failed with result", never so many that they push out the server's traceback.
SYSTEMD_LINES = 3


INVOCATION_PROPERTIES = ("InvocationID", "ActiveState", "MainPID", "NRestarts")


def parse_invocation(text: str) -> Invocation:
    """`systemctl show -p InvocationID -p ActiveState -p MainPID -p NRestarts UNIT` → Invocation."""
    blocks = parse_show_blocks(text)
    b = blocks[0] if blocks else {}
    restarts = b.get("NRestarts", "")
    return Invocation(b.get("InvocationID", ""), b.get("ActiveState") or "unknown",
                      parse_main_pid("MainPID=" + b.get("MainPID", "")), int(restarts) if restarts.isdigit() else 0)


def probe_argvs(unit: str, lines: int) -> list[list[str]]:
    """State, MainPID and the log tail of `unit`: two programs, one round trip through the agent.
    The journal is read deeper than `lines`: parse_probe keeps the server's own last lines."""
    return [["systemctl", "show", "-p", "ActiveState", "-p", "MainPID", unit],
            ["journalctl", "-u", unit, "-n", str(3 * lines + SYSTEMD_LINES), "--no-pager"]]


def operator_tail(lines: list[str], n: int) -> list[str]:
    """The last `n` lines the server wrote, with systemd's last SYSTEMD_LINES about the unit among
    them, in journal order. A crashing server under real systemd is followed by a run of PID 1's
    lines (exited, failed, scheduled restart, stopped, started...): a plain tail would show those
    instead of the traceback. Pure."""
    by_systemd = [i for i, ln in enumerate(lines) if " systemd[1]: " in ln]
    own = [i for i in range(len(lines)) if i not in set(by_systemd)]
    keep = set(own[-n:] if n > 0 else []) | set(by_systemd[-SYSTEMD_LINES:])
    return [ln for i, ln in enumerate(lines) if i in keep]


def parse_probe(show_out: str, journal_out: str, lines: int = 10) -> UnitProbe:
    blocks = parse_show_blocks(show_out)
    b = blocks[0] if blocks else {}
    log = operator_tail([ln for ln in journal_out.splitlines() if ln.strip()], lines)
    return UnitProbe(b.get("ActiveState") or "unknown", parse_main_pid("MainPID=" + b.get("MainPID", "")), log)


# ---------------------------------------------------------------------------------------------
# the units of one host


class Services:
    """The units of one host, through its agent (one process per operation runs systemctl)."""

    def __init__(self, agent: AgentTransport, host_name: str, scrub_files: tuple[str, ...] = ()):
        self.agent, self.host_name = agent, host_name
        # Files on the host whose secret values the agent blanks out of log tails before they
        # leave the host (SGLang logs its API key at start-up).
        self.scrub_files = scrub_files

    def _run(self, argv: list[str], timeout: float = 120) -> RunResult:
        return ask_reply(self.agent, Run(argv=argv, timeout=timeout), RunResult, timeout + 30, self.host_name)

    def states(self, units: tuple[str, ...] | list[str]) -> dict[str, UnitState]:
        units = tuple(units)
        return parse_states(self._run(states_argv(units)).stdout, units)

    def state(self, unit: str) -> UnitState:
        return self.states((unit,))[unit]

    def main_pid(self, unit: str) -> int | None:
        return parse_main_pid(self._run(["systemctl", "show", "-p", "MainPID", unit]).stdout)

    def invocation(self, unit: str) -> Invocation:
        argv = ["systemctl", "show", *[a for p in INVOCATION_PROPERTIES for a in ("-p", p)], unit]
        return parse_invocation(self._run(argv).stdout)

    def probe(self, unit: str, lines: int = 30) -> UnitProbe:
        request = Run(argvs=probe_argvs(unit, lines), timeout=30, scrub_files=list(self.scrub_files),
                      secret_words=list(SECRET_NAME_WORDS))
        show, journal = ask_reply(self.agent, request, RunReply, 60, self.host_name).results
        return parse_probe(show.stdout, journal.stdout, lines)

    def gpu_apps(self) -> list[GpuApp] | None:
        """Processes holding GPU memory (nvidia-smi); None on a host without nvidia-smi."""
        r = self._run(QUERY, timeout=60)
        if r.rc == 127:
            return None
        if r.rc != 0:
            raise RemoteCommandError(f"{self.host_name}: nvidia-smi exited {r.rc}: "
                                     f"{(r.stderr or r.stdout).strip()[-400:]}")
        return parse_gpu_apps(r.stdout)

    def _checked(self, argv: list[str], timeout: float = 120) -> None:
        r = self._run(argv, timeout)
        if r.rc != 0:
            raise RemoteCommandError(f"{self.host_name}: `{' '.join(argv)}` exited {r.rc}: "
                                     f"{(r.stderr or r.stdout).strip()[-800:]}")

    def daemon_reload(self) -> None:
        self._checked(["systemctl", "daemon-reload"])

    def stop(self, unit: str) -> None:
        self._checked(["systemctl", "stop", unit], timeout=300)

    def restart(self, unit: str) -> None:
        # A unit that crashes at once makes restart itself fail; the health wait reports why.
        self._run(["systemctl", "restart", unit], timeout=300)

    def enable(self, unit: str) -> None:
        self._run(["systemctl", "enable", unit])

    def disable(self, unit: str) -> None:
        self._run(["systemctl", "disable", unit])
