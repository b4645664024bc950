"""The deploy lock: an flock on <state_dir>/deploy.lock, held by the agent process for as long as
it lives. The agent lives as long as its lease (lease.py): a controller that is stopped, killed or
cut off loses the lock within the lease, and the kernel drops the flock when the agent exits. The
file says who holds it, since when, doing what, and counts generations: a re-take after a
reconnect must find its own, and a lease that expired moves the generation on."""

import errno
import fcntl
import json
import os
import shutil
import signal
import time

from .files import read_json
from .procs import proc_start
from .protocol import Lock, LockReply, Unlock, UnlockReply
from .statedir import ensure_state_dir

LOCK_FILE = "deploy.lock"


def _read_holder(fd):
    """The holder's record: the file's first line (write_holder), read until two reads agree.

    The holder rewrites the record in place while other agents read it (a reader cannot take the
    flock: that is what it is asking about), so one read may overlap a write; a second equal read
    cannot have, short of two copies torn at the same byte."""
    try:
        data = os.pread(fd, 1 << 16, 0)
        for _ in range(50):
            again = os.pread(fd, 1 << 16, 0)
            if again == data:
                break
            data = again
        line = data.split(b"\n", 1)[0]
        doc = json.loads(line.decode()) if line.strip() else {}
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _legacy_holder(state):
    """A lock directory left by an earlier ddtree-ops (mkdir lock): its holder, or None."""
    if os.path.isdir(os.path.join(state, "lock")):
        return read_json(os.path.join(state, "lock", "holder.json")) or {"holder": "unknown (old lock directory)"}
    return None


def lock_facts(state):
    """Who holds the lock, seen from outside: `held` is decided by flock, not by the file."""
    path = os.path.join(state, LOCK_FILE)
    legacy = _legacy_holder(state)
    if legacy is not None:
        return dict(legacy, held=True, legacy=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # free (the file keeps the last holder, for the generation count)
        except OSError:
            return dict(_read_holder(fd), held=True)
    finally:
        os.close(fd)


class LockState:
    """The deploy lock as this process holds it: an open file description with an flock."""

    def __init__(self):
        self.fd = None
        self.holder = None
        self.state_dir = None
        self.unit = None  # the systemd unit the agent runs in, recorded with the holder

    @property
    def held(self):
        return self.fd is not None

    def release(self):
        if self.fd is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)
        self.fd, self.holder = None, None


def write_holder(fd, holder):
    """The holder's record as one line, replaced in place (the flock is on this file, so no
    rename): written over the old one, then cut to its length, with SIGTERM held off between the
    two (the agent is one thread: its handler runs once the mask is back). Another agent reads this
    file while it is written (op_lock, when its flock fails): it finds the old record or the new
    one as the first line (_read_holder), never an empty file and never half of each. Truncated
    first, as it was, a reconnect's re-take that read the file between the two calls (or sent the
    SIGTERM that ended the writer there: a holder marking itself orphaned as the reconnect arrives)
    found no holder, so not its own lock, and was refused."""
    data = (json.dumps(holder, sort_keys=True) + "\n").encode()
    mask = _block_sigterm()
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.fsync(fd)


def _block_sigterm():
    """SIGTERM held off; the signal mask before (None where this Python cannot)."""
    try:
        return signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    except (AttributeError, OSError, ValueError):
        return None


def op_lock(req: Lock, lock):
    """Take the deploy lock for this process's lifetime. `break` (the holder's token, as shown
    to the operator) ends a holder that is still connected: its agent process is sent SIGTERM
    (which frees its flock), and the lock is taken only if nobody else took it meanwhile, so two
    breakers with the same token cannot both win.

    A re-take after a reconnect (`resume_generation`, the same token) ends the operation's own
    agent in the same way when it still holds the lock, waiting out its lease for this very
    controller; it gets the lock only if that generation is still the lock's (a lease that ran
    out moved it on: `taken_meanwhile`). Any run ends and replaces a holder whose controller's
    connection closed (`orphaned_at`) before its lease ran out: the run repairs from the journal
    at once, as it did when a lost connection freed the lock by itself."""
    state = req.state_dir
    ensure_state_dir(state)
    if lock.fd is not None:
        return LockReply(True, lock.holder)
    breaking = req.break_token
    legacy = _legacy_holder(state)
    if legacy is not None:
        if not breaking or legacy.get("token") != breaking:
            return LockReply(False, dict(legacy, held=True, legacy=True))
        shutil.rmtree(os.path.join(state, "lock"), ignore_errors=True)
    fd = os.open(os.path.join(state, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        # A run that just ended (or was killed) frees the lock when its agent has read EOF and
        # exited: a moment's grace, so that the next run does not trip over it.
        resume = req.resume_generation
        if _try_flock(fd, wait_s=float(req.wait_s)):
            seen = _read_holder(fd)
        else:
            seen = _read_holder(fd)
            own = _own_orphan(seen, req)
            abandoned = _abandoned(seen) and resume is None
            if not (own or abandoned) and (not breaking or seen.get("token") != breaking):
                os.close(fd)
                return LockReply(False, dict(seen, held=True), taken_meanwhile=resume is not None)
            _end_holder(seen)
            taken = lambda: _read_holder(fd).get("generation") != seen.get("generation")  # noqa: E731
            if not _try_flock(fd, wait_s=float(req.break_wait_s), give_up=taken):
                now = _read_holder(fd)
                os.close(fd)
                return LockReply(False, dict(now, held=True), break_failed=not (own or abandoned),
                                 taken_meanwhile=own)
            if _read_holder(fd).get("generation") != seen.get("generation"):
                # Someone else held it between our SIGTERM and our flock (or the holder's lease
                # ran out meanwhile): not ours to take.
                fcntl.flock(fd, fcntl.LOCK_UN)
                now = _read_holder(fd)
                os.close(fd)
                return LockReply(False, dict(now, held=False), break_failed=not (own or abandoned),
                                 taken_meanwhile=own)
        if resume is not None and seen.get("generation") != resume:
            # Re-taking the lock after a lost connection: another run held it meanwhile (and may
            # have repaired or deployed), so what this run knew about the host is stale.
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return LockReply(False, dict(seen, held=False), taken_meanwhile=True)
        holder = dict(req.holder, generation=int(seen.get("generation") or 0) + 1, agent_pid=os.getpid(),
                      agent_start=proc_start(os.getpid()), agent_unit=lock.unit, broke=breaking or None)
        write_holder(fd, holder)
    except BaseException:
        if lock.fd != fd:
            try:
                os.close(fd)
            except OSError:
                pass
        raise
    lock.fd, lock.holder, lock.state_dir = fd, holder, state
    return LockReply(True, holder)


def _own_orphan(seen, req):
    """The lock is held by this very operation's earlier agent (its connection was lost): same
    token, and the generation the controller held."""
    token = (req.holder or {}).get("token")
    return (req.resume_generation is not None and bool(token) and seen.get("token") == token
            and seen.get("generation") == req.resume_generation and not seen.get("lease_expired"))


def _abandoned(seen):
    """The holder's controller is gone (its connection closed: the agent marked itself orphaned)
    and the lease has not run out yet: any run may take the lock over, ending that agent, and
    repair from the journal, rather than wait for the host to heal itself."""
    return bool(seen.get("orphaned_at")) and not seen.get("lease_expired")


def mark_orphaned(lock):
    """Record in the lock file that this holder's controller connection closed."""
    lock.holder = dict(lock.holder, orphaned_at=time.time())
    write_holder(lock.fd, lock.holder)


def _try_flock(fd, wait_s=0.0, give_up=lambda: False):
    deadline = time.time() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
        if time.time() >= deadline or give_up():
            return False
        time.sleep(0.05)


def _end_holder(holder):
    """SIGTERM the holder's agent process, if it is still the same process."""
    pid = holder.get("agent_pid")
    if isinstance(pid, int) and pid > 1 and pid != os.getpid() and proc_start(pid) == holder.get("agent_start"):
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass


def op_unlock(req: Unlock, lock):
    if lock.fd is None or (lock.holder or {}).get("token") != req.token:
        return UnlockReply(False, lock.holder)
    write_holder(lock.fd, dict(lock.holder, released_at=time.time()))
    lock.release()
    return UnlockReply(True)


