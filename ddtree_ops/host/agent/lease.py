"""The deploy lock is a lease: the agent keeps it while its controller is heard from, and lets it
go by itself when the controller is gone.

Every request renews the lease (`Renew` is the controller's heartbeat when it has nothing else
to ask). The lease runs down only while the agent waits for a request: an op that takes longer
than the lease does not expire it, since the controller is waiting for its answer. Its clock is
CLOCK_BOOTTIME, which keeps counting while the host is suspended.

The lease expires after `lease_s` idle, or when the controller's connection closed and it did
not come back (a reconnect's new agent ends this one with SIGTERM) before the rest of the lease
ran out. Then, still holding the lock, the agent heals the host (heal.py: the interrupted deploy
or rollback the journal names is finished), records in the lock file that the lease expired,
with a new generation (so the controller, if it ever comes back, finds its lock gone and stops
without touching the host), and lets the lock go.
"""

import json
import os
import signal
import time

from .files import read_json
from .heal import heal
from .lock import write_holder

DEFAULT_LEASE_S = 30.0  # until the controller's Hello says otherwise


def lease_clock():
    """Seconds on a clock that counts through a suspend of the host (only differences count)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class Lease:
    """How long the agent may wait for its controller before the lock goes."""

    def __init__(self, lease_s=DEFAULT_LEASE_S, clock=lease_clock):
        self.lease_s, self.clock = float(lease_s), clock
        self.renewed_at = clock()

    def renew(self):
        self.renewed_at = self.clock()

    def left(self):
        """Seconds until the lease expires (<= 0: expired)."""
        return self.renewed_at + self.lease_s - self.clock()


class Expiry:
    """Why a lease expired, in the words the lock file and the heal record keep."""

    IDLE = "no request from the controller for %g s"
    GONE = "the controller's connection closed and it did not reconnect within %g s"


def expire(lock, lease, how, heal_fn=heal):
    """The lease ran out while this agent holds the lock: heal, record, release. A SIGTERM from
    here on is ignored: a reconnecting controller that comes now finds the generation moved on
    instead of a half-healed host."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    step = _journal_step(lock.state_dir)
    why = "controller lost at %s: %s" % (step or "no step (nothing changed yet)", how % lease.lease_s)
    now = time.time()
    # When the controller was last heard from, on the host's wall clock: an operator (and a test)
    # reads how long the host waited from the record itself, not from when the controller died.
    last_heard_at = now - (lease.clock() - lease.renewed_at)
    record = dict(lock.holder, generation=int(lock.holder.get("generation") or 0) + 1, lease_expired=True,
                  lease_s=lease.lease_s, last_heard_at=last_heard_at, last_heard_at_utc=_utc(last_heard_at),
                  expired_at=now, expired_at_utc=_utc(now), lost_at_step=step, why=why,
                  healing=True, agent_pid=os.getpid())
    write_holder(lock.fd, record)
    try:
        healed = heal_fn(lock.state_dir, why)
    except Exception as e:  # heal records its own failures; this is a bug in it, kept for the next run
        healed = {"ok": False, "healed": False, "error": "%s: %s" % (type(e).__name__, e)}
    record.update(healing=False, heal=healed, released_at=time.time())
    write_holder(lock.fd, json.loads(json.dumps(record, default=str)))
    lock.release()
    return record


def _journal_step(state):
    try:
        journal = read_json(os.path.join(state, "journal.json"))
    except (OSError, ValueError, UnicodeDecodeError):
        return "an unreadable journal"
    return journal.get("step") if isinstance(journal, dict) else None


def _utc(at=None):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
