"""The release store on a host, driven from here through the remote agent.

`ReleaseStore` speaks the agent's protocol (one JSON request, one JSON answer) through a
transport: `SSHAgent` ships `remote_agent.py` and the request over the SSH session's stdin to the
host's own Python (`python -I -S -c BOOTSTRAP`), so no file is left behind, no value passes through a
shell unquoted, and a non-root user's privileged steps run under `sudo -n` like any other
command. A fake host (ddtree_ops.testing.fake_host) is another transport.
"""

from __future__ import annotations

import base64
import getpass
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from . import remote_agent
from .errors import LockHeldError, RemoteCommandError
from .inventory import Host
from .localproc import pid_alive
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


def agent_argv(python: str) -> list[str]:
    """How the host's Python runs the agent: isolated (-I: no PYTHONPATH, no user site, no
    current folder) and without `site` (-S), so no `.pth` file in the venv runs as root. The agent
    needs only the standard library."""
    return [python, "-I", "-S", "-c", remote_agent.BOOTSTRAP]


class SSHAgent:
    """The remote agent over SSH, run by the host's own Python."""

    def __init__(self, conn: HostConnection, host: Host):
        self.conn, self.host = conn, host

    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        op = request["op"]
        payload = json.dumps({"agent": _AGENT_SOURCE, "request": request})
        res = self.conn.run(agent_argv(self.host.python), check=False,
                            stdin=payload, timeout=timeout)
        try:
            answer = json.loads(res.stdout)
        except ValueError:
            raise RemoteCommandError(
                f"{self.host.name}: remote step {op!r} failed (exit {res.exit_code}) with {self.host.python}: "
                f"{(res.stderr or res.stdout).strip()[-800:]}"
            ) from None
        return answer_result(self.host.name, op, answer)


def answer_result(host: str, op: str, answer: dict[str, Any]) -> dict[str, Any]:
    """The agent's answer document → its result, or the error it reported."""
    if not answer.get("ok"):
        raise RemoteCommandError(f"{host}: remote step {op!r} failed: {answer.get('error')}")
    return answer["result"]


class ReleaseStore:
    def __init__(self, agent: AgentTransport, host: Host):
        self.agent, self.host = agent, host
        self.state_dir = host.state_dir

    def call(self, op: str, timeout: float = 300, **request: Any) -> dict[str, Any]:
        return self.agent.call({"op": op, "state_dir": self.state_dir, **request}, timeout)

    # -- facts ---------------------------------------------------------------------------------
    def facts(self, paths: list[str]) -> dict[str, Any]:
        return self.call("facts", site_packages=self.host.site_packages, unit_path=self.host.unit_path,
                         paths=paths)

    # -- lock ------------------------------------------------------------------------------------
    def acquire_lock(self, command: str, *, break_lock: bool = False) -> LockHolder:
        token = uuid.uuid4().hex
        holder = {
            "token": token, "user": _whoami(), "machine": socket.gethostname(), "pid": os.getpid(),
            "since": time.time(), "since_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": command,
        }
        res = self.call("lock", holder=holder, **({"break": True} if break_lock else {}))
        if not res["acquired"]:
            raise LockHeldError(f"{self.host.name}: deploy lock held by {describe_holder(res['holder'])}; "
                                f"if that run is gone, clear it with --break-lock")
        return LockHolder(token, holder)

    def release_lock(self, lock: LockHolder) -> None:
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
    alive = ""
    if h.get("machine") == socket.gethostname() and h.get("pid"):
        alive = " (that process is still running)" if pid_alive(int(h["pid"])) else " (that process is gone: stale)"
    return (f"{h['user']}@{h.get('machine')} pid {h.get('pid')}{alive}, since {h.get('since_utc')} "
            f"({age:.0f} s ago), running `{h.get('command')}`")



def _whoami() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return str(os.getuid())
