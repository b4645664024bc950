"""Paramiko, imported without invoke.

paramiko.config imports invoke (and invoke imports unittest.mock) when Paramiko is imported, only
for ssh_config's `Match exec`; ddtree-ops never reads an ssh_config (host/transport.py connects
with the inventory's values alone). Refused for that one import, Paramiko is 0.12 CPU-s lighter
on every CLI start (`ddtree-ops status` on one host: 0.77 -> 0.65 CPU-s). A process that had
imported invoke before keeps it, and one that imports it afterwards gets it: only
`paramiko.config.invoke` stays None, so `Match exec` in an ssh_config parsed by this process's
Paramiko raises the ImportError paramiko saved.
"""

import sys

_refused = "invoke" not in sys.modules
if _refused:
    sys.modules["invoke"] = None  # type: ignore[assignment]  # `import invoke` raises ImportError
try:
    import paramiko
finally:
    if _refused and sys.modules.get("invoke", False) is None:
        del sys.modules["invoke"]

__all__ = ["paramiko"]
