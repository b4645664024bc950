"""The restore check on the controller's side: before a rollback, or the repair of an interrupted
deploy or rollback, puts any backup back, the host's agent compares every file the restore would
write over with what the releases being undone installed, and the SGLang in the venv with the
version they were installed onto (host/agent/restore_check.py, the rule). A venv upgraded under a
release (0.5.23 backups about to go over 0.5.24 files) refuses the run: exit 2, naming the host,
each file (expected and found sha256, short) and the versions, nothing changed. `--force`
restores anyway, and the run says so.

A deploy's own rollback of a release it failed to deploy is not checked: it puts back what that
very run backed up a moment before and installed since, under the same lock.
"""

from __future__ import annotations

from typing import Callable

from ..config.inventory import Host
from ..errors import DriftedSinceRelease
from ..host.agent.protocol import RestoreCheckReply
from ..host.agent.restore_check import restore_drift_summary

STEP = "restore check"


def drift_refusal(host: Host, reply: RestoreCheckReply, what: str) -> DriftedSinceRelease:
    return DriftedSinceRelease(host.name, (
        f"refusing to {what}: {restore_drift_summary(reply, host.site_packages)}. Restoring the backups over them "
        f"could mix two SGLang releases; nothing was changed on the host. "
        f"`ddtree-ops rollback --force --limit {host.name}` restores them anyway"), reply)


def check_before_restore(host: Host, step: Callable[[str, str], None], check: Callable[[], RestoreCheckReply], *,
                         force: bool, what: str, quiet_when_clean: bool = False) -> None:
    """`check` (the agent's answer) before anything is restored: DriftedSinceRelease on drift,
    unless `force` (then the step says it was skipped). What could not be checked (a release
    recorded by an older ddtree-ops) is said in the step, unless `quiet_when_clean`."""
    if force:
        step(STEP, "skipped (--force): the backups are restored whatever the host holds now")
        return
    reply = check()
    if reply.drifted:
        raise drift_refusal(host, reply, what)
    if reply.unchecked and not quiet_when_clean:
        step(STEP, "nothing changed under the release; " + "; ".join(reply.unchecked))
