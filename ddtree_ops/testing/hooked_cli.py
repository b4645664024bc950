"""`python -m ddtree_ops.testing.hooked_cli ARGS`: the `ddtree-ops` command with the test hooks the
environment asks for (`ddtree_ops.testing.pause_points`). The fault-matrix tests run this; an
operator runs `ddtree-ops`, whose hooks do nothing."""

from __future__ import annotations

from ddtree_ops.cli.commands import main
from ddtree_ops.testing.pause_points import EnvHooks

if __name__ == "__main__":
    main(hooks=EnvHooks.from_environ())
