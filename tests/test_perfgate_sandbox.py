"""The performance gate of a real rollout on sandbox hosts while two busy loops spin on the machine's
cores: the release with the DDTree patch set's own payload (its accept length measured by the host's
stand-in at start-up) passes against the DFlash server it replaces, and the same release slowed with
the stand-in's knob fails and is rolled back. The fast tier repeats the measurement ten times
(test_perfgate_standin.py); this proves it end to end once."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kit import busy_loops, make_patchset, run_cli, upstream_file, write_inventory

REPO = Path(__file__).resolve().parents[1]
PAYLOAD = "sglang/srt/speculative/ddtree_utils.py"
DFLASH_INFO = "sglang/srt/speculative/dflash_info.py"
DDTREE = "sglang-k26-ddtree.service"
DFLASH = "sglang-k26-dflash-cg.service"
# A short deterministic workload and the limits of tests/test_live_traffic.py's gate: the p99s of a
# few requests are their slowest one, which a busy machine makes; a clear slowdown fails on tok/s.
GATE = {"duration_s": 1, "min_requests": 6, "concurrency": 2, "max_new_tokens": 24, "temperature": 0.0,
        "thresholds": {"marginal_drop": 0.25, "fail_drop": 0.5, "ttft_p50_marginal": 1.0, "ttft_p50_fail": 3.0,
                       "ttft_p99_marginal": 9.0, "ttft_p99_fail": 10.0, "itl_p50_marginal": 0.5,
                       "itl_p50_fail": 1.0, "itl_p99_marginal": 9.0, "itl_p99_fail": 10.0}}


@pytest.fixture
def payload_patchset(tmp_path) -> Path:
    """The shape of the real patch set with its real DDTree payload module."""
    return make_patchset(tmp_path, {
        PAYLOAD: (REPO / "patches" / "ddtree-temp" / "files" / PAYLOAD).read_bytes(),
        DFLASH_INFO: upstream_file(DFLASH_INFO) + b"\n# patched by the ddtree-ops tests\n",
    })


def _gate_inventory(sandbox, path: Path, **sbx1_vars) -> Path:
    inv = write_inventory(sandbox, path, {"sbx1": sbx1_vars, "sbx2": {}})
    doc = yaml.safe_load(inv.read_text())
    doc["all"]["vars"]["perf_gate"] = GATE
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    return inv


def test_with_both_cores_busy_the_payloads_release_passes_the_gate_and_its_slowed_copy_is_rolled_back(
        sandbox, clean_hosts, tmp_path, payload_patchset, record_property):
    sbx1, sbx2 = clean_hosts[0], clean_hosts[1]
    plain = _gate_inventory(sandbox, tmp_path / "plain.yaml")
    slow = _gate_inventory(sandbox, tmp_path / "slow.yaml",
                           extra_args=sbx1.base_extra_args() + ["--standin-tokens-per-second", "60"])
    with busy_loops(2) as loops:
        first = run_cli("deploy", "-i", str(plain), "-l", "sbx1", "-p", str(payload_patchset), "--yes", "--json")
        sbx2_pid = sbx2.main_pid(DFLASH)
        pid_before = sbx1.main_pid(DDTREE)
        slowed = run_cli("deploy", "-i", str(slow), "-l", "sbx1,sbx2", "--canary", "1", "-p", str(payload_patchset),
                         "--budget", "17", "--yes", "--json")
        assert all(p.poll() is None for p in loops)  # they spun through both rollouts
    assert first.code == 0, first.stderr
    gate = first.json()["hosts"][0]["perf_gate"]
    # DFlash (accept length 1) to DDTree with the payload's accept length: faster by about as much.
    assert gate["verdict"] == "pass" and gate["baseline"]["requests"] >= 6, gate
    assert gate["baseline"]["accept_length"] == 1.0 and gate["canary"]["accept_length"] > 1.5, gate
    assert gate["canary"]["output_tps"] > 1.2 * gate["baseline"]["output_tps"], gate
    log = sbx1.ssh(["journalctl", "-u", DDTREE, "--no-pager", "-o", "cat"]).stdout
    assert "DDTree payload measured at start-up (budget=16, topk_cap=4" in log, log[-3000:]

    assert slowed.code == 3, slowed.stderr
    h1, h2 = slowed.json()["hosts"]
    record_property("measured", "with 2 busy loops: DFlash → DDTree payload {:.0f} → {:.0f} tok/s (accept length "
                    "{:.2f}, {}); slowed copy {:.0f} → {:.0f} tok/s ({})".format(
                        gate["baseline"]["output_tps"], gate["canary"]["output_tps"], gate["canary"]["accept_length"],
                        gate["verdict"], h1["perf_gate"]["baseline"]["output_tps"],
                        h1["perf_gate"]["canary"]["output_tps"], h1["perf_gate"]["verdict"]))
    assert h1["outcome"] == "rolled_back" and h1["failed_step"] == "perf gate", h1
    g = h1["perf_gate"]
    assert g["verdict"] == "fail" and g["canary"]["output_tps"] < 0.5 * g["baseline"]["output_tps"], g
    assert g["peers"] is not None and g["peers"]["requests"] > 0  # sbx2 measured side by side
    assert h2["outcome"] == "skipped" and sbx2.main_pid(DFLASH) == sbx2_pid  # no other host touched
    assert sbx1.unit_state(DDTREE) == "active" and sbx1.main_pid(DDTREE) != pid_before  # restored, restarted
    hist = run_cli("history", "-i", str(slow), "--host", "sbx1", "--json").json()
    failed = [x for x in hist["releases"] if x.get("perf_gate", {}).get("verdict") == "fail"]
    assert failed and failed[0]["outcome"].startswith("rolled back"), hist["releases"]
    table = run_cli("history", "-i", str(slow), "--host", "sbx1")
    assert "fail (" in table.stdout and "pass (" in table.stdout, table.stdout
