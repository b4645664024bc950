"""TEST HOOKS, built from environment variables, handed to the CLI by `ddtree_ops.testing.hooked_cli`:
named points where the fault-matrix tests (tests/test_faults.py) pause the tool, so that they can
kill or interrupt it exactly there, and faults at a named remote call.

With DDTREE_OPS_TEST_PAUSE_AT=<point> and DDTREE_OPS_TEST_PAUSE_FILE=<path>, the deploy writes
"<pid> <point>" to <path> when it reaches <point> and waits until the file is removed (points:
`ddtree_ops.host.hooks`; "between-files" is written ON THE HOST by the agent).

DDTREE_OPS_TEST_FAULT="<fail|drop|lost-answer>:<call>:<n>" makes the n-th call named <call> fail
as a host would report it ("fail"), cuts the SSH connection just before it ("drop"), or just after
the host did it, before its answer is read ("lost-answer"). A call is named by
the agent op ("journal", "backup", "install", "release_write", "set_current", "prune", ...), a
unit action by its systemctl verb ("systemctl restart"), a unit probe "probe".

The product never imports this module: it only calls the `Hooks` object it is given.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..host.hooks import Hooks, call_name

PAUSE_AT = "DDTREE_OPS_TEST_PAUSE_AT"
PAUSE_FILE = "DDTREE_OPS_TEST_PAUSE_FILE"
FAULT = "DDTREE_OPS_TEST_FAULT"
HOOK_VARIABLES = (PAUSE_AT, PAUSE_FILE, FAULT)


class EnvHooks(Hooks):
    """The hooks the environment asks for (see the module docstring)."""

    def __init__(self, pause_at: str | None, pause_file: str | None, fault_spec: str | None):
        self.pause_at, self.pause_file = pause_at, pause_file
        self.fault_spec = fault_spec.split(":") if fault_spec else None
        if self.fault_spec is not None and len(self.fault_spec) != 3:
            raise ValueError(f"{FAULT} must be <fail|drop|lost-answer>:<call>:<n>, got {fault_spec!r}")
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()  # hosts of a batch call in parallel threads

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> EnvHooks:
        return cls(environ.get(PAUSE_AT), environ.get(PAUSE_FILE), environ.get(FAULT))

    def pause(self, point: str) -> None:
        if not self.pause_file or self.pause_at != point:
            return
        with open(self.pause_file, "w") as fh:
            fh.write(f"{os.getpid()} {point}\n")
        deadline = time.monotonic() + 600
        while os.path.exists(self.pause_file) and time.monotonic() < deadline:
            time.sleep(0.05)

    def agent_install_pause(self) -> dict[str, Any]:
        if not self.pause_file or self.pause_at != "between-files":
            return {}
        return {"test_pause": {"after": 1, "file": self.pause_file}}

    def fault(self, request: dict[str, Any]) -> str | None:
        if self.fault_spec is None:
            return None
        kind, name, nth = self.fault_spec
        got = call_name(request)
        if got != name:
            return None
        with self._lock:
            self._seen[got] = self._seen.get(got, 0) + 1
            return kind if self._seen[got] == int(nth) else None
