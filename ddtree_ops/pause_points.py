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
