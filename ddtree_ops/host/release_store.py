"""The release store on a host (files, backups, lock, journal, releases), driven from here through
the host's agent: one typed method per agent op, each building its `protocol` request.

A method answers what its caller reads: a reply dataclass where the caller reads fields, the
agent's document where it is passed on whole (facts, history). The transport is an
`AgentTransport`: the SSH channel (channel.py) or a fake host.
"""

from __future__ import annotations

import base64
import getpass
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, TypeVar

from ..config.inventory import Host
from ..errors import LeaseLost, LockHeldError
from .agent.protocol import (
    Backup,
    BackupPath,
    BackupReply,
    Compile,
    CompileReply,
    Facts,
    History,
    Install,
    InstallFile,
    Journal,
    LaunchCheck,
    Lock,
    LockReply,
    PathAccess,
    PathAccessReply,
    ProcInfo,
    Prune,
    ReleaseContent,
    ReleaseContentReply,
    ReleaseWrite,
    RemovePartial,
    RemovePartialReply,
    Request,
    Restore,
    RestoreCheck,
    RestoreCheckReply,
    RestoreReply,
    SetCurrent,
    TuneWrite,
    Unlock,
    VerifyBackup,
    VerifyBackupReply,
    VerifyUnit,
    VerifyUnitReply,
    WantedContent,
)
from .channel import AgentTransport, ask, ask_reply
from .lease import lease_lost_message


def new_release_id() -> str:
    """Sortable by time, unique across operators: 20261130T075500Z-1a2b3c."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass
class LockHolder:
    token: str
    holder: dict[str, Any]


# How long `lock` waits for a holder that is just ending (its agent reading EOF and exiting).
LOCK_GRACE_S = 3.0
# Every store op answers within this (a backup or an install of a patch set's files included).
R = TypeVar("R")
STORE_TIMEOUT_S = 300.0


class ReleaseStore:
    def __init__(self, agent: AgentTransport, host: Host):
        self.agent, self.host = agent, host
        self.state_dir = host.state_dir
        self.held: LockHolder | None = None  # the lock this operation holds, re-taken after a reconnect
        self.lock_grace_s = LOCK_GRACE_S

    def _ask(self, request: Request) -> Any:
        return ask(self.agent, request, STORE_TIMEOUT_S)

    def _reply(self, request: Request, reply_type: type[R]) -> R:
        return ask_reply(self.agent, request, reply_type, STORE_TIMEOUT_S, self.host.name)

    # -- facts ---------------------------------------------------------------------------------
    def facts(self, paths: list[str], secret_paths: list[str] = ()) -> dict[str, Any]:
        """Host facts; `secret_paths` get mode and owner only (no hash of a secret leaves the host)."""
        return self._ask(Facts(self.state_dir, self.host.site_packages, self.host.unit_path, list(paths),
                               list(secret_paths), python=self.host.python, service_user=self.host.service_user))

    def unit_text(self, unit_path: str) -> str | None:
        """The text of a unit file on the host (None: there is none), read as `facts` reads the
        host's own unit."""
        return self._ask(Facts(self.state_dir, self.host.site_packages, unit_path))["unit_text"]

    # -- checks before anything is written ----------------------------------------------------------
    def compile(self, request: Compile) -> CompileReply:
        """Compile errors of new modules under the venv's Python, run as the unit's user (or why
        the compile could not run: `failed`)."""
        return self._reply(request, CompileReply)

    def verify_unit(self, unit_name: str, text: str, argv: list[str]) -> VerifyUnitReply:
        return self._reply(VerifyUnit(unit_name, text, argv), VerifyUnitReply)

    def launch_check(self, request: LaunchCheck) -> dict[str, Any]:
        """The server parser's verdict on a launch line and who holds its ports (the document
        runbook.launch_check reads)."""
        return self._ask(request)

    def path_access(self, request: PathAccess) -> PathAccessReply:
        """Whether the unit's User= can use each path (exists, readable; `execute`: runnable)."""
        return self._reply(request, PathAccessReply)

    def proc_info(self, pids: list[int]) -> dict[str, dict[str, Any]]:
        """Command line and ancestors of each PID still running, by PID as a string."""
        return self._ask(ProcInfo(list(pids)))

    # -- lock ------------------------------------------------------------------------------------
    def _lock(self, request: Lock) -> LockReply:
        return self._reply(request, LockReply)

    def acquire_lock(self, command: str, *, break_tokens: tuple[str, ...] = ()) -> LockHolder:
        """Take the host's deploy lock for this operation (it lives as long as the agent process).
        `break_tokens`: holders' tokens the operator read in a lock message and chose to end."""
        token = uuid.uuid4().hex[:12]
        holder = {
            "token": token, "user": _whoami(), "machine": socket.gethostname(), "pid": os.getpid(),
            "since": time.time(), "since_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": command, "lease_s": self.host.lock_lease_s,
        }
        res = self._lock(Lock(self.state_dir, holder, wait_s=self.lock_grace_s))
        if not res.acquired and (res.holder or {}).get("token") in break_tokens:
            res = self._lock(Lock(self.state_dir, holder, break_token=res.holder["token"]))
        if not res.acquired:
            raise LockHeldError(lock_message(self.host.name, res.holder or {}, res.break_failed))
        self.held = LockHolder(token, res.holder)
        return self.held

    def relock(self) -> None:
        """After a reconnect (a new agent process): take the lock again for the same operation.
        LockHeldError when somebody else took it while the connection was down."""
        if self.held is None:
            return
        res = self._relock(self.held.holder.get("generation"))
        seen = res.holder or {}
        if not res.acquired and _ours_later(seen, self.held):
            # An earlier try of this very reconnect took the lock (a new agent, the next
            # generation) and its answer was lost with the connection: that agent is ours too.
            res = self._relock(seen.get("generation"))
        if not res.acquired:
            self.held = None
            lost = lease_lost_by(self.agent, self.host, res.holder or {})
            if lost is not None:
                raise lost
            raise LockHeldError(f"{self.host.name}: the deploy lock was taken by another run while the connection "
                                f"was down ({describe_holder(res.holder or {})}); that run owns the host now (it "
                                f"repairs what this run left, or has already), so this run stops without touching "
                                f"it")
        self.held = LockHolder(self.held.token, res.holder)

    def _relock(self, generation: Any) -> LockReply:
        assert self.held is not None
        return self._lock(Lock(self.state_dir, dict(self.held.holder, token=self.held.token, reacquired_at=time.time()),
                               wait_s=self.lock_grace_s, resume_generation=generation))

    def release_lock(self, lock: LockHolder) -> None:
        self.held = None
        self._ask(Unlock(self.state_dir, lock.token))

    # -- journal ---------------------------------------------------------------------------------
    def journal(self, **fields: Any) -> None:
        self._ask(Journal(self.state_dir, journal=fields))

    def clear_journal(self) -> None:
        self._ask(Journal(self.state_dir, clear=True))

    # -- files -----------------------------------------------------------------------------------
    def backup(self, rid: str, paths: list[BackupPath]) -> BackupReply:
        """Every path release `rid` will touch, copied into its backup and read back; `changed`
        non-empty: a path differs from what the request expects, nothing was written."""
        return self._reply(Backup(self.state_dir, rid, list(paths), site_packages=self.host.site_packages), BackupReply)

    def install(self, files: list[InstallFile], test_pause: dict[str, Any] | None = None) -> None:
        """Each file written atomically; `test_pause` is a test hook's (the agent pauses between files)."""
        self._ask(Install(self.state_dir, list(files), test_pause))

    def remove_partial(self, rid: str) -> bool:
        """Drop what an interrupted backup of `rid` left; whether `rid` has a complete backup."""
        reply = self._reply(RemovePartial(self.state_dir, rid), RemovePartialReply)
        return reply.backup_complete

    def verify_backup(self, rid: str) -> list[str]:
        """What is wrong with the backup of `rid` ('original': the pristine one); [] when sound."""
        return self._reply(VerifyBackup(self.state_dir, self.backup_dir(rid)), VerifyBackupReply).problems

    def restore_check(self, releases: list[str], to_original: bool = False) -> RestoreCheckReply:
        """Read only: what restoring the backups of `releases` (newest first; then original/ with
        `to_original`) would write over that those releases did not leave there, and whether the
        SGLang is still the version each was installed onto (agent/restore_check.py)."""
        return self._reply(RestoreCheck(self.state_dir, list(releases), to_original), RestoreCheckReply)

    def journal_restore_check(self) -> RestoreCheckReply:
        """The same check for what the host's journal would restore (an interrupted run's repair)."""
        return self._reply(RestoreCheck(self.state_dir, journal=True), RestoreCheckReply)

    def installed_drift(self, rid: str) -> RestoreCheckReply:
        """`status`'s check: each file exactly as release `rid` installed it, and its SGLang version."""
        return self._reply(RestoreCheck(self.state_dir, [rid], as_installed=True), RestoreCheckReply)

    def restore(self, rid: str) -> RestoreReply:
        """The files as release `rid` found them, byte for byte; `refused` when the backup is corrupted."""
        return self._reply(Restore(self.state_dir, self.backup_dir(rid)), RestoreReply)

    # -- releases --------------------------------------------------------------------------------
    def release_dir(self, rid: str) -> str:
        return f"{self.state_dir}/releases/{rid}"

    def backup_dir(self, rid: str) -> str:
        return f"{self.state_dir}/original" if rid == "original" else f"{self.release_dir(rid)}/backup"

    def write_release(self, rid: str, **fields: Any) -> dict[str, Any]:
        return self._ask(ReleaseWrite(self.state_dir, rid, fields))["release"]

    def write_tune(self, tune_id: str, doc: dict[str, Any]) -> None:
        self._ask(TuneWrite(self.state_dir, tune_id, doc))

    def set_current(self, rid: str | None) -> None:
        self._ask(SetCurrent(self.state_dir, rid))

    def history(self) -> dict[str, Any]:
        return self._ask(History(self.state_dir))

    def prune(self, keep: int) -> list[str]:
        return self._ask(Prune(self.state_dir, keep))["removed"]

    def release_content(self, wanted: list[tuple[str, str]], max_bytes: int) -> ReleaseContentReply:
        """Read only: the text of each (path, sha256) as a backup or the live file holds it."""
        request = ReleaseContent(self.state_dir, [WantedContent(p, sha) for p, sha in wanted], max_bytes)
        return self._reply(request, ReleaseContentReply)


def _ours_later(seen: dict[str, Any], held: LockHolder) -> bool:
    """The lock file names this operation (its token, known only to this controller) at a later
    generation than the one it last heard of, with the lease still running: every generation in
    between was this operation's own (a resumed take-over demands the generation before it)."""
    gen, mine = seen.get("generation"), held.holder.get("generation")
    return (seen.get("token") == held.token and not seen.get("lease_expired") and isinstance(gen, int)
            and isinstance(mine, int) and gen > mine)


def lease_lost_by(agent: AgentTransport, host: Host, holder: dict[str, Any]) -> LeaseLost | None:
    """The lock's file says this operation's lease expired while the connection was down (the
    host healed itself or was left as it was): that, as the error to stop with."""
    if not holder.get("lease_expired"):
        return None
    watch = getattr(agent, "watch", None)  # an SSH channel's view of the lease; a fake host has none
    if watch is None:
        return LeaseLost(lease_lost_message(host.name, host.lock_lease_s, None,
                                            "its lease ran out while the connection was down", holder))
    return watch.lose("its lease ran out while the connection was down", holder)


def describe_holder(h: dict[str, Any]) -> str:
    if not h or "user" not in h:
        return str(h.get("holder", "an unknown holder")) if h else "an unknown holder"
    age = time.time() - float(h.get("since", time.time()))
    agent = f", host-side agent pid {h['agent_pid']}" if h.get("agent_pid") else ""
    return (f"{h['user']}@{h.get('machine')} pid {h.get('pid')}{agent}, since {h.get('since_utc')} "
            f"({age:.0f} s ago), running `{h.get('command')}`")


def lock_message(host: str, holder: dict[str, Any], break_failed: bool = False) -> str:
    """Why the lock could not be taken, and the way out: the lock frees itself within the holder's
    lease once the holder is gone; only a holder that is still there needs --break-lock."""
    token = holder.get("token")
    if break_failed:
        return (f"{host}: --break-lock {token}: the lock changed hands or its holder did not end; now held by "
                f"{describe_holder(holder)}")
    if holder.get("legacy"):
        return (f"{host}: deploy lock held by {describe_holder(holder)} (a lock directory left by an older "
                f"ddtree-ops); if that run is gone, pass --break-lock {token}")
    lease = f"{holder['lease_s']:g} s" if isinstance(holder.get("lease_s"), (int, float)) else "its lease"
    return (f"{host}: deploy lock held by {describe_holder(holder)}. It is freed by itself when that run ends, or "
            f"within {lease} (lock_lease_s) once that run is killed, stopped or cut off (the host rolls itself back "
            f"first if needed); to end that run's hold on the host now, pass --break-lock {token}")


def _whoami() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return str(os.getuid())
