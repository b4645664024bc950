"""The `path_access` op: can the unit's process use the paths its launch line names (the model,
the draft model, the venv's interpreter)? A path that is missing, or that the unit's User= cannot
read, makes the new server fail after the old one stopped; preflight refuses it instead.

Existence is read here (as root); access is asked by a forked child that takes the unit's
identity (unit_identity.py), since only the kernel answers what that user may read through every
folder on the way. Nothing is written; no venv code runs.
"""

import json
import os
import select
import signal
import stat
import time

from .protocol import PathAccess, PathAccessReply, PathFact
from .unit_identity import UnitRefusal, unit_run_as

PROBE_TIMEOUT_S = 30.0
PROBE_REPLY_CAP = 1 << 16


def usable(path, execute):
    """As the process asking: a folder must be listable (read and search), a file readable, an
    interpreter executable."""
    if execute:
        return os.access(path, os.X_OK)
    if os.path.isdir(path):
        return os.access(path, os.R_OK | os.X_OK)
    return os.access(path, os.R_OK)


def path_kind(path):
    """(exists, kind) as the server would open it: symlinks followed."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False, ""
    return True, "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def _child(w, req, run_as):
    """In the forked child: take the unit's identity (no way back), ask, write the answers, exit.
    No interpreter is started, so no venv's code runs and the agent's own need not be runnable
    by the unit's user."""
    try:
        if run_as.switch:
            os.setgroups(run_as.groups or [])
            os.setresgid(run_as.gid, run_as.gid, run_as.gid)
            os.setresuid(run_as.uid, run_as.uid, run_as.uid)
        flags = _execute_flags(req)
        doc = [usable(p, flags[i]) for i, p in enumerate(req.paths)]
    except BaseException as e:  # noqa: B036 (the child must always reach _exit)
        doc = {"error": "%s: %s" % (type(e).__name__, e)}
    try:
        os.write(w, json.dumps(doc).encode())
    finally:
        os._exit(0)


def probe(req, run_as):
    """One boolean per path, asked by a child with the unit's identity; (None, why) on failure."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(w, req, run_as)
    os.close(w)
    out, deadline = b"", time.monotonic() + PROBE_TIMEOUT_S
    try:
        while len(out) <= PROBE_REPLY_CAP:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                return None, "the access check as User=%s did not finish in %gs" % (run_as.name, PROBE_TIMEOUT_S)
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            out += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    try:
        doc = json.loads(out.decode("utf-8"))
    except ValueError:
        doc = None
    if isinstance(doc, dict) and "error" in doc:
        return None, "the access check as User=%s failed: %s" % (run_as.name, doc["error"])
    if not isinstance(doc, list) or len(doc) != len(req.paths):
        return None, "the access check as User=%s gave no verdict" % run_as.name
    return [bool(a) for a in doc], None


def _execute_flags(req):
    return list(req.execute) + [False] * (len(req.paths) - len(req.execute))


def path_fact(path, execute, exists, kind, can, who):
    if not exists:
        return PathFact(path, False, problem="does not exist")
    if execute and kind != "file":
        return PathFact(path, True, kind, "is not a file")
    if not can:
        what = "executable" if execute else "listable" if kind == "dir" else "readable"
        return PathFact(path, True, kind, "is not %s by %s" % (what, who))
    return PathFact(path, True, kind)


def op_path_access(req: PathAccess):
    try:
        run_as = unit_run_as(req.user, req.group, req.supplementary_groups, [], [], None)
    except UnitRefusal as e:
        return PathAccessReply([], str(e))
    found = [path_kind(p) for p in req.paths]
    answers, failed = probe(req, run_as)
    if failed:
        return PathAccessReply([], failed)
    who = "User=%s (uid %d)" % (run_as.name, run_as.uid)
    flags = _execute_flags(req)
    return PathAccessReply([path_fact(p, flags[i], found[i][0], found[i][1], answers[i], who)
                            for i, p in enumerate(req.paths)])
