"""One host, connected: SSH transport, the agent channel and the agent itself (the only code that
runs on a host), the release store, systemd units, GPUs, the host session.

May import config and errors only; knows nothing of gates, runbooks or fleets.
"""
