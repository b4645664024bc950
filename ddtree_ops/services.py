"""systemctl on the host: unit states, restart/stop/enable/disable, and a probe of one unit.

Works with real systemd and with docker-systemctl-replacement (the sandbox), so only the
common subset is used: `is-active`, `is-enabled`, `show -p MainPID`, `journalctl -u -n`.
What systemctl prints is parsed by the pure functions at the top (one parser per output).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .transport import HostConnection, shell_join


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


# `states` asks for every unit in one round trip; each unit is one tab-separated line.
STATES_SCRIPT = ('for u do a=$(systemctl is-active "$u"); e=$(systemctl is-enabled "$u"); '
                 'p=$(systemctl show -p MainPID "$u"); printf "%s\\t%s\\t%s\\t%s\\n" "$u" "$a" "$e" "$p"; done')


def parse_states(text: str, units: tuple[str, ...] | list[str]) -> dict[str, UnitState]:
    """STATES_SCRIPT's output → a state per asked unit ('unknown' for a unit it did not report)."""
    found: dict[str, UnitState] = {}
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) != 4 or parts[0] not in units:
            continue
        found[parts[0]] = UnitState(parts[0], first_word(parts[1]), first_word(parts[2]), parse_main_pid(parts[3]))
    return {u: found.get(u, UnitState(u, "unknown", "unknown", None)) for u in units}


_PROBE_SEP = "@@@"


def probe_command(unit: str, lines: int) -> str:
    """is-active, MainPID and the log tail of `unit` in one shell command line."""
    return "; ".join([
        shell_join(["systemctl", "is-active", unit]),
        shell_join(["echo", _PROBE_SEP]),
        shell_join(["systemctl", "show", "-p", "MainPID", unit]),
        shell_join(["echo", _PROBE_SEP]),
        shell_join(["journalctl", "-u", unit, "-n", str(lines), "--no-pager"]),
    ])


def parse_probe(text: str) -> UnitProbe:
    parts = text.split(_PROBE_SEP + "\n")
    active = first_word(parts[0]) if parts else "unknown"
    pid = parse_main_pid(parts[1]) if len(parts) > 1 else None
    log = [ln for ln in (parts[2].splitlines() if len(parts) > 2 else []) if ln.strip()]
    return UnitProbe(active, pid, log)


# ---------------------------------------------------------------------------------------------
# the units of one host


class Services:
    def __init__(self, conn: HostConnection):
        self.conn = conn

    def states(self, units: tuple[str, ...] | list[str]) -> dict[str, UnitState]:
        """The state of several units in one round trip (each systemctl call costs one, and
        the sandbox's Python systemctl is slow to start)."""
        units = tuple(units)
        out = self.conn.run(["sh", "-c", STATES_SCRIPT, "sh", *units], check=False).stdout
        return parse_states(out, units)

    def state(self, unit: str) -> UnitState:
        return self.states((unit,))[unit]

    def main_pid(self, unit: str) -> int | None:
        return parse_main_pid(self.conn.run(["systemctl", "show", "-p", "MainPID", unit], check=False).stdout)

    def probe(self, unit: str, lines: int = 30) -> UnitProbe:
        cmd = probe_command(unit, lines)
        if self.conn.host.become:
            cmd = "sudo -n -- sh -c " + shell_join([cmd])
        return parse_probe(self.conn.run_shell(cmd, check=False, timeout=30).stdout)

    def daemon_reload(self) -> None:
        self.conn.run(["systemctl", "daemon-reload"])

    def stop(self, unit: str) -> None:
        self.conn.run(["systemctl", "stop", unit], timeout=300)

    def restart(self, unit: str) -> None:
        # A unit that crashes at once makes restart itself fail; the health wait reports why.
        self.conn.run(["systemctl", "restart", unit], check=False, timeout=300)

    def enable(self, unit: str) -> None:
        self.conn.run(["systemctl", "enable", unit], check=False)

    def disable(self, unit: str) -> None:
        self.conn.run(["systemctl", "disable", unit], check=False)
