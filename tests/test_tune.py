"""The tune's per-host run (fleet/tune.py) on fake hosts (fast tier): the real runbook deploys each
config and rolls a crashing one back, a model of the server's speed stands in for the measurement,
and every host ends on the files it started with."""

from __future__ import annotations

import re

import pytest

from ddtree_ops.config.workload_settings import Workload
from ddtree_ops.fleet.tune import Tune, TuneOptions, server_said, tune_document
from ddtree_ops.fleet.tune_plan import assign, grid, workloads
from ddtree_ops.gates.tune_ranking import Objective, RepeatRule
from ddtree_ops.gates.workload import Measurement
from ddtree_ops.testing.fake_host import _fate_from_installed_files as default_fate
from ddtree_ops.testing.fake_host import fake_hosts

BUDGET_RE = re.compile(rb"--speculative-ddtree-budget[= ](\d+)")


def speed_of(fake) -> float:
    """The model: DFlash 100 tok/s; a DDTree budget B 100 + B tok/s (bigger is faster)."""
    if fake.serving_unit() != fake.host.unit:
        return 100.0
    return 100.0 + int(BUDGET_RE.search(fake.read(fake.host.unit_path)).group(1))


def crash_above(limit: int):
    """Boot fate: a DDTree server with a budget above `limit` dies while it loads."""
    def fate(fake, unit):
        text = fake.read(f"/etc/systemd/system/{unit}") or b""
        m = BUDGET_RE.search(text)
        if unit == fake.host.unit and m and int(m.group(1)) > limit:
            return "crash"
        return default_fate(fake, unit)
    return fate


@pytest.fixture
def two(tmp_path):
    fakes = fake_hosts(tmp_path / "hosts", 2)
    return {f.host.name: f for f in fakes}


def run_tune(fakes, patchset, configs, *, on_measure=None, max_parallel=2):
    wls = workloads(Workload(), [1, 8], [0.0], 1.0)
    plans = assign(configs, list(fakes), on_original=list(fakes))
    calls = []

    def measure(session, w, should_stop):
        calls.append((session.host.name, w.concurrency))
        if on_measure is not None:
            on_measure(tune, len(calls))
        tps = speed_of(fakes[session.host.name]) * (1 if w.concurrency == 1 else 4)
        return Measurement(requests=10, errors=0, output_tokens=int(tps * 10), wall_s=10.0, ttft_p50_s=0.02,
                           ttft_p99_s=0.03, itl_p50_s=0.005, itl_p99_s=0.006, accept_length=2.0,
                           stopped=should_stop())
    tune = Tune(plans, {n: f.host for n, f in fakes.items()},
                TuneOptions(patchset=patchset, workloads=wls, rule=RepeatRule(2, 3, 0.05), tune_id="tune-test"),
                connect=lambda h: fakes[h.name].session(), max_parallel=max_parallel, measure=measure)
    results = tune.run()
    doc = tune_document(tune_id="tune-test", started_at=0.0, hosts=[f.host for f in fakes.values()],
                        configs=configs, budgets=[4, 8, 16], topk_caps=[1], workloads_=wls, results=results,
                        objective=Objective(), notes=[], interrupted=tune.interrupted_by, inventory="inv.yaml")
    return doc, calls


def on_original(fake) -> bool:
    return fake.serving_unit() == fake.host.conflicts[0] and fake.session().store.history()["current"] is None


def test_every_config_is_measured_once_per_workload_and_every_host_goes_back(two, patchset):
    configs = grid([4, 8, 16], [1], (16, 1))
    doc, _ = run_tune(two, patchset, configs)
    rows = doc["rows"]
    assert sorted((r["config"], r["concurrency"]) for r in rows) == sorted(
        (c.label, conc) for c in configs for conc in (1, 8))
    assert all(r["status"] == "ok" and r["repeats"] == 2 for r in rows)  # steady: two repeats are enough
    assert {w["config"] for w in doc["winners"]} == {"16/1"}
    assert doc["winners"][0]["vs_dflash"]["ratio"] == pytest.approx(116 / 100)
    assert all(on_original(f) for f in two.values())
    assert [r["ok"] for r in doc["restored"]] == [True, True]


def test_a_config_that_crashes_at_start_is_a_failed_row_and_the_host_goes_on(two, patchset):
    for f in two.values():
        f.boot = crash_above(8)
    configs = grid([4, 8, 16, 32], [1], (4, 1))
    doc, _ = run_tune(two, patchset, configs)
    by = {(r["config"], r["concurrency"]): r for r in doc["rows"]}
    for label in ("16/1", "32/1"):
        assert by[(label, 1)]["status"] == "failed" and "deploy failed" in by[(label, 1)]["reason"]
    assert by[("8/1", 8)]["status"] == "ok"
    assert {w["config"] for w in doc["winners"]} == {"8/1"}
    assert doc["pick"]["config"] == "8/1"
    assert all(on_original(f) for f in two.values())


def test_an_interrupt_keeps_the_rows_measured_and_puts_every_host_back(two, patchset):
    configs = grid([4, 8, 16, 32], [1], (4, 1))

    def interrupt_at(tune, n):
        if n == 6:
            tune.interrupt(KeyboardInterrupt())
    doc, calls = run_tune(two, patchset, configs, on_measure=interrupt_at)
    assert doc["interrupted"]
    measured = [r for r in doc["rows"] if r["status"] == "ok"]
    assert measured and len(measured) < len(doc["rows"])
    assert all("interrupted" in r["reason"] for r in doc["rows"] if r["status"] != "ok")
    assert all(on_original(f) for f in two.values())
    assert len(calls) < 2 * len(configs) * 3  # it stopped measuring


def test_hosts_are_tuned_one_at_a_time_under_max_unavailable_1(two, patchset):
    configs = grid([4, 8], [1], (4, 1))
    doc, calls = run_tune(two, patchset, configs, max_parallel=1)
    order = [h for h, _ in calls]
    first = order[0]
    assert order == sorted(order, key=lambda h: h != first)  # every measurement of one host before the other's
    assert len(set(order)) == 2 and all(r["status"] == "ok" for r in doc["rows"])


def test_a_failed_start_says_the_servers_last_exception():
    log = ["Dec 04 18:15:14 sbx2 python[797]: [TP0] Traceback (most recent call last):",
           "Dec 04 18:15:14 sbx2 python[797]: RuntimeError: CUDA error: too many resources requested",
           "Dec 04 18:15:14 sbx2 python[797]: Exception: Capture cuda graph failed: CUDA error: too many resources",
           "Dec 04 18:15:14 sbx2 python[797]: Possible solutions:"]
    assert server_said(log) == "Exception: Capture cuda graph failed: CUDA error: too many resources"
    assert server_said(["Load weight begin", "Load weight end"]) is None


def test_each_host_keeps_the_tunes_record_and_its_history_lists_it(two, patchset):
    from ddtree_ops.errors import DdtreeOpsError
    from ddtree_ops.fleet.tune import keep_record

    configs = grid([4], [1], (4, 1))
    doc, _ = run_tune(two, patchset, configs)
    notes = []
    assert keep_record([f.host for f in two.values()], doc, lambda h: two[h.name].session(), notes.append) == []
    for f in two.values():
        (kept,) = f.session().store.history()["tunes"]
        assert kept["tune_id"] == "tune-test" and kept["rows"] == len(doc["rows"]) and kept["pick"] == doc["pick"]
        assert "rows" not in kept or isinstance(kept["rows"], int)  # the summary, not the whole record
    with pytest.raises(DdtreeOpsError, match="bad tune id"):
        two["fh1"].session().store.write_tune("../../etc/x", doc)


def test_a_write_that_would_be_refused_is_refused_before_any_host_is_touched(tmp_path):
    """sbx-a takes its budget from its own vars, sbx-b from the group's: no one place to write a pick
    to, so `tune --write` exits 2 at once (127.0.0.9 is never connected to: nothing listens there)."""
    from typer.testing import CliRunner

    from ddtree_ops.cli.commands import app

    key = tmp_path / "id"
    key.write_text("not a key\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"""\
all:
  vars:
    address: 127.0.0.9
    identity_file: {key}
    known_hosts: {tmp_path / "known_hosts"}
    python: /opt/venv/bin/python
    site_packages: /opt/venv/lib/python3.11/site-packages
    model_path: /m
    draft_model_path: /d
    budget: 16
    topk_cap: 4
  children:
    gpu:
      hosts:
        sbx-a:
          budget: 8
        sbx-b:
""")
    r = CliRunner().invoke(app, ["tune", "-i", str(inv), "--write", "--yes", "--budgets", "4,8"],
                           catch_exceptions=False)
    assert r.exit_code == 2, r.output
    assert "--write would be refused after the tune, so nothing was started" in r.stderr
    assert "sbx-a" in r.stderr and "sbx-b" in r.stderr
