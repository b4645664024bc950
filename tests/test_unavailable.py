"""max_unavailable, the rollout policy deploy and rollback share (fleet/policy.py), in the fast
tier: the value as the inventory and the flag write it, the batches it bounds, the router's pool
read before each batch (shrink, wait, stop), and the rollout that obeys it, with plain actions,
a simulated pool, and fake hosts behind an in-memory smg."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ddtree_ops.cli.commands import app
from ddtree_ops.config.inventory import parse_inventory
from ddtree_ops.config.schema import CountOrShare, Invalid, count_or_share
from ddtree_ops.errors import EXIT_BAD_INPUT, EXIT_ERROR, InputError, InventoryError
from ddtree_ops.fleet.actions import rolling_deploy, rolling_rollback
from ddtree_ops.fleet.policy import Admission, Pool, RolloutPolicy, admit, pool_of, rollout_policy
from ddtree_ops.fleet.rollout import Rollout, Target, plan_batches
from ddtree_ops.gates.router import WorkerEntry
from ddtree_ops.host.transport import HostConnection
from ddtree_ops.runbook.options import DeployOptions
from ddtree_ops.runbook.results import HostResult, Outcome
from ddtree_ops.testing.fake_host import FakeHost, fake_inventory
from ddtree_ops.testing.fake_router import FakeSmg

ROUTER = {"url": "http://router.test:30000", "admin_key_env": "DDTREE_TEST_ROUTER_KEY"}
FOREIGN = "http://10.0.0.99:30000"  # a worker of the router that no inventory host runs


def inventory_doc(n: int, *, router: dict | None = ROUTER, **all_vars) -> dict:
    """`n` fake hosts, each serving on its own port (so each is its own worker of the router)."""
    doc = fake_inventory(n, **({"router": router} if router else {}), **all_vars)
    doc["all"]["hosts"] = {f"fh{i + 1}": {"port": 30001 + i} for i in range(n)}
    return doc


def targets_of(doc: dict) -> list[Target]:
    inv = parse_inventory(doc, "inv.yaml")
    return [Target(h.name, (h,)) for h in inv.hosts.values()]


def url(i: int) -> str:
    return f"http://127.0.0.1:{30000 + i}"


def pool(*, workers: list[str], ready: list[str]) -> dict[str, Pool]:
    return {"http://router.test:30000": Pool("http://router.test:30000", frozenset(workers), frozenset(ready))}


# ---------------------------------------------------------------------------------------------
# the value


@pytest.mark.parametrize("value, count, percent", [(1, 1, None), ("3", 3, None), ("25%", None, 25),
                                                   (" 100% ", None, 100), ("0.5%", None, 0.5)])
def test_a_count_or_a_share_is_accepted(value, count, percent):
    v = count_or_share()(value, {})
    assert (v.count, v.percent) == (count, percent)


@pytest.mark.parametrize("value", [0, -1, "0", "-2", "0%", "150%", "x", 1.5, True, None, "1 %%"])
def test_zero_negative_or_anything_else_is_refused_naming_what_is_allowed(value):
    with pytest.raises(Invalid, match=r"a number of targets \(1 or more\) or a share"):
        count_or_share()(value, {})


def test_the_inventory_key_is_checked_at_the_edge_naming_the_host_and_field():
    assert parse_inventory(inventory_doc(2, max_unavailable="50%"), "i.yaml").hosts["fh1"].max_unavailable == \
        CountOrShare(percent=50)
    with pytest.raises(InventoryError, match=r"host 'fh1': field 'max_unavailable': must be a number of targets"):
        parse_inventory(inventory_doc(2, max_unavailable="0%"), "i.yaml")


@pytest.mark.parametrize("spec, total, expected", [(CountOrShare(count=1), 4, 1), (CountOrShare(count=9), 4, 4),
                                                   (CountOrShare(percent=50), 4, 2), (CountOrShare(percent=10), 4, 1),
                                                   (CountOrShare(percent=100), 3, 3)])
def test_a_share_rounds_down_but_is_at_least_one_and_a_count_is_clamped_to_the_selection(spec, total, expected):
    assert spec.of(total) == expected


# ---------------------------------------------------------------------------------------------
# the policy: flag, inventory, default; the batches it bounds


def test_the_default_is_one_target_the_inventory_sets_it_and_the_flag_wins():
    four = targets_of(inventory_doc(4))
    assert rollout_policy(four)[0].max_unavailable == 1
    from_inventory = targets_of(inventory_doc(4, max_unavailable="50%"))
    assert rollout_policy(from_inventory)[0].max_unavailable == 2
    assert rollout_policy(from_inventory, CountOrShare(count=3))[0].max_unavailable == 3
    assert rollout_policy(four, CountOrShare(count=40))[0].max_unavailable == 4  # larger than the selection


def test_hosts_that_disagree_get_the_strictest_value_and_the_policy_says_whose():
    doc = inventory_doc(3, max_unavailable=3)
    doc["all"]["hosts"]["fh2"]["max_unavailable"] = 1
    policy, _ = rollout_policy(targets_of(doc))
    assert policy.max_unavailable == 1 and "fh2" in policy.said


def test_a_canary_larger_than_max_unavailable_is_refused_and_a_larger_batch_is_cut_with_a_note():
    four = targets_of(inventory_doc(4))
    with pytest.raises(InputError, match=r"--canary 2 would take 2 targets out of service at once"):
        rollout_policy(four, canary=2)
    _, notes = rollout_policy(four, canary=1, batch_size=3, batch_flag="3")
    assert notes == ["--batch 3 is cut to batches of 1: max_unavailable 1 (the default)"]
    assert rollout_policy(four, CountOrShare(count=3), canary=2, batch_size=3, batch_flag="3")[1] == []  # control


def test_max_unavailable_bounds_every_batch_and_none_keeps_the_old_plan():
    assert plan_batches(4, canary=1, max_unavailable=1) == [[0], [1], [2], [3]]
    assert plan_batches(5, canary=0, batch="3", max_unavailable=2) == [[0, 1], [2, 3], [4]]
    assert plan_batches(4, canary=1) == [[0], [1, 2, 3]]  # control: no bound, the rest at once


# ---------------------------------------------------------------------------------------------
# the router's pool, from data


def test_a_batch_never_leaves_fewer_ready_than_the_pool_less_max_unavailable():
    t = targets_of(inventory_doc(3))
    whole = pool(workers=[url(1), url(2), url(3)], ready=[url(1), url(2), url(3)])
    one = admit(t[:2], whole, RolloutPolicy(1))
    assert (one.go, one.wait) == (("fh1",), ("fh2",)) and "taking fh2 out would leave 1, fewer than 2" in one.why
    assert admit(t[:2], whole, RolloutPolicy(2)).go == ("fh1", "fh2")  # control: two may go


def test_a_pool_already_short_shrinks_the_batch_and_then_stops_it_naming_the_worker_down():
    t = targets_of(inventory_doc(3))
    short = pool(workers=[url(1), url(2), url(3), FOREIGN], ready=[url(1), url(2), url(3)])
    shrunk = admit(t[:2], short, RolloutPolicy(2))
    assert (shrunk.go, shrunk.wait) == (("fh1",), ("fh2",))
    stopped = admit(t[:1], short, RolloutPolicy(1))
    assert stopped.refused and stopped.go == ()
    assert stopped.why == (f"router http://router.test:30000 has 3 of 4 workers ready (not: {FOREIGN}): taking fh1 "
                           f"out would leave 2, fewer than 3 (its pool of 4 less max_unavailable 1 (the default))")


def test_a_worker_already_out_of_service_costs_nothing_to_take_out():
    """Rolling back the host that is down is why one rolls back: it leaves no fewer workers ready."""
    t = targets_of(inventory_doc(3))
    own_down = pool(workers=[url(1), url(2), url(3), FOREIGN], ready=[url(2), url(3)])
    assert admit(t[:1], own_down, RolloutPolicy(1)).go == ("fh1",)
    assert admit(t[1:2], own_down, RolloutPolicy(1)).refused  # control: a ready one may not go


def test_the_router_is_never_emptied_unless_max_unavailable_is_everything():
    t = targets_of(inventory_doc(1))
    alone = pool(workers=[url(1)], ready=[url(1)])
    refused = admit(t, alone, RolloutPolicy(1))
    assert refused.refused and "would leave 0, none, and the router is never emptied" in refused.why
    assert admit(t, alone, RolloutPolicy(1, empty_ok=True)).go == ("fh1",)
    assert rollout_policy(t, CountOrShare(percent=100))[0].empty_ok
    assert not rollout_policy(t, CountOrShare(count=1))[0].empty_ok


def test_targets_without_a_router_are_bounded_only_by_the_batch_size():
    t = targets_of(inventory_doc(3, router=None))
    assert admit(t, {}, RolloutPolicy(1)).go == ("fh1", "fh2", "fh3")


def test_a_target_behind_another_router_goes_while_one_behind_a_short_router_waits():
    doc = inventory_doc(2)
    doc["all"]["hosts"]["fh2"]["router"] = {"url": "http://other.test:30000"}
    t = targets_of(doc)
    pools = {**pool(workers=[url(1), FOREIGN], ready=[url(1)]),
             "http://other.test:30000": Pool("http://other.test:30000", frozenset([url(2), FOREIGN]),
                                             frozenset([url(2), FOREIGN]))}
    a = admit(t, pools, RolloutPolicy(1))
    assert (a.go, a.wait) == (("fh2",), ("fh1",)) and "router.test" in a.why


def test_the_pool_is_what_the_router_lists_normalised_without_its_draining_entries():
    entries = [WorkerEntry("a", url(2) + "/", "ready", True), WorkerEntry("b", FOREIGN, "draining", False),
               WorkerEntry("c", url(3), "not_ready", False)]
    p = pool_of("http://ROUTER.test:30000/", entries)
    assert p == Pool("http://router.test:30000", frozenset([url(2), url(3)]), frozenset([url(2)]))


# ---------------------------------------------------------------------------------------------
# the rollout obeying it: plain actions over a simulated pool


class SimulatedPool:
    """A router's ready workers as actions take targets out and put them back; `wait_for_all`:
    how long a target stays out waiting for every other one to be out too (the control's proof
    that the measure sees targets out together)."""

    def __init__(self, targets: list[Target], wait_for_all: float):
        self.workers = {t.name: url(i + 1) for i, t in enumerate(targets)}
        self.ready = set(self.workers)
        self.fewest, self.wait_for_all = len(targets), wait_for_all
        self.lock, self.all_out = threading.Lock(), threading.Event()

    def action(self, t: Target, report) -> list[HostResult]:
        with self.lock:
            self.ready.discard(t.name)
            self.fewest = min(self.fewest, len(self.ready))
            if not self.ready:
                self.all_out.set()
        self.all_out.wait(self.wait_for_all)
        with self.lock:
            self.ready.add(t.name)
        return [HostResult(t.name, Outcome.ROLLED_BACK, 0)]

    def gate(self, policy: RolloutPolicy):
        def read(batch: list[Target]) -> Admission:
            with self.lock:
                ready = [self.workers[n] for n in self.ready]
            return admit(batch, pool(workers=list(self.workers.values()), ready=ready), policy)
        return read


@pytest.mark.parametrize("max_unavailable, fewest_ready", [(1, 3), (None, 0)], ids=["rolling", "all at once"])
def test_a_rollback_under_the_policy_keeps_the_pool_less_one_ready_and_all_at_once_empties_it(
        max_unavailable, fewest_ready):
    t = targets_of(inventory_doc(4))
    sim = SimulatedPool(t, wait_for_all=0.05 if max_unavailable else 10.0)
    gate = sim.gate(RolloutPolicy(max_unavailable)) if max_unavailable else None
    res = Rollout(t, sim.action, kind="rollback", canary=0, max_fail=100, forks=10, max_unavailable=max_unavailable,
                  admit=gate).run()
    assert sim.fewest == fewest_ready
    assert res.batches == ([["fh1"], ["fh2"], ["fh3"], ["fh4"]] if max_unavailable else [["fh1", "fh2", "fh3", "fh4"]])
    assert res.exit_code == 0


def script(ran: list[str]):
    def act(t: Target, report) -> list[HostResult]:
        ran.append(t.name)
        return [HostResult(t.name, Outcome.DEPLOYED, 0, release="r")]
    return act


def test_a_router_that_refuses_the_first_batch_changes_nothing_and_exits_2():
    ran: list[str] = []
    reverted: list[str] = []
    res = Rollout(targets_of(inventory_doc(3)), script(ran), canary=1, max_unavailable=1, revert=script(reverted),
                  admit=lambda batch: Admission((), tuple(t.name for t in batch), "router R has 1 of 2 ready")).run()
    assert ran == [] and reverted == []
    assert [(r.outcome, r.exit_code) for r in res.results] == [(Outcome.REFUSED, EXIT_BAD_INPUT)] * 3
    assert res.exit_code == EXIT_BAD_INPUT and res.aborted
    assert res.abort_reason == "router R has 1 of 2 ready; stopped before fh1; nothing was changed"


def test_a_router_that_refuses_a_later_batch_stops_there_without_rolling_back_and_exits_1():
    ran: list[str] = []
    reverted: list[str] = []
    looks = iter([Admission(("fh1",)), Admission(("fh2",)), Admission((), ("fh3",), "router R is short")])
    res = Rollout(targets_of(inventory_doc(3)), script(ran), canary=1, max_unavailable=1, revert=script(reverted),
                  admit=lambda batch: next(looks)).run()
    assert ran == ["fh1", "fh2"] and reverted == []  # a revert would take more workers out of a short router
    assert [(r.outcome, r.exit_code) for r in res.results] == [
        (Outcome.DEPLOYED, 0), (Outcome.DEPLOYED, 0), (Outcome.SKIPPED, EXIT_ERROR)]
    assert res.exit_code == EXIT_ERROR
    assert res.results[2].message == "not started: router R is short; stopped before fh3"


def test_a_shortened_batch_leaves_the_rest_to_a_batch_of_its_own_next():
    ran: list[str] = []
    looks = iter([Admission(("fh1",)), Admission(("fh2",), ("fh3",), "router R: fh3 must wait"), Admission(("fh3",)),
                  Admission(("fh4",))])
    res = Rollout(targets_of(inventory_doc(4)), script(ran), canary=1, batch="2", max_unavailable=2, forks=1,
                  admit=lambda batch: next(looks)).run()
    assert res.batches == [["fh1"], ["fh2"], ["fh3"], ["fh4"]] and ran == ["fh1", "fh2", "fh3", "fh4"]
    assert res.exit_code == 0


@pytest.mark.parametrize("max_unavailable, together", [(1, 1), (None, 2)], ids=["bounded", "unbounded"])
def test_the_rollback_of_an_aborted_rollout_takes_no_more_out_at_once_than_a_batch(max_unavailable, together):
    out, most, lock, both = [0], [0], threading.Lock(), threading.Event()

    def revert(t: Target, report) -> list[HostResult]:
        with lock:
            out[0] += 1
            most[0] = max(most[0], out[0])
            if out[0] == 2:
                both.set()
        both.wait(0.2 if max_unavailable else 10.0)
        with lock:
            out[0] -= 1
        return [HostResult(t.name, Outcome.ROLLED_BACK, 0)]

    def act(t: Target, report) -> list[HostResult]:
        failed = t.name == "fh3"
        return [HostResult(t.name, Outcome.ROLLED_BACK if failed else Outcome.DEPLOYED, 3 if failed else 0)]
    res = Rollout(targets_of(inventory_doc(3)), act, canary=0, batch="1", forks=10, revert=revert,
                  max_unavailable=max_unavailable).run()
    assert res.aborted and res.reverted == ["fh1", "fh2"] and most[0] == together


def test_a_router_that_cannot_be_read_is_a_refusal_not_a_guess():
    def unreadable(batch):
        raise ConnectionError("router down")
    ran: list[str] = []
    res = Rollout(targets_of(inventory_doc(2)), script(ran), canary=1, max_unavailable=1, admit=unreadable).run()
    assert ran == [] and res.exit_code == EXIT_BAD_INPUT
    assert "the router's workers could not be read: ConnectionError: router down" in res.abort_reason


# ---------------------------------------------------------------------------------------------
# fake hosts behind an in-memory smg, through the fleet's own router client


@pytest.fixture
def fleet_behind_smg(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_TEST_ROUTER_KEY", "k-123456")
    inv = parse_inventory(inventory_doc(3), "inv.yaml")
    fakes = [FakeHost(h, tmp_path / name) for name, h in inv.hosts.items()]
    smg = FakeSmg([f.host.base_url for f in fakes] + [FOREIGN], key="k-123456", drain_looks=0)
    routed_at_each_removal: list[int] = []
    handle = smg.handle

    def watched(request):
        answer = handle(request)
        if request.method == "DELETE":
            routed_at_each_removal.append(len(smg.routed()))
        return answer
    smg.handle = watched
    by_name = {f.host.name: f for f in fakes}

    def routers(host):
        import contextlib

        @contextlib.contextmanager
        def client():
            with smg.client(host.router, sleep=lambda s: by_name[host.name].tick()) as c:
                yield c
        return client()
    targets = [Target(f.host.name, (f.host,)) for f in fakes]
    return fakes, smg, routers, targets, routed_at_each_removal


def test_a_default_deploy_and_rollback_behind_smg_take_one_worker_out_at_a_time(fleet_behind_smg, patchset):
    fakes, smg, routers, targets, routed = fleet_behind_smg
    by_name = {f.host.name: f for f in fakes}
    policy, _ = rollout_policy(targets)
    dep = rolling_deploy(targets, patchset, DeployOptions(reconnect_s=5), connect=lambda h: by_name[h.name].session(),
                         routers=routers, policy=policy)
    assert [r.outcome for r in dep.results] == [Outcome.DEPLOYED] * 3, [r.message for r in dep.results]
    back = rolling_rollback(targets, None, DeployOptions(reconnect_s=5), routers=routers, policy=policy,
                            connect=lambda h: by_name[h.name].session())
    assert [r.outcome for r in back.results] == [Outcome.ROLLED_BACK] * 3, [r.message for r in back.results]
    assert back.batches == [["fh1"], ["fh2"], ["fh3"]]
    assert len(routed) == 6 and min(routed) == 3  # 4 workers, one out at a time


def test_a_rollback_behind_smg_with_a_foreign_worker_down_is_refused_before_any_change(fleet_behind_smg):
    fakes, smg, routers, targets, routed = fleet_behind_smg
    foreign = next(w for w in smg.workers.values() if w["url"] == FOREIGN)
    foreign.update(status="not_ready", is_healthy=False)
    by_name = {f.host.name: f for f in fakes}
    policy, _ = rollout_policy(targets)
    back = rolling_rollback(targets, None, DeployOptions(reconnect_s=5), routers=routers, policy=policy,
                            connect=lambda h: by_name[h.name].session())
    assert back.exit_code == EXIT_BAD_INPUT and [r.outcome for r in back.results] == [Outcome.REFUSED] * 3
    assert f"(not: {FOREIGN})" in back.abort_reason and "taking fh1 out would leave 2" in back.abort_reason
    assert smg.events == [] and all(f.events == [] for f in fakes)  # no host, no worker touched


def test_a_router_down_before_the_first_batch_refuses_at_once_as_preflight_does(fleet_behind_smg):
    """One look, no retry window: nothing has changed yet, and an operator is not kept waiting."""
    fakes, smg, routers, targets, _ = fleet_behind_smg
    smg.down = True
    asked: list[str] = []
    handle = smg.handle

    def counted(request):
        asked.append(f"{request.method} {request.url.path}")
        return handle(request)
    smg.handle = counted
    by_name = {f.host.name: f for f in fakes}
    back = rolling_rollback(targets, None, DeployOptions(reconnect_s=5), routers=routers,
                            policy=rollout_policy(targets)[0], connect=lambda h: by_name[h.name].session())
    assert back.exit_code == EXIT_BAD_INPUT and "the router's workers could not be read" in back.abort_reason
    assert asked == ["GET /workers"] and all(f.events == [] for f in fakes)


# ---------------------------------------------------------------------------------------------
# the command line: checked before anything connects


@pytest.fixture
def inv_file(tmp_path) -> Path:
    p = tmp_path / "inv.yaml"
    p.write_text(yaml.safe_dump(inventory_doc(3, router=None)))
    return p


@pytest.mark.parametrize("command, flags, says", [
    ("rollback", ["--max-unavailable", "0"], "--max-unavailable must be a number of targets"),
    ("rollback", ["--max-unavailable", "-1"], "--max-unavailable must be a number of targets"),
    ("deploy", ["--max-unavailable", "0%"], "--max-unavailable must be a number of targets"),
    ("deploy", ["--max-unavailable", "150%"], "--max-unavailable must be a number of targets"),
    ("deploy", ["--canary", "2"], "--canary 2 would take 2 targets out of service at once"),
])
def test_a_bad_max_unavailable_is_exit_2_before_any_connection(inv_file, monkeypatch, command, flags, says):
    tried: list[str] = []
    monkeypatch.setattr(HostConnection, "open", lambda self: tried.append(self.host.name))
    r = CliRunner().invoke(app, [command, "-i", str(inv_file), "--yes", *flags], catch_exceptions=False)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and says in errors[0], r.stdout + r.stderr
    assert tried == [] and "Traceback" not in r.stderr
