"""`ddtree-ops tune` on real sandbox hosts behind a real smg: two of the four hosts tuned over a grid
of DDTree configs (and DFlash, on its original files) at concurrency 1 and 8, while a client sends
requests through the router to the whole pool.

The stand-in paces verify steps with its GPU cost model (testing/standin/costmodel.py): a step takes
(1/N) x max(1, batch x (budget + 1) / K), and a config's accept length is its payload's own. So the
best tree is the largest at batch 1 and a smaller one at batch 8; the test computes which from the
model and the accept lengths the tune measured, independently of the tok/s it ranked by."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest
import yaml
from test_live_traffic import Client, RoutedSampler

from ddtree_ops.testing.standin.costmodel import expected_output_tps
from kit import _clean, host_tree, run_cli, wait_for

STEPS_PER_S = 40  # a verify step is 25 ms or more: the pacing, not the 2 cores, sets the speed
KNEE = 24  # a small chip: 32/4 (33 tokens a step) is past it even alone, 2/1 at 8 streams is not
FAIL_ABOVE = 16  # budget 32 crashes while "capturing CUDA graphs"
PACING = [f"--standin-verify-steps-per-second={STEPS_PER_S}", f"--standin-verify-knee-tokens={KNEE}"]
TUNED = ["sbx1", "sbx2"]
MAX_NEW_TOKENS = 64
TTFT_S = 0.03  # the stand-in's default prefill delay
GROUP_VARS = """\
# The sandbox hosts' DDTree settings (a hand-written file: comments and order must survive --write).
budget: 32   # the guess to beat (over the fail knob: it crashes at start on this "chip")
# the top-k cap below
topk_cap: 4
"""


def _pace_dflash(th) -> None:
    """The host's DFlash server (its original state, the tune's control) paced like the DDTree configs."""
    unit = f"/etc/systemd/system/{th.host.conflicts[0]}"
    text = th.read(unit).decode()
    paced = text.replace("--speculative-algorithm DFLASH", "--speculative-algorithm DFLASH " + " ".join(PACING))
    assert paced != text
    th.ssh(["sh", "-c", 'cat > "$1" && systemctl daemon-reload && systemctl restart "$2"', "sh", unit,
            th.host.conflicts[0]], stdin=paced)
    wait_for(lambda: _healthy(th.host.base_url), 60, what=f"{th.name}'s DFlash server back")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def tune_fleet(sandbox, tmp_path_factory):
    """Every sandbox host on its original files behind one smg; sbx1 and sbx2's DFlash paced like the
    configs; an inventory with the stand-in's cost model knobs and the budget / top-k cap in
    group_vars/sandbox.yml. Yields (inventory, env, router info, hosts)."""
    from ddtree_ops.testing.sandbox import smg

    hosts = [_clean(sandbox, h.name) for h in sandbox.hosts()]
    for th in hosts:
        if th.name in TUNED:
            _pace_dflash(th)
    tmp = tmp_path_factory.mktemp("tune")
    d = tmp / "router"
    d.mkdir(mode=0o700)
    smg.write_key(d / smg.KEY_FILE)
    info = smg.start(d, [th.host.base_url for th in hosts], smg.free_port())
    try:
        smg.wait_ready(info)
        doc = yaml.safe_load(Path(sandbox.inventory_path).read_text())
        v = doc["all"]["vars"]
        v["router"] = {"kind": "smg", "url": info["url"], "admin_key_env": smg.ROUTER_KEY_ENV, "timeout_s": 30}
        v["extra_args"] = [*v["extra_args"], *PACING, f"--standin-fail-budget-above={FAIL_ABOVE}"]
        v["perf_gate"] = {"max_new_tokens": MAX_NEW_TOKENS}
        del v["budget"], v["topk_cap"]
        inv = tmp / "inventory.yaml"
        inv.write_text(yaml.safe_dump(doc, sort_keys=False))
        (tmp / "group_vars").mkdir()
        (tmp / "group_vars" / "sandbox.yml").write_text(GROUP_VARS)
        yield inv, {smg.ROUTER_KEY_ENV: smg.read_key(info["key_file"])}, info, hosts
    finally:
        smg.stop(info)


def _routed(info) -> set[str]:
    from ddtree_ops.testing.sandbox import smg

    return {w["url"].rstrip("/") for w in smg.list_workers(info) if w["status"] == "ready" and w["is_healthy"]}


def _state(th) -> tuple[str, str, dict]:
    h = th.host
    return th.unit_state(h.unit), th.unit_state(h.conflicts[0]), host_tree(th)


@pytest.fixture(scope="module")
def tuned(tune_fleet):
    """One tune of sbx1 and sbx2 (budgets 2, 4, 16 x caps 1, 4, and the inventory's 32/4; concurrency 1
    and 8, greedy) with
    --write, under traffic through the router: (result, document, what each host was before, the
    client, the routed sampler)."""
    inv, env, info, hosts = tune_fleet
    before = {th.name: _state(th) for th in hosts if th.name in TUNED}
    with Client(info["url"], threads=2, pause_s=0.25) as client, RoutedSampler(info) as sampler:
        time.sleep(0.5)
        res = run_cli("tune", "-i", str(inv), "--limit", ",".join(TUNED), "--budgets", "2,4,16",
                      "--topk-caps", "1,4", "--concurrency", "1,8", "--temperatures", "0", "--duration", "2",
                      "--max-repeats", "4", "--max-unavailable", "2", "--write", "--yes", "--json",
                      "--report", str(inv.parent / "tune.html"), env=env, timeout=600)
    (inv.parent / "tune.err").write_text(res.stderr)  # the tune's own lines, for a failure's reader
    doc = json.loads(res.stdout) if res.stdout.strip() else {}
    return res, doc, before, client, sampler


def test_the_tune_finds_the_config_the_cost_model_implies_at_each_concurrency(tuned):
    res, doc, _, _, _ = tuned
    assert res.code == 0, res.stderr[-4000:]
    ok = [r for r in doc["rows"] if r["status"] == "ok" and r["kind"] == "ddtree"]
    winners = {w["concurrency"]: w for w in doc["winners"]}
    for c in (1, 8):
        rows = [r for r in ok if r["concurrency"] == c]
        assert len(rows) == 5, [r["config"] for r in rows]  # 2/1 4/1 4/4 16/1 16/4; the inventory's 32/4 failed
        model = {r["config"]: expected_output_tps(r["accept_length"], r["budget"] + 1, c, STEPS_PER_S, KNEE,
                                                  MAX_NEW_TOKENS, TTFT_S) for r in rows}
        best = max(model, key=model.get)
        measured = {r["config"]: round(r["tok_s"], 1) for r in rows}
        assert winners[c]["config"] == best, (c, measured, model)
        assert winners[c]["vs_dflash"]["ratio"] > 1 and winners[c]["vs_inventory"] is None  # it crashed
    assert winners[1]["config"] != winners[8]["config"]  # the best tree shrinks as the batch grows
    assert (winners[1]["config"], winners[8]["config"]) == ("16/4", "2/1")  # the model's, for these payloads


def test_a_config_above_the_fail_knob_is_a_failed_row_and_its_host_is_restored_byte_for_byte(tuned, tune_fleet):
    res, doc, before, _, _ = tuned
    failed = [r for r in doc["rows"] if r["budget"] == 32]
    assert len(failed) == 2 and all(r["status"] == "failed" and r["inventory"] for r in failed)  # c1 and c8
    assert all("the server said: Exception: Capture cuda graph failed" in r["reason"] for r in failed), failed
    _, _, _, hosts = tune_fleet
    for th in hosts:
        if th.name in TUNED:
            assert _state(th) == before[th.name], th.name  # units and files as before the tune
    assert {r["host"]: r["ok"] for r in doc["restored"]} == {"sbx1": True, "sbx2": True}


def test_traffic_through_the_router_fails_no_request_while_hosts_are_tuned(tuned, tune_fleet):
    res, _, _, client, sampler = tuned
    assert res.code == 0
    assert client.sent > 50 and client.failed == [], client.failed[:5]
    assert sampler.fewest is not None and sampler.fewest >= 2  # --max-unavailable 2 of 4
    _, _, info, hosts = tune_fleet
    assert _routed(info) == {th.host.base_url.rstrip("/") for th in hosts}  # every host routed again


def test_write_changes_only_the_picked_values_in_the_file_they_came_from(tuned, tune_fleet):
    res, doc, _, _, _ = tuned
    inv, _, _, _ = tune_fleet
    p = doc["pick"]
    after = (inv.parent / "group_vars" / "sandbox.yml").read_text().splitlines()
    want = (GROUP_VARS.replace("budget: 32 ", f"budget: {p['budget']} ")
            .replace("topk_cap: 4", f"topk_cap: {p['topk_cap']}"))
    assert after == want.splitlines()
    changed = [f"+{k}: {p[k]}" for k, was in (("budget", 32), ("topk_cap", 4)) if p[k] != was]
    assert all(c in res.stderr for c in changed) and ("--- " in res.stderr) == bool(changed)  # the diff first
    from ddtree_ops.config.inventory import load_inventory

    h = load_inventory(inv).hosts["sbx1"]
    assert (h.budget, h.topk_cap) == (p["budget"], p["topk_cap"])


def test_the_tune_is_kept_on_each_host_and_shown_by_history(tuned, tune_fleet):
    _, doc, _, _, _ = tuned
    inv, env, _, _ = tune_fleet
    hist = run_cli("history", "--host", "sbx2", "-i", str(inv), "--json", env=env)
    assert hist.code == 0, hist.stderr
    tunes = hist.json()["tunes"]
    assert tunes[-1]["tune_id"] == doc["tune_id"] and tunes[-1]["pick"] == doc["pick"]
    text = run_cli("history", "--host", "sbx2", "-i", str(inv), env=env)
    assert doc["tune_id"] in text.stdout


def test_sigterm_mid_tune_leaves_every_host_on_its_original_release_and_routed(tuned, tune_fleet, start_cli):
    inv, env, info, hosts = tune_fleet
    p = start_cli("tune", "-i", str(inv), "--limit", ",".join(TUNED), "--budgets", "4,8", "--topk-caps", "1",
                  "--concurrency", "1", "--temperatures", "0", "--duration", "2", "--max-unavailable", "2",
                  "--yes", "--json", env=env)
    wait_for(lambda: "serving (release" in p.stderr(), 120, what="a config deployed and serving")
    p.signal(signal.SIGTERM)
    res = p.wait(180)
    assert res.code == 3, res.stderr[-3000:]
    doc = json.loads(res.stdout)
    assert doc["interrupted"] and doc["interrupted_by"] == "SIGTERM"
    assert doc["rows"]  # what was measured (or marked not measured) is kept
    for th in hosts:
        if th.name in TUNED:
            ddtree, dflash, _ = _state(th)
            assert (ddtree, dflash) == ("inactive", "active"), th.name
            assert run_cli("history", "--host", th.name, "-i", str(inv), "--json", env=env).json()["current"] is None
    assert _routed(info) == {th.host.base_url.rstrip("/") for th in hosts}


def test_keep_best_leaves_the_host_on_the_pick_routed(tuned, tune_fleet):
    """Last in the module: it leaves sbx2 on a release (the next module's clean hosts reset it)."""
    from ddtree_ops.config.inventory import load_inventory

    inv, env, info, hosts = tune_fleet
    h = load_inventory(inv).hosts["sbx2"]  # what --write made it: the grid is that one config
    r = run_cli("tune", "-i", str(inv), "--limit", "sbx2", "--budgets", str(h.budget), "--topk-caps", str(h.topk_cap),
                "--concurrency", "1", "--temperatures", "0", "--duration", "1", "--max-repeats", "2", "--keep", "best",
                "--yes", "--json", env=env, timeout=300)
    assert r.code == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["grid"]["configs"] == ["DFlash", f"{h.budget}/{h.topk_cap}"]
    assert (doc["pick"]["budget"], doc["pick"]["topk_cap"]) == (h.budget, h.topk_cap)
    th = next(t for t in hosts if t.name == "sbx2")
    ddtree, dflash, _ = _state(th)
    assert (ddtree, dflash) == ("active", "inactive")
    unit = th.read(th.host.unit_path).decode()
    assert f"--speculative-ddtree-budget {h.budget} " in unit and f"--speculative-ddtree-topk-cap {h.topk_cap}" in unit
    assert "sbx2 | --keep best: deployed" in r.stderr
    assert _routed(info) == {t.host.base_url.rstrip("/") for t in hosts}
