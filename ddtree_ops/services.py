"""systemctl on the host: states, start/stop/restart, enablement, the unit's recent log.

Works with real systemd and with docker-systemctl-replacement (the sandbox), so only the
common subset is used: `is-active`, `is-enabled`, `show -p MainPID`, `journalctl -u -n`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .transport import HostConnection


@dataclass(frozen=True)
class UnitState:
    unit: str
    active: str  # active, inactive, failed, activating, unknown
    enabled: str  # enabled, disabled, static, unknown
    main_pid: int | None

    @property
    def is_active(self) -> bool:
        return self.active == "active"


class Services:
    def __init__(self, conn: HostConnection):
        self.conn = conn

    def state(self, unit: str) -> UnitState:
        active = self.conn.run(["systemctl", "is-active", unit], check=False).stdout.strip() or "unknown"
        enabled = self.conn.run(["systemctl", "is-enabled", unit], check=False).stdout.strip() or "unknown"
        return UnitState(unit, active.splitlines()[0], enabled.splitlines()[0], self.main_pid(unit))

    def states(self, units: list[str] | tuple[str, ...]) -> dict[str, UnitState]:
        """The state of several units in one round trip (each systemctl call costs one, and
        the sandbox's Python systemctl is slow to start)."""
        script = ('for u do a=$(systemctl is-active "$u"); e=$(systemctl is-enabled "$u"); '
                  'p=$(systemctl show -p MainPID "$u"); printf "%s\\t%s\\t%s\\t%s\\n" "$u" "$a" "$e" "$p"; done')
        out = self.conn.run(["sh", "-c", script, "sh", *units], check=False).stdout
        found: dict[str, UnitState] = {}
        for line in out.splitlines():
            parts = line.split("\t")
            if len(parts) != 4 or parts[0] not in units:
                continue
            pid = parts[3].split("=", 1)[1].strip() if "=" in parts[3] else ""
            found[parts[0]] = UnitState(parts[0], parts[1].strip() or "unknown", parts[2].strip() or "unknown",
                                        int(pid) if pid.isdigit() and int(pid) else None)
        return {u: found.get(u, UnitState(u, "unknown", "unknown", None)) for u in units}

    def is_active(self, unit: str) -> str:
        return (self.conn.run(["systemctl", "is-active", unit], check=False).stdout.strip() or "unknown").splitlines()[0]

    def main_pid(self, unit: str) -> int | None:
        out = self.conn.run(["systemctl", "show", "-p", "MainPID", unit], check=False).stdout
        for line in out.splitlines():
            if line.startswith("MainPID="):
                try:
                    pid = int(line.split("=", 1)[1].strip())
                except ValueError:
                    return None
                return pid or None
        return None

    def daemon_reload(self) -> None:
        self.conn.run(["systemctl", "daemon-reload"])

    def start(self, unit: str) -> None:
        self.conn.run(["systemctl", "start", unit], timeout=300)

    def stop(self, unit: str) -> None:
        self.conn.run(["systemctl", "stop", unit], timeout=300)

    def restart(self, unit: str) -> None:
        # A unit that crashes at once makes restart itself fail; the health wait reports why.
        self.conn.run(["systemctl", "restart", unit], check=False, timeout=300)

    def enable(self, unit: str) -> None:
        self.conn.run(["systemctl", "enable", unit], check=False)

    def disable(self, unit: str) -> None:
        self.conn.run(["systemctl", "disable", unit], check=False)

    def log_tail(self, unit: str, lines: int = 20) -> list[str]:
        res = self.conn.run(["journalctl", "-u", unit, "-n", str(lines), "--no-pager"], check=False, timeout=30)
        return [ln for ln in res.stdout.splitlines() if ln.strip()][-lines:]
