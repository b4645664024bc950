"""The state dir: created 0700 and marked as the tool's, or refused when it is somebody else's
folder; and the id of the release the host runs (`current`).

Release store under <state_dir>:
    deploy.lock                 the deploy lock (flock); who holds it, since when, doing what
    journal.json                the operation in progress: release id, step, units that were active
    current                     id of the release the host runs
    original/                   pristine state of every path any release ever touched
    releases/<id>/release.json  what the release is (patch set, budget, topk, outcome, previous)
    releases/<id>/backup/       state of each path before this release, with manifest.json
"""

import os

from .errors import AgentError
from .files import atomic_write

STATE_MARKER = ".ddtree-ops-state"

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


def read_current(state):
    try:
        with open(os.path.join(state, "current")) as fh:
            return fh.read().strip() or None
    except FileNotFoundError:
        return None

