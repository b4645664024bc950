"""Fleets: rolling deploys (canary, batches, failure budget, abort → revert), multi-node servers,
`status`, release bundles and JSON output, on 4 real sandbox hosts; plus the pure arithmetic.

The sandbox tests share one module-level starting point (every host deployable: reachable, no
lock, no journal, no drift, healthy) and then compare each host before/after, so they do not need
a full host reset each (20 s per host on a loaded machine).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import socket
import tarfile
import time
from fractions import Fraction
from pathlib import Path

import pytest
import yaml

from ddtree_ops.config.inventory import parse_inventory
from ddtree_ops.errors import BundleError, InputError, InventoryError
from ddtree_ops.fleet.rollout import batch_size, budget_exceeded, make_targets, parse_percent, plan_batches
from kit import DFLASH_INFO, TestHost, make_patchset, run_cli, snapshot_paths, upstream_file, write_inventory

PROBE = "sglang/srt/speculative/ddtree_probe.py"
RELS = [PROBE, DFLASH_INFO]


def _ps(root: Path, tag: str, version: str = "1.0.0") -> Path:
    return make_patchset(root, {
        PROBE: f"PROBE = {tag!r}\n".encode(),
        DFLASH_INFO: upstream_file(DFLASH_INFO) + f"\n# fleet test {tag}\n".encode(),
    }, name=f"fleet-{tag}", version=version)


# ---------------------------------------------------------------------------------------------
# pure logic: no hosts


def test_batches_canary_first_then_counts_or_percentages():
    assert plan_batches(4, canary=1) == [[0], [1, 2, 3]]
    assert plan_batches(4, canary=1, batch="1") == [[0], [1], [2], [3]]
    assert plan_batches(10, canary=2, batch="30%") == [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]]
    assert plan_batches(4, canary=0, batch="2") == [[0, 1], [2, 3]]
    assert plan_batches(3, canary=5) == [[0, 1, 2]]
    assert plan_batches(0, canary=1) == []
    assert batch_size("10%", 4) == 1  # rounded down, at least 1 (Ansible's serial)
    assert batch_size("50%", 5) == 2
    assert batch_size("100%", 7) == 7
    assert batch_size(None, 7) == 7
    for bad in ("0", "-1", "x", "0%", "150%", "2.5"):
        with pytest.raises(InputError):
            batch_size(bad, 4)
    with pytest.raises(InputError):
        plan_batches(4, canary=-1)


def test_max_fail_must_be_exceeded_not_equalled():
    assert parse_percent("25%") == Fraction(25) and parse_percent("12.5") == Fraction(25, 2)
    for bad in ("-1%", "101%", "lots"):
        with pytest.raises(InputError):
            parse_percent(bad)
    assert not budget_exceeded(1, 4, 25)  # 25% of 4 failed with max 25%: still within (Ansible)
    assert budget_exceeded(1, 4, Fraction(2499, 100))
    assert not budget_exceeded(2, 4, 50) and budget_exceeded(2, 4, 49)
    assert budget_exceeded(1, 3, 33) and not budget_exceeded(1, 3, Fraction(100, 3))  # exact, no float
    assert not budget_exceeded(0, 4, 0) and budget_exceeded(1, 100, 0)
    assert not budget_exceeded(4, 4, 100)
    assert not budget_exceeded(0, 0, 0)


MN_INV = """
all:
  vars: {python: /opt/v/bin/python, site_packages: /opt/v/lib/python3.11/site-packages, model_path: /m,
         draft_model_path: /d}
  children:
    single: {hosts: {a: {address: 10.0.0.1}, b: {address: 10.0.0.5}}}
    k26x2:
      vars: {multinode: true}
      hosts:
        n1: {address: 10.0.0.3, node_rank: 1}
        n0: {address: 10.0.0.2, node_rank: 0}
"""


def test_inventory_multinode_servers_are_validated_and_one_target():
    inv = parse_inventory(yaml.safe_load(MN_INV))
    assert inv.servers() == {"k26x2": ("n0", "n1")}
    n1 = inv.hosts["n1"]
    assert (n1.server, n1.node_rank, n1.nnodes, n1.dist_init_addr) == ("k26x2", 1, 2, "10.0.0.2:20000")
    assert not inv.hosts["a"].multinode and inv.hosts["a"].nnodes == 1
    targets, notes = make_targets(inv, inv.select("n1,a"))
    assert [(t.name, [h.name for h in t.hosts]) for t in targets] == [("a", ["a"]), ("k26x2", ["n0", "n1"])]
    assert notes and "n0" in notes[0]
    from ddtree_ops.artifacts.units import parse_exec_flags, render_unit
    text = render_unit(n1)
    assert "--nnodes 2" in text and "--node-rank 1" in text and "--dist-init-addr 10.0.0.2:20000" in text
    assert parse_exec_flags(text)["budget"] == 16
    assert "--nnodes" not in render_unit(inv.hosts["a"])

    def bad(mutate, match):
        doc = yaml.safe_load(MN_INV)
        mutate(doc)
        with pytest.raises(InventoryError, match=match):
            parse_inventory(doc)

    hosts = lambda d: d["all"]["children"]["k26x2"]["hosts"]  # noqa: E731
    bad(lambda d: hosts(d)["n1"].update(node_rank=0), "node_rank")
    bad(lambda d: hosts(d)["n1"].update(node_rank=2), "node_rank")
    bad(lambda d: hosts(d)["n1"].pop("node_rank"), "node_rank")
    bad(lambda d: d["all"]["children"]["k26x2"]["vars"].update(nnodes=3), "nnodes")
    bad(lambda d: d["all"]["children"]["k26x2"]["vars"].update(dist_init_addr="x; rm -rf /"), "dist_init_addr")
    bad(lambda d: d["all"]["children"]["single"]["hosts"]["a"].update(node_rank=0), "only hosts of a multi-node")
    bad(lambda d: hosts(d)["n1"].update(multinode=True), "group var")


# ---------------------------------------------------------------------------------------------
# bundles: no hosts


def _tar_members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path, "r:gz") as tf:
        return {m.name: tf.extractfile(m).read() for m in tf}


def _rewrite(path: Path, members: dict[str, bytes]) -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    path.write_bytes(gzip.compress(raw.getvalue(), mtime=0))


def test_bundle_is_byte_reproducible_and_content_addressed(tmp_path):
    from ddtree_ops.artifacts.bundle import build_bundle, open_bundle

    ps1 = _ps(tmp_path / "one", "repro")
    ps2 = _ps(tmp_path / "two", "repro")  # same content elsewhere, other mtimes
    os.utime(ps2 / "manifest.yaml", (1, 1))
    r1 = run_cli("bundle", "--patchset", str(ps1), "--out", str(tmp_path / "out1"), "--json")
    assert r1.code == 0, r1.stderr
    doc = r1.json()
    time.sleep(1.1)
    b2 = build_bundle(str(ps2), tmp_path / "out2")
    assert doc["id"] == b2.id and doc["id"].startswith("fleet-repro-1.0.0-")
    assert Path(doc["path"]).read_bytes() == b2.path.read_bytes()
    assert doc["sha256"] == b2.sha256
    names = list(_tar_members(b2.path))
    assert names[0] == "bundle.json" and names[1:] == sorted(names[1:])
    assert "templates/sglang-ddtree.service.j2" in names and f"patchset/files/{PROBE}" in names
    with tarfile.open(b2.path, "r:gz") as tf:
        assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in tf} == {(0, 0, 0, "", "", 0o644)}
    assert b2.path.read_bytes()[4:8] == b"\0\0\0\0"  # gzip mtime 0
    manifest = json.loads(_tar_members(b2.path)["bundle.json"])
    assert {f["path"] for f in manifest["files"]} == set(names[1:])
    with open_bundle(b2.path) as ob:
        assert ob.id == b2.id and ob.patchset.name == "fleet-repro"
        assert (ob.templates_dir / "sglang-ddtree.service.j2").is_file()
    # A different byte anywhere gives a different id.
    ps3 = _ps(tmp_path / "three", "other")
    assert build_bundle(str(ps3), tmp_path / "out3").id != b2.id


def test_tampered_or_truncated_bundle_is_refused_before_any_connection(tmp_path):
    from ddtree_ops.artifacts.bundle import build_bundle, open_bundle

    good = build_bundle(str(_ps(tmp_path, "tamper")), tmp_path / "dist").path
    members = _tar_members(good)
    cases = {}
    t1 = tmp_path / "content.tar.gz"  # a shipped file changed, manifest left alone
    m = dict(members)
    m[f"patchset/files/{PROBE}"] = b"import os; os.system('evil')\n"
    _rewrite(t1, m)
    cases["content"] = t1
    t2 = tmp_path / "extra.tar.gz"  # an unlisted member smuggled in
    m = dict(members)
    m["templates/evil.j2"] = b"x"
    _rewrite(t2, m)
    cases["extra"] = t2
    t3 = tmp_path / "truncated.tar.gz"
    data = good.read_bytes()
    t3.write_bytes(data[: len(data) * 2 // 3])
    cases["truncated"] = t3
    t4 = tmp_path / "template.tar.gz"  # a template changed AND its hash in the manifest: id no longer matches
    m = dict(members)
    man = json.loads(m["bundle.json"])
    m["templates/sglang-ddtree.service.j2"] += b"\nExecStartPre=/bin/evil\n"
    for f in man["files"]:
        if f["path"] == "templates/sglang-ddtree.service.j2":
            import hashlib
            f["sha256"] = hashlib.sha256(m["templates/sglang-ddtree.service.j2"]).hexdigest()
            f["size"] = len(m["templates/sglang-ddtree.service.j2"])
    m["bundle.json"] = json.dumps(man).encode()
    _rewrite(t4, m)
    cases["id"] = t4
    for path in cases.values():
        with pytest.raises(BundleError):
            open_bundle(path)

    # The CLI refuses with exit 2 before any connection: a listener stands in for the host's sshd.
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    lsock.settimeout(0.0)
    port = lsock.getsockname()[1]
    kh = tmp_path / "known_hosts"
    kh.write_text("")
    doc = yaml.safe_load(MN_INV)
    doc["all"]["vars"]["known_hosts"] = str(kh)
    doc["all"]["children"]["single"]["hosts"]["sbx1"] = {"address": "127.0.0.1", "ssh_port": port}
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump(doc))
    try:
        for name, path in cases.items():
            # every case through deploy; plan shares the loader (one case proves it does)
            for cmd in ("deploy", "plan") if name == "content" else ("deploy",):
                yes = ["--yes"] if cmd == "deploy" else []
                r = run_cli(cmd, "-i", str(inv), "--limit", "sbx1", "--bundle", str(path), *yes, "--json", timeout=60)
                assert r.code == 2, (name, cmd, r.stdout, r.stderr)
                doc = r.json()
                assert doc["exit_code"] == 2 and doc["error"] == "BundleError" and not doc["ok"]
        with pytest.raises(BlockingIOError):
            lsock.accept()  # nobody connected
    finally:
        lsock.close()


# ---------------------------------------------------------------------------------------------
# the sandbox: 4 hosts


@pytest.fixture(scope="module")
def fleet(sandbox):
    """The 4 sandbox hosts, each deployable (reset only the ones that are not)."""
    from ddtree_ops.config.inventory import load_inventory
    from ddtree_ops.fleet.status import collect_status

    names = [h.name for h in sandbox.hosts()]
    if len(names) < 4:
        pytest.skip("the fleet tests need 4 sandbox hosts (DDTREE_OPS_TEST_HOSTS >= 4)")
    inv = load_inventory(sandbox.inventory_path)
    rows = collect_status(list(inv.hosts.values()))
    for row in rows:
        th = TestHost(row["host"], sandbox, Path(sandbox.inventory_path))
        clean = row["ok"] and not row["lock"] and not row["journal"]
        if clean and row["release"] is None:
            clean = th.snapshot([f"{th.host.site_packages}/{DFLASH_INFO}"]).popitem()[1] == \
                __import__("hashlib").sha256(upstream_file(DFLASH_INFO)).hexdigest()
        if not clean:
            sandbox.reset_host(row["host"])
    return [TestHost(n, sandbox, Path(sandbox.inventory_path)) for n in names[:4]]


def _snap(th: TestHost) -> dict:
    """Files and units byte for byte, plus the running units' MainPIDs and the release pointer."""
    h = th.host
    snap = th.snapshot(snapshot_paths(th, RELS) + [f"{h.state_dir}/current"])
    snap["pids"] = {u: th.main_pid(u) for u in (h.unit, *h.conflicts)}
    return snap


def _by_host(doc: dict) -> dict:
    return {h["host"]: h for h in doc["hosts"]}


def test_canary_failure_stops_the_rollout_and_touches_no_other_host(fleet, tmp_path):
    before = {th.name: _snap(th) for th in fleet}
    inv = write_inventory(fleet[0].sandbox, tmp_path / "inv.yaml",
                          {"sbx1": {"extra_args_add": ["--standin-crash-during-load"]}})
    t0 = time.monotonic()
    r = run_cli("deploy", "-i", str(inv), "-p", str(_ps(tmp_path, "canary")), "--batch", "2", "--yes", "--json")
    doc = r.json()
    assert r.code == doc["exit_code"] == 3, r.stderr
    assert doc["aborted"] and "canary" in doc["abort_reason"] and doc["batches"][0] == ["sbx1"]
    hosts = _by_host(doc)
    assert hosts["sbx1"]["outcome"] == "rolled_back"
    for name in ("sbx2", "sbx3", "sbx4"):
        assert hosts[name]["outcome"] == "skipped" and hosts[name]["steps"] == []
    for th in fleet:
        now = _snap(th)
        if th.name == "sbx1":  # rolled back byte for byte; its DFlash server was restarted
            now.pop("pids"), before["sbx1"].pop("pids")
            assert th.unit_state(th.host.conflicts[0]) == "active"
        assert now == before[th.name], th.name  # the rest untouched, servers never restarted
    assert time.monotonic() - t0 < 150


def test_max_fail_must_be_exceeded_and_an_abort_reverts_what_this_run_updated(fleet, tmp_path):
    sb = fleet[0].sandbox
    # sbx1 refuses in preflight (not enough disk for its min_free_mb): one failed target per batch of 2.
    inv = write_inventory(sb, tmp_path / "inv.yaml", {"sbx1": {"min_free_mb": 10_000_000}})
    sbx1_before = _snap(fleet[0])
    ps_a = _ps(tmp_path / "a", "budget-a")
    r = run_cli("deploy", "-i", str(inv), "-p", str(ps_a), "--canary", "0", "--batch", "2", "--max-unavailable", "2",
                "--max-fail", "50%", "--yes", "--json")
    doc = r.json()
    assert r.code == doc["exit_code"] == 2, r.stderr  # one host refused; 1 of 2 = 50% is not > 50%
    assert not doc["aborted"] and doc["batches"] == [["sbx1", "sbx2"], ["sbx3", "sbx4"]]
    hosts = _by_host(doc)
    assert hosts["sbx1"]["outcome"] == "refused"
    assert [hosts[n]["outcome"] for n in ("sbx2", "sbx3", "sbx4")] == ["deployed"] * 3
    after_a = {th.name: _snap(th) for th in fleet}
    assert after_a["sbx1"] == sbx1_before

    # Same failure with 49%: 50% > 49% → no new batch; sbx2 (updated by this run) goes back to release A.
    r = run_cli("deploy", "-i", str(inv), "-p", str(_ps(tmp_path / "b", "budget-b")), "--canary", "0",
                "--batch", "2", "--max-unavailable", "2", "--max-fail", "49", "--yes", "--json")
    doc = r.json()
    assert r.code == doc["exit_code"] == 3, r.stderr
    assert doc["aborted"] and "exceeded" in doc["abort_reason"] and doc["reverted"] == ["sbx2"]
    hosts = _by_host(doc)
    assert hosts["sbx2"]["outcome"] == "reverted"
    assert hosts["sbx3"]["outcome"] == hosts["sbx4"]["outcome"] == "skipped"
    for th in fleet:
        now = _snap(th)
        if th.name == "sbx2":  # back on release A: same files and unit; the server was restarted
            now.pop("pids"), after_a[th.name].pop("pids")
        assert now == after_a[th.name], th.name
    r = run_cli("status", "-i", str(sb.inventory_path), "--limit", "sbx2", "--json")
    row = r.json()["hosts"][0]
    assert row["patchset"] == "fleet-budget-a-1.0.0" and row["drift"] == [] and row["health"] == 200


@pytest.fixture
def sbx4_down(fleet):
    sb = fleet[0].sandbox
    sb.stop_sshd("sbx4")
    addr = fleet[3].host.address
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection((addr, 22), timeout=0.5).close()
            time.sleep(0.1)
        except OSError:
            break
    yield fleet[3]
    sb.reset_host("sbx4")


def test_one_host_down_is_a_status_row_and_fails_only_itself_within_the_budget(fleet, sbx4_down, tmp_path):
    """The host that is down has a 3 s reconnect window: each command waits for it that long before
    it counts as down (60 s by default; tests/test_ssh_blips.py proves the window itself), and the
    other hosts keep theirs."""
    inv = str(sbx4_down.with_vars(tmp_path, reconnect_window_s=3).inventory)
    r = run_cli("status", "-i", inv, "--json")
    doc = r.json()
    assert r.code == doc["exit_code"] == 1, r.stderr
    rows = _by_host(doc)
    assert not rows["sbx4"]["reachable"] and rows["sbx4"]["reason"]
    assert all(rows[n]["reachable"] for n in ("sbx1", "sbx2", "sbx3"))

    from ddtree_ops.artifacts.bundle import build_bundle
    b = build_bundle(str(_ps(tmp_path, "down")), tmp_path / "dist")
    t0 = time.monotonic()
    r = run_cli("deploy", "-i", inv, "--bundle", str(b.path), "--max-fail", "25%", "--max-unavailable", "3", "--yes",
                "--json")
    doc = r.json()
    assert r.code == doc["exit_code"] == 1, r.stderr  # unreachable: 1 of 4 = 25%, within the budget
    assert not doc["aborted"] and doc["bundle"] == b.id
    hosts = _by_host(doc)
    assert hosts["sbx4"]["outcome"] == "unreachable"
    assert [hosts[n]["outcome"] for n in ("sbx1", "sbx2", "sbx3")] == ["deployed"] * 3
    assert time.monotonic() - t0 < 200

    r = run_cli("status", "-i", inv, "--json")
    rows = _by_host(r.json())
    for n in ("sbx1", "sbx2", "sbx3"):
        row = rows[n]
        assert row["reachable"] and row["bundle"] == b.id and row["patchset"] == "fleet-down-1.0.0"
        assert row["release"] == hosts[n]["release"] and row["drift"] == []
        assert (row["budget"], row["topk_cap"], row["algorithm"]) == (16, 4, "DDTREE")
        assert row["active_unit"] == fleet[0].host.unit and row["health"] == 200
        assert isinstance(row["avg_accept_length"], float)
    assert not rows["sbx4"]["reachable"]
    # Drift: a file changed behind the tool's back shows up.
    probe = f"{fleet[1].host.site_packages}/{PROBE}"
    original = fleet[1].read(probe)
    fleet[1].ssh(["sh", "-c", f"echo '# hand edit' >> {probe}"])
    r = run_cli("status", "-i", inv, "--limit", "sbx2", "--json")
    row = r.json()["hosts"][0]
    assert r.code == 1 and [d["path"].rsplit("/", 1)[1] for d in row["drift"]] == ["ddtree_probe.py"]
    fleet[1].ssh(["sh", "-c", f"cat > {probe}"], stdin=original.decode())
    r = run_cli("status", "-i", inv, "--limit", "sbx2", "--json")
    assert r.json()["hosts"][0]["drift"] == [] and r.code == 0, r.stdout


def test_multinode_server_deploys_and_rolls_back_all_nodes_together(fleet, tmp_path):
    sb = fleet[0].sandbox
    inv = write_inventory(sb, tmp_path / "inv.yaml", multinode=["sbx3", "sbx4"])
    nodes = [TestHost("sbx3", sb, inv), TestHost("sbx4", sb, inv)]
    before = {th.name: _snap(th) for th in (*fleet[:2], *nodes)}
    r = run_cli("deploy", "-i", str(inv), "--limit", "sbx4", "-p", str(_ps(tmp_path, "multinode")), "--yes", "--json")
    doc = r.json()
    assert r.code == doc["exit_code"] == 0, r.stderr
    assert doc["batches"] == [["server1"]] and any("sbx3" in n for n in doc["notes"])
    hosts = _by_host(doc)
    assert set(hosts) == {"sbx3", "sbx4"}
    assert hosts["sbx3"]["outcome"] == hosts["sbx4"]["outcome"] == "deployed"
    assert hosts["sbx3"]["release"] == hosts["sbx4"]["release"]
    # rank 0 restarted last; only node 0 waited on and gated
    steps = {n: [s["step"] for s in hosts[n]["steps"]] for n in ("sbx3", "sbx4")}
    assert "health gate" in steps["sbx3"] and "health gate" not in steps["sbx4"]
    t_restart = {n: next(s["t"] for s in hosts[n]["steps"] if s["step"] == "restart") for n in ("sbx3", "sbx4")}
    assert t_restart["sbx4"] < t_restart["sbx3"]
    addr0 = nodes[0].host.address
    for rank, th in enumerate(nodes):
        unit = th.read(th.host.unit_path).decode()
        assert "--nnodes 2" in unit and f"--node-rank {rank}" in unit and f"--dist-init-addr {addr0}:20000" in unit
        assert th.read(f"{th.host.site_packages}/{PROBE}") == b"PROBE = 'multinode'\n"
        assert th.unit_state(th.host.unit) == "active"
    for th in fleet[:2]:
        assert _snap(th) == before[th.name]
    r = run_cli("status", "-i", str(inv), "--limit", "server1", "--json")
    rows = _by_host(r.json())
    assert rows["sbx3"]["health"] == 200 and rows["sbx4"]["health"] == "n/a (rank 1)"
    assert r.code == 0, r.stdout

    r = run_cli("rollback", "-i", str(inv), "--limit", "server1", "--yes", "--json")
    doc = r.json()
    assert r.code == doc["exit_code"] == 0, r.stderr
    assert [h["outcome"] for h in doc["hosts"]] == ["rolled_back", "rolled_back"]
    for th in nodes:
        now = _snap(th)
        now.pop("pids"), before[th.name].pop("pids")
        assert now == before[th.name], th.name
