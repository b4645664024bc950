"""The part of a deploy that runs ON the host: file facts, backup, atomic install, restore, lock,
journal, the release store and systemctl. Stdlib only, Python >= 3.8, run by the SGLang venv's
interpreter.

One process serves a whole operation (a deploy, a rollback, a status) over one SSH channel: the
controller (release_store.py) starts `python -I -S -c BOOTSTRAP`, sends this file's source
(10-digit length, then the bytes), then one JSON request per line; each answer is one JSON line.
The process holds the deploy lock (`flock` on <state_dir>/deploy.lock) for as long as it lives,
so a controller that is killed, closed or cut off frees the lock by itself: its channel closes,
this process reads EOF and exits, and the kernel drops the flock. A controller whose network is
gone without a FIN is noticed by the idle timeout (no request for `idle_timeout` seconds).

Nothing is pasted into a shell, nothing is written in place: every file is written to a temp file
in its target folder, fsynced and renamed over the target (Ansible's atomic_move), then the folder
is fsynced.

Release store under <state_dir> (mode 0700, created by this agent, marked by .ddtree-ops-state):
    deploy.lock                 the deploy lock (flock); who holds it, since when, doing what
    journal.json                the operation in progress: release id, step, units that were active
    current                     id of the release the host runs
    original/                   pristine state of every path any release ever touched
    releases/<id>/release.json  what the release is (patch set, budget, topk, outcome, previous)
    releases/<id>/backup/       state of each path before this release, with manifest.json
"""

import base64
import errno
import fcntl
import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

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
STATE_MARKER = ".ddtree-ops-state"
LOCK_FILE = "deploy.lock"


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


def file_facts(path, content=True):
    """Mode, owner, size and (with `content`) sha256 of a path, not following a symlink. A
    secret file is asked for without `content`: nothing derived from it leaves the host."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return {"path": path, "exists": False}
    is_file = os.path.isfile(path) and not os.path.islink(path)
    return {"path": path, "exists": True, "mode": st.st_mode & 0o7777, "uid": st.st_uid,
            "gid": st.st_gid, "size": st.st_size, "sha256": sha256_file(path) if content and is_file else None,
            "is_file": is_file}


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
    """A folder of the tool's own inside the state dir (never the state dir itself)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


# What an earlier ddtree-ops left in a state dir before the marker existed: adopted as ours.
_OLD_STATE_ENTRIES = ("releases", "current", "journal.json", "original", "lock")


def ensure_state_dir(state):
    """Create the state dir (0700) and mark it as the tool's, or check that it is the tool's.

    A directory the tool did not create is never chmodded or written: `state_dir: /var/lib` or
    `/etc/systemd/system` must not become 0700 with a journal in it."""
    marker = os.path.join(state, STATE_MARKER)
    if os.path.islink(state) or (os.path.exists(state) and not os.path.isdir(state)):
        raise AgentError("state_dir %s exists and is not a directory" % state)
    if not os.path.exists(state):
        parent = os.path.dirname(state.rstrip("/")) or "/"
        os.makedirs(parent, mode=0o755, exist_ok=True)
        os.mkdir(state, 0o700)
        os.chmod(state, 0o700)
        _write_marker(marker)
        return
    if os.path.isfile(marker):
        return
    entries = os.listdir(state)
    if entries and all(e in _OLD_STATE_ENTRIES or e.startswith(".ddtree-ops.") for e in entries):
        os.chmod(state, 0o700)  # an earlier ddtree-ops made it (and made it 0700)
        _write_marker(marker)
        return
    mode = os.stat(state).st_mode & 0o777
    if not entries and not mode & 0o077:
        _write_marker(marker)  # an empty private folder prepared for us: adopt without chmod
        return
    raise AgentError("state_dir %s exists and was not created by ddtree-ops (%s, mode %04o); refusing to "
                     "take it over. Name a dedicated directory that does not exist yet (e.g. "
                     "/var/lib/ddtree-ops); the tool creates it with mode 0700"
                     % (state, "%d entries" % len(entries) if entries else "empty", mode))


def require_state_dir(state):
    if not os.path.isfile(os.path.join(state, STATE_MARKER)):
        raise AgentError("state_dir %s is not set up (take the deploy lock first)" % state)


def _write_marker(marker):
    atomic_write(marker, b"ddtree-ops state directory: release store, journal and deploy lock\n", 0o600)


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
    files.update({p: file_facts(p, content=False) for p in req.get("secret_paths", [])})
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
        **_journal_facts(state),
        "lock": lock_facts(state),
        "free_mb": {"site_packages": disk_free_mb(sp), "state_dir": disk_free_mb(state)},
    }


def _journal_facts(state):
    """The journal, or why it cannot be read: a truncated or foreign file is reported (the
    controller stops with "corrupt journal"), never guessed at."""
    path = os.path.join(state, "journal.json")
    try:
        return {"journal": read_json(path), "journal_error": None}
    except (ValueError, UnicodeDecodeError) as e:
        return {"journal": None, "journal_error": "%s is not valid JSON: %s" % (path, e)}
    except OSError as e:
        return {"journal": None, "journal_error": "%s cannot be read: %s" % (path, e)}


def _current(state):
    try:
        with open(os.path.join(state, "current")) as fh:
            return fh.read().strip() or None
    except FileNotFoundError:
        return None


# ------------------------------------------------------------------------------------- lock

def _proc_start(pid):
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat): a PID
    with another start time is another process."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _read_holder(fd):
    try:
        data = os.pread(fd, 1 << 16, 0)
        doc = json.loads(data.decode()) if data.strip() else {}
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _legacy_holder(state):
    """A lock directory left by an earlier ddtree-ops (mkdir lock): its holder, or None."""
    if os.path.isdir(os.path.join(state, "lock")):
        return read_json(os.path.join(state, "lock", "holder.json")) or {"holder": "unknown (old lock directory)"}
    return None


def lock_facts(state):
    """Who holds the lock, seen from outside: `held` is decided by flock, not by the file."""
    path = os.path.join(state, LOCK_FILE)
    legacy = _legacy_holder(state)
    if legacy is not None:
        return dict(legacy, held=True, legacy=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # free (the file keeps the last holder, for the generation count)
        except OSError:
            return dict(_read_holder(fd), held=True)
    finally:
        os.close(fd)


class LockState:
    """The deploy lock as this process holds it: an open file description with an flock."""

    def __init__(self):
        self.fd = None
        self.holder = None

    def release(self):
        if self.fd is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)
        self.fd, self.holder = None, None


def op_lock(req, lock):
    """Take the deploy lock for this process's lifetime. `break` (the holder's token, as shown
    to the operator) ends a holder that is still connected: its agent process is sent SIGTERM
    (which frees its flock), and the lock is taken only if nobody else took it meanwhile, so two
    breakers with the same token cannot both win."""
    state = req["state_dir"]
    ensure_state_dir(state)
    if lock.fd is not None:
        return {"acquired": True, "holder": lock.holder}
    breaking = req.get("break")
    legacy = _legacy_holder(state)
    if legacy is not None:
        if not breaking or legacy.get("token") != breaking:
            return {"acquired": False, "holder": dict(legacy, held=True, legacy=True)}
        shutil.rmtree(os.path.join(state, "lock"), ignore_errors=True)
    fd = os.open(os.path.join(state, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        # A run that just ended (or was killed) frees the lock when its agent has read EOF and
        # exited: a moment's grace, so that the next run does not trip over it.
        if _try_flock(fd, wait_s=float(req.get("wait_s", 0))):
            seen = _read_holder(fd)
        else:
            seen = _read_holder(fd)
            if not breaking or seen.get("token") != breaking:
                os.close(fd)
                return {"acquired": False, "holder": dict(seen, held=True)}
            _end_holder(seen)
            taken = lambda: _read_holder(fd).get("generation") != seen.get("generation")  # noqa: E731
            if not _try_flock(fd, wait_s=float(req.get("break_wait_s", 15)), give_up=taken):
                now = _read_holder(fd)
                os.close(fd)
                return {"acquired": False, "holder": dict(now, held=True), "break_failed": True}
            if _read_holder(fd).get("generation") != seen.get("generation"):
                # Someone else held it between our SIGTERM and our flock: not ours to take.
                fcntl.flock(fd, fcntl.LOCK_UN)
                now = _read_holder(fd)
                os.close(fd)
                return {"acquired": False, "holder": dict(now, held=False), "break_failed": True}
        resume = req.get("resume_generation")
        if resume is not None and seen.get("generation") != resume:
            # Re-taking the lock after a lost connection: another run held it meanwhile (and may
            # have repaired or deployed), so what this run knew about the host is stale.
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return {"acquired": False, "holder": dict(seen, held=False), "taken_meanwhile": True}
        holder = dict(req["holder"], generation=int(seen.get("generation") or 0) + 1, agent_pid=os.getpid(),
                      agent_start=_proc_start(os.getpid()), broke=breaking or None)
        data = (json.dumps(holder, sort_keys=True) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
    except BaseException:
        if lock.fd != fd:
            try:
                os.close(fd)
            except OSError:
                pass
        raise
    lock.fd, lock.holder = fd, holder
    return {"acquired": True, "holder": holder}


def _try_flock(fd, wait_s=0.0, give_up=lambda: False):
    deadline = time.time() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
        if time.time() >= deadline or give_up():
            return False
        time.sleep(0.05)


def _end_holder(holder):
    """SIGTERM the holder's agent process, if it is still the same process."""
    pid = holder.get("agent_pid")
    if isinstance(pid, int) and pid > 1 and pid != os.getpid() and _proc_start(pid) == holder.get("agent_start"):
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass


def op_unlock(req, lock):
    if lock.fd is None or (lock.holder or {}).get("token") != req["token"]:
        return {"released": False, "holder": lock.holder}
    done = dict(lock.holder, released_at=time.time())
    data = (json.dumps(done, sort_keys=True) + "\n").encode()
    os.ftruncate(lock.fd, 0)
    os.pwrite(lock.fd, data, 0)
    lock.release()
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
    require_state_dir(req["state_dir"])
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
    require_state_dir(state)
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
    require_state_dir(req["state_dir"])
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


# ------------------------------------------------------------------------------------- units

# Only these programs, and always as an argv (no shell): the controller asks for unit states,
# actions and log tails; it never sends a command line.
_PROGRAMS = ("systemctl", "journalctl", "nvidia-smi")


def _run(argv, timeout):
    if argv[0] not in _PROGRAMS:
        raise AgentError("not a program the agent runs: %r" % argv[0])
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           timeout=timeout)
    except FileNotFoundError:
        return {"rc": 127, "stdout": "", "stderr": "%s: not found" % argv[0]}
    return {"rc": r.returncode, "stdout": r.stdout.decode("utf-8", "replace"),
            "stderr": r.stderr.decode("utf-8", "replace")}


def op_run(req):
    """One systemctl/journalctl call, or several in a row (`argvs`): one round trip. The values
    of secret-named keys in `scrub_files` (the secrets_config SGLang reads its API key from,
    the unit's EnvironmentFile=) are replaced by *** in what goes back: SGLang logs its
    server_args, key included, and the controller must never receive it."""
    timeout = float(req.get("timeout", 300))
    secrets = _secret_values(req.get("scrub_files") or [], req.get("secret_words") or [])
    results = [_scrubbed(_run(list(a), timeout), secrets) for a in req.get("argvs") or [req["argv"]]]
    return {"results": results} if "argvs" in req else results[0]


def _secret_values(paths, words):
    """Values of secret-named keys (`api-key: v`, `HF_TOKEN=v`) in the given files, longest first."""
    values = set()
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                lines = fh.read(1 << 20).splitlines()
        except OSError:
            continue
        for line in lines:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            seps = [i for i in (line.find(":"), line.find("=")) if i > 0]
            if not seps:
                continue
            key, value = line[:min(seps)].strip(), line[min(seps) + 1:].strip()
            if key.startswith("export "):
                key = key[7:].strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            name_words = [w for w in key.upper().replace("-", "_").split("_") if w]
            if len(value) >= 4 and any(w.endswith(s) for w in name_words for s in words):
                values.add(value)
    return sorted(values, key=len, reverse=True)


def _scrubbed(result, secrets):
    for value in secrets:
        result["stdout"] = result["stdout"].replace(value, "***")
        result["stderr"] = result["stderr"].replace(value, "***")
    return result


# ------------------------------------------------------------------------------------- launch check

# SGLang's own parser, exactly as prepare_server_args (srt/server_args.py, 0.5.23) builds and
# feeds it, without ServerArgs.__post_init__ (which needs the GPUs): unknown flags, bad values and
# choices exit 2 with argparse's message, as the server would at start.
SGLANG_PARSE_ONLY = "\n".join([
    "import argparse, sys",
    "from sglang.srt.server_args import ServerArgs",
    "argv = sys.argv[1:]",
    "parser = argparse.ArgumentParser(prog='sglang serve')",
    "ServerArgs.add_cli_args(parser)",
    "if '--config' in argv:",
    "    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger",
    "    argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)",
    "parser.parse_args(argv)",
])


def op_launch_check(req):
    """Run the new launch line through the server's own argument parser (nothing starts), and
    say who holds the ports it will bind."""
    python, args = req["python"], [str(a) for a in req["args"]]
    if not os.path.isabs(python) or not os.access(python, os.X_OK):
        return {"rc": 127, "stdout": "", "stderr": "%s: not an executable absolute path" % python, "holders": {}}
    if req.get("sglang"):
        argv = [python, "-c", SGLANG_PARSE_ONLY] + args
    else:
        argv = [python, "-m", req["module"], "--parse-only"] + args
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           timeout=float(req.get("timeout", 180)), cwd="/")
        result = {"rc": r.returncode, "stdout": r.stdout.decode("utf-8", "replace")[-4000:],
                  "stderr": r.stderr.decode("utf-8", "replace")[-4000:]}
    except subprocess.TimeoutExpired:
        result = {"rc": 124, "stdout": "", "stderr": "the parse did not finish in time"}
    secrets = _secret_values(req.get("scrub_files") or [], req.get("secret_words") or [])
    result = _scrubbed(result, secrets)  # SGLang's "unrecognized arguments" error repeats values
    result["holders"] = {str(port): port_holders(int(port)) for port in req.get("ports", [])}
    return result


def op_proc_info(req):
    """Command line and ancestors of each asked PID (missing: the process is gone)."""
    out = {}
    for pid in req["pids"]:
        if os.path.isdir("/proc/%d" % int(pid)):
            out[str(pid)] = {"cmd": _cmdline(int(pid)), "ancestors": _ancestors(int(pid))}
    return out


def _listening_inodes(port):
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                next(fh, None)
                for line in fh:
                    f = line.split()
                    if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f[9])
        except OSError:
            continue
    return inodes


def port_holders(port):
    """Processes with a listening TCP socket on `port` (this network namespace): pid, command
    and ancestors (so a child of a unit's main process counts as the unit's)."""
    inodes = _listening_inodes(port)
    if not inodes:
        return []
    wanted = set("socket:[%s]" % i for i in inodes)
    out = []
    for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
        try:
            fds = os.listdir("/proc/%d/fd" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink("/proc/%d/fd/%s" % (pid, fd)) in wanted:
                    out.append({"pid": pid, "cmd": _cmdline(pid), "ancestors": _ancestors(pid)})
                    break
            except OSError:
                continue
    return out


def _cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:200]
    except OSError:
        return ""


def _ancestors(pid):
    chain = []
    while pid > 1 and len(chain) < 64:
        try:
            with open("/proc/%d/stat" % pid) as fh:
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        chain.append(pid)
    return chain


OPS = {
    "facts": op_facts, "lock": op_lock, "unlock": op_unlock, "journal": op_journal,
    "compile": op_compile, "backup": op_backup, "install": op_install, "restore": op_restore,
    "release_write": op_release_write, "set_current": op_set_current, "history": op_history,
    "prune": op_prune, "verify_backup": op_verify_backup, "remove_partial": op_remove_partial,
    "verify_unit": op_verify_unit, "run": op_run, "launch_check": op_launch_check,
    "proc_info": op_proc_info,
}


STATEFUL = {"lock": op_lock, "unlock": op_unlock}


class Agent:
    """One agent process: answers requests and holds the deploy lock while it lives."""

    def __init__(self):
        self.lock = LockState()
        self.idle_timeout = 600.0

    def handle(self, request):
        try:
            op = request["op"]
            if op == "hello":
                self.idle_timeout = float(request.get("idle_timeout", self.idle_timeout))
                result = {"pid": os.getpid(), "python": sys.version.split()[0]}
            elif op in STATEFUL:
                result = STATEFUL[op](request, self.lock)
            else:
                result = OPS[op](request)
            return {"ok": True, "result": result}
        except Exception as e:  # reported to the controller, which decides what it means
            return {"ok": False, "error": "%s: %s" % (type(e).__name__, e), "errno": getattr(e, "errno", None)}

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
