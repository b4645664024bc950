"""The `facts` op: what the controller plans from, read in one round trip. SGLang's version,
file facts (no hash of a secret), the unit file, the current release, the journal (or why it
cannot be read), who holds the lock, the host's last heal of itself, free space, and which
target directories cannot be written (a read-only site-packages is refused before any change).
"python" is the venv's version, read from its files (the agent runs on another interpreter, and
never runs the venv's as root); "service_user_uid" is the unit's User= on this host."""

import os
import sys
import tempfile

from .files import disk_free_mb, file_facts, read_json
from .heal import heal_record_facts
from .lock import lock_facts
from .protocol import Facts
from .statedir import read_current
from .unit_identity import UnitRefusal, resolve_identity
from .venv_version import sglang_dist_versions, venv_python_version


def op_facts(req: Facts):
    sp = req.site_packages
    state = req.state_dir
    versions = sglang_dist_versions(sp) if os.path.isdir(sp) else []
    version = versions[-1] if versions else None  # the last in folder order, as ever
    files = {p: file_facts(p) for p in req.paths}
    files.update({p: file_facts(p, content=False) for p in req.secret_paths})
    unit_path = req.unit_path
    unit_text = None
    if os.path.isfile(unit_path):
        with open(unit_path, encoding="utf-8", errors="replace") as fh:
            unit_text = fh.read()
    current = read_current(state)
    current_release = read_json(os.path.join(state, "releases", current, "release.json")) if current else None
    return {
        "python": venv_python_version(req.python, sp),
        "agent_python": sys.version.split()[0],
        **service_user_facts(req.service_user),
        "sglang_version": version,
        "site_packages_exists": os.path.isdir(sp),
        "files": files,
        "unit": file_facts(unit_path),
        "unit_text": unit_text,
        "current": current,
        "current_release": current_release,
        **journal_facts(state),
        "lock": lock_facts(state),
        "host_heal": heal_record_facts(state),
        "free_mb": {"site_packages": disk_free_mb(sp), "state_dir": disk_free_mb(state)},
        "unwritable": unwritable_dirs(req.paths, sp),
    }


def service_user_facts(user):
    """The unit's User= as this host knows it: its uid, or why it has none (the plan refuses)."""
    if not user:
        return {}
    try:
        return {"service_user_uid": resolve_identity(user, "", [])[1], "service_user_problem": None}
    except UnitRefusal as e:
        return {"service_user_uid": None, "service_user_problem": str(e)}


def unwritable_dirs(paths, site_packages):
    """{directory: why it cannot be written} for the directories the install would write `paths`
    into (the nearest existing one for a path whose directory is new), inside `site_packages`
    only: nothing is tried outside it (a missing site-packages is refused on its own)."""
    found = {}
    top = site_packages.rstrip("/")
    for d in sorted({nearest_dir(os.path.dirname(p)) for p in paths}):
        if d != top and not d.startswith(top + "/"):
            continue
        why = write_problem(d)
        if why:
            found[d] = why
    return found


def nearest_dir(path):
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    return path or "/"


def write_problem(d):
    """Why a file cannot be created in `d` (None: it can). A read-only mount answers access(W_OK)
    differently across kernels and overlays, so the mount flag is read, and then a file is really
    created and removed (an immutable directory, an overlay refusing writes)."""
    try:
        if os.statvfs(d).f_flag & os.ST_RDONLY:
            return "mounted read-only"
        fd, name = tempfile.mkstemp(prefix=".ddtree-ops-write-check-", dir=d)
    except OSError as e:
        return "%s: %s" % (type(e).__name__, e.strerror or e)
    os.close(fd)
    os.unlink(name)
    return None


def journal_facts(state):
    """The journal, or why it cannot be read: a truncated or foreign file is reported (the
    controller stops with "corrupt journal"), never guessed at."""
    path = os.path.join(state, "journal.json")
    try:
        return {"journal": read_json(path), "journal_error": None}
    except (ValueError, UnicodeDecodeError) as e:
        return {"journal": None, "journal_error": "%s is not valid JSON: %s" % (path, e)}
    except OSError as e:
        return {"journal": None, "journal_error": "%s cannot be read: %s" % (path, e)}
