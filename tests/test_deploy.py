"""`ddtree-ops deploy`, `rollback`, `plan`, `render` and `history` on real sandbox hosts."""

from __future__ import annotations

import hashlib
import time

import httpx
import pytest

from ddtree_ops.artifacts.units import parse_exec_flags
from kit import DFLASH_INFO, REPO, make_patchset, run_cli, snapshot_paths, upstream_file

DDTREE = "sglang-k26-ddtree.service"
DFLASH = "sglang-k26-dflash-cg.service"
PROBE = "sglang/srt/speculative/ddtree_probe.py"
UPSTREAM_DFLASH_INFO = "71d17803fb088089e1124a58efa5bc46734fd4404c7387a690faadacda50b2d3"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _healthy(th) -> bool:
    try:
        return httpx.get(th.host.base_url + "/health", timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


def test_deploy_installs_the_patch_set_renders_the_unit_and_serves(fresh_host, good_patchset):
    r = run_cli("deploy", "-i", str(fresh_host.inventory), "-p", str(good_patchset), "--budget", "16",
                "--topk-cap", "4", "--yes", "--json")
    assert r.code == 0, r.stderr
    doc = r.json()
    assert doc["hosts"][0]["outcome"] == "deployed"
    h = fresh_host.host
    for rel in (PROBE, DFLASH_INFO):
        assert fresh_host.read(f"{h.site_packages}/{rel}") == (good_patchset / "files" / rel).read_bytes()
    unit = fresh_host.read(h.unit_path).decode()
    assert parse_exec_flags(unit) == {"algorithm": "DDTREE", "budget": 16, "topk_cap": 4}
    assert fresh_host.unit_state(DDTREE) == "active"
    assert fresh_host.unit_state(DFLASH) != "active"
    assert _healthy(fresh_host)
    hist = run_cli("history", "--host", "sbx1", "-i", str(fresh_host.inventory), "--json").json()
    assert hist["current"] == doc["hosts"][0]["release"]
    assert hist["releases"][-1]["outcome"] == "deployed"
    assert (hist["releases"][-1]["budget"], hist["releases"][-1]["topk_cap"]) == (16, 4)


def test_the_real_ddtree_payload_is_imported_and_exercised_by_the_server(fresh_host):
    r = run_cli("deploy", "-i", str(fresh_host.inventory), "-p", "ddtree-temp", "--yes", "--json")
    assert r.code == 0, r.stderr
    h = fresh_host.host
    gen = httpx.post(h.base_url + "/generate", json={"text": "x", "sampling_params": {
        "temperature": 0.8, "top_p": 0.9, "max_new_tokens": 24}}, timeout=30).json()
    assert gen["meta_info"]["spec_ddtree"] is True
    assert gen["meta_info"]["completion_tokens"] == 24
    log = fresh_host.ssh(["journalctl", "-u", DDTREE, "-n", "200", "--no-pager"]).stdout
    assert "ddtree_utils" in log and "DDTree modules imported" in log


def test_plan_shows_the_changes_and_changes_nothing(fresh_host, good_patchset):
    paths = snapshot_paths(fresh_host, [PROBE, DFLASH_INFO])
    before = fresh_host.snapshot(paths)
    r = run_cli("plan", "-i", str(fresh_host.inventory), "-p", str(good_patchset), "--json")
    assert r.code == 0, r.stderr
    plan = r.json()["plans"][0]
    status = {f["rel"]: (f["status"], f["old_sha256"]) for f in plan["files"]}
    assert status[PROBE] == ("new", None)
    assert status[DFLASH_INFO] == ("change", UPSTREAM_DFLASH_INFO)
    assert "-    --speculative-ddtree-budget 7" in plan["unit_diff"]
    assert "+    --speculative-ddtree-budget 16" in plan["unit_diff"]
    assert plan["stop_units"] == [DFLASH]
    assert fresh_host.snapshot(paths) == before
    assert fresh_host.unit_state(DFLASH) == "active"


def test_module_with_a_syntax_error_is_refused_in_preflight_and_nothing_changes(fresh_host, tmp_path):
    ps = make_patchset(tmp_path, {
        "sglang/srt/speculative/ddtree_broken.py": b"def oops(:\n    pass\n",
        DFLASH_INFO: upstream_file(DFLASH_INFO) + b"\n# x\n",
    })
    paths = snapshot_paths(fresh_host, ["sglang/srt/speculative/ddtree_broken.py", DFLASH_INFO])
    before = fresh_host.snapshot(paths)
    pid_before = fresh_host.main_pid(DFLASH)
    r = run_cli("deploy", "-i", str(fresh_host.inventory), "-p", str(ps), "--yes")
    assert r.code == 2, r.stderr
    assert "does not compile" in r.stderr and "ddtree_broken.py:1" in r.stderr
    assert fresh_host.snapshot(paths) == before
    assert fresh_host.main_pid(DFLASH) == pid_before  # not even restarted
    assert fresh_host.ssh(["test", "-e", "/var/lib/ddtree-ops/journal.json"], check=False).exit_code != 0
    assert fresh_host.ssh(["test", "-e", "/var/lib/ddtree-ops/lock"], check=False).exit_code != 0


def test_module_that_raises_at_import_is_caught_while_loading_and_rolled_back(fresh_host, tmp_path):
    ps = make_patchset(tmp_path, {
        "sglang/srt/speculative/ddtree_raises.py": b"raise RuntimeError('boom at import')\n",
        DFLASH_INFO: upstream_file(DFLASH_INFO) + b"\n# x\n",
    })
    # A long weight load and a long deadline: only watching the unit can catch this quickly.
    th = fresh_host.with_vars(tmp_path, extra_args=fresh_host.base_extra_args() + ["--standin-load-seconds=4"],
                              health={"load_deadline_s": 600, "poll_interval_s": 0.3, "consecutive_successes": 2})
    paths = snapshot_paths(th, ["sglang/srt/speculative/ddtree_raises.py", DFLASH_INFO])
    before = th.snapshot(paths)
    t0 = time.monotonic()
    r = run_cli("deploy", "-i", str(th.inventory), "-p", str(ps), "--yes", "--json")
    took = time.monotonic() - t0
    assert r.code == 3, r.stderr
    res = r.json()["hosts"][0]
    assert res["outcome"] == "rolled_back"
    assert res["failed_step"] == "wait for weights"
    assert any("boom at import" in line for line in res["log"]), res["log"]
    assert took < 120  # seconds after the crash, not the 600 s deadline
    assert th.snapshot(paths) == before
    assert th.unit_state(DFLASH) == "active" and th.unit_state(DDTREE) != "active"
    assert _healthy(th)


def test_an_unknown_launch_flag_is_refused_before_the_old_server_stops(fresh_host, tmp_path, good_patchset):
    """The new ExecStart goes through the server's own parser on the host (the stand-in's
    `--parse-only`, which knows SGLang 0.5.23's flags from its source) with the new files in
    place: an unknown flag fails the deploy before DFlash is stopped; its PID never changes."""
    th = fresh_host.with_vars(tmp_path, extra_args=fresh_host.base_extra_args() + ["--mem-fraction-static", "0.8",
                                                                                   "--no-such-sglang-flag", "1"])
    paths = snapshot_paths(th, [PROBE, DFLASH_INFO])
    before, dflash_pid = th.snapshot(paths), th.main_pid(DFLASH)
    r = run_cli("deploy", "-i", str(th.inventory), "-l", th.name, "-p", str(good_patchset), "--yes", "--json")
    assert r.code == 3, r.stderr
    res = r.json()["hosts"][0]
    assert res["failed_step"] == "launch check", res
    assert "unrecognized arguments: --no-such-sglang-flag 1" in res["message"], res["message"]
    assert "--mem-fraction-static" not in res["message"]  # a real SGLang flag is accepted
    assert th.main_pid(DFLASH) == dflash_pid and th.snapshot(paths) == before
    assert th.unit_state(DDTREE) != "active" and _healthy(th)


def test_a_long_generation_in_flight_completes_before_the_server_is_restarted(fresh_host, tmp_path, good_patchset):
    """No router: a redeploy (same unit, new budget) first waits until the server reports no
    request in flight (/v1/loads), then restarts it; the 8 s generation is answered in full (8 s:
    the redeploy's preflight must reach the drain while it is in flight, on a loaded machine too;
    under the health gate's 10 s request timeout, which the first deploy's warm-up must pass)."""
    import threading

    th = fresh_host.with_vars(tmp_path, extra_args=fresh_host.base_extra_args() + ["--standin-generate-seconds", "8"])
    assert run_cli("deploy", "-i", str(th.inventory), "-l", th.name, "-p", str(good_patchset), "--yes").code == 0
    got: list = []
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4}}
    t = threading.Thread(target=lambda: got.append(httpx.post(th.host.base_url + "/generate", json=body, timeout=60)))
    t.start()
    deadline = time.monotonic() + 10
    while httpx.get(th.host.base_url + "/v1/loads", timeout=5).json()["loads"][0]["num_running_reqs"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = run_cli("deploy", "-i", str(th.inventory), "-l", th.name, "-p", str(good_patchset), "--budget", "17", "--yes",
                "--json")
    t.join(60)
    assert r.code == 0, r.stderr
    assert got and got[0].status_code == 200 and got[0].json()["text"], got
    [drain] = [s["detail"] for s in r.json()["hosts"][0]["steps"] if s["step"] == "drain"]
    assert drain.startswith(f"{DDTREE}: 1 request(s) in flight") and "cut" not in drain, drain


def test_gpu_memory_left_behind_by_the_old_server_is_waited_for_before_the_new_one_starts(fresh_host, tmp_path,
                                                                                       good_patchset):
    """The sandbox's nvidia-smi lists the stand-in's 'GPU memory'; a process the old server left
    behind holds some for 3 s after it stopped: the redeploy starts the new server only after that."""
    th = fresh_host.with_vars(tmp_path, extra_args=fresh_host.base_extra_args() + ["--standin-orphan-gpu-seconds", "3"])
    try:
        assert run_cli("deploy", "-i", str(th.inventory), "-l", th.name, "-p", str(good_patchset), "--yes").code == 0
        r = run_cli("deploy", "-i", str(th.inventory), "-l", th.name, "-p", str(good_patchset), "--budget", "17",
                    "--yes", "--json")
        assert r.code == 0, r.stderr
        steps = r.json()["hosts"][0]["steps"]
        [gpus] = [s for s in steps if s["step"] == "gpus free"]
        waited = float(gpus["detail"].split("waited ")[1].split(" s")[0])
        assert waited >= 2.0, gpus
    finally:  # the next test must not meet this server's leftover: stop it, and let the leftover go
        th.ssh(["systemctl", "stop", DDTREE], check=False)
        deadline = time.monotonic() + 30
        while th.ssh(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                     check=False).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.5)


def test_gpu_memory_held_by_a_process_that_is_not_ours_is_refused_in_preflight(fresh_host, good_patchset):
    th = fresh_host
    th.ssh(["sh", "-c", "nohup sh -c 'echo 1234 > /run/ddtree-sandbox/gpu/$$; exec sleep 120' >/dev/null 2>&1 &"])
    pid = int(th.ssh(["sh", "-c", "for f in /run/ddtree-sandbox/gpu/*; do "
                                  "grep -qx 1234 $f && basename $f; done"]).stdout.split()[0])
    try:
        r = run_cli("deploy", "-i", str(th.inventory), "-l", th.name, "-p", str(good_patchset), "--yes")
        assert r.code == 2, r.stderr
        assert f"GPU memory: pid {pid} (sleep 120) holds 1234 MiB" in r.stderr
        assert th.unit_state(DFLASH) == "active"
    finally:
        th.ssh(["kill", str(pid)], check=False)


def test_warm_up_that_never_completes_hits_the_deadline_and_rolls_back(fresh_host, tmp_path, good_patchset):
    th = fresh_host.with_vars(tmp_path, extra_args=fresh_host.base_extra_args() + ["--standin-warmup-never-completes"])
    paths = snapshot_paths(th, [PROBE, DFLASH_INFO])
    before = th.snapshot(paths)
    r = run_cli("deploy", "-i", str(th.inventory), "-p", str(good_patchset), "--yes", "--deadline", "4", "--json")
    assert r.code == 3, r.stderr
    res = r.json()["hosts"][0]
    assert "deadline" in res["message"]
    assert th.snapshot(paths) == before
    assert th.unit_state(DFLASH) == "active" and _healthy(th)


@pytest.mark.parametrize("flags, message", [
    (["--budget", "0"], "--budget must be an integer 1..1024"),
    (["--budget", "2000"], "--budget must be an integer 1..1024"),
    (["--budget", "8", "--topk-cap", "9"], "--topk-cap must be an integer 1..budget (8)"),
    (["--topk-cap", "0"], "--topk-cap must be an integer 1..budget"),
])
def test_invalid_budget_or_topk_exits_2_before_connecting(tmp_path, good_patchset, flags, message):
    # An address nobody answers on: had the tool connected, the error would be a connection error.
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        "all:\n  hosts:\n    ghost:\n      address: 10.200.254.2\n      python: /opt/venv_sglang/bin/python\n"
        "      site_packages: /opt/venv_sglang/lib/python3.11/site-packages\n"
        "      model_path: /m\n      draft_model_path: /d\n"
    )
    r = run_cli("deploy", "-i", str(inv), "-p", str(good_patchset), "--yes", *flags)
    assert r.code == 2
    assert message in r.stderr


def test_drifted_upstream_file_is_refused_unless_forced(fresh_host, good_patchset):
    h = fresh_host.host
    target = f"{h.site_packages}/{DFLASH_INFO}"
    fresh_host.ssh(["sh", "-c", 'echo "# local hotfix" >> "$1"', "sh", target])
    drifted = fresh_host.snapshot([target])
    r = run_cli("deploy", "-i", str(fresh_host.inventory), "-p", str(good_patchset), "--yes")
    assert r.code == 2
    assert "drift" in r.stderr and DFLASH_INFO in r.stderr
    assert fresh_host.snapshot([target]) == drifted
    r = run_cli("deploy", "-i", str(fresh_host.inventory), "-p", str(good_patchset), "--yes", "--force")
    assert r.code == 0, r.stderr
    # ... and a rollback brings back the drifted bytes exactly, not the upstream ones.
    r = run_cli("rollback", "-i", str(fresh_host.inventory), "--yes")
    assert r.code == 0, r.stderr
    assert fresh_host.snapshot([target]) == drifted


def test_held_lock_exits_5_and_names_the_holder(fresh_host, good_patchset):
    from ddtree_ops.host.session import session_to

    with session_to(fresh_host.host) as session:
        store = session.store
        lock = store.acquire_lock("ddtree-ops deploy (another operator)")
        try:
            r = run_cli("deploy", "-i", str(fresh_host.inventory), "-p", str(good_patchset), "--yes")
            assert r.code == 5
            assert "deploy lock held by" in r.stderr and "another operator" in r.stderr
            assert fresh_host.unit_state(DFLASH) == "active"
        finally:
            store.release_lock(lock)


def test_rollback_steps_back_one_release_then_to_original(fresh_host, good_patchset, tmp_path):
    inv = str(fresh_host.inventory)
    assert run_cli("deploy", "-i", inv, "-l", "sbx1", "-p", str(good_patchset), "--yes", "--budget", "16").code == 0
    first = run_cli("history", "--host", "sbx1", "-i", inv, "--json").json()["current"]
    v2 = make_patchset(tmp_path / "v2", {
        PROBE: b"PROBE = 'version 2'\n",
        DFLASH_INFO: upstream_file(DFLASH_INFO) + b"\n# v2\n",
    })
    assert run_cli("deploy", "-i", inv, "-l", "sbx1", "-p", str(v2), "--yes", "--budget", "32").code == 0
    h = fresh_host.host
    assert fresh_host.read(f"{h.site_packages}/{PROBE}") == b"PROBE = 'version 2'\n"

    r = run_cli("rollback", "-i", inv, "-l", "sbx1", "--yes", "--json")
    assert r.code == 0, r.stderr
    assert r.json()["hosts"][0]["release"] == first
    assert fresh_host.read(f"{h.site_packages}/{PROBE}") == (good_patchset / "files" / PROBE).read_bytes()
    assert parse_exec_flags(fresh_host.read(h.unit_path).decode())["budget"] == 16
    assert _healthy(fresh_host)

    r = run_cli("rollback", "-i", inv, "-l", "sbx1", "--yes", "--to", "original", "--json")
    assert r.code == 0, r.stderr
    snap = fresh_host.snapshot([f"{h.site_packages}/{DFLASH_INFO}", f"{h.site_packages}/{PROBE}"])
    assert snap == {f"{h.site_packages}/{DFLASH_INFO}": UPSTREAM_DFLASH_INFO, f"{h.site_packages}/{PROBE}": None}
    assert parse_exec_flags(fresh_host.read(h.unit_path).decode())["budget"] == 7  # the unit as it was
    assert fresh_host.unit_state(DFLASH) == "active" and _healthy(fresh_host)
    hist = run_cli("history", "--host", "sbx1", "-i", inv, "--json").json()
    assert hist["current"] is None
    assert {r["outcome"] for r in hist["releases"]} == {"rolled back"}


# What `pip install -U sglang` to 0.5.24 leaves, as far as the tool can see it: two of the files the
# release replaced rewritten, the dist-info renamed with its new Version (and the way back).
_UPGRADE = r"""for f in "$@"; do echo '# sglang 0.5.24' >> "$SP/$f"; done
mv "$SP/sglang-0.5.23.dist-info" "$SP/sglang-0.5.24.dist-info"
sed -i 's/^Version: 0.5.23$/Version: 0.5.24/' "$SP/sglang-0.5.24.dist-info/METADATA"
"""
_DOWNGRADE = r"""[ -d "$SP/sglang-0.5.24.dist-info" ] || exit 0
mv "$SP/sglang-0.5.24.dist-info" "$SP/sglang-0.5.23.dist-info"
sed -i 's/^Version: 0.5.24$/Version: 0.5.23/' "$SP/sglang-0.5.23.dist-info/METADATA"
"""
# The files a rollback may write (sha256 or "-"), every file of the state dir but the lock file
# (which each run takes), and the units' states: in one round trip.
_LOOK = r"""for f in "$@"; do [ -f "$SP/$f" ] && sha256sum "$SP/$f" || echo "- $SP/$f"; done
find "$STATE" -type f ! -name deploy.lock -exec sha256sum {} + | sort
systemctl is-active "$UNIT" "$OTHER" || true
"""


def test_a_rollback_over_an_upgraded_sglang_is_refused_and_force_restores_the_backups(clean_host, tmp_path):
    """Issue 29: deploy, upgrade SGLang in the venv under the release, roll back: exit 2, nothing
    written, the files and versions named; `rollback --force` restores the backups anyway."""
    th, h = clean_host, clean_host.host
    replaced = [DFLASH_INFO, "sglang/srt/speculative/spec_info.py"]
    ps = make_patchset(tmp_path, {PROBE: b"PROBE = 1\n", **{r: upstream_file(r) + b"\n# patched\n" for r in replaced}})
    inv, env = str(th.inventory), f"SP={h.site_packages} STATE={h.state_dir} UNIT={DDTREE} OTHER={DFLASH}"

    def sh(script: str, *args: str) -> str:
        return th.ssh(["sh", "-c", f"{env}; {script}", "sh", *args]).stdout

    assert run_cli("deploy", "-i", inv, "-l", th.name, "-p", str(ps), "--yes").code == 0
    try:
        before = sh(_UPGRADE + _LOOK, *replaced, PROBE)
        assert "active\ninactive" in before  # control: the release serves

        r = run_cli("rollback", "-i", inv, "-l", th.name, "--yes", "--json")

        assert r.code == 2, r.stderr
        row = r.json()["hosts"][0]
        assert row["outcome"] == "refused" and "nothing was changed" in row["message"], row
        assert all(f"{rel} (expected " in row["message"] for rel in replaced), row["message"]
        assert "SGLang 0.5.24 installed" in row["message"] and "installed onto 0.5.23" in row["message"]
        assert sh(_LOOK, *replaced, PROBE) == before  # not a byte written, no unit touched

        r = run_cli("rollback", "-i", inv, "-l", th.name, "--yes", "--force", "--json")

        assert r.code == 0, r.stderr
        after = sh(_LOOK, *replaced, PROBE).splitlines()
        assert after[:3] == [f"{_sha(upstream_file(rel))}  {h.site_packages}/{rel}" for rel in replaced] + [
            f"- {h.site_packages}/{PROBE}"]
        assert after[-2:] == ["inactive", "active"]  # DFlash serves again
    finally:
        sh(_DOWNGRADE)


def test_render_prints_the_unit_and_rejects_bad_values(sandbox):
    r = run_cli("render", "--host", "sbx1", "-i", str(sandbox.inventory_path), "--budget", "64", "--topk-cap", "8")
    assert r.code == 0, r.stderr
    assert parse_exec_flags(r.stdout) == {"algorithm": "DDTREE", "budget": 64, "topk_cap": 8}
    assert "ExecStart=/opt/venv_sglang/bin/python -m ddtree_ops.testing.standin" in r.stdout
    bad = run_cli("render", "--host", "sbx1", "-i", str(sandbox.inventory_path), "--budget", "4", "--topk-cap", "5")
    assert bad.code == 2 and "--topk-cap" in bad.stderr


def test_ct200_unit_renders_like_the_production_unit():
    r = run_cli("render", "--host", "ct200", "-i", str(REPO / "inventory" / "ct200.yaml"))
    assert r.code == 0, r.stderr
    assert "ExecStart=/root/venv_sglang211/bin/python -m sglang.launch_server" in r.stdout
    assert parse_exec_flags(r.stdout) == {"algorithm": "DDTREE", "budget": 16, "topk_cap": 4}
    assert "--tp 8" in r.stdout and "Conflicts=sglang-k26-dflash-cg.service" in r.stdout
