"""The `compile` op: the patch set's modules compiled by the venv's own interpreter (its version
decides which syntax is valid: a 3.12-only construct is refused for a 3.11 venv), before anything
is written.

The agent runs on a system interpreter (interpreter.py), so the compile runs the venv's, and as
the launch check does: as the unit's User=/Group= (unit_identity.py; root only for a root unit),
isolated (`-I -S`: no .pth file, no sitecustomize). The sources go in on stdin, the verdict comes
back as one JSON list on stdout, read up to a cap: whoever can write the venv decides what that
process prints, and it is given no more room, time or rights than its unit.
"""

import json
import os
import select
import signal
import subprocess
import tempfile
import time

from .protocol import Compile, CompileReply
from .unit_identity import SETUP_FAILED_PREFIX, SETUP_FAILED_RC, UnitRefusal, unit_run_as

# Python 3.7+ (a venv may be old): path → base64 source in, the list of error lines out.
COMPILER = "\n".join([
    "import base64, json, sys",
    "errors = []",
    "for path, b64 in sorted(json.loads(sys.stdin.buffer.read()).items()):",
    "    try:",
    "        compile(base64.b64decode(b64), path, 'exec', dont_inherit=True)",
    "    except SyntaxError as e:",
    "        errors.append('%s:%s: %s: %s' % (path, e.lineno, type(e).__name__, e.msg))",
    "    except (ValueError, RecursionError, MemoryError) as e:",
    "        errors.append('%s: %s: %s' % (path, type(e).__name__, e))",
    "sys.stdout.write(json.dumps(errors))",
])
COMPILE_OUTPUT_CAP = 4 << 20  # a few hundred bytes per error: far more than any real verdict
STDERR_TAIL = 2000


def compile_argv(python):
    return [python, "-I", "-S", "-c", COMPILER]


def run_capped(argv, run_as, data, timeout, cap=COMPILE_OUTPUT_CAP):
    """(rc, stdout, stderr tail, why it was stopped or None): `data` on stdin (from a file the
    child inherits open, so the unit's user needs no access to it), stdout read up to `cap`, the
    whole process group killed at `cap` or at the timeout."""
    with tempfile.TemporaryFile() as inp:
        inp.write(data)
        inp.seek(0)
        proc = subprocess.Popen(argv, stdin=inp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=run_as.env,
                                preexec_fn=run_as.enter, start_new_session=True, close_fds=True)
    out, err, stopped = b"", b"", None
    streams = {proc.stdout.fileno(): "out", proc.stderr.fileno(): "err"}
    deadline = time.monotonic() + timeout
    while streams and stopped is None:
        left = deadline - time.monotonic()
        ready = select.select(list(streams), [], [], max(left, 0))[0] if left > 0 else []
        if not ready:
            stopped = "it did not finish in %gs" % timeout
            break
        for fd in ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                del streams[fd]
            elif streams[fd] == "out":
                out += chunk
                if len(out) > cap:
                    stopped = "it printed more than %d bytes" % cap
            else:
                err = (err + chunk)[-STDERR_TAIL:]
    if stopped:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    proc.stdout.close()
    proc.stderr.close()
    rc = proc.wait()
    return rc, out, err.decode("utf-8", "replace"), stopped


def verdict(python, rc, out, err, stopped):
    """(errors, why the compile gave no verdict or None) from what the compiling process did."""
    if stopped:
        return [], "the compile by %s was stopped: %s" % (python, stopped)
    if rc == SETUP_FAILED_RC and err.startswith(SETUP_FAILED_PREFIX):
        return [], err.strip()
    last = " | ".join(ln for ln in err.splitlines()[-3:] if ln.strip()) or "(nothing on stderr)"
    if rc != 0:
        return [], "%s exited %d while compiling: %s" % (python, rc, last[-600:])
    try:
        errors = json.loads(out.decode("utf-8"))
    except ValueError:
        errors = None
    if not isinstance(errors, list) or not all(isinstance(e, str) for e in errors):
        return [], "%s printed no list of compile errors: %r" % (python, out[:200])
    return errors, None


def op_compile(req: Compile):
    """Compile the new modules with the venv's interpreter, as the unit's user."""
    python = req.python
    if not os.path.isabs(python) or not os.access(python, os.X_OK):
        return CompileReply([], "%s: not an executable absolute path" % python)
    try:
        run_as = unit_run_as(req.user, req.group, req.supplementary_groups, [], [], None)
    except UnitRefusal as e:
        return CompileReply([], str(e))
    who = {"user": run_as.name, "uid": run_as.uid, "gid": run_as.gid}
    data = json.dumps(req.files).encode()
    try:
        rc, out, err, stopped = run_capped(compile_argv(python), run_as, data, float(req.timeout))
    except OSError as e:  # the unit's user may not execute the venv's interpreter
        return CompileReply([], "User=%s cannot run %s: %s" % (run_as.name, python, e.strerror or e), who)
    errors, failed = verdict(python, rc, out, err, stopped)
    return CompileReply(errors, failed, who)
