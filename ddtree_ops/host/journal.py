"""The host's journal (<state_dir>/journal.json), as the controller reads it back.

The agent writes it before every step that changes the host; the next run repairs from it. A
journal this tool did not write (truncated by a full disk, edited by hand, from a foreign tool)
is never acted on: the run stops with exit 4, "corrupt journal", and the way out.
"""

from __future__ import annotations

from typing import Any


def journal_problem(journal: Any) -> str | None:
    """Why a journal is not one this tool wrote (None: it is, or there is none). Pure."""
    if journal is None:
        return None
    if not isinstance(journal, dict):
        return f"journal.json holds a {type(journal).__name__}, not an object"
    rid = journal.get("release")
    if not isinstance(rid, str) or not rid or "/" in rid or rid.startswith("."):
        return f"journal.json names no valid release ({str(rid)[:40]!r})"
    if not isinstance(journal.get("step"), str):
        return "journal.json names no step"
    for key in ("active_before", "enabled_before"):
        v = journal.get(key, {})
        if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
            return f"journal.json field {key!r} is not a map of unit → state"
    if journal.get("kind", "deploy") not in ("deploy", "rollback"):
        return f"journal.json is of an unknown kind {str(journal.get('kind'))[:40]!r}"
    if journal.get("kind") == "rollback":
        undo = journal.get("undo")
        if (not isinstance(undo, list) or not undo
                or not all(isinstance(r, str) and r and "/" not in r and not r.startswith(".") for r in undo)):
            return "journal.json (rollback) has no valid list of releases to undo"
        if journal.get("to") is not None and not isinstance(journal.get("to"), str):
            return "journal.json (rollback) field 'to' is not a release id"
    prev = journal.get("previous")
    if prev is not None and not isinstance(prev, str):
        return "journal.json field 'previous' is not a release id"
    return None
