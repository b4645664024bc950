"""Rollback when the inventory's units changed since the release was recorded (fast tier, fake
hosts): a unit dropped from `conflicts` since is restored as the record says (its state is read
too), a unit added since is left alone and the result says so. Before, both crashed with KeyError.
"""

from __future__ import annotations

import dataclasses

import pytest

from ddtree_ops.errors import RollbackFailed
from ddtree_ops.runbook.deploy import deploy_host
from ddtree_ops.runbook.phases import DeployOptions
from ddtree_ops.runbook.results import Outcome
from ddtree_ops.runbook.rollback import rollback_host
from ddtree_ops.testing.fake_host import DFLASH_UNIT, FAKE_CRASH, FakeUnit

OPTS = DeployOptions(reconnect_s=5)
EXTRA = "sglang-extra.service"


def _steps(result) -> list[str]:
    return [s["step"] for s in result.steps]


def _systemctl_on(fake, unit: str) -> list[str]:
    return [e for e in fake.events if e.startswith("systemctl ") and e.endswith(" " + unit)]


def test_a_unit_dropped_from_the_inventory_since_the_release_is_restored_as_recorded(fake, patchset):
    deploy_host(fake.session(), patchset, OPTS)
    assert (fake.units[DFLASH_UNIT].active, fake.units[DFLASH_UNIT].enabled) == ("inactive", "disabled")
    fake.host = dataclasses.replace(fake.host, conflicts=())  # the inventory no longer names it

    r = rollback_host(fake.session(), None, OPTS)

    assert r.outcome == Outcome.ROLLED_BACK and r.release is None
    assert (fake.units[DFLASH_UNIT].active, fake.units[DFLASH_UNIT].enabled) == ("active", "enabled")
    assert (fake.units[fake.host.unit].active, fake.units[fake.host.unit].enabled) == ("inactive", "disabled")
    i = _steps(r).index("rollback: units no longer in the inventory")
    assert DFLASH_UNIT in r.steps[i]["detail"] and "restored as recorded" in r.steps[i]["detail"]
    assert "rollback: healthy" in _steps(r)


def test_a_unit_added_to_the_inventory_since_the_release_is_left_alone_and_said(fake, patchset):
    deploy_host(fake.session(), patchset, OPTS)
    fake.units[EXTRA] = FakeUnit(active="active", enabled="enabled", pid=4242, ready=True)  # running: not stopped
    fake.host = dataclasses.replace(fake.host, conflicts=(DFLASH_UNIT, EXTRA))
    fake.events.clear()

    r = rollback_host(fake.session(), None, OPTS)

    assert r.outcome == Outcome.ROLLED_BACK
    assert _systemctl_on(fake, EXTRA) == []
    assert (fake.units[EXTRA].active, fake.units[EXTRA].enabled, fake.units[EXTRA].pid) == ("active", "enabled", 4242)
    assert (fake.units[DFLASH_UNIT].active, fake.units[DFLASH_UNIT].enabled) == ("active", "enabled")
    said = f"{EXTRA} not in the record of the release (added to the inventory since): left as it is"
    assert said in r.message and "rollback: units not recorded" in _steps(r)


def test_an_interrupted_deploy_is_repaired_after_the_inventory_dropped_a_unit(fake, versioned_patchset):
    fake.fail_next["agent restore"] = "disk gone"
    with pytest.raises(RollbackFailed):
        deploy_host(fake.session(), versioned_patchset(marker=b"\n# " + FAKE_CRASH + b"\n"), OPTS)
    journal = fake.session().store.facts([])["journal"]
    assert journal and DFLASH_UNIT in journal["active_before"]
    fake.host = dataclasses.replace(fake.host, conflicts=())

    r = rollback_host(fake.session(), None, OPTS)

    assert r.repaired == journal["release"] and r.outcome == Outcome.ROLLED_BACK
    assert (fake.units[DFLASH_UNIT].active, fake.units[DFLASH_UNIT].enabled) == ("active", "enabled")
    assert fake.session().store.facts([])["journal"] is None


def test_a_record_naming_an_invalid_unit_is_refused_before_systemctl_sees_it(fake, patchset):
    d = deploy_host(fake.session(), patchset, OPTS)
    fake.session().store.write_release(d.release, active_before={"--root=/tmp/x.service": "active"},
                                       enabled_before={})
    fake.events.clear()
    with pytest.raises(RollbackFailed, match="names '--root=/tmp/x.service', not a valid unit name"):
        rollback_host(fake.session(), None, OPTS)
    assert not [e for e in fake.events if "--root" in e]
