"""`ddtree-ops diff --host H REL1 REL2`: what changed on a host between two of its releases.

From the release store only, and read only: the two release records (patch set and its digest,
bundle, budget/topk, rollout, outcome) and the files each installed, by sha256. For a file whose
sha256 differs, the text of both sides is looked up in the host's backups and live files
(agent `release_content`) and shown as a unified diff; a side no copy is left of (pruned, or never
installed) or that is binary or large is named instead. Diff lines are scrubbed of secrets
(the unit's lines) and capped at MAX_DIFF_LINES per file.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from ..config.redaction import scrub_lines
from ..config.secrets import known_secrets
from ..errors import InputError, RemoteCommandError
from ..host.agent.protocol import ContentItem
from ..host.session import HostSession

RECORD_FIELDS = ("patchset", "patchset_digest", "bundle", "budget", "topk_cap", "rollout", "outcome", "by")
MAX_TEXT_BYTES = 256 * 1024
MAX_DIFF_LINES = 400


@dataclass(frozen=True)
class FieldChange:
    name: str
    old: Any
    new: Any


@dataclass
class FileDiff:
    path: str
    change: str  # added | removed | changed
    old_sha256: Optional[str]
    new_sha256: Optional[str]
    unit: bool = False
    diff: list[str] = field(default_factory=list)  # unified diff lines; empty with a `note`
    note: Optional[str] = None  # why there is no text diff


@dataclass
class ReleaseDiff:
    host: str
    old: str
    new: str
    fields: list[FieldChange]
    files: list[FileDiff]
    unchanged_files: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- pure --------------------------------------------------------------------------------------

def record_changes(old: dict[str, Any], new: dict[str, Any]) -> list[FieldChange]:
    return [FieldChange(k, old.get(k), new.get(k)) for k in RECORD_FIELDS if old.get(k) != new.get(k)]


def file_changes(old: dict[str, str], new: dict[str, str], unit_path: str) -> tuple[list[FileDiff], int]:
    """Paths whose sha256 differs (added, removed, changed) and the count of the same ones."""
    out, same = [], 0
    for path in sorted(set(old) | set(new), key=lambda p: (p == unit_path, p)):
        a, b = old.get(path), new.get(path)
        if a == b:
            same += 1
            continue
        change = "added" if a is None else "removed" if b is None else "changed"
        out.append(FileDiff(path, change, a, b, unit=path == unit_path))
    return out, same


def text_diff(path: str, old: str, new: str, old_label: str, new_label: str,
              secrets: tuple[str, ...] = ()) -> list[str]:
    """A unified diff of two texts, scrubbed, cut to MAX_DIFF_LINES (the cut said on the last line)."""
    lines = list(difflib.unified_diff(old.splitlines(), new.splitlines(), f"{path} ({old_label})",
                                      f"{path} ({new_label})", lineterm=""))
    lines = scrub_lines(lines, secrets)
    if len(lines) > MAX_DIFF_LINES:
        lines = lines[:MAX_DIFF_LINES] + [f"… ({len(lines) - MAX_DIFF_LINES} more diff lines)"]
    return lines


def _missing(item: Optional[ContentItem], rid: str) -> Optional[str]:
    """Why a side has no text (None: it has)."""
    if item is None:
        return None
    if not item.found:
        return f"no copy of it as release {rid} had it is left on the host (pruned or never installed)"
    if item.binary:
        return f"binary ({item.size} bytes)"
    if item.text is None:
        return f"larger than {MAX_TEXT_BYTES} bytes ({item.size})"
    return None


def attach_text(f: FileDiff, old: Optional[ContentItem], new: Optional[ContentItem], old_rid: str, new_rid: str,
                secrets: tuple[str, ...] = ()) -> None:
    """The unified diff of `f` from its two sides' contents (None: that side has no file)."""
    why = _missing(old, old_rid) or _missing(new, new_rid)
    if why:
        f.note = why
        return
    f.diff = text_diff(f.path, old.text if old else "", new.text if new else "", old_rid, new_rid, secrets)


# -- from a host -------------------------------------------------------------------------------

def _release(host: str, hist: dict[str, Any], rid: str) -> dict[str, Any]:
    by_id = {r.get("id"): r for r in hist.get("releases") or [] if isinstance(r, dict)}
    if rid not in by_id:
        known = ", ".join(str(k) for k in list(by_id)[-5:]) or "none"
        raise InputError(f"{host}: release {rid!r} is not on the host (its newest releases: {known}; see "
                         f"`ddtree-ops history --host {host}`)")
    return by_id[rid]


def _installed(rec: dict[str, Any]) -> dict[str, str]:
    inst = rec.get("installed")
    return {str(k): str(v) for k, v in inst.items()} if isinstance(inst, dict) else {}


def diff_releases(session: HostSession, old_rid: str, new_rid: str) -> ReleaseDiff:
    """The difference between two releases on the session's host; InputError naming an unknown one."""
    host = session.host
    hist = session.store.history()
    old, new = _release(host.name, hist, old_rid), _release(host.name, hist, new_rid)
    notes = [f"release {rid} has no record of installed files (outcome: {rec.get('outcome')}): its files are "
             f"not compared" for rid, rec in ((old_rid, old), (new_rid, new)) if not _installed(rec)]
    files, same = file_changes(_installed(old), _installed(new), host.unit_path)
    if files and not notes:
        wanted = [(f.path, sha) for f in files for sha in (f.old_sha256, f.new_sha256) if sha]
        reply = session.store.release_content(wanted, MAX_TEXT_BYTES).items
        if len(reply) != len(wanted):
            raise RemoteCommandError(f"{host.name}: remote step 'release_content': {len(reply)} answers to "
                                     f"{len(wanted)} paths")
        items = iter(reply)
        secrets = known_secrets(host)
        for f in files:
            a = next(items) if f.old_sha256 else None
            b = next(items) if f.new_sha256 else None
            attach_text(f, a, b, old_rid, new_rid, secrets)
    return ReleaseDiff(host.name, old_rid, new_rid, record_changes(old, new), files if not notes else [], same,
                       notes)
