"""Named points where a test may stop or break a run: the fault matrix's handle on the product.

The product calls these on the `Hooks` object it was given and never asks where one came from: the
default (`NO_HOOKS`) does nothing, and only the test rig (`ddtree_ops.testing.pause_points`) builds
one that acts. So nothing on the deploy path reads a test's environment variables.

Points (in deploy order): before-connect (each host's first contact, also of status, plan and
logs), connect-retry (each failed try of a first contact that is to be retried), before-backup,
after-backup, between-files (asked of the agent, which pauses after the first installed file, on
the host), after-unit, before-deregister (each time a serving unit leaves the router),
wait-for-weights, before-register (each time, the rollback's too), before-commit; in a rollback:
rollback-services (files restored, the units not yet).
"""

from __future__ import annotations

from typing import Any


def call_name(request: dict[str, Any]) -> str:
    """How a fault names an agent call: its op, a unit action by its systemctl verb
    ("systemctl restart"), a unit probe "probe"."""
    if request.get("op") == "run":
        return "probe" if "argvs" in request else " ".join(request["argv"][:2])
    return str(request.get("op"))


class Hooks:
    """No-op hooks; a test subclass overrides what it needs."""

    def pause(self, point: str) -> None:
        """The run reached `point`; a test may hold it here (to kill or interrupt it)."""

    def agent_install_pause(self) -> dict[str, Any]:
        """Extra fields of the agent's `install` request: a test may ask the agent to pause between
        two files, on the host."""
        return {}

    def fault(self, request: dict[str, Any]) -> str | None:
        """Before an agent call: "fail" (answer as a host error), "drop" (cut the connection),
        "lost-answer" (cut it once the host has done the call) or None (go ahead)."""
        return None


NO_HOOKS = Hooks()
