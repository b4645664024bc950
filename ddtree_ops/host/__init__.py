"""One host, connected: SSH transport, the agent channel and the agent itself (the only code that
runs on a host), the release store, systemd units, GPUs, HTTP to the host's server, and the host
session over its one seam (`session.HostLink`: SSH here, the fast tier's fake host in testing).

May import config and errors only; knows nothing of gates, runbooks or fleets.
"""
