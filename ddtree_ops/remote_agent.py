"""The part of a deploy that runs ON the host: file facts, backup, atomic install, restore, lock,
journal and the release store. Stdlib only, Python >= 3.8, run by the SGLang venv's interpreter.

The controller (release_store.py) sends this file's source plus one JSON request on stdin to
`python -I -S -c BOOTSTRAP`; the answer is one JSON document on stdout. Nothing is pasted into a
shell, nothing is written in place: every file is written to a temp file in its target folder,
fsynced and renamed over the target (Ansible's atomic_move), then the folder is fsynced.

Release store under <state_dir> (mode 0700):
    lock/holder.json            the deploy lock (mkdir is atomic); who holds it, since when, doing what
    journal.json                the deploy in progress: release id, step, units that were active
    current                     id of the release the host runs
    original/                   pristine state of every path any release ever touched
    releases/<id>/release.json  what the release is (patch set, budget, topk, outcome, previous)
    releases/<id>/backup/       state of each path before this release, with manifest.json
"""

import base64
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time

BOOTSTRAP = (
    "import sys,json;d=json.loads(sys.stdin.read());"
    "g={'__name__':'ddtree_agent'};exec(compile(d['agent'],'ddtree_agent','exec'),g);"
    "g['main'](d['request'])"
)


class AgentError(Exception):
    pass


# ------------------------------------------------------------------------------------- helpers

def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_facts(path):
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return {"path": path, "exists": False}
    return {"path": path, "exists": True, "mode": st.st_mode & 0o7777, "uid": st.st_uid,
            "gid": st.st_gid, "size": st.st_size, "sha256": sha256_file(path) if os.path.isfile(path) else None,
            "is_file": os.path.isfile(path) and not os.path.islink(path)}


def atomic_write(path, data, mode, uid=None, gid=None):
    """Temp file in the target folder, fsync, chmod/chown, rename, fsync the folder."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ddtree-ops.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        if uid is not None and os.geteuid() == 0:
            os.chown(tmp, uid, gid)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(folder)


def atomic_json(path, doc):
    atomic_write(path, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode(), 0o600)


def read_json(path, default=None):
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return default


def purge_bytecode(path):
    """A restored .py with the size and mtime of a cached .pyc would run the stale bytecode."""
    if not path.endswith(".py"):
        return []
    folder, name = os.path.split(path)
    cache = os.path.join(folder, "__pycache__")
    stem = name[:-3] + "."
    removed = []
    try:
        entries = os.listdir(cache)
    except FileNotFoundError:
        return removed
    for entry in entries:
        if entry.startswith(stem) and entry.endswith(".pyc"):
            os.unlink(os.path.join(cache, entry))
            removed.append(os.path.join(cache, entry))
    return removed


def ensure_private_dir(path):
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def disk_free_mb(path):
    while not os.path.exists(path):
        path = os.path.dirname(path) or "/"
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize // (1024 * 1024)


# ------------------------------------------------------------------------------------- facts

def op_facts(req):
    sp = req["site_packages"]
    state = req["state_dir"]
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
    files = {p: file_facts(p) for p in req.get("paths", [])}
    unit_path = req["unit_path"]
    unit_text = None
    if os.path.isfile(unit_path):
        with open(unit_path, encoding="utf-8", errors="replace") as fh:
            unit_text = fh.read()
    current = _current(state)
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
        "journal": read_json(os.path.join(state, "journal.json")),
        "lock": read_json(os.path.join(state, "lock", "holder.json")),
        "free_mb": {"site_packages": disk_free_mb(sp), "state_dir": disk_free_mb(state)},
    }


def _current(state):
    try:
        with open(os.path.join(state, "current")) as fh:
            return fh.read().strip() or None
    except FileNotFoundError:
        return None


# ------------------------------------------------------------------------------------- lock

def op_lock(req):
    state = req["state_dir"]
    ensure_private_dir(state)
    lock = os.path.join(state, "lock")
    if req.get("break"):
        shutil.rmtree(lock, ignore_errors=True)
    try:
        os.mkdir(lock, 0o700)
    except FileExistsError:
        holder = read_json(os.path.join(lock, "holder.json")) or {"holder": "unknown (lock without holder file)"}
        return {"acquired": False, "holder": holder}
    atomic_json(os.path.join(lock, "holder.json"), req["holder"])
    return {"acquired": True, "holder": req["holder"]}


def op_unlock(req):
    lock = os.path.join(req["state_dir"], "lock")
    holder = read_json(os.path.join(lock, "holder.json")) or {}
    if holder.get("token") != req["token"]:
        return {"released": False, "holder": holder}
    shutil.rmtree(lock, ignore_errors=True)
    return {"released": True}


# ------------------------------------------------------------------------------------- journal

def op_journal(req):
    path = os.path.join(req["state_dir"], "journal.json")
    if req.get("clear"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        fsync_dir(req["state_dir"])
        return {"journal": None}
    ensure_private_dir(req["state_dir"])
    doc = dict(req["journal"], updated=time.time())
    atomic_json(path, doc)
    return {"journal": doc}


# ------------------------------------------------------------------------------------- compile

def op_compile(req):
    """Compile the new modules with THIS interpreter (the host's own Python)."""
    errors = []
    for path, b64 in sorted(req["files"].items()):
        src = base64.b64decode(b64)
        try:
            compile(src, path, "exec", dont_inherit=True)
        except SyntaxError as e:
            errors.append("%s:%s: %s: %s" % (path, e.lineno, type(e).__name__, e.msg))
        except ValueError as e:
            errors.append("%s: %s" % (path, e))
    return {"errors": errors}


# ------------------------------------------------------------------------------------- backup

def op_backup(req):
    """Copy every path the release will touch into releases/<id>/backup, then read it back."""
    state = req["state_dir"]
    rid = req["release_id"]
    rdir = os.path.join(state, "releases", rid)
    final = os.path.join(rdir, "backup")
    partial = final + ".partial"
    ensure_private_dir(state)
    ensure_private_dir(os.path.join(state, "releases"))
    ensure_private_dir(rdir)
    shutil.rmtree(partial, ignore_errors=True)
    ensure_private_dir(partial)  # makedirs' mode= applies to the leaf only
    ensure_private_dir(os.path.join(partial, "files"))
    entries = []
    for i, item in enumerate(req["paths"]):
        path = item["path"]
        f = file_facts(path)
        entry = {"path": path, "kind": item.get("kind", "file"), "existed": f["exists"]}
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


# ------------------------------------------------------------------------------------- install

def op_install(req):
    """Write each file atomically; a replaced file keeps its owner, a new one gets the folder's."""
    done = []
    for item in req["files"]:
        path = item["path"]
        data = base64.b64decode(item["content_b64"])
        if hashlib.sha256(data).hexdigest() != item["sha256"]:
            raise AgentError("%s: content arrived corrupted (sha256 mismatch); nothing written for it" % path)
        old = file_facts(path)
        if old["exists"]:
            uid, gid = old["uid"], old["gid"]
        else:
            st = os.stat(os.path.dirname(path)) if os.path.isdir(os.path.dirname(path)) else None
            uid, gid = (st.st_uid, st.st_gid) if st else (None, None)
        atomic_write(path, data, item.get("mode", 0o644), uid, gid)
        purged = purge_bytecode(path)
        done.append({"path": path, "sha256": item["sha256"], "purged": purged})
        _test_pause(req, len(done))
    return {"installed": done}


def _test_pause(req, files_done):
    """TEST HOOK, off unless the controller sends `test_pause` (it does only when the environment
    variable DDTREE_OPS_TEST_PAUSE_AT=between-files is set; see deploy.py): after `after` files,
    write "<pid> between-files" to `file` and wait until a test removes it, so that the tool can
    be killed between two file replacements. A heartbeat byte on stdout (JSON allows leading
    whitespace) notices a controller that is gone (EPIPE): then exit at once, touching nothing
    more, as a process whose connection was cut would."""
    pause = req.get("test_pause")
    if not pause or files_done != pause.get("after"):
        return
    with open(pause["file"], "w") as fh:
        fh.write("%d between-files\n" % os.getpid())
    deadline = time.time() + 600
    while os.path.exists(pause["file"]):
        try:
            os.write(1, b" ")
        except OSError:
            os._exit(70)
        if time.time() > deadline:
            os._exit(71)
        time.sleep(0.05)


# ------------------------------------------------------------------------------------- restore

def op_restore(req):
    """Put back the state recorded in a backup (a release's, or original/), byte for byte.

    The whole backup is verified first: a corrupted backup restores nothing.
    """
    bdir = req["backup_dir"]
    problems = verify_backup(bdir)
    if problems:
        return {"restored": [], "refused": True, "problems": problems}
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
    return {"restored": restored, "refused": False, "problems": []}


# ------------------------------------------------------------------------------------- releases

def op_release_write(req):
    """Create or update releases/<id>/release.json (merging fields)."""
    rdir = os.path.join(req["state_dir"], "releases", req["release_id"])
    ensure_private_dir(os.path.join(req["state_dir"], "releases"))
    ensure_private_dir(rdir)
    path = os.path.join(rdir, "release.json")
    doc = read_json(path, {})
    doc.update(req["fields"])
    atomic_json(path, doc)
    return {"release": doc}


def op_set_current(req):
    state = req["state_dir"]
    rid = req.get("release_id")
    path = os.path.join(state, "current")
    if rid:
        atomic_write(path, (rid + "\n").encode(), 0o600)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return {"current": rid}


def op_history(req):
    state = req["state_dir"]
    rels = []
    root = os.path.join(state, "releases")
    if os.path.isdir(root):
        for rid in sorted(os.listdir(root)):
            doc = read_json(os.path.join(root, rid, "release.json"))
            if doc is not None:
                doc.setdefault("id", rid)
                doc["backup_present"] = os.path.isdir(os.path.join(root, rid, "backup"))
                rels.append(doc)
    rels.sort(key=lambda d: (d.get("created") or 0, d["id"]))
    return {"releases": rels, "current": _current(state),
            "original": os.path.isfile(os.path.join(state, "original", "manifest.json"))}


def op_prune(req):
    """Keep the newest `keep` releases plus every release on the current chain's first `keep`."""
    state = req["state_dir"]
    keep = req["keep"]
    hist = op_history(req)["releases"]
    protected = set()
    cur = _current(state)
    by_id = {r["id"]: r for r in hist}
    while cur and cur in by_id and len(protected) < keep:
        protected.add(cur)
        cur = by_id[cur].get("previous")
    newest = [r["id"] for r in hist[-keep:]]
    removed = []
    for r in hist:
        if r["id"] in protected or r["id"] in newest:
            continue
        shutil.rmtree(os.path.join(state, "releases", r["id"]), ignore_errors=True)
        removed.append(r["id"])
    return {"removed": removed}


def op_verify_backup(req):
    return {"problems": verify_backup(req["backup_dir"])}


def op_remove_partial(req):
    """An interrupted backup never became a release backup: drop its partial copy."""
    rdir = os.path.join(req["state_dir"], "releases", req["release_id"])
    shutil.rmtree(os.path.join(rdir, "backup.partial"), ignore_errors=True)
    return {"backup_complete": os.path.isfile(os.path.join(rdir, "backup", "manifest.json"))}


def op_verify_unit(req):
    """Run `systemd-analyze verify` on the host, where ExecStart's program really exists."""
    import subprocess

    if shutil.which(req["argv"][0]) is None:
        return {"available": False}
    d = tempfile.mkdtemp(prefix="ddtree-ops-verify-")
    try:
        path = os.path.join(d, req["unit_name"])
        with open(path, "w") as fh:
            fh.write(req["text"])
        argv = [path if a == "@PATH@" else a for a in req["argv"]]
        r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           universal_newlines=True, timeout=120)
        return {"available": True, "returncode": r.returncode,
                "stdout": r.stdout.replace(path, req["unit_name"]),
                "stderr": r.stderr.replace(path, req["unit_name"])}
    finally:
        shutil.rmtree(d, ignore_errors=True)


OPS = {
    "facts": op_facts, "lock": op_lock, "unlock": op_unlock, "journal": op_journal,
    "compile": op_compile, "backup": op_backup, "install": op_install, "restore": op_restore,
    "release_write": op_release_write, "set_current": op_set_current, "history": op_history,
    "prune": op_prune, "verify_backup": op_verify_backup, "remove_partial": op_remove_partial,
    "verify_unit": op_verify_unit,
}


def main(request):
    try:
        result = {"ok": True, "result": OPS[request["op"]](request)}
    except Exception as e:  # reported to the controller, which decides what it means
        result = {"ok": False, "error": "%s: %s" % (type(e).__name__, e),
                  "errno": getattr(e, "errno", None)}
    sys.stdout.write(json.dumps(result))
    sys.stdout.flush()
