"""`systemctl` and `nvidia-smi` as programs on PATH, for tests of code that runs them itself (the
agent's heal, on the host): each call appends its argv to a log, and the units' states live in a
JSON file, so a test sets them up, runs the code, and reads back what was asked in which order
and where the units ended.

Run as a script (the wrappers `install` writes exec this file with this interpreter); the answers
follow real systemd 252 where the code reads them: `show` prints one block per unit asked (the
service's MainPID before Id, ActiveState, UnitFileState; blank line between blocks; a unit that
does not exist is `inactive` with an empty UnitFileState), `is-active` prints the state and exits
3 unless active. `ports` (unit → port) makes a unit started while another unit holds its port
end `failed`, as a server that cannot bind exits. `start_as` sets the state a started unit
ends in. `fail` in the state file makes a call exit with a code (keyed "VERB UNIT" or
"VERB"), as a unit whose stop times out would.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE_ENV, LOG_ENV = "FAKE_SYSTEMCTL_STATE", "FAKE_SYSTEMCTL_LOG"
SHOW_ORDER = ("MainPID", "Id", "ActiveState", "UnitFileState")


def _load(path: str) -> dict[str, Any]:
    with open(path) as fh:
        return json.load(fh)


def _save(path: str, doc: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
    os.replace(tmp, path)


def _show(state: dict[str, Any], args: list[str]) -> str:
    props, i = [], 0
    while i + 1 < len(args) and args[i] == "-p":
        props.append(args[i + 1])
        i += 2
    blocks = []
    for unit in args[i:]:
        u = state["units"].get(unit)
        values = {"Id": unit, "ActiveState": u["active"] if u else "inactive",
                  "UnitFileState": u["enabled"] if u else "", "MainPID": str((u or {}).get("pid") or 0)}
        blocks.append("".join(f"{p}={values[p]}\n" for p in SHOW_ORDER if p in props))
    return "\n".join(blocks)


def _port_taken(state: dict[str, Any], unit: str) -> bool:
    ports = state.get("ports", {})
    return unit in ports and any(other != unit and ports.get(other) == ports[unit] and u["active"] in
                                 ("active", "activating") for other, u in state["units"].items())


def systemctl(state: dict[str, Any], args: list[str]) -> tuple[int, str, str]:
    verb, rest = args[0], args[1:]
    failure = state.get("fail", {}).get(" ".join(args[:2])) or state.get("fail", {}).get(verb)
    if failure:
        return failure, "", f"fake failure of {' '.join(args)}\n"
    if verb == "show":
        return 0, _show(state, rest), ""
    if verb == "daemon-reload":
        return 0, "", ""
    unit = rest[0]
    u = state["units"].setdefault(unit, {"active": "inactive", "enabled": "", "pid": 0})
    if verb == "is-active":
        return (0 if u["active"] == "active" else 3), u["active"] + "\n", ""
    if verb == "stop":
        u.update(active="inactive", pid=0)
    elif verb in ("restart", "start"):
        state["next_pid"] = state.get("next_pid", 1000) + 1
        u.update(active=state.get("start_as", {}).get(unit, "active"), pid=state["next_pid"])
        if _port_taken(state, unit):  # the server cannot bind its port: it exits, the unit fails
            u.update(active="failed", pid=0)
    elif verb in ("enable", "disable"):
        u["enabled"] = "enabled" if verb == "enable" else "disabled"
    else:
        return 1, "", f"Unknown command verb {verb}.\n"
    return 0, "", ""


def main(argv: list[str]) -> int:
    state_path, log = os.environ[STATE_ENV], os.environ[LOG_ENV]
    with open(log, "a") as fh:
        fh.write(json.dumps(argv) + "\n")
    state = _load(state_path)
    if os.path.basename(argv[0]) == "nvidia-smi":
        out = "".join(f"{a['pid']}, {a['used_mib']}\n" for a in state.get("gpu_apps", []))
        rc, err = 0, ""
    else:
        rc, out, err = systemctl(state, argv[1:])
        _save(state_path, state)
    sys.stdout.write(out)
    sys.stderr.write(err)
    return rc


@dataclass
class FakeSystemctl:
    """The programs in `bin_dir`, their log and units' state file; `env()` is the PATH that finds
    them (and nothing else: the machine's own systemctl is never reached)."""

    bin_dir: Path

    @property
    def state_path(self) -> Path:
        return self.bin_dir / "units.json"

    @property
    def log_path(self) -> Path:
        return self.bin_dir / "calls.log"

    @classmethod
    def install(cls, bin_dir: Path, units: dict[str, dict[str, Any]]) -> FakeSystemctl:
        bin_dir.mkdir(parents=True, exist_ok=True)
        fake = cls(bin_dir)
        for name in ("systemctl", "nvidia-smi"):
            wrapper = bin_dir / name
            wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I "{Path(__file__).resolve()}" "$0" "$@"\n')
            wrapper.chmod(0o755)
        fake.write({"units": {u: {"pid": 0, **s} for u, s in units.items()}})
        fake.log_path.write_text("")
        return fake

    def env(self) -> dict[str, str]:
        return {"PATH": str(self.bin_dir), STATE_ENV: str(self.state_path), LOG_ENV: str(self.log_path)}

    def read(self) -> dict[str, Any]:
        return _load(str(self.state_path))

    def write(self, doc: dict[str, Any]) -> None:
        _save(str(self.state_path), doc)

    def update(self, **fields: Any) -> None:
        self.write({**self.read(), **fields})

    def units(self) -> dict[str, dict[str, Any]]:
        return self.read()["units"]

    def calls(self) -> list[list[str]]:
        """Every call's argv (the program's name first, as the code ran it)."""
        return [[os.path.basename(a[0]), *a[1:]] for a in map(json.loads, self.log_path.read_text().splitlines())]

    def actions(self) -> list[str]:
        """The calls that change a unit, as `VERB UNIT` in order (reads and daemon-reload too)."""
        return [" ".join(c[1:]) for c in self.calls()
                if c[0] == "systemctl" and c[1] in ("stop", "start", "restart", "enable", "disable", "daemon-reload")]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
