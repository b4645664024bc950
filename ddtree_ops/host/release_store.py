"""The release store on a host, driven from here through the remote agent.

`ReleaseStore` speaks the agent's protocol (one JSON request per line, one JSON answer per line)
through a transport. `AgentChannel` starts ONE agent process per operation on the host's own
Python (`python -I -S -c BOOTSTRAP`, under `sudo -n` for a non-root user), sends it
`remote_agent.py`'s source, and then every request of the operation over that one SSH channel:
no file is left behind, no value passes through a shell, and no SSH exec or Python start is paid
per step. That process holds the deploy lock while it lives, so the lock dies with the
operation's connection. A fake host (ddtree_ops.testing.fake_host) is another transport.
"""

from __future__ import annotations

import base64
import contextlib
import getpass
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..config.inventory import Host
from ..errors import LockHeldError, RemoteCommandError, UnreachableError
from ..testing.pause_points import call_name, fault_for
from . import agent as remote_agent
from .transport import HostConnection

_AGENT_SOURCE = Path(remote_agent.__file__).read_text()


def new_release_id() -> str:
    """Sortable by time, unique across operators: 20261130T075500Z-1a2b3c."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass
class LockHolder:
    token: str
    holder: dict[str, Any]


class AgentTransport(Protocol):
    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Run one agent request; its `result`, or RemoteCommandError/UnreachableError."""

    def close(self) -> None:
        """End the agent process (and with it the lock it holds)."""


def agent_argv(python: str) -> list[str]:
    """How the host's Python runs the agent: isolated (-I: no PYTHONPATH, no user site, no
    current folder) and without `site` (-S), so no `.pth` file in the venv runs as root. The agent
    needs only the standard library."""
    return [python, "-I", "-S", "-c", remote_agent.BOOTSTRAP]


# Without a request for this long the agent exits (freeing the lock): a controller whose network
# vanished without closing the TCP connection is noticed. Long waits poll the unit meanwhile.
IDLE_TIMEOUT_S = 600.0
# How long `lock` waits for a holder that is just ending (its agent reading EOF and exiting).
LOCK_GRACE_S = 3.0


class AgentChannel:
    """The remote agent over one SSH channel, started on the first request.

    After a lost connection or a timed-out request the channel is closed and every later call
    raises UnreachableError until `reset()` (a reconnect) starts a new agent."""

    def __init__(self, conn: HostConnection, host: Host):
        self.conn, self.host = conn, host
        self._chan: Any = None
        self._buf = bytearray()
        self._broken: str | None = None
        self.starts = 0  # agent processes started (one per operation unless reconnected)

    def _start(self) -> None:
        chan = self.conn.start(agent_argv(self.host.python))
        source = _AGENT_SOURCE.encode()
        try:
            chan.sendall(b"%010d" % len(source) + source)
        except (OSError, EOFError) as e:
            chan.close()
            raise UnreachableError(f"{self.host.name}: connection lost while starting the agent: {e}") from None
        self._chan, self._buf = chan, bytearray()
        self.starts += 1
        self._exchange({"op": "hello", "idle_timeout": IDLE_TIMEOUT_S}, self.host.connect_timeout_s + 30)

    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self._broken:
            raise UnreachableError(f"{self.host.name}: {self._broken}")
        if self._chan is None:
            self._start()
        fault = fault_for(request)  # a test hook, off unless its environment variable is set
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


class ReleaseStore:
    def __init__(self, agent: AgentTransport, host: Host):
        self.agent, self.host = agent, host
        self.state_dir = host.state_dir
        self.held: LockHolder | None = None  # the lock this operation holds, re-taken after a reconnect
        self.lock_grace_s = LOCK_GRACE_S

    def call(self, op: str, timeout: float = 300, **request: Any) -> dict[str, Any]:
        return self.agent.call({"op": op, "state_dir": self.state_dir, **request}, timeout)

    # -- facts ---------------------------------------------------------------------------------
    def facts(self, paths: list[str], secret_paths: list[str] = ()) -> dict[str, Any]:
        """Host facts; `secret_paths` get mode and owner only (no hash of a secret leaves the host)."""
        return self.call("facts", site_packages=self.host.site_packages, unit_path=self.host.unit_path,
                         paths=paths, secret_paths=list(secret_paths))

    # -- lock ------------------------------------------------------------------------------------
    def acquire_lock(self, command: str, *, break_tokens: tuple[str, ...] = ()) -> LockHolder:
        """Take the host's deploy lock for this operation (it lives as long as the agent process).
        `break_tokens`: holders' tokens the operator read in a lock message and chose to end."""
        token = uuid.uuid4().hex[:12]
        holder = {
            "token": token, "user": _whoami(), "machine": socket.gethostname(), "pid": os.getpid(),
            "since": time.time(), "since_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": command,
        }
        res = self.call("lock", holder=holder, wait_s=self.lock_grace_s)
        if not res["acquired"] and res["holder"].get("token") in break_tokens:
            res = self.call("lock", holder=holder, **{"break": res["holder"]["token"]})
        if not res["acquired"]:
            raise LockHeldError(lock_message(self.host.name, res["holder"], res.get("break_failed", False)))
        self.held = LockHolder(token, res["holder"])
        return self.held

    def relock(self) -> None:
        """After a reconnect (a new agent process): take the lock again for the same operation.
        LockHeldError when somebody else took it while the connection was down."""
        if self.held is None:
            return
        res = self.call("lock", holder=dict(self.held.holder, token=self.held.token, reacquired_at=time.time()),
                        wait_s=self.lock_grace_s, resume_generation=self.held.holder.get("generation"))
        if not res["acquired"]:
            self.held = None
            raise LockHeldError(f"{self.host.name}: the deploy lock was taken by another run while the connection "
                                f"was down ({describe_holder(res['holder'])}); this run no longer knows the host's "
                                f"state and stops without touching it")
        self.held = LockHolder(self.held.token, res["holder"])

    def release_lock(self, lock: LockHolder) -> None:
        self.held = None
        self.call("unlock", token=lock.token)

    # -- journal ---------------------------------------------------------------------------------
    def journal(self, **fields: Any) -> None:
        self.call("journal", journal=fields)

    def clear_journal(self) -> None:
        self.call("journal", clear=True)

    # -- releases --------------------------------------------------------------------------------
    def release_dir(self, rid: str) -> str:
        return f"{self.state_dir}/releases/{rid}"

    def backup_dir(self, rid: str) -> str:
        return f"{self.state_dir}/original" if rid == "original" else f"{self.release_dir(rid)}/backup"

    def write_release(self, rid: str, **fields: Any) -> dict[str, Any]:
        return self.call("release_write", release_id=rid, fields=fields)["release"]

    def set_current(self, rid: str | None) -> None:
        self.call("set_current", release_id=rid)

    def history(self) -> dict[str, Any]:
        return self.call("history")

    def prune(self, keep: int) -> list[str]:
        return self.call("prune", keep=keep)["removed"]


def describe_holder(h: dict[str, Any]) -> str:
    if not h or "user" not in h:
        return str(h.get("holder", "an unknown holder")) if h else "an unknown holder"
    age = time.time() - float(h.get("since", time.time()))
    agent = f", host-side agent pid {h['agent_pid']}" if h.get("agent_pid") else ""
    return (f"{h['user']}@{h.get('machine')} pid {h.get('pid')}{agent}, since {h.get('since_utc')} "
            f"({age:.0f} s ago), running `{h.get('command')}`")


def lock_message(host: str, holder: dict[str, Any], break_failed: bool = False) -> str:
    """Why the lock could not be taken, and the way out: the lock frees itself when its holder's
    connection ends; only a holder that is still connected needs --break-lock with its token."""
    token = holder.get("token")
    if break_failed:
        return (f"{host}: --break-lock {token}: the lock changed hands or its holder did not end; now held by "
                f"{describe_holder(holder)}")
    if holder.get("legacy"):
        return (f"{host}: deploy lock held by {describe_holder(holder)} (a lock directory left by an older "
                f"ddtree-ops); if that run is gone, pass --break-lock {token}")
    return (f"{host}: deploy lock held by {describe_holder(holder)}. It is freed by itself when that run ends or "
            f"loses its connection; to end that run's hold on the host now, pass --break-lock {token}")


def _whoami() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return str(os.getuid())
