"""The agent's dispatch: one process per operation, one JSON request per line in, one JSON answer
per line out, every request decoded into its `protocol` class before its op runs.

The controller (host/channel.py) starts `AGENT_PYTHON -I -S -c BOOTSTRAP` (the inventory's
`agent_python`, a root-owned system interpreter, never the venv's: interpreter.py), sends the agent's source (its
modules joined into one, 10-digit length then the bytes), then the requests of the operation over
one SSH channel. On a host run by systemd, BOOTSTRAP first moves into a transient unit of its own
(`systemd-run --pipe`, its stdin and stdout still the channel's), so the agent outlives the SSH
session: a controller that is gone does not take the agent down with it half-way, and the lease
(lease.py) decides when the lock goes and whether the host heals itself. The process holds the
deploy lock for as long as it lives; it exits on EOF (at once without the lock, else when the
lease runs out unless a reconnect ends it first), SIGTERM, or an expired lease.
"""

import json
import os
import select
import signal
import sys
import time

from .backup import op_backup, op_restore, op_verify_backup
from .content import op_release_content
from .errors import AgentError
from .facts import op_facts
from .install import op_install
from .interpreter import interpreter_problem
from .launch_check import op_launch_check
from .lease import Expiry, Lease, expire, lease_clock
from .lock import LockState, mark_orphaned, op_lock, op_unlock
from .path_access import op_path_access
from .procs import op_proc_info
from .protocol import (
    Backup,
    Compile,
    Facts,
    Hello,
    HelloReply,
    History,
    Install,
    Journal,
    LaunchCheck,
    Lock,
    Message,
    PathAccess,
    ProcInfo,
    Prune,
    ReleaseContent,
    ReleaseWrite,
    RemovePartial,
    Renew,
    Restore,
    RestoreCheck,
    Run,
    SetCurrent,
    TuneWrite,
    Unlock,
    VerifyBackup,
    VerifyUnit,
    decode_request,
)
from .restore_check import op_restore_check
from .store import (
    op_history,
    op_journal,
    op_prune,
    op_release_write,
    op_remove_partial,
    op_set_current,
    op_tune_write,
)
from .systemd import op_run, op_verify_unit
from .venv_compile import op_compile

# Reads the agent's source from stdin without a buffered reader (the serve loop selects on fd 0
# and must see every byte that follows), then serves requests until EOF. `sys.argv[1]`, when
# there is one, names the systemd unit it runs in.
READER = "\n".join([
    "import os,sys",
    "def r(n):",
    " b=b''",
    " while len(b)<n:",
    "  c=os.read(0,n-len(b))",
    "  if not c:sys.exit(0)",
    "  b+=c",
    " return b",
    "g={'__name__':'ddtree_agent'}",
    "exec(compile(r(int(r(10))).decode(),'ddtree_agent','exec'),g)",
    "g['main']()",
])
UNIT_PREFIX = "ddtree-ops-agent-"
# Where the host runs systemd (as PID 1) and the agent runs as root: READER again, in a transient
# unit (`u` says how: None to run here). Nothing of the agent's source has been read yet, so the
# unit's READER reads it from the same stdin. The unit's name is READER's only argument, which
# also keeps it from going round again.
UNIT_LAUNCH = "\n".join([
    "def u(argv,isdir,which,euid,tag,path,python):",
    " s=which('systemd-run')",
    " if len(argv)>1 or euid!=0 or not isdir('/run/systemd/system') or not s:return None",
    " n='%s'+tag" % UNIT_PREFIX,
    " return [s,'--pipe','--quiet','--collect','--unit='+n,'--property=Description=ddtree-ops agent',",
    "  '--setenv=PATH='+path,python,'-I','-S','-c',R,n]",
])
BOOTSTRAP = "\n".join([
    "import os,sys,shutil,time",
    "R=%r" % READER,
    UNIT_LAUNCH,
    "c=u(sys.argv,os.path.isdir,shutil.which,os.geteuid(),'%d-%d'%(os.getpid(),time.time()*1e6),"
    "os.environ.get('PATH','/usr/sbin:/usr/bin:/sbin:/bin'),sys.executable)",
    "if c:os.execv(c[0],c)",
    "exec(R)",
])

# Every op but `hello`, `renew` and the lock's two (which act on the process's own lease and lock).
OPS = {
    Facts: op_facts, Journal: op_journal, Compile: op_compile, Backup: op_backup, Install: op_install,
    Restore: op_restore, ReleaseWrite: op_release_write, TuneWrite: op_tune_write, SetCurrent: op_set_current,
    History: op_history,
    Prune: op_prune, VerifyBackup: op_verify_backup, RemovePartial: op_remove_partial,
    VerifyUnit: op_verify_unit, Run: op_run, LaunchCheck: op_launch_check, ProcInfo: op_proc_info,
    PathAccess: op_path_access, ReleaseContent: op_release_content, RestoreCheck: op_restore_check,
}


class Agent:
    """One agent process: answers requests and holds the deploy lock while its lease lasts."""

    def __init__(self, clock=lease_clock, heal_fn=None, unit=None, refused=None):
        self.refused = refused  # why this agent will not act (its interpreter): said in its hello
        self.lock = LockState()
        self.lock.unit = unit
        self.lease = Lease(clock=clock)
        self.heal_fn = heal_fn  # None: heal.py's
        self.unit = unit

    def handle(self, doc):
        """A wire request → its wire answer: {"ok": true, "result": ...} or {"ok": false, "error": ...},
        with `busy_s`, the seconds this agent worked on it: its lease starts again when the answer
        goes, and the controller, which cannot tell when the answer arrived (it may read it after a
        SIGSTOP), counts its view of the lease from when it sent the request plus `busy_s`."""
        self.lease.renew()
        started = self.lease.renewed_at
        try:
            result = self._run(decode_request(doc))
            answer = {"ok": True, "result": result.to_wire() if isinstance(result, Message) else result}
        except Exception as e:  # reported to the controller, which decides what it means
            answer = {"ok": False, "error": "%s: %s" % (type(e).__name__, e), "errno": getattr(e, "errno", None)}
        finally:
            self.lease.renew()  # the lease runs down only while the agent waits
        answer["busy_s"] = round(max(self.lease.renewed_at - started, 0.0), 6)
        return answer

    def _run(self, request):
        if isinstance(request, Hello):
            if request.lease_s is not None:
                if not float(request.lease_s) > 0:
                    raise ValueError("lease_s must be > 0, got %r" % (request.lease_s,))
                self.lease.lease_s = float(request.lease_s)
            return HelloReply(os.getpid(), sys.version.split()[0], self.unit, self.refused)
        if self.refused:
            raise AgentError(self.refused)
        if isinstance(request, Renew):
            return {}
        if isinstance(request, Lock):
            return op_lock(request, self.lock)
        if isinstance(request, Unlock):
            return op_unlock(request, self.lock)
        return OPS[type(request)](request)

    def controller_gone(self, how, sleep=time.sleep):
        """The controller fell silent (`how`: Expiry.IDLE) or its connection closed (Expiry.GONE).
        Without the lock there is nothing to keep; with it, wait out the lease (a reconnect's
        agent ends this one meanwhile with SIGTERM), then heal and let the lock go."""
        if not self.lock.held:
            return None
        if how == Expiry.GONE:
            # Said in the lock file: the next run, whoever starts it, may take this lock over
            # at once (and repair from the journal) instead of waiting out the lease.
            mark_orphaned(self.lock)
        while self.lease.left() > 0:
            sleep(min(self.lease.left(), 1.0))
        kw = {} if self.heal_fn is None else {"heal_fn": self.heal_fn}
        return expire(self.lock, self.lease, how, **kw)

    def exit(self):
        self.lock.release()


def unit_of(argv):
    """The systemd unit this agent runs in (BOOTSTRAP's UNIT_LAUNCH named it), or None."""
    name = argv[1] if len(argv) > 1 else ""
    return name if name.startswith(UNIT_PREFIX) else None


def main():
    """The agent as BOOTSTRAP starts it: its unit from its arguments, and its interpreter checked
    (an agent on an interpreter others can change answers its hello with why, and nothing else)."""
    serve(agent=Agent(unit=unit_of(sys.argv), refused=interpreter_problem()))


def serve(fd_in=0, fd_out=1, agent=None):
    """Answer one request per line until the controller is gone (EOF, a broken pipe, or a lease
    run out without a request), then see to the lock (Agent.controller_gone) and exit. SIGTERM
    ends the agent at once, without healing: a reconnecting controller or --break-lock took over."""
    agent = agent or Agent(unit=unit_of(sys.argv))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        agent.controller_gone(_answer_requests(agent, fd_in, fd_out))
    finally:
        agent.exit()


def _answer_requests(agent, fd_in, fd_out):
    """Serve until the controller is gone; how it went (an Expiry)."""
    buf = b""
    while True:
        nl = buf.find(b"\n")
        if nl < 0:
            left = agent.lease.left()
            if left <= 0:
                return Expiry.IDLE
            # Re-read the lease clock at least every second: select's timeout stops in a suspend.
            ready, _, _ = select.select([fd_in], [], [], min(left, 1.0))
            if not ready:
                continue
            try:
                chunk = os.read(fd_in, 1 << 20)
            except OSError:  # ECONNRESET and the like: the connection is gone all the same
                chunk = b""
            if not chunk:
                return _how_it_went(agent.lease)
            buf += chunk
            continue
        line, buf = buf[:nl], buf[nl + 1:]
        if not line.strip():
            continue
        try:
            request = json.loads(line.decode())
        except ValueError as e:
            answer = {"ok": False, "error": "bad request: %s" % e}
        else:
            answer = agent.handle(request)
        data = (json.dumps(answer) + "\n").encode()
        try:
            while data:
                data = data[os.write(fd_out, data):]
        except OSError:
            return Expiry.GONE


def _how_it_went(lease):
    """The connection closed (EOF or a reset): how the controller went, read on the lease's clock.

    Within the lease it hung up (Expiry.GONE: the rest of the lease is waited out for a reconnect).
    Past it, its silence had expired the lease already (Expiry.IDLE: no request came for the whole
    lease), whatever closed the connection since. A controller that stays connected and silent
    hangs up by itself once its own view of the lease runs out (channel.py: the heartbeat closes
    the channel on LeaseLost), and that view starts after this agent's renewal: on the same clock,
    that hang-up always comes after the expiry. Told apart by which event this process saw first,
    the reason depended on a race: woken late (a loaded machine), select() found the EOF already
    there and a silent controller read as one that hung up (a fresh-clone CI failure of
    tests/test_lease_agent.py::test_idle_past_the_lease_the_agent_heals_once_...)."""
    return Expiry.IDLE if lease.left() <= 0 else Expiry.GONE
