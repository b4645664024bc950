"""What the host's last heal of itself (agent/heal.py, `facts`' `host_heal`) says, in one line for
`status` and for the deploy or rollback that finds it. Pure.

A heal is shown by `status` until a deploy or a rollback has shown it: that run marks it seen
(the heal's `at` as `host_heal_reported` in the healed release's record), and `facts` then says
`reported`, until a later heal.
"""

from __future__ import annotations

import time
from typing import Any

HEAL_STEP = "host healed"  # the step of a deploy or rollback that reports a heal it found


def healed_notes(steps: Any) -> list[str]:
    """What the `HEAL_STEP` steps of a run's step records say (a result's or a report's steps)."""
    return [str(s.get("detail") or "") for s in steps or [] if isinstance(s, dict) and s.get("step") == HEAL_STEP]


def _utc(ts: Any) -> str:
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        return "an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def unreported_heal(record: Any) -> dict[str, Any] | None:
    """The heal record when there is one that no deploy or rollback has shown yet."""
    if not isinstance(record, dict) or record.get("reported"):
        return None
    return record


def heal_note(record: dict[str, Any]) -> str:
    """`rolled back by the host at TIME: controller lost at STEP; now on PREV`, or what stopped it."""
    at, step = _utc(record.get("at")), record.get("step") or "?"
    now_on = record.get("previous") or "its original files"
    rid = record.get("release") or "?"
    if record.get("ok") and record.get("healed"):
        if record.get("kind") == "rollback":
            return f"rollback finished by the host at {at}: controller lost at {step} (undoing {rid}); now on {now_on}"
        return f"rolled back by the host at {at}: controller lost at {step} (release {rid}); now on {now_on}"
    if record.get("refused"):  # the restore check found the host changed under the release
        return (f"the host did not heal itself at {at} (controller lost at {step}, release {rid}): "
                f"{record.get('error') or 'the host changed under the release'}")
    return (f"the host tried to heal itself at {at} (controller lost at {step}, release {rid}) and stopped: "
            f"{record.get('error') or 'no reason recorded'}; its journal stays for the next deploy or rollback")
