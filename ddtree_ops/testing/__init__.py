"""The test rig, never on the deploy path: local test hosts (`ddtree_ops.testing.sandbox`), the
stand-in SGLang server they run (`ddtree_ops.testing.standin`) and the `sandbox` commands
(`ddtree_ops.testing.cli`).

The test hosts need the `sandbox` extra (docker-systemctl-replacement):
`pip install 'ddtree-ops[sandbox]'`, or from a checkout `pip install -e '.[sandbox]'`.

Kept light: `ddtree_ops.cli.commands` imports this module to decide whether to offer the sandbox commands,
and the stand-in server imports it on every test host.
"""

from __future__ import annotations

from importlib import metadata

# The distribution the `sandbox` extra adds (pyproject.toml, [project.optional-dependencies]).
SANDBOX_EXTRA_DISTRIBUTION = "docker-systemctl-replacement"
SANDBOX_EXTRA_HINT = ("the sandbox needs the `sandbox` extra: pip install 'ddtree-ops[sandbox]' "
                      "(from a checkout: pip install -e '.[sandbox]')")


def sandbox_extra_installed() -> bool:
    """True when the `sandbox` extra's distribution is installed in this environment.

    Decided by the installed distribution's metadata, not by importing `systemctl2` (a folder
    without `__init__.py`: any `systemctl2/` folder on sys.path would pass for it) nor by
    finding `systemctl3` on PATH (which depends on how the tool was started). Whether the
    machine can run test hosts at all (root, sshd, ...) is `missing_prerequisites()`'s answer.
    """
    try:
        metadata.distribution(SANDBOX_EXTRA_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return False
    return True
