"""The deploy lock's lease (inventory `lock_renew_s`, `lock_lease_s`): how often the controller
renews it, and how long a host's agent keeps the lock without hearing from its controller before
it lets it go (and heals the host). A stopped or cut-off controller loses the lock within
`lock_lease_s`; the lease must leave room for at least one missed renewal, and a renewal more
often than every second would only load the hosts."""

from __future__ import annotations

from typing import Any, Mapping

from .schema import Check, Invalid, number_range

LOCK_RENEW_S = 10.0
LOCK_LEASE_S = 30.0
# How long a run keeps trying to reach a host whose SSH connection failed or was lost (inventory
# `reconnect_window_s`): long enough for an sshd restart or a network blip, short enough that an
# operator hears of a host that is really gone within a minute.
RECONNECT_WINDOW_S = 60.0
RENEW_MIN_S = 1.0
LEASE_MAX_S = 86400.0


def renew_interval() -> Check:
    """Seconds between two renewals: a number >= 1."""
    return number_range(RENEW_MIN_S, LEASE_MAX_S / 2)


def lease_duration(renew_field: str = "lock_renew_s") -> Check:
    """Seconds a lease lasts: a number at least twice the renewal interval (read from the field
    `renew_field`, validated before it), so one late renewal does not cost the lock."""
    in_range = number_range(2 * RENEW_MIN_S, LEASE_MAX_S)

    def check(value: Any, done: Mapping[str, Any]) -> float:
        lease = in_range(value, done)
        renew = done[renew_field]
        if lease < 2 * renew:
            raise Invalid(f"must be at least twice {renew_field} ({renew:g} s), so that one late renewal does not "
                          f"cost the lock; got {lease:g}")
        return lease
    return check
