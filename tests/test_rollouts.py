"""Rollouts as first-class objects, on fake hosts and pure records: one id per run on every host
it touches, the listing from the hosts' records, `rollback --rollout` choosing what to undo,
`promote` choosing where to continue, and `status` comparing each host with the inventory."""

from __future__ import annotations

import dataclasses
import re

import pytest

from ddtree_ops.artifacts.units import render_unit
from ddtree_ops.errors import InputError
from ddtree_ops.fleet.actions import rolling_deploy, rolling_rollback
from ddtree_ops.fleet.config_drift import Expected, Running, compare, flag_difference
from ddtree_ops.fleet.rollout import Rollout, Target
from ddtree_ops.fleet.rollout_id import is_rollout_id, new_rollout_id
from ddtree_ops.fleet.rollouts import (
    HostRecords,
    Kind,
    SourceGiven,
    check_same_source,
    find_rollout,
    list_rollouts,
    promote_selection,
    read_records,
    undo_selection,
)
from ddtree_ops.runbook.options import DeployOptions
from ddtree_ops.runbook.results import HostResult, Outcome
from ddtree_ops.runbook.rollback import UndoRollout, releases_of_rollout
from ddtree_ops.testing.fake_host import fake_hosts

# ---------------------------------------------------------------------------------------------
# ids


def test_a_rollout_id_is_sortable_by_time_and_unique():
    ids = [new_rollout_id() for _ in range(50)]
    assert all(re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{6}", i) and is_rollout_id(i) for i in ids)
    assert len(set(ids)) == 50
    for bad in ("20261202T015500Z-1A2B3C", "20261202T015500Z-1a2b3", "latest", "", "20261202T015500Z-1a2b3c\n"):
        assert not is_rollout_id(bad), bad


# ---------------------------------------------------------------------------------------------
# deploy and rollback on fake hosts: the records


@pytest.fixture
def fleet3(tmp_path):
    fakes = fake_hosts(tmp_path / "hosts", 3)
    by_name = {f.host.name: f for f in fakes}
    return fakes, (lambda h: by_name[h.name].session())


def _targets(fakes):
    return [Target(f.host.name, (f.host,)) for f in fakes]


def _deploy(fakes, connect, ps, **opts):
    rid = new_rollout_id()
    res = rolling_deploy(_targets(fakes), ps, DeployOptions(reconnect_s=5, rollout_id=rid, **opts), connect=connect)
    return rid, res


def _records(fakes, connect):
    return read_records([f.host for f in fakes], connect)


def test_one_deploy_records_one_rollout_id_on_every_host_and_in_its_result(fleet3, patchset):
    fakes, connect = fleet3
    rid, res = _deploy(fakes, connect, patchset)
    assert res.exit_code == 0 and res.rollout_id == rid and res.to_dict()["rollout_id"] == rid
    per_host = {r.host: r.history["releases"][-1] for r in _records(fakes, connect)}
    assert {rel["rollout"] for rel in per_host.values()} == {rid}
    assert len({rel["id"] for rel in per_host.values()}) == 3  # release ids differ; the rollout id does not
    listing = list_rollouts(_records(fakes, connect))
    assert [(i.id, i.kind, sorted(i.hosts)) for i in listing] == [(rid, Kind.DEPLOY, ["fh1", "fh2", "fh3"])]


def test_rollback_of_a_rollout_restores_each_host_and_leaves_untouched_ones_alone(fleet3, versioned_patchset):
    fakes, connect = fleet3
    first, _ = _deploy(fakes, connect, versioned_patchset("1.0.0"))
    before = {r.host: r.history["current"] for r in _records(fakes, connect)}
    second, res = _deploy(fakes[:2], connect, versioned_patchset("2.0.0", b"v2"))
    assert res.exit_code == 0
    targets, notes = undo_selection(_targets(fakes), _records(fakes, connect),
                                    find_rollout(_records(fakes, connect), second))
    assert [t.name for t in targets] == ["fh1", "fh2"]
    assert notes == [f"fh3: left alone: rollout {second} never changed it"]

    undo = DeployOptions(reconnect_s=5, rollout_id=new_rollout_id())
    back = rolling_rollback(targets, UndoRollout(second), undo, connect=connect)
    assert back.exit_code == 0 and back.rollout_id == undo.rollout_id
    after = {r.host: r.history["current"] for r in _records(fakes, connect)}
    assert after == before  # fh1, fh2 on the first rollout's release again; fh3 never moved

    listing = list_rollouts(_records(fakes, connect))
    assert [(i.id, i.kind) for i in listing] == [(undo.rollout_id, Kind.ROLLBACK), (second, Kind.DEPLOY),
                                                (first, Kind.DEPLOY)]
    assert sorted(listing[0].hosts) == ["fh1", "fh2"]
    # Undone: nothing of it is left to undo, and a deploy rollout is not a rollback one.
    again, notes = undo_selection(_targets(fakes), _records(fakes, connect), listing[1])
    assert again == [] and len(notes) == 3
    with pytest.raises(InputError, match="is a rollback, not a deploy"):
        find_rollout(_records(fakes, connect), undo.rollout_id)


def test_an_aborted_deploys_own_revert_is_part_of_that_rollout_not_a_rollback_of_its_own(tmp_path, patchset):
    fakes = fake_hosts(tmp_path / "hosts", 2)
    by_name = {f.host.name: f for f in fakes}
    fakes[1].host = dataclasses.replace(fakes[1].host, min_free_mb=10 ** 9)  # its preflight refuses: no disk
    targets = _targets(fakes)
    rid = new_rollout_id()
    res = rolling_deploy(targets, patchset, DeployOptions(reconnect_s=5, rollout_id=rid), canary=1, max_fail="0%",
                         connect=lambda h: by_name[h.name].session())
    assert res.aborted and res.reverted == ["fh1"], res.to_dict()
    listing = list_rollouts(_records(fakes, lambda h: by_name[h.name].session()))
    assert [(i.id, i.kind) for i in listing] == [(rid, Kind.DEPLOY)]
    assert [p.on_chain for p in listing[0].parts] == [False]


def _hist(*rels, current):
    return {"releases": [{"backup_present": True, **r} for r in rels], "current": current}


def test_the_release_before_a_rollout_is_found_through_later_releases():
    h = _hist({"id": "r1", "previous": None, "rollout": "A"}, {"id": "r2", "previous": "r1", "rollout": "B"},
              {"id": "r3", "previous": "r2", "rollout": "C"}, current="r3")
    assert releases_of_rollout(h, "B", "h") == ["r3", "r2"]  # back to r1
    assert releases_of_rollout(h, "A", "h") == ["r3", "r2", "r1"]  # back to the upstream files
    with pytest.raises(InputError, match="never changed this host"):
        releases_of_rollout(h, "Z", "h")
    gone = _hist({"id": "r1", "previous": None, "rollout": "A"},
                 {"id": "r2", "previous": "r1", "rollout": "B", "outcome": "rolled back"}, current="r1")
    with pytest.raises(InputError, match="no longer current"):
        releases_of_rollout(gone, "B", "h")
    pruned = _hist({"id": "r1", "previous": None, "rollout": "A"}, current="r1")
    pruned["releases"][0]["backup_present"] = False
    with pytest.raises(InputError, match="pruned"):
        releases_of_rollout(pruned, "A", "h")


def test_an_unknown_or_malformed_rollout_id_is_refused_naming_it():
    records = [HostRecords("h1", _hist({"id": "r1", "rollout": "20261202T010000Z-aaaaaa", "created": 1},
                                       current="r1"))]
    assert find_rollout(records, "20261202T010000Z-aaaaaa").hosts == ["h1"]
    with pytest.raises(InputError, match="rollout 20261202T010000Z-bbbbbb: no selected host records it"):
        find_rollout(records, "20261202T010000Z-bbbbbb")
    with pytest.raises(InputError, match="not a rollout id"):
        find_rollout(records, "../etc")
    with pytest.raises(InputError, match=r"not read: h2"):
        find_rollout([*records, HostRecords("h2", None, "cannot reach")], "20261202T010000Z-bbbbbb")


def test_a_record_edited_by_hand_does_not_stop_the_listing():
    a, b = "20261202T010000Z-aaaaaa", "20261202T020000Z-bbbbbb"
    good = _hist({"id": "r1", "rollout": a, "created": 100.0}, {"id": "r2", "previous": "r1", "rollout": b,
                                                                  "created": 200.0}, current="r2")
    assert [i.id for i in list_rollouts([HostRecords("h1", good)])] == [b, a]  # newest first
    odd = _hist({"id": "r1", "rollout": a, "created": "yesterday"},
                {"id": "r2", "rollout": b, "created": None, "rollback_rollout": a, "rolled_back_at": [1]},
                current="r2")
    listing = list_rollouts([HostRecords("h1", odd)])
    assert sorted((i.id, str(i.kind)) for i in listing) == [(a, "deploy"), (a, "rollback"), (b, "deploy")]
    assert all(p.at == 0.0 for i in listing for p in i.parts)


# ---------------------------------------------------------------------------------------------
# stop after the canary, then promote


def _ok(t: Target, report) -> list[HostResult]:
    return [HostResult(h.name, Outcome.DEPLOYED, 0) for h in t.hosts]


def test_stop_after_canary_runs_the_canary_only_and_exits_0(fleet3):
    fakes, _ = fleet3
    res = Rollout(_targets(fakes), _ok, canary=1, stop_after_canary=True, rollout_id="R").run()
    assert [str(r.outcome) for r in res.results] == ["deployed", "skipped", "skipped"]
    assert res.exit_code == 0 and res.stopped_after_canary and not res.aborted
    full = Rollout(_targets(fakes), _ok, canary=1).run()
    assert [str(r.outcome) for r in full.results] == ["deployed"] * 3 and not full.stopped_after_canary


def test_promote_continues_on_the_hosts_the_rollout_has_not_reached(fleet3, patchset):
    fakes, connect = fleet3
    rid, res = _deploy(fakes, connect, patchset, stop_after_canary=True, overrides={"budget": 8})
    assert res.stopped_after_canary and [str(r.outcome) for r in res.results] == ["deployed", "skipped", "skipped"]
    info = find_rollout(_records(fakes, connect), rid)
    assert info.args["overrides"] == {"budget": 8} and info.hosts == ["fh1"]
    rest, notes = promote_selection(_targets(fakes), info)
    assert [t.name for t in rest] == ["fh2", "fh3"] and notes == [f"fh1: already on rollout {rid}"]
    check_same_source(info, SourceGiven(None, patchset.digest(), patchset.label))
    with pytest.raises(InputError, match="differs"):
        check_same_source(info, SourceGiven(None, "0" * 64, "other-1.0.0"))
    with pytest.raises(InputError, match="without a bundle"):
        check_same_source(info, SourceGiven("b-1", patchset.digest(), patchset.label))

    promoted = rolling_deploy(rest, patchset, DeployOptions(reconnect_s=5, rollout_id=rid), canary=0,
                              connect=connect)
    assert promoted.exit_code == 0
    info = find_rollout(_records(fakes, connect), rid)
    assert sorted(info.hosts) == ["fh1", "fh2", "fh3"]
    assert promote_selection(_targets(fakes), info)[0] == []


def test_promote_is_refused_once_a_host_of_the_rollout_left_its_release(fleet3, patchset):
    fakes, connect = fleet3
    rid, _ = _deploy(fakes[:1], connect, patchset, stop_after_canary=True)
    rolling_rollback(_targets(fakes[:1]), UndoRollout(rid), DeployOptions(reconnect_s=5), connect=connect)
    with pytest.raises(InputError, match="is rolled back, not deployed"):
        promote_selection(_targets(fakes), find_rollout(_records(fakes, connect), rid))


def test_promote_of_a_bundle_rollout_needs_that_bundle():
    records = [HostRecords("h1", _hist({"id": "r1", "rollout": "20261202T010000Z-aaaaaa", "bundle": "ps-1-abc",
                                        "patchset_digest": "d" * 64, "outcome": "deployed"}, current="r1"))]
    info = find_rollout(records, "20261202T010000Z-aaaaaa")
    check_same_source(info, SourceGiven("ps-1-abc", "d" * 64, "ps-1"))
    for given in (SourceGiven("ps-2-def", "d" * 64, "ps-2"), SourceGiven(None, "d" * 64, "ps-1")):
        with pytest.raises(InputError, match="deployed bundle ps-1-abc"):
            check_same_source(info, given)


# ---------------------------------------------------------------------------------------------
# status against the inventory


def _running(host, **kw):
    text = render_unit(host)
    base = dict(release="r1", patchset="ps-1.0.0", patchset_digest="d" * 64, bundle=None, budget=host.budget,
                topk_cap=host.topk_cap, active_unit=host.unit, unit_text=text)
    return Running(**{**base, **kw})


def test_status_reports_each_field_that_differs_from_the_inventory(tmp_path):
    host = fake_hosts(tmp_path, 1)[0].host
    assert compare(host, _running(host)) == []
    budget10 = render_unit(dataclasses.replace(host, budget=10))
    drift = compare(host, _running(host, budget=10, unit_text=budget10))
    assert [(d.field, d.inventory, d.host) for d in drift] == [("budget", 16, 10)]  # flags not counted twice
    topk2 = render_unit(dataclasses.replace(host, topk_cap=2))
    assert [d.field for d in compare(host, _running(host, topk_cap=2, unit_text=topk2))] == ["topk_cap"]
    other = compare(host, _running(host, active_unit="sglang-dflash.service"))
    assert [(d.field, d.host) for d in other] == [("unit", "sglang-dflash.service")]
    extra = render_unit(dataclasses.replace(host, extra_args=(*host.extra_args, "--mem-fraction-static", "0.8")))
    flags = compare(host, _running(host, unit_text=extra))
    assert [(d.field, d.inventory, d.host) for d in flags] == [("flags", [], ["--mem-fraction-static", "0.8"])]
    assert flags[0].brief() == "flags: the host's unit adds --mem-fraction-static 0.8 (against the inventory's)"
    assert compare(host, _running(host, release=None, budget=10)) == []  # not deployed yet: nothing to compare
    want = Expected("ps-2.0.0", "e" * 64)
    assert [(d.field, d.inventory, d.host) for d in compare(host, _running(host), want)] == [
        ("patchset", "ps-2.0.0", "ps-1.0.0")]
    assert compare(host, _running(host), Expected("ps-1.0.0", "d" * 64)) == []


def test_flag_difference_counts_repeated_words():
    assert flag_difference(["a", "b", "b"], ["a", "b"]) == (["b"], [])
    assert flag_difference(["a"], ["a", "c"]) == ([], ["c"])
    assert flag_difference(["x"], ["x"]) == ([], [])
