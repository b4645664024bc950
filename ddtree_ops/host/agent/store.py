"""The release store's records: the journal of the operation in progress, releases/<id>/release.json,
which release is current, the history, pruning old releases, and dropping a backup that an
interrupted run left half-made."""

import os
import shutil
import time

from .files import atomic_json, atomic_write, ensure_private_dir, fsync_dir, read_json
from .protocol import History, Journal, Prune, ReleaseWrite, RemovePartial, RemovePartialReply, SetCurrent, TuneWrite
from .statedir import ensure_state_dir, read_current, require_state_dir


def op_journal(req: Journal):
    path = os.path.join(req.state_dir, "journal.json")
    if req.clear:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        fsync_dir(req.state_dir)
        return {"journal": None}
    require_state_dir(req.state_dir)
    doc = dict(req.journal, updated=time.time())
    atomic_json(path, doc)
    return {"journal": doc}


def op_release_write(req: ReleaseWrite):
    """Create or update releases/<id>/release.json (merging fields)."""
    rdir = os.path.join(req.state_dir, "releases", req.release_id)
    require_state_dir(req.state_dir)
    ensure_private_dir(os.path.join(req.state_dir, "releases"))
    ensure_private_dir(rdir)
    path = os.path.join(rdir, "release.json")
    doc = read_json(path, {})
    doc.update(req.fields)
    atomic_json(path, doc)
    return {"release": doc}


# A tune's record is kept whole (its rows), but `history` shows only these keys of the newest ones.
TUNE_SUMMARY_KEYS = ("tune_id", "started_at", "finished_at", "interrupted", "hosts", "winners", "pick", "objective")
TUNES_LISTED = 20
TUNE_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")


def op_tune_write(req: TuneWrite):
    if not req.tune_id or len(req.tune_id) > 64 or not set(req.tune_id) <= TUNE_ID_CHARS:
        raise ValueError("bad tune id %r" % (req.tune_id,))
    ensure_state_dir(req.state_dir)  # a host that only measured DFlash for the tune has none yet
    tdir = os.path.join(req.state_dir, "tunes")
    ensure_private_dir(tdir)
    atomic_json(os.path.join(tdir, req.tune_id + ".json"), req.doc)
    return {"tune_id": req.tune_id}


def _tune_summaries(state):
    root = os.path.join(state, "tunes")
    if not os.path.isdir(root):
        return []
    out = []
    for name in sorted(os.listdir(root)):
        if not name.endswith(".json"):
            continue
        doc = read_json(os.path.join(root, name))
        if isinstance(doc, dict):
            summary = {k: doc.get(k) for k in TUNE_SUMMARY_KEYS}
            summary["rows"] = len(doc.get("rows") or [])
            out.append(summary)
    out.sort(key=lambda d: (d.get("started_at") or 0, d.get("tune_id") or ""))
    return out[-TUNES_LISTED:]


def op_set_current(req: SetCurrent):
    state = req.state_dir
    rid = req.release_id
    path = os.path.join(state, "current")
    if rid:
        atomic_write(path, (rid + "\n").encode(), 0o600)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return {"current": rid}


def op_history(req: History):
    state = req.state_dir
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
    return {"releases": rels, "current": read_current(state),
            "original": os.path.isfile(os.path.join(state, "original", "manifest.json")),
            "tunes": _tune_summaries(state)}


def op_prune(req: Prune):
    """Keep the newest `keep` releases plus every release on the current chain's first `keep`."""
    state = req.state_dir
    keep = req.keep
    hist = op_history(req)["releases"]
    protected = set()
    cur = read_current(state)
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


def op_remove_partial(req: RemovePartial):
    """An interrupted backup never became a release backup: drop its partial copy."""
    rdir = os.path.join(req.state_dir, "releases", req.release_id)
    shutil.rmtree(os.path.join(rdir, "backup.partial"), ignore_errors=True)
    return RemovePartialReply(os.path.isfile(os.path.join(rdir, "backup", "manifest.json")))
