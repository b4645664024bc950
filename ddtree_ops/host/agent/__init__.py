"""The part of a deploy that runs ON the host: file facts, backup, atomic install, restore, lock,
journal, the release store, systemctl, the launch check. Stdlib only, Python >= 3.8, run by the
SGLang venv's interpreter (`python -I -S`: no site, no .pth file runs as root).

One module per concern; `serve` is the dispatch loop. They are sent to the host joined into one
source (host/agent_source.py: package-relative imports taken out, modules in dependency order) and
run there as one namespace, so a name is defined in one module only. Here, in-process (the fake
host, tests), the package is imported as any other.

`protocol` holds the request and reply dataclasses the controller builds its requests from.
"""

from .protocol import ProtocolError
from .serve import BOOTSTRAP, OPS, Agent, serve

__all__ = ["BOOTSTRAP", "OPS", "Agent", "ProtocolError", "serve"]
