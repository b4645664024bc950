"""Backups: every path a release will touch, copied into releases/<id>/backup and read back
before anything is installed; the first pre-state of each path kept once more in original/; a
backup verified against its manifest; and a restore, byte for byte, that refuses a corrupted backup.
"""

import os
import shutil
import time

from .errors import AgentError
from .files import (
    atomic_json,
    atomic_write,
    ensure_private_dir,
    file_facts,
    fsync_dir,
    purge_bytecode,
    read_json,
    sha256_file,
)
from .protocol import Backup, Restore, RestoreReply, VerifyBackup, VerifyBackupReply
from .statedir import require_state_dir


def op_backup(req: Backup):
    """Copy every path the release will touch into releases/<id>/backup, then read it back."""
    state = req.state_dir
    rid = req.release_id
    rdir = os.path.join(state, "releases", rid)
    final = os.path.join(rdir, "backup")
    partial = final + ".partial"
    require_state_dir(state)
    ensure_private_dir(os.path.join(state, "releases"))
    ensure_private_dir(rdir)
    shutil.rmtree(partial, ignore_errors=True)
    ensure_private_dir(partial)  # makedirs' mode= applies to the leaf only
    ensure_private_dir(os.path.join(partial, "files"))
    entries = []
    for i, item in enumerate(req.paths):
        path = item.path
        f = file_facts(path)
        entry = {"path": path, "kind": item.kind, "existed": f["exists"]}
        if f["exists"]:
            if not f["is_file"]:
                raise AgentError("refusing to back up %s: not a regular file" % path)
            stored = "files/%04d" % i
            dst = os.path.join(partial, stored)
            shutil.copyfile(path, dst)
            os.chmod(dst, 0o600)
            with open(dst, "rb") as fh:
                os.fsync(fh.fileno())
            entry.update(stored=stored, mode=f["mode"], uid=f["uid"], gid=f["gid"], sha256=f["sha256"])
        entries.append(entry)
    manifest = {"release_id": rid, "created": time.time(), "entries": entries}
    atomic_json(os.path.join(partial, "manifest.json"), manifest)
    fsync_dir(os.path.join(partial, "files"))
    problems = verify_backup(partial)
    if problems:
        raise AgentError("backup read-back failed: " + "; ".join(problems))
    shutil.rmtree(final, ignore_errors=True)
    os.rename(partial, final)
    fsync_dir(rdir)
    _record_original(state, entries, final)
    return {"manifest": manifest}


def _record_original(state, entries, backup_dir):
    """The first time any release touches a path, its pre-state is the pristine upstream one."""
    odir = os.path.join(state, "original")
    ensure_private_dir(odir)
    ensure_private_dir(os.path.join(odir, "files"))
    mpath = os.path.join(odir, "manifest.json")
    manifest = read_json(mpath, {"release_id": "original", "entries": []})
    known = {e["path"] for e in manifest["entries"]}
    changed = False
    for e in entries:
        if e["path"] in known:
            continue
        e = dict(e)
        if e["existed"]:
            stored = "files/%04d" % len(manifest["entries"])
            shutil.copyfile(os.path.join(backup_dir, e["stored"]), os.path.join(odir, stored))
            os.chmod(os.path.join(odir, stored), 0o600)
            e["stored"] = stored
        manifest["entries"].append(e)
        changed = True
    if changed:
        atomic_json(mpath, manifest)


def verify_backup(bdir):
    manifest = read_json(os.path.join(bdir, "manifest.json"))
    if manifest is None:
        return ["%s has no manifest.json" % bdir]
    problems = []
    for e in manifest["entries"]:
        if not e["existed"]:
            continue
        stored = os.path.join(bdir, e["stored"])
        if not os.path.isfile(stored):
            problems.append("%s: backup copy %s is missing" % (e["path"], stored))
        elif sha256_file(stored) != e["sha256"]:
            problems.append("%s: backup copy %s has sha256 %s, manifest says %s"
                            % (e["path"], stored, sha256_file(stored)[:12], e["sha256"][:12]))
    return problems


def op_restore(req: Restore):
    """Put back the state recorded in a backup (a release's, or original/), byte for byte.

    The whole backup is verified first: a corrupted backup restores nothing.
    """
    bdir = req.backup_dir
    problems = verify_backup(bdir)
    if problems:
        return RestoreReply([], True, problems)
    manifest = read_json(os.path.join(bdir, "manifest.json"))
    restored = []
    for e in manifest["entries"]:
        path = e["path"]
        if e["existed"]:
            now = file_facts(path)
            if (now["exists"] and now["is_file"] and now["sha256"] == e["sha256"]
                    and (now["mode"], now["uid"], now["gid"]) == (e["mode"], e["uid"], e["gid"])):
                # Already as recorded: rewriting it would need free space for a temp copy,
                # which a full disk (the reason we may be rolling back) does not have.
                restored.append({"path": path, "action": "unchanged", "sha256": e["sha256"]})
                purge_bytecode(path)
                continue
            with open(os.path.join(bdir, e["stored"]), "rb") as fh:
                data = fh.read()
            atomic_write(path, data, e["mode"], e["uid"], e["gid"])
            restored.append({"path": path, "action": "restored", "sha256": e["sha256"]})
        elif os.path.lexists(path):
            os.unlink(path)
            fsync_dir(os.path.dirname(path))
            restored.append({"path": path, "action": "removed"})
        purge_bytecode(path)
    return RestoreReply(restored, False, [])


def op_verify_backup(req: VerifyBackup):
    return VerifyBackupReply(verify_backup(req.backup_dir))
