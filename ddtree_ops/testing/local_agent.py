"""The real remote agent as a local process, for tests: `AgentChannel` over pipes instead of SSH.

`LocalConnection.start(argv)` runs argv here and returns a channel with the few methods
`AgentChannel` uses (sendall, recv with a timeout, stderr, close), so tests drive the agent with
the controller's own framing and protocol, and can kill the process to see what its death frees.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
from types import SimpleNamespace
from typing import Any, Sequence

from ..host.channel import AgentChannel


class PipeChannel:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self._timeout: float | None = None

    def sendall(self, data: bytes) -> None:
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

    def close(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class LocalConnection:
    def __init__(self, env: dict[str, str] | None = None, cwd: str | None = None):
        self.env, self.cwd = env, cwd
        self.channels: list[PipeChannel] = []

    def start(self, argv: Sequence[str], *, sudo: bool = True) -> PipeChannel:
        proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=self.env, cwd=self.cwd)
        chan = PipeChannel(proc)
        self.channels.append(chan)
        return chan


def local_agent(name: str = "local", **conn: Any) -> AgentChannel:
    """An AgentChannel to an agent process on this machine, run by this interpreter."""
    host = SimpleNamespace(name=name, python=sys.executable, connect_timeout_s=10.0, become=False)
    return AgentChannel(LocalConnection(**conn), host)  # type: ignore[arg-type]


def agent_pid(agent: AgentChannel) -> int:
    return agent.conn.channels[-1].proc.pid  # type: ignore[attr-defined]


def kill_agent(agent: AgentChannel) -> None:
    """The agent process dies at once (SIGKILL), as when its controller's connection is cut."""
    chan = agent.conn.channels[-1]  # type: ignore[attr-defined]
    chan.proc.send_signal(signal.SIGKILL)
    chan.proc.wait()
