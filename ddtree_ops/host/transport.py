"""SSH to a host over Paramiko, with host keys verified and every command quoted.

Paramiko's SSHClient trusts no key by itself (Fabric 3, used here before, set AutoAddPolicy and
trusted any key). Here the known_hosts file from the inventory is loaded read-only and unknown
keys are rejected; `accept_new=True` (`--accept-new-host-keys`) records a key for a host that has
none, and a *changed* key is always refused (Paramiko raises BadHostKeyException before any
policy runs).

Commands are argv lists joined with `shlex.quote`: no raw value is ever pasted into a shell.
For a non-root `ssh_user`, privileged commands run through `sudo -n` and uploads go to a temp
path that a privileged step then moves into place.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import shlex
import socket
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from ..config.inventory import Host
from ..errors import AuthRefused, HostKeyError, LocalKeyMissing, RemoteCommandError, UnreachableError, reason
from .ssh_lib import paramiko


def shell_join(argv: Sequence[str | int | os.PathLike]) -> str:
    """One shell command line from an argv list; each element quoted."""
    return " ".join(shlex.quote(str(a)) for a in argv)


@dataclass(frozen=True)
class Result:
    command: str
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class _RecordNewKey(paramiko.MissingHostKeyPolicy):
    """--accept-new-host-keys: trust on first use, and write the key to known_hosts."""

    def __init__(self, known_hosts: str, lock: threading.Lock):
        self.known_hosts, self.lock = known_hosts, lock

    def missing_host_key(self, client, hostname, key):
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        with self.lock:
            os.makedirs(os.path.dirname(self.known_hosts) or ".", exist_ok=True)
            fd = os.open(self.known_hosts, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "a") as fh:
                fh.write(line)


_known_hosts_lock = threading.Lock()


def _host_key_name(host: Host) -> str:
    return host.address if host.ssh_port == 22 else f"[{host.address}]:{host.ssh_port}"


def check_identity_file(host: Host) -> None:
    """The host's `identity_file` is a readable file here, or LocalKeyMissing (exit 2) before any
    connection: Paramiko reports a missing key as the connection failing ("cannot reach ...")."""
    path = host.identity_file
    if not path:
        return
    if os.path.isdir(path):
        why = "is a folder, not a private key file"
    elif not os.path.exists(path):
        why = "no such file on this machine"
    elif not os.access(path, os.R_OK):
        why = "this user cannot read it"
    else:
        return
    raise LocalKeyMissing(f"{host.name}: identity_file {path}: {why} (checked before connecting; "
                          f"nothing was changed)")


def connect_kwargs_for(host: Host) -> dict:
    """Paramiko's `SSHClient.connect` arguments: `connect_timeout` (seconds, a float: 0.5 is half a
    second) bounds the TCP connect (`timeout`), the SSH banner and the authentication."""
    t = float(host.connect_timeout_s)
    kwargs: dict = {"timeout": t, "banner_timeout": t, "auth_timeout": t, "look_for_keys": False,
                    "allow_agent": False}
    if host.identity_file:
        kwargs["key_filename"] = [host.identity_file]
    else:  # fall back to the operator's default keys and agent, as ssh(1) would
        kwargs.update(look_for_keys=True, allow_agent=True)
    return kwargs


class HostConnection:
    """One SSH connection to one host (a Paramiko `SSHClient`); use as a context manager."""

    def __init__(self, host: Host, *, accept_new_host_keys: bool = False):
        # Paramiko itself, not Fabric's Connection around it: of Fabric this used only the client
        # it wraps, overrode its host-key policy and its ssh_config loading, and had to keep its
        # `connect_timeout` away (int() made 0.5 s no timeout at all); Fabric and the invoke it
        # brings were imported by every CLI start for that (ssh_lib.py keeps invoke out too).
        # The timeouts go to Paramiko as floats (connect_kwargs_for).
        self.host = host
        self.accept_new = accept_new_host_keys
        self._connect_kwargs = connect_kwargs_for(host)
        self._client = paramiko.SSHClient()

    # -- connection ----------------------------------------------------------------------------
    def open(self) -> "HostConnection":
        check_identity_file(self.host)
        client = self._client
        kh = self.host.known_hosts
        if os.path.exists(kh):
            client.load_system_host_keys(kh)  # read-only: load_host_keys would write back
        elif not self.accept_new:
            raise HostKeyError(
                f"{self.host.name}: known_hosts file {kh} does not exist; refusing to trust "
                f"{self.host.address} without a recorded host key (use --accept-new-host-keys to record it)"
            )
        policy = _RecordNewKey(kh, _known_hosts_lock) if self.accept_new else paramiko.RejectPolicy()
        client.set_missing_host_key_policy(policy)
        try:
            client.connect(hostname=self.host.address, port=self.host.ssh_port, username=self.host.ssh_user,
                           **self._connect_kwargs)
        except paramiko.BadHostKeyException as e:
            raise HostKeyError(
                f"{self.host.name}: the host key of {self.host.address} has CHANGED (got {e.key.get_name()} "
                f"{e.key.get_fingerprint().hex()}, known_hosts {kh} has another). Refusing to connect: this "
                f"may be an attack. If the host was reinstalled, remove the old key with "
                f"`ssh-keygen -R {_host_key_name(self.host)} -f {kh}` and verify the new one."
            ) from None
        except paramiko.SSHException as e:
            if "not found in known_hosts" in str(e):
                raise HostKeyError(
                    f"{self.host.name}: {self.host.address} is not in {kh} (unknown host key). Refusing to "
                    f"connect; verify its fingerprint and add it, or pass --accept-new-host-keys."
                ) from None
            if isinstance(e, paramiko.AuthenticationException) and _LOST_IN_AUTH not in str(e):
                raise AuthRefused(f"{self.host.name}: SSH authentication failed for {self.host.ssh_user}@"
                                  f"{self.host.address}: {e}") from None
            raise UnreachableError(f"{self.host.name}: SSH to {self.host.address}:{self.host.ssh_port} "
                                   f"failed: {reason(e)} (connect_timeout {self.host.connect_timeout_s:g} s)") from None
        except (socket.timeout, TimeoutError):
            raise UnreachableError(f"{self.host.name}: connection to {self.host.address}:{self.host.ssh_port} "
                                   f"timed out after {self.host.connect_timeout_s:g} s") from None
        except (OSError, paramiko.ssh_exception.NoValidConnectionsError) as e:
            raise UnreachableError(f"{self.host.name}: cannot reach {self.host.address}:{self.host.ssh_port}: "
                                   f"{getattr(e, 'strerror', None) or reason(e)}") from None
        except EOFError:
            # Paramiko's transport thread saves a bare EOFError (no text) when the server side of
            # the handshake goes away, and `connect` raises it as it is.
            raise UnreachableError(f"{self.host.name}: SSH to {self.host.address}:{self.host.ssh_port} closed "
                                   f"during the handshake (EOF from the server)") from None
        return self

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close()

    def reconnect(self) -> "HostConnection":
        """A fresh SSH connection in place of a lost one (same host-key checks); every object
        holding this HostConnection uses the new one."""
        self.close()
        self._client = paramiko.SSHClient()
        return self.open()

    def __enter__(self) -> "HostConnection":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- commands ------------------------------------------------------------------------------
    def run(self, argv: Sequence[str | int | os.PathLike], *, check: bool = True, sudo: bool = True,
            timeout: float | None = 120, stdin: str | None = None) -> Result:
        """Run argv on the host; `sudo` applies only when the SSH user is not root."""
        cmd = shell_join(argv)
        if sudo and self.host.become:
            cmd = "sudo -n -- " + cmd
        return self.run_shell(cmd, check=check, timeout=timeout, stdin=stdin)

    def start(self, argv: Sequence[str | int | os.PathLike], *, sudo: bool = True) -> paramiko.Channel:
        """Start argv on the host and return its channel (stdin/stdout stay open): for a process
        that serves many requests, such as the remote agent."""
        cmd = shell_join(argv)
        if sudo and self.host.become:
            cmd = "sudo -n -- " + cmd
        try:
            chan = self._client.get_transport().open_session(timeout=self.host.connect_timeout_s)
            chan.exec_command(cmd)
        except (paramiko.SSHException, OSError, EOFError, AttributeError) as e:
            raise UnreachableError(f"{self.host.name}: connection lost: {reason(e)}") from None
        return chan

    def run_shell(self, command: str, *, check: bool = True, timeout: float | None = 120,
                  stdin: str | bytes | None = None) -> Result:
        """Run an already-quoted command line (build it with shell_join).

        Straight on a Paramiko channel: a runner that pumps stdin a byte at a time (Fabric's, through
        invoke, fed one byte per 10 ms) turns a 30 kB request into minutes.
        """
        try:
            chan = self._client.get_transport().open_session(timeout=self.host.connect_timeout_s)
        except (paramiko.SSHException, OSError, EOFError, AttributeError) as e:
            raise UnreachableError(f"{self.host.name}: connection lost: {reason(e)}") from None
        out, err = bytearray(), bytearray()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            chan.exec_command(command)
            if stdin:
                chan.sendall(stdin.encode() if isinstance(stdin, str) else stdin)
            chan.shutdown_write()
            while True:
                if deadline is not None and time.monotonic() > deadline:
                    raise RemoteCommandError(f"{self.host.name}: command timed out after {timeout} s: {command[:200]}")
                select.select([chan], [], [], 0.2)
                while chan.recv_ready():
                    out += chan.recv(1 << 16)
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(1 << 16)
                if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                    if chan.closed or chan.eof_received:
                        break
                    # exit status can arrive before the last data; wait for EOF briefly
                    select.select([chan], [], [], 0.05)
                    if not chan.recv_ready() and not chan.recv_stderr_ready():
                        break
            code = chan.recv_exit_status()
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise UnreachableError(f"{self.host.name}: connection lost while running a command: {reason(e)}") from None
        finally:
            chan.close()
        if code == -1:
            raise UnreachableError(f"{self.host.name}: connection lost while running a command (no exit status)")
        res = Result(command, code, out.decode(errors="replace"), err.decode(errors="replace"))
        if check and not res.ok:
            raise RemoteCommandError(
                f"{self.host.name}: `{command[:300]}` exited {res.exit_code}: "
                f"{(res.stderr or res.stdout).strip()[-800:]}"
            )
        return res


# Paramiko's AuthenticationException when the connection, not the server, ended the
# authentication (paramiko/auth_handler.py, wait_for_response): a lost connection, not a refusal.
_LOST_IN_AUTH = "transport shut down or saw EOF"


def is_connection_trouble(exc: BaseException) -> bool:
    """Whether `exc` says the SSH connection was lost or is struggling (worth a reconnect), as
    opposed to a final answer: a changed or unknown host key, a lost lease, a lock another run
    holds, a step the host refused. Paramiko and the socket layer raise their own types (some with
    no text) from deep inside a handshake; ours is UnreachableError."""
    if isinstance(exc, UnreachableError):
        return True
    if isinstance(exc, paramiko.BadHostKeyException):
        return False
    return isinstance(exc, (EOFError, paramiko.SSHException, socket.timeout, TimeoutError, ConnectionError,
                            BrokenPipeError)) or (isinstance(exc, OSError) and exc.errno in _NETWORK_ERRNOS)


_NETWORK_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.EHOSTUNREACH,
                             errno.ENETUNREACH, errno.ENETDOWN, errno.ETIMEDOUT, errno.EPIPE, errno.ENOTCONN,
                             errno.EBADF, None})


@contextlib.contextmanager
def connect(host: Host, *, accept_new_host_keys: bool = False) -> Iterator[HostConnection]:
    conn = HostConnection(host, accept_new_host_keys=accept_new_host_keys)
    conn.open()
    try:
        yield conn
    finally:
        conn.close()
