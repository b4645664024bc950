"""Read only: a file's text as it was under a release, for `ddtree-ops diff`.

A release records the sha256 of every file it installed; the bytes themselves are kept by the
backups (every backup holds the files as the release before it left them, and original/ the
upstream ones) and, for the current release, by the live files. A copy is looked up by path and
sha256, hashed again before it is sent (a backup changed since is never passed off as the
release's file), and only from the tool's own places: a stored file named by a manifest as
`files/NNNN`, or a live path that some backup manifest lists (a path the tool manages).
"""

import hashlib
import os
import re

from .files import read_json
from .protocol import ContentItem, ReleaseContent, ReleaseContentReply

_STORED_NAME = re.compile(r"^files/[0-9]{1,6}$")


def _content_backup_dirs(state):
    dirs = [os.path.join(state, "original")]
    root = os.path.join(state, "releases")
    if os.path.isdir(root):
        dirs += [os.path.join(root, rid, "backup") for rid in sorted(os.listdir(root))]
    return dirs


def _content_entries(state):
    """(path, sha256, stored file) of every stored copy in every backup manifest."""
    out = []
    for bdir in _content_backup_dirs(state):
        try:
            manifest = read_json(os.path.join(bdir, "manifest.json"))
        except (OSError, ValueError):
            continue
        entries = manifest.get("entries") if isinstance(manifest, dict) else None
        for e in entries if isinstance(entries, list) else ():
            if not isinstance(e, dict) or not isinstance(e.get("path"), str):
                continue
            stored = e.get("stored")
            ok = e.get("existed") and isinstance(stored, str) and _STORED_NAME.match(stored)
            out.append((e["path"], e.get("sha256"), os.path.join(bdir, stored) if ok else None))
    return out


def _content_read(path, sha256, max_bytes):
    """The item for `path` when its bytes hash to `sha256`; None otherwise (or unreadable)."""
    try:
        if os.path.islink(path) or not os.path.isfile(path):
            return None
        h, head, size = hashlib.sha256(), b"", 0
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
                if size <= max_bytes:
                    head += chunk[:max_bytes + 1 - len(head)]
                size += len(chunk)
    except OSError:
        return None
    if h.hexdigest() != sha256:
        return None
    if size > max_bytes:
        return ContentItem(True, size=size)
    try:
        return ContentItem(True, text=head.decode("utf-8"), size=size)
    except UnicodeDecodeError:
        return ContentItem(True, binary=True, size=size)


def op_release_content(req: ReleaseContent):
    entries = _content_entries(req.state_dir)
    managed = {e[0] for e in entries}
    items = []
    for want in req.paths:
        item = None
        for path, sha, stored in entries:
            if item is None and stored and path == want.path and sha == want.sha256:
                item = _content_read(stored, want.sha256, req.max_bytes)
                if item is not None:
                    item.source = "backup"
        if item is None and want.path in managed:
            item = _content_read(want.path, want.sha256, req.max_bytes)
            if item is not None:
                item.source = "live"
        items.append(item or ContentItem(False))
    return ReleaseContentReply(items)
