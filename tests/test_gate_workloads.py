"""The gate between servers named by URL (gates/url_gate.py, `ddtree-ops gate`) over several
workloads, fast tier: each workload measured on every server side by side, one after the other,
the worst deciding and named, the bound summed, and the command taking an inventory's workloads.
The measurements are given per server and workload (a fake `measure`); the probe answers through
a MockTransport. Real servers: tests/test_gate_cli.py."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from ddtree_ops.cli.commands import app
from ddtree_ops.config.perfgate_settings import Thresholds
from ddtree_ops.config.workload_settings import DEFAULT_WORKLOADS, Workload
from ddtree_ops.errors import NoVerdict
from ddtree_ops.gates import url_gate
from ddtree_ops.gates.gate_service import AllowList, GateService
from ddtree_ops.gates.perfgate import Verdict
from ddtree_ops.gates.url_gate import GateRequest, GateSettings, bound_s, run_bound_s, run_gate
from ddtree_ops.gates.workload import STOP_GRACE_S, Measurement
from ddtree_ops.testing.fake_host import fake_inventory

BASE, CANARY = "http://10.200.0.1:30000", "http://10.200.0.2:30000"
TWO = (Workload(duration_s=1, request_timeout_s=5), Workload(concurrency=1, temperature=0.0, duration_s=1,
                                                              request_timeout_s=5))
HEALTHY = httpx.MockTransport(lambda request: httpx.Response(200, json={}))


def m(tps: float, ok: bool = True) -> Measurement:
    return Measurement(requests=20, errors=0 if ok else 20, output_tokens=int(tps * 10) if ok else 0, wall_s=10.0,
                       ttft_p50_s=0.05, ttft_p99_s=0.1, itl_p50_s=0.01, itl_p99_s=0.02, accept_length=3.0)


@pytest.fixture
def speeds(monkeypatch):
    """{(url, workload label): Measurement} the gate gets; `calls` lists (url, label) as measured."""
    class Table(dict):
        calls: list[tuple[str, str]]

    table = Table()
    table.calls = []

    def fake_measure(client: httpx.Client, workload: Workload, **kw: Any) -> Measurement:
        key = (str(client.base_url).rstrip("/"), workload.label)
        table.calls.append(key)
        return table[key]
    monkeypatch.setattr(url_gate, "measure", fake_measure)
    return table


def gate(settings: GateSettings):
    return run_gate(GateRequest.of([BASE], [CANARY]), settings, transport=HEALTHY)


def test_each_workload_is_measured_on_every_server_in_turn_and_the_worst_decides_named(speeds):
    speeds[BASE, "c4 T0.7"], speeds[CANARY, "c4 T0.7"] = m(200.0), m(204.0)
    speeds[BASE, "c1 T0"], speeds[CANARY, "c1 T0"] = m(80.0), m(50.0)  # the tree loses at batch 1
    out = gate(GateSettings(TWO[0], Thresholds(), workloads=TWO))
    assert sorted(speeds.calls[:2]) == [(BASE, "c4 T0.7"), (CANARY, "c4 T0.7")]  # side by side, then the next
    assert sorted(speeds.calls[2:]) == [(BASE, "c1 T0"), (CANARY, "c1 T0")]
    assert out.verdict is Verdict.FAIL and out.decider.settings.workload.label == "c1 T0"
    assert out.summary().startswith("fail on c1 T0 (c4 T0.7 pass, c1 T0 fail): output tok/s 80.0 → 50.0")
    assert out.reasons()[0].startswith("c1 T0: output tok/s")
    doc = out.as_dict()
    assert doc["verdict"] == "fail" and doc["canary"]["output_tps"] == 50.0 and doc["workload"]["label"] == "c1 T0"
    assert [(w["workload"]["label"], w["verdict"]) for w in doc["workloads"]] == [("c4 T0.7", "pass"),
                                                                                  ("c1 T0", "fail")]
    assert doc["bound_s"] == run_bound_s(out.settings)
    report = out.report()
    assert "== workload c4 T0.7: pass" in report and "== workload c1 T0: fail" in report


def test_when_every_workload_passes_the_first_is_the_outcome(speeds):
    for label, tps in (("c4 T0.7", 200.0), ("c1 T0", 80.0)):
        speeds[BASE, label], speeds[CANARY, label] = m(tps), m(tps)
    out = gate(GateSettings(workloads=TWO))
    assert out.verdict is Verdict.PASS and out.summary() == "pass on every workload (c4 T0.7 pass, c1 T0 pass)"
    assert out.as_dict()["workload"]["label"] == "c4 T0.7" and out.as_dict()["baseline"]["output_tps"] == 200.0


def test_one_workload_keeps_the_outcome_it_always_had(speeds):
    speeds[BASE, "c4 T0.7"], speeds[CANARY, "c4 T0.7"] = m(200.0), m(100.0)
    out = gate(GateSettings(TWO[0]))
    assert out.cases == () and out.summary().startswith("fail: output tok/s 200.0 → 100.0")
    assert "workloads" not in out.as_dict() and out.as_dict()["bound_s"] == bound_s(TWO[0])


def test_a_baseline_without_a_success_in_one_workload_is_no_verdict_naming_it(speeds):
    speeds[BASE, "c4 T0.7"], speeds[CANARY, "c4 T0.7"] = m(200.0), m(200.0)
    speeds[BASE, "c1 T0"], speeds[CANARY, "c1 T0"] = m(0.0, ok=False), m(80.0)
    with pytest.raises(NoVerdict, match=f"baseline {BASE}: no successful request .* with c1 T0; nothing to compare"):
        gate(GateSettings(workloads=TWO))


def test_the_bound_is_one_probe_and_every_workloads_window_and_the_service_says_it():
    one, two = GateSettings(TWO[0]), GateSettings(workloads=TWO)
    assert run_bound_s(one) == bound_s(TWO[0])
    assert run_bound_s(two) == pytest.approx(bound_s(TWO[0]) + url_gate.cut_after_s(TWO[1]) + STOP_GRACE_S)
    service = GateService(two, AllowList.of((BASE, CANARY), []))
    assert service.handle("GET", "/healthz").doc["bound_s"] == run_bound_s(two)


@pytest.fixture
def settings_seen(monkeypatch) -> list[GateSettings]:
    """The settings `ddtree-ops gate` runs with (the run itself stubbed: a passing outcome)."""
    seen: list[GateSettings] = []

    class Passed:
        verdict = Verdict.PASS

        def as_dict(self) -> dict[str, Any]:
            return {"verdict": "pass"}

    def fake_run(request, settings, **kw):
        seen.append(settings)
        return Passed()
    monkeypatch.setattr(url_gate, "run_gate", fake_run)
    return seen


def invoke(*args: str):
    return CliRunner().invoke(app, ["gate", "--baseline", BASE, "--canary", CANARY, "--json", *args])


def test_the_command_takes_every_workload_of_the_inventory_and_its_flags_apply_to_each(tmp_path, settings_seen):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump(fake_inventory(2, perf_gate={"duration_s": 3})))  # the default two
    r = invoke("-i", str(inv), "--duration", "2", "--max-new-tokens", "16")
    assert r.exit_code == 0, r.output
    (s,) = settings_seen
    assert [(w.label, w.duration_s) for w in s.workloads] == [("c4 T0.7 16 tok", 2.0), ("c1 T0 16 tok", 2.0)]
    r = invoke("-i", str(inv), "--concurrency", "2")
    assert r.exit_code == 0, r.output
    assert [w.label for w in settings_seen[-1].workloads] == ["c2 T0.7", "c2 T0"]


def test_the_command_without_an_inventory_measures_todays_one_workload(settings_seen):
    assert invoke().exit_code == 0
    assert settings_seen[0].workloads == (Workload(),) and len(DEFAULT_WORKLOADS) == 2


def test_two_cases_the_flags_make_the_same_are_measured_once(tmp_path, settings_seen):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump(fake_inventory(1, perf_gate={"workloads": [{"concurrency": 1}, {"concurrency": 8}]})))
    assert invoke("-i", str(inv), "--concurrency", "2").exit_code == 0
    assert [w.label for w in settings_seen[0].workloads] == ["c2 T0.7"]


def test_hosts_whose_workloads_differ_need_host(tmp_path, settings_seen):
    doc = fake_inventory(2, perf_gate={"workloads": [{"concurrency": 1}, {"concurrency": 4}]})
    doc["all"]["hosts"]["fh2"] = {"perf_gate": {"workloads": [{"concurrency": 1}, {"concurrency": 8}]}}
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump(doc))
    r = invoke("-i", str(inv))
    assert r.exit_code == 2 and "the hosts' perf_gate settings differ" in r.stderr, r.output
    assert invoke("-i", str(inv), "--host", "fh2").exit_code == 0
    assert [w.label for w in settings_seen[0].workloads] == ["c1 T0.7", "c8 T0.7"]
