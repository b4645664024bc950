"""`systemctl` and `nvidia-smi` as programs on PATH, for tests of code that runs them itself (the
agent's heal, on the host): each call appends its argv to a log, and the units' states live in a
JSON file, so a test sets them up, runs the code, and reads back what was asked in which order
and where the units ended. The programs, and the answers they give, are systemctl_program.py (the
wrappers `install` writes exec it with this interpreter).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import systemctl_program
from .systemctl_program import LOG_ENV, STATE_ENV, load_state, save_state

PROGRAM = Path(systemctl_program.__file__).resolve()


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
            wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "{PROGRAM}" "$0" "$@"\n')
            wrapper.chmod(0o755)
        fake.write({"units": {u: {"pid": 0, **s} for u, s in units.items()}})
        fake.log_path.write_text("")
        return fake

    def env(self) -> dict[str, str]:
        return {"PATH": str(self.bin_dir), STATE_ENV: str(self.state_path), LOG_ENV: str(self.log_path)}

    def read(self) -> dict[str, Any]:
        return load_state(str(self.state_path))

    def write(self, doc: dict[str, Any]) -> None:
        save_state(str(self.state_path), doc)

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

