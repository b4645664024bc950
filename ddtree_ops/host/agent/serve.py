"""The agent's dispatch: one process per operation, one JSON request per line in, one JSON answer
per line out, every request decoded into its `protocol` class before its op runs.

The controller (host/channel.py) starts `python -I -S -c BOOTSTRAP`, sends the agent's source (its
modules joined into one, 10-digit length then the bytes), then the requests of the operation over
one SSH channel. The process holds the deploy lock for as long as it lives; it exits on EOF, a
broken pipe, SIGTERM, or `idle_timeout` seconds without a request (a controller whose network is
gone without a FIN), and the kernel drops the flock.
"""

import json
import os
import select
import signal
import sys

from .backup import op_backup, op_restore, op_verify_backup
from .facts import op_facts
from .install import op_compile, op_install
from .launch_check import op_launch_check
from .lock import LockState, op_lock, op_unlock
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
    ProcInfo,
    Prune,
    ReleaseWrite,
    RemovePartial,
    Restore,
    Run,
    SetCurrent,
    Unlock,
    VerifyBackup,
    VerifyUnit,
    decode_request,
)
from .store import op_history, op_journal, op_prune, op_release_write, op_remove_partial, op_set_current
from .systemd import op_run, op_verify_unit

# Reads the agent's source from stdin without a buffered reader (the serve loop selects on fd 0
# and must see every byte that follows), then serves requests until EOF.
BOOTSTRAP = "\n".join([
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
    "g['serve']()",
])

# Every op but `hello` and the lock's two (which act on the process's own lock), by request class.
OPS = {
    Facts: op_facts, Journal: op_journal, Compile: op_compile, Backup: op_backup, Install: op_install,
    Restore: op_restore, ReleaseWrite: op_release_write, SetCurrent: op_set_current, History: op_history,
    Prune: op_prune, VerifyBackup: op_verify_backup, RemovePartial: op_remove_partial,
    VerifyUnit: op_verify_unit, Run: op_run, LaunchCheck: op_launch_check, ProcInfo: op_proc_info,
}


class Agent:
    """One agent process: answers requests and holds the deploy lock while it lives."""

    def __init__(self):
        self.lock = LockState()
        self.idle_timeout = 600.0

    def handle(self, doc):
        """A wire request → its wire answer: {"ok": true, "result": ...} or {"ok": false, "error": ...}."""
        try:
            result = self._run(decode_request(doc))
            return {"ok": True, "result": result.to_wire() if isinstance(result, Message) else result}
        except Exception as e:  # reported to the controller, which decides what it means
            return {"ok": False, "error": "%s: %s" % (type(e).__name__, e), "errno": getattr(e, "errno", None)}

    def _run(self, request):
        if isinstance(request, Hello):
            if request.idle_timeout is not None:
                self.idle_timeout = float(request.idle_timeout)
            return HelloReply(os.getpid(), sys.version.split()[0])
        if isinstance(request, Lock):
            return op_lock(request, self.lock)
        if isinstance(request, Unlock):
            return op_unlock(request, self.lock)
        return OPS[type(request)](request)

    def exit(self):
        self.lock.release()


def serve(fd_in=0, fd_out=1):
    """Answer one request per line until EOF, a broken pipe, SIGTERM or `idle_timeout` seconds
    without a request; then exit, which frees the lock."""
    agent = Agent()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    buf = b""
    try:
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                ready, _, _ = select.select([fd_in], [], [], agent.idle_timeout)
                if not ready:
                    return
                chunk = os.read(fd_in, 1 << 20)
                if not chunk:
                    return
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
                return
    finally:
        agent.exit()
