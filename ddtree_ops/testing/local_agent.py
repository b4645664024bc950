"""The real remote agent as a local process, for tests: `AgentChannel` over pipes instead of SSH.

`LocalConnection.start(argv)` runs argv here and returns a channel with the few methods
`AgentChannel` uses (sendall, recv with a timeout, stderr, close), so tests drive the agent with
the controller's own framing and protocol, and can kill the process to see what its death frees.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
from types import SimpleNamespace
from typing import Any, Callable, Sequence

from ..config.lock_settings import LOCK_LEASE_S, LOCK_RENEW_S
from ..host.channel import AgentChannel
from ..host.lease import lease_clock


class PipeChannel:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self._timeout: float | None = None
        self.sent = 0  # writes to the agent: its source, then one per request

    def sendall(self, data: bytes) -> None:
        self.sent += 1
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def settimeout(self, t: float | None) -> None:
        self._timeout = t

    def recv(self, n: int) -> bytes:
        ready, _, _ = select.select([self.proc.stdout], [], [], self._timeout)
        if not ready:
            raise socket.timeout("timed out")
        return os.read(self.proc.stdout.fileno(), n)

    def exit_status_ready(self) -> bool:
        try:
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            return False
        return True

    def recv_exit_status(self) -> int:
        return self.proc.wait()

    def recv_stderr_ready(self) -> bool:
        return bool(select.select([self.proc.stderr], [], [], 0)[0]) and self.proc.poll() is not None

    def recv_stderr(self, n: int) -> bytes:
        return os.read(self.proc.stderr.fileno(), n)

    def hang_up(self) -> None:
        """The controller's end of the channel closes (the agent reads EOF); the process lives on."""
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        """Hang up, and end an agent that does not exit by itself: one that holds the lock waits
        out its lease for a reconnect, which a test ends as a reconnect would (SIGTERM)."""
        self.hang_up()
        try:
            self.proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# The agent package (not the joined source) with a heal that only records its calls, one JSON line
# each, in the file named by its argument: what the lease does when it runs out, without systemctl.
RECORDING_HEAL_AGENT = "\n".join([
    "import json, os, sys",
    "def r(n):",
    "    b = b''",
    "    while len(b) < n:",
    "        c = os.read(0, n - len(b))",
    "        if not c: sys.exit(0)",
    "        b += c",
    "    return b",
    "r(int(r(10)))  # the joined source the channel sends: this agent is the package itself",
    "from ddtree_ops.host.agent.serve import Agent, serve",
    "def heal(state_dir, why):",
    "    with open(sys.argv[1], 'a') as fh:",
    "        fh.write(json.dumps({'state_dir': state_dir, 'why': why, 'pid': os.getpid()}) + '\\n')",
    "    return {'healed': True, 'ok': True, 'previous': 'r-before', 'recorded': True}",
    "serve(agent=Agent(heal_fn=heal))",
])


def healed(log: str) -> list[dict[str, Any]]:
    """The calls of the recording heal (LocalConnection(heal_log=...)) so far."""
    if not os.path.exists(log):
        return []
    with open(log) as fh:
        return [json.loads(line) for line in fh if line.strip()]


class LocalConnection:
    """`heal_log`: run the agent package with a heal that records its calls there instead."""

    def __init__(self, env: dict[str, str] | None = None, cwd: str | None = None, heal_log: str | None = None):
        self.env, self.cwd, self.heal_log = env, cwd, heal_log
        self.channels: list[PipeChannel] = []

    def start(self, argv: Sequence[str], *, sudo: bool = True) -> PipeChannel:
        if self.heal_log is not None:
            argv = [sys.executable, "-c", RECORDING_HEAL_AGENT, self.heal_log]
        proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=self.env, cwd=self.cwd)
        chan = PipeChannel(proc)
        self.channels.append(chan)
        return chan


def local_agent(name: str = "local", *, lease_s: float = LOCK_LEASE_S, renew_s: float = LOCK_RENEW_S,
                clock: Callable[[], float] = lease_clock, **conn: Any) -> AgentChannel:
    """An AgentChannel to an agent process on this machine, run by this interpreter."""
    host = SimpleNamespace(name=name, python=sys.executable, agent_python=sys.executable, connect_timeout_s=10.0,
                           become=False, lock_lease_s=lease_s, lock_renew_s=renew_s)
    return AgentChannel(LocalConnection(**conn), host, clock=clock)  # type: ignore[arg-type]


def agent_pid(agent: AgentChannel) -> int:
    return agent.conn.channels[-1].proc.pid  # type: ignore[attr-defined]


def hang_up(agent: AgentChannel) -> int:
    """The controller's connection closes under the agent (it reads EOF) and the controller is
    gone; the agent's pid, which lives on."""
    chan = agent.conn.channels[-1]  # type: ignore[attr-defined]
    agent._stop_heartbeat()
    chan.hang_up()
    return chan.proc.pid


def kill_agent(agent: AgentChannel) -> None:
    """The agent process dies at once (SIGKILL), as when its controller's connection is cut."""
    chan = agent.conn.channels[-1]  # type: ignore[attr-defined]
    chan.proc.send_signal(signal.SIGKILL)
    chan.proc.wait()
