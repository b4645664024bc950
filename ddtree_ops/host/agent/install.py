"""Installing new files: each one checked against its sha256, written atomically with its
owner kept, its stale bytecode purged (as it is written, and again for every .py once all are in
place, whatever the order they came in). The new modules were compiled by the venv's Python before
(venv_compile.py: a syntax error stops the deploy before anything is written)."""

import base64
import hashlib
import os
import time

from .errors import AgentError
from .files import atomic_write, file_facts, purge_bytecode
from .protocol import Install


def op_install(req: Install):
    """Write each file atomically; a replaced file keeps its owner, a new one gets the folder's."""
    done = []
    for item in req.files:
        path = item.path
        data = base64.b64decode(item.content_b64)
        if hashlib.sha256(data).hexdigest() != item.sha256:
            raise AgentError("%s: content arrived corrupted (sha256 mismatch); nothing written for it" % path)
        old = file_facts(path)
        if old["exists"]:
            uid, gid = old["uid"], old["gid"]
        else:
            st = os.stat(os.path.dirname(path)) if os.path.isdir(os.path.dirname(path)) else None
            uid, gid = (st.st_uid, st.st_gid) if st else (None, None)
        atomic_write(path, data, item.mode, uid, gid)
        purged = purge_bytecode(path)
        done.append({"path": path, "sha256": item.sha256, "purged": purged})
        _test_pause(req.test_pause, len(done))
    # Again once every file is in place: a file written after a module (its own bytecode, say)
    # must not outlive that module's purge.
    for entry in done:
        entry["purged"] += purge_bytecode(entry["path"])
    return {"installed": done}


def _test_pause(pause, files_done):
    """TEST HOOK, off unless the controller sends `test_pause` (it does only when the environment
    variable DDTREE_OPS_TEST_PAUSE_AT=between-files is set; see testing/pause_points.py): after `after` files,
    write "<pid> between-files" to `file` and wait until a test removes it, so that the tool can
    be killed between two file replacements. A heartbeat byte on stdout (JSON allows leading
    whitespace) notices a controller that is gone (EPIPE): then the install stops there, touching
    nothing more, and the agent sees its controller gone (lease.py)."""
    if not pause or files_done != pause.get("after"):
        return
    with open(pause["file"], "w") as fh:
        fh.write("%d between-files\n" % os.getpid())
    deadline = time.time() + 600
    while os.path.exists(pause["file"]):
        try:
            os.write(1, b" ")
        except OSError:
            raise OSError("the controller is gone (test pause between files)") from None
        if time.time() > deadline:
            os._exit(71)
        time.sleep(0.05)
