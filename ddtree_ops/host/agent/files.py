"""Files on the host: facts of a path, atomic writes (temp file, fsync, rename, fsync the folder,
as Ansible's atomic_move), JSON documents, stale bytecode, private folders, free space.

Nothing is written in place: a reader sees the old file or the new one, never half of one.
"""

import hashlib
import json
import os
import tempfile


def text_lines(path, limit):
    """The lines of the first `limit` bytes of a text file (a file someone else may have written:
    read bounded, undecodable bytes replaced); None when it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(limit).splitlines()
    except OSError:
        return None


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


def disk_free_mb(path):
    while not os.path.exists(path):
        path = os.path.dirname(path) or "/"
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize // (1024 * 1024)


