"""Backups: every path a release will touch, copied into releases/<id>/backup and read back
before anything is installed; the first pre-state of each path kept once more in original/; a
backup verified against its manifest; and a restore, byte for byte, that refuses a corrupted backup.

A path the controller sends with what preflight read there (`expect_sha256`/`expect_absent`) is
compared first: one that changed since (an operator's edit between preflight and backup) makes the
backup refuse before it writes anything, so the host stays exactly as preflight saw it.

Bytecode is purged only for the files a restore actually changed, after all of them are back (a
rollback of a release that never wrote a file leaves its __pycache__ alone, read-only or not).
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
from .protocol import (
    Backup,
    BackupChange,
    BackupReply,
    ReleaseWrite,
    Restore,
    RestoreReply,
    VerifyBackup,
    VerifyBackupReply,
)
from .statedir import require_state_dir
from .store import op_release_write
from .venv_version import sglang_version_in


def op_backup(req: Backup):
    """Copy every path the release will touch into releases/<id>/backup, then read it back; a
    path that changed since preflight: refuse, writing nothing."""
    facts = [file_facts(item.path) for item in req.paths]
    changed = changed_since_preflight(req.paths, facts)
    if changed:
        return BackupReply(None, changed)
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
        path, f = item.path, facts[i]
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
    if req.site_packages:
        # The SGLang these files belong to: a restore of this backup into another one is refused
        # (restore_check.py). Read here, under the lock, just before the release installs.
        op_release_write(ReleaseWrite(state, rid, {"sglang_version": sglang_version_in(req.site_packages),
                                                   "site_packages": req.site_packages}))
    return BackupReply(manifest, [])


def changed_since_preflight(paths, facts):
    """The paths whose content is not what preflight read (a path sent without an expectation is
    not compared). The copy made next is read back against these same facts, so a change after
    this comparison fails the backup's read-back instead of slipping through."""
    changed = []
    for i, item in enumerate(paths):
        f = facts[i]
        found = f["sha256"] if f["exists"] and f["is_file"] else None
        if item.expect_absent and f["exists"]:
            changed.append(BackupChange(i, found))
        elif item.expect_sha256 is not None and found != item.expect_sha256:
            changed.append(BackupChange(i, found))
    return changed


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
                continue
            with open(os.path.join(bdir, e["stored"]), "rb") as fh:
                data = fh.read()
            # Purged before the write too: a restore cut off between the write and the purge
            # below finds the file "unchanged" next time, and would leave the bytecode.
            purged = purge_bytecode(path)
            atomic_write(path, data, e["mode"], e["uid"], e["gid"])
            restored.append({"path": path, "action": "restored", "sha256": e["sha256"], "purged": purged})
        elif os.path.lexists(path):
            purged = purge_bytecode(path)
            os.unlink(path)
            fsync_dir(os.path.dirname(path))
            restored.append({"path": path, "action": "removed", "purged": purged})
    purge_touched(restored)
    return RestoreReply(restored, False, [])


def purge_touched(restored):
    """Once every file is back: the stale bytecode of each one the restore wrote or removed (a
    later entry cannot bring bytecode back for an earlier one)."""
    for r in restored:
        if r["action"] != "unchanged":
            r["purged"] += purge_bytecode(r["path"])


def op_verify_backup(req: VerifyBackup):
    return VerifyBackupReply(verify_backup(req.backup_dir))
