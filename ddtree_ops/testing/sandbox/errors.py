"""The test rig's one exception type."""

from __future__ import annotations

from ddtree_ops.errors import EXIT_BAD_INPUT, DdtreeOpsError


class SandboxError(DdtreeOpsError):
    """The sandbox cannot be created or managed (missing prerequisite, port taken, ...)."""

    exit_code = EXIT_BAD_INPUT
