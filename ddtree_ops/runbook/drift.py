"""Drift at backup: a file that changed on the host between preflight and backup (an operator's
edit, another tool) is not backed up and replaced; the deploy stops with nothing changed.

Preflight's plan holds the sha256 it read for each target (None: absent). The backup request
carries it (`BackupPath.expect_sha256`/`expect_absent`) and the agent compares before it writes
anything; `--force`, which lets preflight's own drift through, sends no expectation.
"""

from __future__ import annotations

from ..errors import ChangedSincePreflight
from ..host.agent.protocol import BackupChange, BackupPath
from ..host.release_store import ReleaseStore
from .plan import HostPlan


def backup_paths(plan: HostPlan, unit_path: str, *, check: bool) -> list[BackupPath]:
    """The paths the release touches; with `check`, each file with what preflight read there."""
    def one(path: str, old: str | None) -> BackupPath:
        if not check:
            return BackupPath(path, "file")
        return BackupPath(path, "file", expect_sha256=old, expect_absent=old is None)

    return [one(f.path, f.old_sha256) for f in plan.files] + [BackupPath(unit_path, "unit")]


def _short(sha: str | None) -> str:
    return "absent" if sha is None else sha[:12]


def changed_error(host: str, paths: list[BackupPath], changed: list[BackupChange]) -> ChangedSincePreflight:
    """One line naming the host, the (first) file and what preflight read against what is there."""
    first = changed[0]
    p = paths[first.index]
    more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
    return ChangedSincePreflight(
        host, f"{p.path} changed since preflight (sha256 {_short(p.expect_sha256)} then, {_short(first.found_sha256)} "
              f"now){more}; the backup refused and nothing was changed on the host: run again to plan against "
              f"the file as it is now, or pass --force to replace it")


def stand_down(store: ReleaseStore, rid: str, error: ChangedSincePreflight) -> ChangedSincePreflight:
    """The refused release recorded as such and the journal cleared (nothing else was written):
    the host is as preflight saw it, with nothing for a later run to repair."""
    store.write_release(rid, outcome="refused at backup: a file changed since preflight; nothing changed",
                        error=str(error))
    store.clear_journal()
    return error
