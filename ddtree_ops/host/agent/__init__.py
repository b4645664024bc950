"""The part of a deploy that runs ON the host: file facts, backup, atomic install, restore, lock,
journal, the release store, systemctl, the launch check. Stdlib only, Python >= 3.8, run as root
by the host's system interpreter (`agent_python -I -S`), never the venv's (interpreter.py); the
venv's interpreter runs only as the unit's User= (venv_compile.py, launch_check.py).

One module per concern; `serve` is the dispatch loop. They are sent to the host joined into one
source (host/agent_source.py: package-relative imports taken out, modules in dependency order) and
run there as one namespace, so a name is defined in one module only. Here, in-process (the fake
host, tests), the package is imported as any other.

`protocol` holds the request and reply dataclasses the controller builds its requests from.
"""

from .protocol import ProtocolError
from .serve import BOOTSTRAP, OPS, Agent, serve

__all__ = ["BOOTSTRAP", "OPS", "Agent", "ProtocolError", "serve"]
