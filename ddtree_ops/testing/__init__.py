"""The test rig, never on the deploy path: local test hosts (`ddtree_ops.testing.sandbox`), the
stand-in SGLang server they run (`ddtree_ops.testing.standin`) and the `sandbox` commands
(`ddtree_ops.testing.cli`).

The test hosts are containers with real systemd as PID 1; they need OS packages only (root,
systemd-container, openssh-server, iproute2: `missing_prerequisites()` names what is missing),
no Python extra. The `sandbox` extra is kept, empty, so that `pip install 'ddtree-ops[sandbox]'`
from older instructions still works.

Kept light: the stand-in server imports it on every test host.
"""
