"""The rollout's logic with plain functions as actions (fast tier): canary, batches, the failure
budget, abort and revert, skipped rows, a crashing action, and the run's exit code."""

from __future__ import annotations

import threading

import pytest

from ddtree_ops.config.inventory import parse_inventory
from ddtree_ops.errors import EXIT_ERROR, EXIT_NEEDS_PERSON, EXIT_ROLLED_BACK
from ddtree_ops.fleet.rollout import Rollout, Target
from ddtree_ops.runbook.results import HostResult, Outcome
from ddtree_ops.testing.fake_host import fake_inventory


def targets(n: int) -> list[Target]:
    inv = parse_inventory(fake_inventory(n), "inv.yaml")
    return [Target(h.name, (h,)) for h in inv.hosts.values()]


class Script:
    """An action whose outcome per host comes from a table; records what ran, in order."""

    def __init__(self, outcomes: dict[str, Outcome] | None = None, default: Outcome = Outcome.DEPLOYED):
        self.outcomes, self.default = outcomes or {}, default
        self.ran: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, t: Target, report) -> list[HostResult]:
        with self._lock:
            self.ran.append(t.name)
        o = self.outcomes.get(t.name, self.default)
        code = {Outcome.DEPLOYED: 0, Outcome.ROLLED_BACK: EXIT_ROLLED_BACK, Outcome.UNCHANGED: 0}.get(o, EXIT_ERROR)
        return [HostResult(h.name, o, code, release="r-" + h.name) for h in t.hosts]


def run(n: int, outcomes: dict[str, Outcome], *, revert_outcome: Outcome = Outcome.ROLLED_BACK, forks: int = 1,
        **kw):
    action, revert = Script(outcomes), Script(default=revert_outcome)
    res = Rollout(targets(n), action, revert=revert, forks=forks, **kw).run()
    return res, action, revert


def outcomes(res) -> list[str]:
    return [str(r.outcome) for r in res.results]


CASES = [
    # (name, hosts, failing hosts, rollout options, expected outcomes in host order, aborted, exit code)
    ("all good", 4, {}, {}, ["deployed"] * 4, False, 0),
    ("canary fails: nothing else starts", 4, {"fh1": Outcome.ROLLED_BACK}, {},
     ["rolled_back", "skipped", "skipped", "skipped"], True, EXIT_ROLLED_BACK),
    ("over the budget after a batch (1 of 3 attempted = 33% > 30%)", 4, {"fh3": Outcome.ROLLED_BACK},
     {"batch": "1", "max_fail": "30%"}, ["reverted", "reverted", "rolled_back", "skipped"], True, EXIT_ROLLED_BACK),
    ("budget 0%: the first failed batch aborts and reverts what was updated", 4, {"fh3": Outcome.ROLLED_BACK},
     {"batch": "1"}, ["reverted", "reverted", "rolled_back", "skipped"], True, EXIT_ROLLED_BACK),
    ("within the budget (1 of 3 attempted = 33% is not > 34%)", 4, {"fh3": Outcome.ROLLED_BACK},
     {"batch": "1", "max_fail": "34%"}, ["deployed", "deployed", "rolled_back", "deployed"], False, EXIT_ROLLED_BACK),
    ("--keep-updated keeps the updated hosts on the new release", 4, {"fh2": Outcome.ROLLED_BACK},
     {"batch": "1", "keep_updated": True}, ["deployed", "rolled_back", "skipped", "skipped"], True, EXIT_ROLLED_BACK),
    ("no canary: batches only", 3, {}, {"canary": 0, "batch": "2"}, ["deployed"] * 3, False, 0),
]


@pytest.mark.parametrize("name, n, failing, kw, expected, aborted, code", CASES, ids=[c[0] for c in CASES])
def test_canary_batches_budget_and_revert(name, n, failing, kw, expected, aborted, code):
    res, action, revert = run(n, failing, **kw)
    assert outcomes(res) == expected
    assert res.aborted is aborted and res.exit_code == code
    assert set(revert.ran) == {r.host for r in res.results if r.outcome == Outcome.REVERTED}
    assert action.ran == [r.host for r in res.results if r.outcome != Outcome.SKIPPED]


def test_batches_run_in_order_canary_first():
    res, action, _ = run(5, {}, batch="2", forks=1)
    assert res.batches == [["fh1"], ["fh2", "fh3"], ["fh4", "fh5"]]
    assert action.ran == ["fh1", "fh2", "fh3", "fh4", "fh5"]


def test_a_revert_that_fails_needs_a_person():
    res, _, _ = run(3, {"fh3": Outcome.ROLLED_BACK}, batch="1", revert_outcome=Outcome.ROLLBACK_FAILED)
    assert outcomes(res) == ["revert_failed", "revert_failed", "rolled_back"]
    assert res.exit_code == EXIT_NEEDS_PERSON


def test_an_action_that_crashes_is_a_failed_row_not_a_crashed_rollout():
    def boom(t, report):
        raise RuntimeError("a bug")

    res = Rollout(targets(2), boom, canary=0).run()
    assert outcomes(res) == ["failed", "failed"] and "RuntimeError: a bug" in res.results[0].message
    assert res.exit_code == EXIT_ERROR


def test_a_rollback_run_counts_rolled_back_as_success():
    res = Rollout(targets(2), Script(default=Outcome.ROLLED_BACK), kind="rollback", canary=0, max_fail=100).run()
    assert not res.aborted and outcomes(res) == ["rolled_back", "rolled_back"]
    assert res.to_dict()["hosts"][0]["outcome"] == "rolled_back"
