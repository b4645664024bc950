"""Is the interpreter the agent runs on one that only root can change? (sshd's StrictModes rule.)

The agent runs as root on `agent_python` (the inventory's; /usr/bin/python3 by default), never on
the venv's interpreter: whoever can write a venv (its `pyvenv.cfg`, whose `home =` picks the
standard library even under `-I -S`, or `bin/python`) would otherwise run code as root. An
interpreter the agent could still be started on by mistake (the venv's, one under /tmp or a home
folder) is refused here, at the agent's first answer, before it touches anything: the
executable (as named and as resolved), a `pyvenv.cfg` beside or above it, and the standard
library it loaded must each be owned by root and not writable by group or others, and so must
every folder above them (a root-owned sticky folder such as /tmp may be world-writable: nobody
else can rename or remove what root owns in it).

What this can and cannot do: it stops the agent from acting on a misconfigured interpreter (the
deploy is refused, exit 2). It cannot undo what an interpreter that was already subverted ran
while starting, before this check: that is kept out by the choice of a root-owned system
interpreter, which this check confirms is what the inventory named.
"""

import os
import stat
import sys


def path_problem(path, lstat=os.lstat):
    """Why `path` or a folder above it could be changed by someone other than root (None: it
    cannot). Symbolic links along the way are judged by their folders; the caller checks the
    resolved path too."""
    path = os.path.abspath(path)
    parts = path.split("/")[1:]
    for i in range(len(parts) + 1):
        p = "/" + "/".join(parts[:i])
        try:
            st = lstat(p)
        except OSError as e:
            return "%s: %s" % (p, e.strerror or e)
        if stat.S_ISLNK(st.st_mode):
            continue
        if st.st_uid != 0:
            return "%s is owned by uid %d, not root" % (p, st.st_uid)
        if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX and p != path:
            continue  # root's sticky folder (/tmp): others may add entries, never rename or remove root's
        if st.st_mode & 0o022:
            return "%s is writable by %s (mode %04o)" % (
                p, "group and others" if st.st_mode & 0o022 == 0o022 else
                "its group" if st.st_mode & 0o020 else "others", stat.S_IMODE(st.st_mode))
    return None


def interpreter_files(executable, stdlib_file):
    """What decides the code this interpreter runs: the executable as named and as resolved, the
    pyvenv.cfg files Python would read (beside the executable or one folder up), and the standard
    library's folder and its `os` module."""
    found = [executable, os.path.realpath(executable)]
    here = os.path.dirname(executable)
    for cfg in (os.path.join(here, "pyvenv.cfg"), os.path.join(os.path.dirname(here), "pyvenv.cfg")):
        if os.path.lexists(cfg):
            found += [cfg, os.path.realpath(cfg)]
    if stdlib_file:
        real = os.path.realpath(stdlib_file)
        found += [os.path.dirname(real), real]
    return list(dict.fromkeys(found))


def interpreter_problem(executable=None, stdlib_file=None, euid=None, lstat=os.lstat):
    """Why the agent must not run as root on this interpreter (None: it may, or it is not root)."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        return None  # the agent has no more rights than whoever started it
    executable = sys.executable if executable is None else executable
    stdlib_file = getattr(os, "__file__", None) if stdlib_file is None else stdlib_file
    if not executable or not os.path.isabs(executable):
        return "the agent's interpreter does not know its own path (%r)" % (executable,)
    for p in interpreter_files(executable, stdlib_file):
        why = path_problem(p, lstat)
        if why:
            return ("the agent runs as root and will not run on %s: %s (set agent_python to a root-owned "
                    "system interpreter, such as /usr/bin/python3)" % (executable, why))
    return None
