"""A run whose lease on the lock is lost (its controller was stopped or cut off for longer than
lock_lease_s) stops with exit 4 and does nothing more to the host: no rollback is tried, since the
host rolls itself back (fast tier, fake hosts: `lose_lease_at` makes a call find the lease lost)."""

from __future__ import annotations

import pytest

from ddtree_ops.errors import EXIT_NEEDS_PERSON, DeployFailed, LeaseLost
from ddtree_ops.runbook.deploy import deploy_host
from ddtree_ops.runbook.events import Failed, StepDone
from ddtree_ops.runbook.phases import DeployOptions
from ddtree_ops.runbook.rollback import rollback_host
from ddtree_ops.testing.fake_host import DDTREE_UNIT, FAKE_CRASH

OPTS = DeployOptions(reconnect_s=5)
HOST_CALLS = ("agent ", "systemctl ", "probe ", "nvidia-smi")


def host_calls(events: list[str]) -> list[str]:
    return [e for e in events if e.startswith(HOST_CALLS)]


@pytest.mark.parametrize("at", ["agent backup", f"systemctl restart {DDTREE_UNIT}", f"probe {DDTREE_UNIT}",
                                "agent set_current"])
def test_a_deploy_that_finds_its_lease_lost_stops_with_exit_4_and_tries_no_rollback(fake, patchset, at):
    fake.lose_lease_at.add(at)
    said: list = []
    with pytest.raises(LeaseLost) as lost:
        deploy_host(fake.session(), patchset, OPTS, said.append)
    assert lost.value.exit_code == EXIT_NEEDS_PERSON and "lease expired" in str(lost.value)
    assert not [e for e in said if isinstance(e, StepDone) and e.step.startswith("rollback")]
    assert [e.then for e in said if isinstance(e, Failed)] == ["the host rolls itself back"]
    calls = host_calls(fake.events)
    assert at not in calls and "agent remove_partial" not in calls and "agent restore" not in calls
    assert fake.session().store.facts([])["journal"] is not None  # left for the host (or the next run)


def test_the_same_deploy_losing_its_connection_instead_rolls_back(fake, versioned_patchset):
    """Control for the test above: a failure that is not a lost lease is rolled back."""
    fake.drop_connection_at.add("agent remove_partial")  # the rollback's first call, reconnected
    said: list = []
    with pytest.raises(DeployFailed):
        deploy_host(fake.session(), versioned_patchset(marker=b"\n# " + FAKE_CRASH + b"\n"), OPTS, said.append)
    assert "agent restore" in host_calls(fake.events)
    assert [e.then for e in said if isinstance(e, Failed)] == ["rolling back"]


def test_a_rollback_that_finds_its_lease_lost_stops_with_that_exit_4_not_a_failed_rollback(fake, versioned_patchset):
    deploy_host(fake.session(), versioned_patchset("1.0.0"), OPTS)
    deploy_host(fake.session(), versioned_patchset("2.0.0"), OPTS)
    fake.lose_lease_at.add("agent restore")
    with pytest.raises(LeaseLost) as lost:
        rollback_host(fake.session(), None, OPTS)
    assert "rollback failed" not in str(lost.value) and lost.value.exit_code == EXIT_NEEDS_PERSON
