"""The `facts` op: what the controller plans from, read in one round trip. SGLang's version,
file facts (no hash of a secret), the unit file, the current release, the journal (or why it
cannot be read), who holds the lock, the host's last heal of itself, free space."""

import os
import sys

from .files import disk_free_mb, file_facts, read_json
from .heal import heal_record_facts
from .lock import lock_facts
from .protocol import Facts
from .statedir import read_current


def op_facts(req: Facts):
    sp = req.site_packages
    state = req.state_dir
    version = None
    if os.path.isdir(sp):
        for entry in sorted(os.listdir(sp)):
            if entry.startswith("sglang-") and entry.endswith(".dist-info"):
                try:
                    with open(os.path.join(sp, entry, "METADATA"), encoding="utf-8") as fh:
                        for line in fh:
                            if line.startswith("Version:"):
                                version = line.split(":", 1)[1].strip()
                                break
                except OSError:
                    pass
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
        "python": sys.version.split()[0],
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
    }


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
