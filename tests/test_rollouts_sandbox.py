"""Rollouts through the CLI on 3 real sandbox hosts, as CI runs them: a deploy that stops after its
canary and the `promote` command it prints, one rollout id on every host, `status` against the
inventory, and `rollback --rollout` bringing each host it changed back to its previous release
while the host it never touched keeps serving as it was. One scenario, in order: each step starts
from what the previous one left."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from kit import DFLASH_INFO, _clean, make_patchset, run_cli, upstream_file, write_inventory

PROBE = "sglang/srt/speculative/ddtree_probe.py"
HOSTS = ["sbx1", "sbx2", "sbx3"]


def _ps(root: Path, tag: str) -> Path:
    return make_patchset(root, {PROBE: f"PROBE = {tag!r}\n".encode(),
                                DFLASH_INFO: upstream_file(DFLASH_INFO) + f"\n# rollouts {tag}\n".encode()},
                         name=f"rollouts-{tag}")


@pytest.fixture(scope="module")
def three(sandbox):
    if len(sandbox.hosts()) < 3:
        pytest.skip("needs 3 sandbox hosts (DDTREE_OPS_TEST_HOSTS >= 3)")
    hosts = [_clean(sandbox, n) for n in HOSTS]
    for th in hosts:  # preflight refuses a model folder that is missing; the stand-in reads none
        sandbox.inside(th.name, ["mkdir", "-p", th.host.model_path, th.host.draft_model_path])
    return hosts


def _json(r):
    assert r.stdout.strip(), r.stderr
    return r.json()


def _status(inv, *args):
    r = run_cli("status", "-i", str(inv), "-l", ",".join(HOSTS), "--json", *args)
    return r.code, {row["host"]: row for row in _json(r)["hosts"]}


def test_canary_promote_status_and_rollback_of_a_whole_rollout(three, tmp_path):
    inv = Path(three[0].sandbox.inventory_path)
    ps_a, ps_b = _ps(tmp_path / "a", "a"), _ps(tmp_path / "b", "b")

    # deploy --stop-after-canary: sbx1 only, exit 0, the promote command to continue.
    r = run_cli("deploy", "-i", str(inv), "-l", ",".join(HOSTS), "-p", str(ps_a), "--stop-after-canary",
                "--yes", "--json")
    doc = _json(r)
    assert r.code == doc["exit_code"] == 0, r.stderr
    first = doc["rollout_id"]
    assert doc["stopped_after_canary"] and doc["waiting"] == ["sbx2", "sbx3"]
    assert [h["outcome"] for h in doc["hosts"]] == ["deployed", "skipped", "skipped"]
    argv = shlex.split(doc["promote"])
    assert argv[:2] == ["ddtree-ops", "promote"] and first in argv and doc["promote"] in r.stderr

    # The printed command, with a different patch set: refused, nothing changed.
    r = run_cli(*argv[1:-1], str(ps_b), "--yes", "--json")
    assert r.code == 2 and "differs" in _json(r)["message"], r.stderr
    r = run_cli(*argv[1:], "--max-unavailable", "100%", "--yes", "--json")
    doc = _json(r)
    assert r.code == doc["exit_code"] == 0, r.stderr
    assert doc["rollout_id"] == first and [h["host"] for h in doc["hosts"]] == ["sbx2", "sbx3"]
    assert any("sbx1: already on rollout" in n for n in doc["notes"])

    code, rows = _status(inv)
    assert code == 0 and {rows[n]["rollout"] for n in HOSTS} == {first}, rows
    assert all(rows[n]["config_drift"] == [] for n in HOSTS)
    on_first = {n: rows[n]["release"] for n in HOSTS}
    assert len(set(on_first.values())) == 3

    # The inventory now says budget 10 for sbx2: status names the field on that host, and exits 1.
    inv10 = write_inventory(three[0].sandbox, tmp_path / "inv10.yaml", {"sbx2": {"budget": 10}})
    code, rows = _status(inv10)
    assert code == 1 and rows["sbx2"]["config_drift"] == [{"field": "budget", "inventory": 10, "host": 16}]
    assert not rows["sbx2"]["ok"] and rows["sbx1"]["ok"] and rows["sbx3"]["ok"]

    # A second rollout on sbx1 and sbx2, then undone as a whole: each back on its release of the first.
    r = run_cli("deploy", "-i", str(inv), "-l", "sbx1,sbx2", "-p", str(ps_b), "--canary", "0", "--max-unavailable",
                "100%", "--yes", "--json")
    second = _json(r)["rollout_id"]
    assert r.code == 0 and second != first, r.stderr
    sbx3 = three[2]
    pid3 = sbx3.main_pid(sbx3.host.unit)
    r = run_cli("rollback", "-i", str(inv), "-l", ",".join(HOSTS), "--rollout", second, "--max-unavailable", "100%",
                "--yes", "--json")
    doc = _json(r)
    assert r.code == doc["exit_code"] == 0, r.stderr
    assert {h["host"]: h["release"] for h in doc["hosts"]} == {n: on_first[n] for n in ("sbx1", "sbx2")}
    assert any(n.startswith("sbx3: left alone") for n in doc["notes"])
    assert pid3 and sbx3.main_pid(sbx3.host.unit) == pid3  # never restarted

    r = run_cli("rollouts", "-i", str(inv), "-l", ",".join(HOSTS), "--json")
    listing = _json(r)["rollouts"]
    assert [(x["id"], x["kind"]) for x in listing] == [(doc["rollout_id"], "rollback"), (second, "deploy"),
                                                       (first, "deploy")]
    r = run_cli("rollback", "-i", str(inv), "--rollout", "20200101T000000Z-000000", "--yes")
    assert r.code == 2 and "rollout 20200101T000000Z-000000" in r.stderr
