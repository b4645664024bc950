"""The agent on a host, reached over one SSH channel per operation.

`AgentChannel` starts ONE agent process per operation on the host's own Python (`python -I -S -c
BOOTSTRAP`, under `sudo -n` for a non-root user), sends it the agent's source (its modules joined
into one, see agent_source.py), and then every request of the operation over that one channel: no
file is left behind, no value passes through a shell, and no SSH exec or Python start is paid per
step. That process holds the deploy lock while it lives, so the lock dies with the operation's
connection. A fake host (ddtree_ops.testing.fake_host) is another `AgentTransport`.

Requests travel as JSON objects (one per line, one answer per line); `ask` sends one built from
its `protocol` dataclass, so callers never spell an op or a field as a string.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from typing import Any, Protocol

from ..config.inventory import Host
from ..errors import RemoteCommandError, UnreachableError
from .agent import BOOTSTRAP
from .agent.protocol import Hello, Request
from .agent_source import agent_source
from .hooks import NO_HOOKS, Hooks, call_name
from .transport import HostConnection


class AgentTransport(Protocol):
    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Run one agent request; its `result`, or RemoteCommandError/UnreachableError."""

    def close(self) -> None:
        """End the agent process (and with it the lock it holds)."""


def agent_argv(python: str) -> list[str]:
    """How the host's Python runs the agent: isolated (-I: no PYTHONPATH, no user site, no
    current folder) and without `site` (-S), so no `.pth` file in the venv runs as root. The agent
    needs only the standard library."""
    return [python, "-I", "-S", "-c", BOOTSTRAP]


# Without a request for this long the agent exits (freeing the lock): a controller whose network
# vanished without closing the TCP connection is noticed. Long waits poll the unit meanwhile.
IDLE_TIMEOUT_S = 600.0


class AgentChannel:
    """The remote agent over one SSH channel, started on the first request.

    After a lost connection or a timed-out request the channel is closed and every later call
    raises UnreachableError until `reset()` (a reconnect) starts a new agent."""

    def __init__(self, conn: HostConnection, host: Host, hooks: Hooks = NO_HOOKS):
        self.conn, self.host, self.hooks = conn, host, hooks
        self._chan: Any = None
        self._buf = bytearray()
        self._broken: str | None = None
        self.starts = 0  # agent processes started (one per operation unless reconnected)

    def _start(self) -> None:
        chan = self.conn.start(agent_argv(self.host.python))
        source = agent_source().encode()
        try:
            chan.sendall(b"%010d" % len(source) + source)
        except (OSError, EOFError) as e:
            chan.close()
            raise UnreachableError(f"{self.host.name}: connection lost while starting the agent: {e}") from None
        self._chan, self._buf = chan, bytearray()
        self.starts += 1
        self._exchange(Hello(IDLE_TIMEOUT_S).to_wire(), self.host.connect_timeout_s + 30)

    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self._broken:
            raise UnreachableError(f"{self.host.name}: {self._broken}")
        if self._chan is None:
            self._start()
        fault = self.hooks.fault(request)  # None unless a test injected hooks
        if fault == "fail":
            raise RemoteCommandError(f"{self.host.name}: remote step {call_name(request)!r} failed (test fault)")
        if fault == "drop":
            self.conn.close()
        return answer_result(self.host.name, request["op"], self._exchange(request, timeout))

    def _exchange(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        op = request["op"]
        chan = self._chan
        try:
            chan.sendall(json.dumps(request).encode() + b"\n")
            deadline = time.monotonic() + timeout
            while (nl := self._buf.find(b"\n")) < 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._fail(f"remote step {op!r} timed out after {timeout:g} s; the agent was stopped")
                    raise RemoteCommandError(f"{self.host.name}: remote step {op!r} timed out after {timeout:g} s")
                chan.settimeout(min(left, 5.0))
                try:
                    chunk = chan.recv(1 << 20)
                except socket.timeout:
                    continue
                if not chunk:
                    raise UnreachableError(f"{self.host.name}: {self._why_ended(op)}")
                self._buf += chunk
        except (OSError, EOFError) as e:
            self._fail(f"connection lost during remote step {op!r}: {e}")
            raise UnreachableError(f"{self.host.name}: connection lost during remote step {op!r}: {e}") from None
        except UnreachableError as e:
            self._fail(str(e).split(": ", 1)[-1])
            raise
        line = bytes(self._buf[:nl])
        del self._buf[:nl + 1]
        try:
            return json.loads(line)
        except ValueError:
            self._fail(f"unreadable answer to {op!r}")
            raise RemoteCommandError(f"{self.host.name}: remote step {op!r}: unreadable answer from "
                                     f"{self.host.python}: {line[-300:]!r} {self._stderr()}") from None

    def _why_ended(self, op: str) -> str:
        """EOF from the agent: it exited (with a status and maybe a traceback), or the connection
        went (sshd or the network gone: no exit status)."""
        chan = self._chan
        status = chan.recv_exit_status() if chan is not None and chan.exit_status_ready() else -1
        if status != -1:  # paramiko's -1: the channel closed without one
            return f"the agent exited ({status}) during {op!r}: {self._stderr()}"
        return f"connection lost during remote step {op!r} (the SSH channel closed without an exit status)"

    def _stderr(self) -> str:
        err = b""
        try:
            while self._chan is not None and self._chan.recv_stderr_ready():
                chunk = self._chan.recv_stderr(1 << 16)
                if not chunk:  # end of the stream: a channel may still call that "ready"
                    break
                err += chunk
        except (OSError, EOFError):
            pass
        text = err.decode(errors="replace").strip()
        return text[-800:] if text else "(no error output)"

    def _fail(self, why: str) -> None:
        self._broken = why
        self._close_channel()

    def _close_channel(self) -> None:
        if self._chan is not None:
            with contextlib.suppress(Exception):
                self._chan.close()
        self._chan = None

    def reset(self) -> None:
        """Forget the old agent (after a reconnect); the next call starts a new one."""
        self._close_channel()
        self._broken = None

    def close(self) -> None:
        self._close_channel()
        self._broken = "the agent was closed"


def answer_result(host: str, op: str, answer: dict[str, Any]) -> dict[str, Any]:
    """The agent's answer document → its result, or the error it reported."""
    if not answer.get("ok"):
        raise RemoteCommandError(f"{host}: remote step {op!r} failed: {answer.get('error')}")
    return answer["result"]


def ask(agent: AgentTransport, request: Request, timeout: float) -> Any:
    """Send one typed request; the result document it answers (RemoteCommandError if the agent
    reported an error)."""
    return agent.call(request.to_wire(), timeout)
