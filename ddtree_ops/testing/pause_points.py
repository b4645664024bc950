"""TEST HOOK, off by default: named points where the fault-matrix tests (tests/test_faults.py)
pause the tool, so that they can kill or interrupt it exactly there.

With DDTREE_OPS_TEST_PAUSE_AT=<point> and DDTREE_OPS_TEST_PAUSE_FILE=<path> in the environment,
the deploy writes "<pid> <point>" to <path> when it reaches <point> and waits until the file is
removed. Points: before-backup, after-backup, between-files (the remote agent pauses after the
first installed file and writes <path> ON THE HOST), after-unit, wait-for-weights (restarted,
weights loading), before-commit (health gate passed). Without both variables nothing happens.
"""

from __future__ import annotations

import os
import time
from typing import Any

PAUSE_AT = "DDTREE_OPS_TEST_PAUSE_AT"
PAUSE_FILE = "DDTREE_OPS_TEST_PAUSE_FILE"


def pause(point: str) -> None:
    path = os.environ.get(PAUSE_FILE)
    if not path or os.environ.get(PAUSE_AT) != point:
        return
    with open(path, "w") as fh:
        fh.write(f"{os.getpid()} {point}\n")
    deadline = time.monotonic() + 600
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def agent_pause_request() -> dict[str, Any]:
    """The agent's half of the hook: pause after the first file of the install."""
    path = os.environ.get(PAUSE_FILE)
    if not path or os.environ.get(PAUSE_AT) != "between-files":
        return {}
    return {"test_pause": {"after": 1, "file": path}}


# Faults at a named remote call (the sandbox half of the fault-at-every-call tests):
# DDTREE_OPS_TEST_FAULT="<fail|drop>:<call>:<n>" makes the n-th call named <call> fail as a host
# would report it ("fail"), or cuts the SSH connection just before it ("drop"). A call is named
# by the agent op ("journal", "backup", "install", "release_write", "set_current", "prune", ...),
# a unit action by its systemctl verb ("systemctl restart"), a unit probe "probe".
FAULT = "DDTREE_OPS_TEST_FAULT"
_seen: dict[str, int] = {}


def call_name(request: dict[str, Any]) -> str:
    if request.get("op") == "run":
        return "probe" if "argvs" in request else " ".join(request["argv"][:2])
    return str(request.get("op"))


def fault_for(request: dict[str, Any]) -> str | None:
    """"fail" or "drop" when this call is the one the hook names, else None."""
    spec = os.environ.get(FAULT)
    if not spec:
        return None
    kind, name, nth = spec.split(":")
    got = call_name(request)
    if got != name:
        return None
    _seen[got] = _seen.get(got, 0) + 1
    return kind if _seen[got] == int(nth) else None
