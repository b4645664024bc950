"""The lease's inventory settings, `lock_renew_s` and `lock_lease_s`: defaults 10 and 30, set per
host or group like any host var, and refused at the edge with the file, host and field named."""

from __future__ import annotations

import pytest

from ddtree_ops.config.inventory import parse_inventory
from ddtree_ops.errors import InventoryError
from ddtree_ops.testing.fake_host import fake_inventory


def hosts(**host_vars):
    return parse_inventory(fake_inventory(1, **host_vars), "inv.yaml").hosts["fh1"]


def test_the_defaults_renew_every_10_s_and_lose_the_lock_after_30_s():
    h = hosts()
    assert (h.lock_renew_s, h.lock_lease_s) == (10.0, 30.0)


def test_a_host_var_overrides_the_group_var():
    doc = fake_inventory(1, lock_renew_s=2, lock_lease_s=6)
    doc["all"]["hosts"]["fh1"] = {"lock_lease_s": 9.5}
    h = parse_inventory(doc, "inv.yaml").hosts["fh1"]
    assert (h.lock_renew_s, h.lock_lease_s) == (2.0, 9.5)


@pytest.mark.parametrize("values, field, says", [
    ({"lock_lease_s": 10}, "lock_lease_s", "at least twice lock_renew_s (10 s)"),
    ({"lock_renew_s": 5, "lock_lease_s": 9}, "lock_lease_s", "at least twice lock_renew_s (5 s)"),
    ({"lock_renew_s": 0.5}, "lock_renew_s", "must be a number 1.0.."),
    ({"lock_renew_s": True}, "lock_renew_s", "must be a number"),
    ({"lock_lease_s": "30"}, "lock_lease_s", "must be a number"),
    ({"lock_lease_s": None}, "lock_lease_s", "must be a number"),
])
def test_a_lease_that_is_not_a_number_or_shorter_than_two_renewals_is_refused(values, field, says):
    with pytest.raises(InventoryError) as err:
        hosts(**values)
    e = err.value
    assert (e.file, e.host, e.field) == ("inv.yaml", "fh1", field) and says in e.problem


def test_the_smallest_allowed_lease_is_accepted():
    """Control for the refusals above: exactly twice a one-second renewal is fine."""
    h = hosts(lock_renew_s=1, lock_lease_s=2)
    assert (h.lock_renew_s, h.lock_lease_s) == (1.0, 2.0)
