"""The id of one rollout: every host a `deploy`, `promote` or `rollback` touches records the same
one, so the fleet's releases can be found, listed and undone together (fleet/rollouts.py)."""

from __future__ import annotations

import re
import time
import uuid

ROLLOUT_ID_RE = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{6}")


def new_rollout_id() -> str:
    """Sortable by time, unique across operators: 20261202T015500Z-1a2b3c."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


def is_rollout_id(text: str) -> bool:
    return bool(ROLLOUT_ID_RE.fullmatch(text))
