"""The agent on a host, reached over one SSH channel per operation.

`AgentChannel` starts ONE agent process per operation on the host's system Python (`agent_python
-I -S -c BOOTSTRAP`, under `sudo -n` for a non-root user; never the venv's interpreter, which whoever
can write the venv controls), sends it the agent's source (its modules joined
into one, see agent_source.py), and then every request of the operation over that one channel: no
file is left behind, no value passes through a shell, and no SSH exec or Python start is paid per
step. That process holds the deploy lock as a lease: the channel's heartbeat (lease.py) renews it
while the runbook asks nothing, and a controller stopped or cut off for longer than the lease
finds it lost (LeaseLost on every later call, nothing more sent). A fake host
(ddtree_ops.testing.fake_host) is another `AgentTransport`.

Requests travel as JSON objects (one per line, one answer per line); `ask` sends one built from
its `protocol` dataclass, so callers never spell an op or a field as a string. One exchange at a
time: the heartbeat waits for a request in flight, and a request for a heartbeat.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from typing import Any, Callable, Protocol, TypeVar

from ..config.inventory import Host
from ..errors import LeaseLost, PreflightError, RemoteCommandError, UnreachableError, reason, shown
from .agent import BOOTSTRAP
from .agent.protocol import Hello, HelloReply, ProtocolError, Renew, Request
from .agent_source import agent_source
from .hooks import NO_HOOKS, Hooks, call_name
from .lease import Heartbeat, LeaseWatch, lease_clock
from .transport import HostConnection

R = TypeVar("R")

# A reply is one JSON line; the biggest real one (the facts of a large patch set) is a few MiB. A
# host that sends more without a line end is not an agent: the channel stops reading and ends it.
MAX_REPLY_BYTES = 64 * 1024 * 1024
REPLY_CAP_ENV = "DDTREE_OPS_MAX_REPLY_BYTES"  # a test lowers the cap without streaming 64 MiB
# Real replies nest a handful of levels; a deeper one would reach code that walks it recursively.
MAX_REPLY_DEPTH = 64
STDERR_READ_MAX = 1 << 20  # an agent's error output read after it ended: enough for a traceback


def reply_cap() -> int:
    """The longest reply line accepted (MAX_REPLY_BYTES unless the environment lowers it)."""
    raw = os.environ.get(REPLY_CAP_ENV, "")
    return int(raw) if raw.isdigit() and 0 < int(raw) < MAX_REPLY_BYTES else MAX_REPLY_BYTES


def nesting_depth(value: Any, limit: int) -> int:
    """How deeply `value` nests lists and dicts, counted without recursion and only up to
    `limit` + 1 (deeper is refused anyway)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if not isinstance(v, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


class AgentTransport(Protocol):
    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Run one agent request; its `result`, or RemoteCommandError/UnreachableError."""

    def close(self) -> None:
        """End the agent process (and with it the lock it holds)."""


def agent_argv(python: str) -> list[str]:
    """How the host's system Python (the inventory's `agent_python`) runs the agent: isolated (-I:
    no PYTHONPATH, no user site, no current folder) and without `site` (-S). The agent needs only
    the standard library; nothing of the venv runs as root (the agent runs the venv's interpreter
    only as the unit's User=, for the compile and the launch check)."""
    return [python, "-I", "-S", "-c", BOOTSTRAP]


class AgentChannel:
    """The remote agent over one SSH channel, started on the first request.

    After a lost connection or a timed-out request the channel is closed and every later call
    raises UnreachableError until `reset()` (a reconnect) starts a new agent; once the lease is
    lost, every call and reset raises LeaseLost."""

    def __init__(self, conn: HostConnection, host: Host, hooks: Hooks = NO_HOOKS, *,
                 clock: Callable[[], float] = lease_clock):
        self.conn, self.host, self.hooks = conn, host, hooks
        self._chan: Any = None
        self._buf = bytearray()
        self._scanned = 0  # the first bytes of _buf already searched for a line end (none there)
        self._broken: str | None = None
        self._io = threading.Lock()  # one exchange at a time: requests and heartbeats
        self.watch = LeaseWatch(host.name, host.lock_lease_s, host.lock_renew_s, clock)
        self._heartbeat: Heartbeat | None = None
        self.starts = 0  # agent processes started (one per operation unless reconnected)
        self.hello: HelloReply | None = None  # the agent's first answer: its pid, Python, unit
        self._ended: tuple[int, str] | None = None  # (exit status, error output) of an agent that exited

    def _start(self) -> None:
        chan = self.conn.start(agent_argv(self.host.agent_python))
        source = agent_source().encode()
        self._chan, self._buf, self._scanned, self._ended = chan, bytearray(), 0, None
        try:
            chan.sendall(b"%010d" % len(source) + source)
        except (OSError, EOFError) as e:
            refusal = self._not_started(chan)
            self._close_channel()
            if refusal is not None:
                raise refusal from None
            raise UnreachableError(f"{self.host.name}: connection lost while starting the agent: {reason(e)}") from None
        self.starts += 1
        try:
            answer = self._exchange(Hello(self.host.lock_lease_s).to_wire(), self.host.connect_timeout_s + 30)
        except UnreachableError:
            refusal = self._not_started(chan)
            if refusal is not None:
                raise refusal from None
            raise
        try:
            self.hello = HelloReply.from_wire(answer_result(self.host.name, "hello", answer))
        except ProtocolError as e:
            self._fail(f"not an agent's hello: {e}")
            raise RemoteCommandError(f"{self.host.name}: remote step 'hello': not an agent's answer: "
                                     f"{str(e)[:300]}; the agent was stopped") from None
        if self.hello.refused:
            self._fail(f"the agent refused its interpreter: {self.hello.refused}")
            raise PreflightError(self.host.name, f"agent_python {self.host.agent_python}: "
                                                 f"{self.hello.refused[:600]}")
        self._start_heartbeat()

    def start(self) -> None:
        """Start the agent now (its hello answered), not at the first request: the first contact
        with a host retries this as it retries the handshake (first_contact.py)."""
        with self._io:
            self.watch.check()
            if self._broken:
                raise UnreachableError(f"{self.host.name}: {self._broken}")
            if self._chan is None:
                self._start()

    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        with self._io:
            self.watch.check()
            if self._broken:
                raise UnreachableError(f"{self.host.name}: {self._broken}")
            if self._chan is None:
                self._start()
            fault = self.hooks.fault(request)  # None unless a test injected hooks
            if fault == "fail":
                raise RemoteCommandError(f"{self.host.name}: remote step {call_name(request)!r} failed (test fault)")
            if fault == "drop":
                self.conn.close()
            self.watch.journal_sent(request)
            answer = answer_result(self.host.name, request["op"], self._exchange(request, timeout))
            if fault == "lost-answer":  # the host did it; the connection goes before the answer arrives
                self.conn.close()
                self._fail("connection lost after the request was done (test fault)")
                raise UnreachableError(f"{self.host.name}: connection lost after remote step "
                                       f"{call_name(request)!r} was done (test fault)")
            return answer

    # -- the heartbeat ---------------------------------------------------------------------------
    def _start_heartbeat(self) -> None:
        if self._heartbeat is None or not self._heartbeat.alive:
            self._heartbeat = Heartbeat(self._beat, min(self.host.lock_renew_s / 2, 1.0),
                                        name=f"lease heartbeat {self.host.name}")
            self._heartbeat.start()

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()

    def _beat(self) -> bool:
        """One look at the lease: lost (this process was stopped, or no answer came for the
        lease), renewed when due, or left alone while a request is in flight. False: stop."""
        if self._io.locked():
            return True  # a request is in flight: the agent does not count the lease meanwhile
        with self._io:
            try:
                self.watch.check()
            except LeaseLost:
                self._close_channel()
                return False
            if self._chan is None or self._broken or not self.watch.due():
                return True  # a lost connection: the runbook reconnects, or the lease runs out
            try:
                self._exchange(Renew().to_wire(), max(self.watch.left_s(), 0.1), abortable=True)
            except (RemoteCommandError, UnreachableError):
                pass  # the channel is broken now; the lease runs out unless a reconnect comes first
            return not (self._heartbeat is not None and self._heartbeat.stopped)

    # -- one exchange ----------------------------------------------------------------------------
    def _exchange(self, request: dict[str, Any], timeout: float, abortable: bool = False) -> dict[str, Any]:
        op = request["op"]
        chan = self._chan
        sent_at = self.watch.clock()
        try:
            chan.sendall(json.dumps(request).encode() + b"\n")
            deadline = time.monotonic() + timeout
            cap = reply_cap()
            while (nl := self._line_end(op, cap)) < 0:
                left = deadline - time.monotonic()
                if abortable and self._heartbeat is not None and self._heartbeat.stopped:
                    raise UnreachableError(f"{self.host.name}: the channel was closed during a heartbeat")
                if left <= 0:
                    self._fail(f"remote step {op!r} timed out after {timeout:g} s; the agent was stopped")
                    raise RemoteCommandError(f"{self.host.name}: remote step {op!r} timed out after {timeout:g} s")
                chan.settimeout(min(left, 1.0 if abortable else 5.0))
                try:
                    chunk = chan.recv(1 << 20)
                except socket.timeout:
                    continue
                if not chunk:
                    raise UnreachableError(f"{self.host.name}: {self._why_ended(op)}")
                self._buf += chunk
        except (OSError, EOFError, ValueError) as e:  # ValueError: a pipe closed under a heartbeat
            why = f"connection lost during remote step {op!r}: {reason(e)}"
            self._fail(why)
            raise UnreachableError(f"{self.host.name}: {why}") from None
        except UnreachableError as e:
            self._fail(str(e).split(": ", 1)[-1])
            raise
        line = bytes(self._buf[:nl])
        del self._buf[:nl + 1]
        self._scanned = 0
        answer = self._parse(op, line)
        self.watch.answered(sent_at + _busy_s(answer))
        return answer

    def _line_end(self, op: str, cap: int) -> int:
        """Where the reply's line ends in the buffer (-1: not yet), searching only the bytes that
        came since the last look. A reply longer than `cap` breaks the channel (RemoteCommandError)."""
        nl = self._buf.find(b"\n", self._scanned)
        self._scanned = len(self._buf) if nl < 0 else 0
        if (nl if nl >= 0 else len(self._buf)) > cap:
            self._buf, self._scanned = bytearray(), 0
            why = f"the answer to {op!r} is longer than {cap} bytes (the reply cap)"
            self._fail(f"{why}; the agent was stopped")
            raise RemoteCommandError(f"{self.host.name}: {why}; the agent was stopped")
        return nl

    def _parse(self, op: str, line: bytes) -> dict[str, Any]:
        """The reply line → its document: a JSON object nested at most MAX_REPLY_DEPTH levels;
        anything else breaks the channel (RemoteCommandError, one line)."""
        try:
            answer = json.loads(line)
        except RecursionError:
            answer, why = None, f"nested deeper than {MAX_REPLY_DEPTH} levels"
        except ValueError:
            err = self._stderr()  # read before the channel closes: a traceback may explain the answer
            self._fail(f"unreadable answer to {op!r}")
            raise RemoteCommandError(f"{self.host.name}: remote step {op!r}: unreadable answer from "
                                     f"{self.host.agent_python}: {line[-300:]!r} {err}") from None
        else:
            why = ("not a JSON object" if not isinstance(answer, dict)
                   else f"nested deeper than {MAX_REPLY_DEPTH} levels"
                   if nesting_depth(answer, MAX_REPLY_DEPTH) > MAX_REPLY_DEPTH else "")
        if why:
            self._fail(f"unusable answer to {op!r}: {why}")
            raise RemoteCommandError(f"{self.host.name}: remote step {op!r}: unusable answer from "
                                     f"{self.host.agent_python} ({len(line)} bytes, {why}); the agent was stopped")
        return answer

    def _why_ended(self, op: str) -> str:
        """EOF from the agent: it exited (with a status and maybe a traceback), or the connection
        went (sshd or the network gone: no exit status)."""
        chan = self._chan
        status = chan.recv_exit_status() if chan is not None and chan.exit_status_ready() else -1
        if status != -1:  # paramiko's -1: the channel closed without one
            self._ended = (status, self._stderr())
            return f"the agent exited ({status}) during {op!r}: {self._ended[1]}"
        return f"connection lost during remote step {op!r} (the SSH channel closed without an exit status)"

    def _not_started(self, chan: Any) -> PreflightError | None:
        """`agent_python` could not be run at all (a wrong path, not executable): a preflight
        refusal naming the host, the field and the path, instead of a lost agent (exit 1)."""
        if self._ended is None and chan.exit_status_ready():
            self._ended = (chan.recv_exit_status(), self._stderr(chan))
        if self._ended is None or not interpreter_missing(*self._ended):
            return None
        status, err = self._ended
        return PreflightError(self.host.name, f"agent_python {self.host.agent_python} cannot be run on the host "
                                              f"(exit {status}: {shown(err, 300)}); nothing was changed. Set "
                                              f"agent_python to the host's system Python, such as /usr/bin/python3")

    def _stderr(self, chan: Any = None) -> str:
        chan = chan or self._chan
        err, read = b"", 0
        try:
            while chan is not None and read < STDERR_READ_MAX and chan.recv_stderr_ready():
                chunk = chan.recv_stderr(1 << 16)
                if not chunk:  # end of the stream: a channel may still call that "ready"
                    break
                read += len(chunk)
                err = (err + chunk)[-(1 << 16):]
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
        """Forget the old agent (after a reconnect); the next call starts a new one, which takes
        over the lock from the old one (release_store.relock) if the lease has not run out."""
        with self._io:
            self.watch.check()
            self._close_channel()
            self._broken = None

    def close(self) -> None:
        """End the channel: an agent that still holds the lock keeps it for the rest of its lease."""
        self._stop_heartbeat()
        held = self._io.acquire(timeout=5.0)  # a heartbeat ends within a second once stopped
        try:
            self._close_channel()
            self._broken = "the agent was closed"
        finally:
            if held:
                self._io.release()


def interpreter_missing(status: int, stderr: str) -> bool:
    """Whether an agent that ended with `status` never ran: the login shell could not find (127)
    or execute (126) `agent_python`, or `sudo -n` could not (exit 1, "command not found")."""
    return status in (126, 127) or (status == 1 and stderr.startswith("sudo:") and "command not found" in stderr)


def _busy_s(answer: dict[str, Any]) -> float:
    """How long the agent says it worked on the request (serve.Agent.handle): its lease started
    again that long after the request arrived. Anything but a number >= 0 counts as 0 (the lease
    view then starts at the request's sending), and LeaseWatch caps it at now."""
    busy = answer.get("busy_s")
    if isinstance(busy, bool) or not isinstance(busy, (int, float)) or not busy >= 0:
        return 0.0
    return float(busy)


def answer_result(host: str, op: str, answer: dict[str, Any]) -> dict[str, Any]:
    """The agent's answer document → its result, or the error it reported."""
    if not answer.get("ok"):
        raise RemoteCommandError(f"{host}: remote step {op!r} failed: {str(answer.get('error'))[:4000]}")
    if "result" not in answer:
        raise RemoteCommandError(f"{host}: remote step {op!r}: an answer without a result")
    return answer["result"]


def ask(agent: AgentTransport, request: Request, timeout: float) -> Any:
    """Send one typed request; the result document it answers (RemoteCommandError if the agent
    reported an error)."""
    return agent.call(request.to_wire(), timeout)


def ask_reply(agent: AgentTransport, request: Request, reply_type: type[R], timeout: float, host: str) -> R:
    """`ask`, the answer read as `reply_type`. An answer of another shape (a hostile or broken
    host) is a RemoteCommandError naming the host, never a traceback."""
    doc = ask(agent, request, timeout)
    try:
        return reply_type.from_wire(doc)
    except ProtocolError as e:
        raise RemoteCommandError(f"{host}: remote step {request.OP!r}: not the answer the tool expects: "
                                 f"{shown(str(e), 300)}") from None
