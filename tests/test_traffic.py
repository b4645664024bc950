"""The live-traffic phases on fake hosts (fast tier): the router (an in-memory smg control plane,
ddtree_ops/testing/fake_router.py) and the performance gate's decisions. The measurements are
given per serving unit here; the real workload runs against stand-in servers in the sandbox
tests (test_live_traffic.py)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest

from ddtree_ops.errors import DeployFailed, PreflightError
from ddtree_ops.fleet.actions import rolling_deploy
from ddtree_ops.fleet.rollout import Target
from ddtree_ops.fleet.routing import router_for
from ddtree_ops.gates.router import SmgRouter
from ddtree_ops.gates.workload import Measurement
from ddtree_ops.runbook import traffic
from ddtree_ops.runbook.deploy import deploy_host
from ddtree_ops.runbook.phases import DeployOptions
from ddtree_ops.runbook.results import Outcome
from ddtree_ops.runbook.rollback import rollback_host
from ddtree_ops.testing.fake_host import DFLASH_UNIT, FakeHost, fake_hosts
from ddtree_ops.testing.fake_router import FakeSmg

ROUTER = {"url": "http://router.test:30000", "admin_key_env": "DDTREE_TEST_ROUTER_KEY"}
# One workload (concurrency set at the top: the operator described theirs), as before `workloads`.
GATE = {"duration_s": 1, "min_requests": 1, "concurrency": 4}


def m(tps: float, ttft: float = 0.05, accept: float | None = 3.0, errors: int = 0) -> Measurement:
    n = 40
    return Measurement(requests=n, errors=errors, output_tokens=int(tps * 10), wall_s=10.0, ttft_p50_s=ttft,
                       ttft_p99_s=ttft * 2, itl_p50_s=0.01, itl_p99_s=0.02, accept_length=accept)


@pytest.fixture
def speeds(monkeypatch):
    """Which measurement the gate gets, by the unit serving on the measured host; `calls` lists them."""
    table: dict[str, Measurement] = {}
    calls: list[str] = []

    def install(fake):
        def fake_measure(client, workload, **kw):
            unit = fake.serving_unit()
            calls.append(unit)
            return table[unit]
        monkeypatch.setattr(traffic, "measure", fake_measure)
        return table
    install.calls = calls
    return install


@dataclass
class Routed:
    """A fake host behind an in-memory smg. The router's client is built beside the host's session,
    as the fleet builds it (fleet/routing.py), and handed to the runbook."""

    fake: FakeHost
    smg: FakeSmg

    def router(self) -> SmgRouter:
        return self.smg.client(self.fake.host.router, sleep=lambda s: self.fake.tick())

    def deploy(self, ps, *, with_router: bool = True):
        return deploy_host(self.fake.session(), ps, DeployOptions(reconnect_s=5),
                           router=self.router() if with_router else None)


@pytest.fixture
def routed(tmp_path, monkeypatch) -> Routed:
    monkeypatch.setenv("DDTREE_TEST_ROUTER_KEY", "k-123456")
    fake = fake_hosts(tmp_path / "h", router=ROUTER)[0]
    return Routed(fake, FakeSmg([fake.host.base_url, "http://10.0.0.99:30000"], key="k-123456"))


def record(fake, rid: str) -> dict:
    """The host's release record of `rid`, as `history` reads it."""
    return next(r for r in fake.session().store.history()["releases"] if r["id"] == rid)


def test_the_worker_leaves_the_router_before_the_old_server_stops_and_is_routed_again_after_the_gate(routed, patchset):
    fake = routed.fake
    routed.smg.events = fake.events  # one timeline: the router's changes among the host's
    r = routed.deploy(patchset)
    assert r.outcome == Outcome.DEPLOYED
    ev, url = fake.events, fake.host.base_url
    gate = max(i for i, e in enumerate(ev) if e == "http POST /generate" and i < ev.index(f"register {url}"))
    assert ev.index(f"deregister {url}") < ev.index(f"systemctl stop {DFLASH_UNIT}")
    assert ev.index(f"systemctl restart {fake.host.unit}") < gate < ev.index(f"register {url}")
    assert ev.index(f"register {url}") < ev.index("agent set_current")  # routed before the commit
    assert sorted(routed.smg.routed()) == sorted([url, "http://10.0.0.99:30000"])
    steps = [s["step"] for s in r.steps]
    assert steps.index("health gate") < steps.index("register") < steps.index("committed")


def test_the_router_is_reached_only_through_the_client_handed_to_the_runbook(routed, patchset):
    """The host's session holds no router: without a client the same deploy never touches smg
    (the control of the test above)."""
    r = routed.deploy(patchset, with_router=False)
    assert r.outcome == Outcome.DEPLOYED
    assert routed.smg.events == [] and "register" not in [s["step"] for s in r.steps]


def test_a_deploy_that_fails_after_leaving_the_router_puts_the_restored_server_back_in_it(routed, versioned_patchset):
    from ddtree_ops.testing.fake_host import FAKE_CRASH

    ps = versioned_patchset(marker=b"\n# " + FAKE_CRASH + b"\n")
    with pytest.raises(DeployFailed):
        routed.deploy(ps)
    url = routed.fake.host.base_url
    assert routed.smg.events == [f"deregister {url}", f"register {url}"]
    assert url in routed.smg.routed()
    assert routed.fake.units[DFLASH_UNIT].active == "active"


def test_an_unreachable_router_or_a_missing_key_refuses_before_anything_changes(routed, patchset, monkeypatch):
    routed.smg.down = True
    with pytest.raises(PreflightError, match="router http://router.test:30000"):
        routed.deploy(patchset)
    routed.smg.down = False
    monkeypatch.delenv("DDTREE_TEST_ROUTER_KEY")
    with pytest.raises(PreflightError, match="DDTREE_TEST_ROUTER_KEY"):
        routed.deploy(patchset)
    assert not [e for e in routed.fake.events if e.startswith(("agent install", "systemctl stop"))]
    assert routed.smg.events == []


def test_a_rollback_takes_the_worker_out_drains_and_puts_it_back(routed, patchset):
    routed.deploy(patchset)
    routed.smg.events.clear()
    r = rollback_host(routed.fake.session(), None, DeployOptions(reconnect_s=5), router=routed.router())
    assert r.outcome == Outcome.ROLLED_BACK
    url = routed.fake.host.base_url
    assert routed.smg.events == [f"deregister {url}", f"register {url}"]
    assert url in routed.smg.routed()


def test_the_inventorys_router_client_is_built_by_the_fleet_and_none_without_a_router(tmp_path):
    with router_for(fake_hosts(tmp_path / "plain")[0].host) as none:
        assert none is None
    with router_for(fake_hosts(tmp_path / "routed", router=ROUTER)[0].host) as client:
        assert isinstance(client, SmgRouter) and client.settings.url == ROUTER["url"]


@pytest.mark.parametrize("with_router", [True, False])
def test_a_rolling_deploy_hands_each_host_the_router_client_its_routers_build(routed, patchset, with_router):
    """The fleet builds the client beside the host's session and closes it after the host's run;
    a factory yielding no client (the control) leaves the router untouched."""
    opened: list[str] = []

    @contextlib.contextmanager
    def routers(host):
        if not with_router:
            yield None
            return
        opened.append(host.name)
        with routed.router() as client:
            yield client
        opened.append("closed")

    fake = routed.fake
    result = rolling_deploy([Target(fake.host.name, (fake.host,))], patchset, DeployOptions(reconnect_s=5),
                            connect=lambda host: fake.session(), routers=routers)
    assert [r.outcome for r in result.results] == [Outcome.DEPLOYED]
    url = fake.host.base_url
    assert routed.smg.events == ([f"deregister {url}", f"register {url}"] if with_router else [])
    assert opened == ([fake.host.name, "closed"] if with_router else [])


def gated(tmp_path, **vars):
    return fake_hosts(tmp_path / "h", perf_gate=GATE, **vars)[0]


def test_a_slower_canary_fails_the_gate_is_rolled_back_and_the_numbers_are_kept(tmp_path, patchset, speeds):
    fake = gated(tmp_path)
    table = speeds(fake)
    table[DFLASH_UNIT], table[fake.host.unit] = m(200.0), m(120.0)
    with pytest.raises(DeployFailed) as ei:
        deploy_host(fake.session(), patchset, DeployOptions(reconnect_s=5))
    r = ei.value.result
    assert r.outcome == Outcome.ROLLED_BACK and r.failed_step == "perf gate"
    assert "output tok/s 200.0 → 120.0" in r.message and r.perf_gate["verdict"] == "fail"
    assert fake.units[DFLASH_UNIT].active == "active"
    rec = record(fake, r.release)
    assert rec["perf_gate"]["verdict"] == "fail" and rec["perf_gate"]["canary"]["output_tps"] == 120.0
    assert speeds.calls == [DFLASH_UNIT, fake.host.unit]  # baseline before the change, canary after


def test_an_unchanged_speed_passes_and_the_verdict_is_in_the_release_record(tmp_path, patchset, speeds):
    fake = gated(tmp_path)
    table = speeds(fake)
    table[DFLASH_UNIT], table[fake.host.unit] = m(200.0), m(204.0)
    r = deploy_host(fake.session(), patchset, DeployOptions(reconnect_s=5))
    assert r.outcome == Outcome.DEPLOYED and r.perf_gate["verdict"] == "pass"
    assert record(fake, r.release)["perf_gate"]["baseline"]["output_tps"] == 200.0


@pytest.mark.parametrize("marginal, answer, deployed", [
    ("fail", None, False),
    ("accept", None, True),
    ("ask", True, True),
    ("ask", False, False),
])
def test_a_marginal_verdict_fails_unless_accepted_or_the_operator_says_yes(tmp_path, patchset, speeds, marginal,
                                                                           answer, deployed):
    fake = gated(tmp_path)
    table = speeds(fake)
    table[DFLASH_UNIT], table[fake.host.unit] = m(200.0), m(190.0)  # −5 %: marginal (3..10 %)
    asked: list[str] = []

    def ask(q: str) -> bool:
        asked.append(q)
        return bool(answer)
    opts = DeployOptions(reconnect_s=5, marginal=marginal, ask=ask)
    if deployed:
        assert deploy_host(fake.session(), patchset, opts).outcome == Outcome.DEPLOYED
    else:
        with pytest.raises(DeployFailed, match="marginal"):
            deploy_host(fake.session(), patchset, opts)
    assert len(asked) == (1 if marginal == "ask" else 0)
    assert not asked or "marginal" in asked[0]


def test_a_peer_not_yet_updated_is_measured_side_by_side_and_a_canary_slower_than_it_fails(tmp_path, patchset,
                                                                                          speeds):
    fake = gated(tmp_path)
    table = speeds(fake)
    table[DFLASH_UNIT], table[fake.host.unit] = m(200.0), m(205.0)  # as fast as its own baseline...
    peers: list[str] = []

    def peer(name: str, workload) -> Measurement:
        peers.append(name)
        return m(300.0)  # ...but the fleet's present is faster
    with pytest.raises(DeployFailed) as ei:
        deploy_host(fake.session(), patchset, DeployOptions(reconnect_s=5, peer_measure=peer))
    assert peers == [fake.host.name]
    assert ei.value.result.perf_gate["peers"]["output_tps"] == 300.0


def test_without_a_baseline_or_a_peer_the_canary_figures_are_recorded_and_the_gate_says_why_it_passed(
        tmp_path, patchset, speeds):
    fake = gated(tmp_path)
    fake.units[DFLASH_UNIT].active = "inactive"  # nothing serves before the change
    table = speeds(fake)
    table[fake.host.unit] = m(150.0)
    r = deploy_host(fake.session(), patchset, DeployOptions(reconnect_s=5))
    assert r.outcome == Outcome.DEPLOYED
    assert r.perf_gate["baseline"] is None and "no baseline" in r.perf_gate["reasons"][0]
    assert speeds.calls == [fake.host.unit]


def test_no_perf_gate_on_the_command_line_skips_an_inventory_gate(tmp_path, patchset, speeds):
    fake = gated(tmp_path)
    speeds(fake)
    r = deploy_host(fake.session(), patchset, DeployOptions(reconnect_s=5, perf_gate=False))
    assert r.outcome == Outcome.DEPLOYED and r.perf_gate is None and speeds.calls == []


# -- several workloads -------------------------------------------------------------------------------

@pytest.fixture
def by_case(monkeypatch):
    """Which measurement the gate gets, by the unit serving on the measured host and the workload's
    label; `calls` lists (unit, label) in order."""
    table: dict[tuple[str, str], Measurement] = {}
    calls: list[tuple[str, str]] = []

    def install(fake):
        def fake_measure(client, workload, **kw):
            key = (fake.serving_unit(), workload.label)
            calls.append(key)
            return table[key]
        monkeypatch.setattr(traffic, "measure", fake_measure)
        return table
    install.calls = calls
    return install


def two_cases(tmp_path):
    """A host whose perf_gate names no workload: the default two, today's case and batch-1 greedy."""
    return fake_hosts(tmp_path / "h", perf_gate={"duration_s": 1, "min_requests": 1})[0]


def test_by_default_both_workloads_are_measured_before_and_after_and_the_worst_verdict_wins_naming_it(
        tmp_path, patchset, by_case):
    fake = two_cases(tmp_path)
    table = by_case(fake)
    new = fake.host.unit
    table[DFLASH_UNIT, "c4 T0.7"], table[new, "c4 T0.7"] = m(200.0), m(204.0)  # batch 4: as fast
    table[DFLASH_UNIT, "c1 T0"], table[new, "c1 T0"] = m(80.0), m(50.0)  # batch 1 greedy: the tree loses
    with pytest.raises(DeployFailed) as ei:
        deploy_host(fake.session(), patchset, DeployOptions(reconnect_s=5))
    r = ei.value.result
    assert by_case.calls == [(DFLASH_UNIT, "c4 T0.7"), (DFLASH_UNIT, "c1 T0"), (new, "c4 T0.7"), (new, "c1 T0")]
    assert r.outcome == Outcome.ROLLED_BACK and r.failed_step == "perf gate"
    assert "fail on c1 T0 (c4 T0.7 pass, c1 T0 fail): output tok/s 80.0 → 50.0" in r.message, r.message
    g = r.perf_gate
    # The top level is the deciding workload's, in the shape consumers read; each workload's is kept.
    assert g["verdict"] == "fail" and g["workload"]["label"] == "c1 T0" and g["canary"]["output_tps"] == 50.0
    assert g["reasons"][0].startswith("c1 T0: output tok/s 80.0 → 50.0")
    assert [(w["workload"]["label"], w["verdict"]) for w in g["workloads"]] == [("c4 T0.7", "pass"), ("c1 T0", "fail")]
    assert (g["workloads"][1]["workload"]["concurrency"], g["workloads"][1]["workload"]["temperature"]) == (1, 0.0)
    assert record(fake, r.release)["perf_gate"]["workloads"][0]["canary"]["output_tps"] == 204.0


def test_when_every_workload_passes_the_record_is_the_first_workloads_and_the_baselines_read_back(
        tmp_path, patchset, by_case):
    fake = two_cases(tmp_path)
    table = by_case(fake)
    new = fake.host.unit
    table[DFLASH_UNIT, "c4 T0.7"], table[new, "c4 T0.7"] = m(200.0), m(204.0)
    table[DFLASH_UNIT, "c1 T0"], table[new, "c1 T0"] = m(80.0), m(81.0)
    r = deploy_host(fake.session(), patchset, DeployOptions(reconnect_s=5))
    assert r.outcome == Outcome.DEPLOYED
    g = record(fake, r.release)["perf_gate"]
    assert g["verdict"] == "pass" and g["workload"]["label"] == "c4 T0.7" and g["baseline"]["output_tps"] == 200.0
    # Each workload's baseline, as the record keeps it, is the measurement taken before the change.
    assert [Measurement.from_dict(w["baseline"]) for w in g["workloads"]] == [table[DFLASH_UNIT, "c4 T0.7"],
                                                                              table[DFLASH_UNIT, "c1 T0"]]
    gate_steps = [s["detail"] for s in r.steps if s["step"] == "perf gate"]
    assert gate_steps[-1].startswith("pass on every workload (c4 T0.7 pass, c1 T0 pass): c4 T0.7 output tok/s "
                                     "200.0 → 204.0 (+2.0 %); c1 T0 output tok/s 80.0 → 81.0"), gate_steps


def test_a_marginal_workload_beside_a_passing_one_makes_the_gate_marginal(tmp_path, patchset, by_case):
    fake = two_cases(tmp_path)
    table = by_case(fake)
    new = fake.host.unit
    table[DFLASH_UNIT, "c4 T0.7"], table[new, "c4 T0.7"] = m(200.0), m(190.0)  # −5 %: marginal
    table[DFLASH_UNIT, "c1 T0"], table[new, "c1 T0"] = m(80.0), m(81.0)
    with pytest.raises(DeployFailed, match="marginal on c4 T0.7") as ei:
        deploy_host(fake.session(), patchset, DeployOptions(reconnect_s=5, marginal="fail"))
    assert ei.value.result.perf_gate["verdict"] == "marginal"


def test_each_workloads_peer_is_measured_with_that_workload_beside_its_canary(tmp_path, patchset, by_case):
    fake = two_cases(tmp_path)
    table = by_case(fake)
    new = fake.host.unit
    for label, tps in (("c4 T0.7", 200.0), ("c1 T0", 80.0)):
        table[DFLASH_UNIT, label], table[new, label] = m(tps), m(tps)
    asked: list[str] = []

    def peer(name: str, workload) -> Measurement:
        asked.append(workload.label)
        return m(300.0) if workload.label == "c1 T0" else m(200.0)  # the fleet is faster at batch 1 only
    with pytest.raises(DeployFailed) as ei:
        deploy_host(fake.session(), patchset, DeployOptions(reconnect_s=5, peer_measure=peer))
    assert asked == ["c4 T0.7", "c1 T0"]
    g = ei.value.result.perf_gate
    assert g["workload"]["label"] == "c1 T0" and g["peers"]["output_tps"] == 300.0
    assert "c1 T0: output tok/s peers 300.0 → canary 80.0" in g["reasons"][0]


def _judged(label: str, verdict: str | None, **w) -> traffic.Judged:
    from ddtree_ops.config.workload_settings import Workload
    from ddtree_ops.gates.perfgate import compare

    workload = Workload(name=label, **w)
    if verdict is None:
        return traffic.Judged(workload, None, {"verdict": "pass", "baseline": None, "canary": m(10.0).as_dict(),
                                               "peers": None, "rows": [], "reasons": ["nothing to compare with"]})
    canary = {"pass": 200.0, "marginal": 190.0, "fail": 100.0}[verdict]
    v = compare(m(200.0), m(canary))
    assert v.verdict.value == verdict
    return traffic.Judged(workload, v, v.as_dict())


@pytest.mark.parametrize("verdicts, deciding, overall", [
    (["pass", "pass"], "a", "pass"),  # a tie: the first
    (["marginal", "fail", "marginal"], "b", "fail"),
    (["marginal", "pass", "marginal"], "a", "marginal"),
    ([None, "marginal"], "b", "marginal"),  # nothing to compare with counts as a pass
    ([None, None], "a", "pass"),
])
def test_the_worst_verdict_wins_the_first_of_the_worst_on_a_tie(verdicts, deciding, overall):
    names = "abc"[:len(verdicts)]
    judged = [_judged(name, v, concurrency=i + 1) for i, (name, v) in enumerate(zip(names, verdicts, strict=True))]
    verdict, rec, summary = traffic.worst_of(judged)
    assert verdict.value == overall and rec["verdict"] == overall and rec["workload"]["label"] == deciding
    assert summary.startswith(f"{overall} on {deciding}" if overall != "pass" else "pass on every workload")
    assert [w["workload"]["label"] for w in rec["workloads"]] == list("abc"[:len(verdicts)])
    assert all(r.split(": ", 1)[0] in "abc" for r in rec["reasons"])  # each reason names its workload
    if overall != "pass":
        assert rec["reasons"][0].startswith(f"{deciding}: ")


def test_one_workload_keeps_the_record_and_summary_it_always_had():
    j = _judged("only", "fail")
    verdict, rec, summary = traffic.worst_of([j])
    assert summary == j.verdict.summary() and rec["reasons"] == list(j.verdict.reasons)
    assert rec["workload"]["label"] == "only" and len(rec["workloads"]) == 1


def test_a_lone_baseline_is_the_first_workloads_and_a_wrong_count_is_a_bug():
    b = m(1.0)
    assert traffic._baselines(b, 2) == (b, None) and traffic._baselines(None, 2) == (None, None)
    with pytest.raises(ValueError, match="1 baseline measurements for 2 workloads"):
        traffic._baselines([b], 2)
