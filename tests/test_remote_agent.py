"""The host side of a deploy, run locally on temp folders: it is plain Python, so its
guarantees (read-back verified backups, atomic writes, refusal of corrupted backups, stale
bytecode purge, private state) can be checked without any host."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import sys
import threading

import pytest

from ddtree_ops.errors import UnreachableError
from ddtree_ops.host.agent.scrub import scrubbed, secret_values
from ddtree_ops.host.agent.statedir import STATE_MARKER, ensure_state_dir
from ddtree_ops.testing.local_agent import agent_pid, kill_agent, local_agent


def call(req: dict) -> dict:
    """Exactly as the controller does it (AgentChannel's framing and protocol), one agent process
    per request."""
    ch = local_agent()
    try:
        return ch.call(req, 60)
    finally:
        ch.close()


def answer(req: dict) -> dict:
    """The agent's answer document, error or not."""
    ch = local_agent()
    try:
        ch.call({"op": "hello"}, 60)
        return ch._exchange(req, 60)
    finally:
        ch.close()


@pytest.fixture
def host(tmp_path):
    site = tmp_path / "site"
    (site / "pkg" / "__pycache__").mkdir(parents=True)
    (site / "pkg" / "mod.py").write_bytes(b"OLD = 1\n")
    os.chmod(site / "pkg" / "mod.py", 0o640)
    (site / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"stale")
    (site / "pkg" / "__pycache__" / "other.cpython-311.pyc").write_bytes(b"keep")
    ensure_state_dir(str(tmp_path / "state"))  # as the lock, the first step of any operation, does
    return {"site": site, "state": tmp_path / "state"}


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def test_the_typed_store_drives_the_agent_process_through_a_release(host):
    """The controller's typed calls, as the runbook makes them, against a real agent process
    started from the joined source: lock, backup, install, a corrupted backup refused, restore."""
    from types import SimpleNamespace

    from ddtree_ops.host.agent.protocol import BackupPath, InstallFile
    from ddtree_ops.host.release_store import ReleaseStore

    mod = str(host["site"] / "pkg" / "mod.py")
    ch = local_agent()
    try:
        store = ReleaseStore(ch, SimpleNamespace(name="local", state_dir=str(host["state"]),
                                                 site_packages=str(host["site"]), unit_path="/nonexistent.service",
                                                 lock_lease_s=30.0, python=sys.executable, service_user="root"))
        store.acquire_lock("test")
        store.backup("r1", [BackupPath(mod)])
        store.install([InstallFile(mod, base64.b64encode(b"NEW = 2\n").decode(), _sha(b"NEW = 2\n"))])
        assert store.facts([mod])["files"][mod]["sha256"] == _sha(b"NEW = 2\n")
        assert store.verify_backup("r1") == [] and store.remove_partial("r1")
        stored = host["state"] / "releases" / "r1" / "backup" / "files" / "0000"
        good = stored.read_bytes()
        stored.write_bytes(b"tampered")  # control: the same restore refuses a corrupted backup
        assert store.restore("r1").refused and open(mod, "rb").read() == b"NEW = 2\n"
        stored.write_bytes(good)
        assert not store.restore("r1").refused and open(mod, "rb").read() == b"OLD = 1\n"
    finally:
        ch.close()


def test_backup_install_restore_round_trip_is_byte_identical_with_mode(host):
    mod, new = str(host["site"] / "pkg" / "mod.py"), str(host["site"] / "pkg" / "added.py")
    state = str(host["state"])
    call({"op": "backup", "state_dir": state, "release_id": "r1",
          "paths": [{"path": mod}, {"path": new}]})
    data = b"NEW = 2\n"
    res = call({"op": "install", "state_dir": state, "files": [
        {"path": mod, "content_b64": base64.b64encode(data).decode(), "sha256": _sha(data), "mode": 0o644},
        {"path": new, "content_b64": base64.b64encode(data).decode(), "sha256": _sha(data), "mode": 0o644}]})
    assert open(mod, "rb").read() == data and open(new, "rb").read() == data
    assert res["installed"][0]["purged"] == [str(host["site"] / "pkg" / "__pycache__" / "mod.cpython-311.pyc")]
    assert (host["site"] / "pkg" / "__pycache__" / "other.cpython-311.pyc").exists()
    res = call({"op": "restore", "state_dir": state, "backup_dir": f"{state}/releases/r1/backup"})
    assert not res["refused"]
    assert open(mod, "rb").read() == b"OLD = 1\n"
    assert stat.S_IMODE(os.stat(mod).st_mode) == 0o640
    assert not os.path.exists(new)  # it did not exist before the release


def test_state_dir_and_backups_are_private(host):
    state = str(host["state"])
    call({"op": "backup", "state_dir": state, "release_id": "r1",
          "paths": [{"path": str(host["site"] / "pkg" / "mod.py")}]})
    for d in (state, f"{state}/releases", f"{state}/releases/r1", f"{state}/original"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    for root, _dirs, files in os.walk(state):
        for f in files:
            assert stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode) & 0o077 == 0, f


def test_a_corrupted_backup_is_refused_and_nothing_is_restored(host):
    mod = str(host["site"] / "pkg" / "mod.py")
    state = str(host["state"])
    call({"op": "backup", "state_dir": state, "release_id": "r1", "paths": [{"path": mod}]})
    with open(mod, "wb") as fh:
        fh.write(b"CURRENT = 3\n")
    stored = f"{state}/releases/r1/backup/files/0000"
    with open(stored, "ab") as fh:
        fh.write(b"bitrot")
    res = call({"op": "restore", "state_dir": state, "backup_dir": f"{state}/releases/r1/backup"})
    assert res["refused"] and "sha256" in res["problems"][0]
    assert open(mod, "rb").read() == b"CURRENT = 3\n"


def test_install_rejects_content_that_arrived_corrupted(host):
    mod = str(host["site"] / "pkg" / "mod.py")
    doc = answer({"op": "install", "state_dir": str(host["state"]), "files": [
        {"path": mod, "content_b64": base64.b64encode(b"X").decode(), "sha256": _sha(b"Y"), "mode": 0o644}]})
    assert not doc["ok"] and "corrupted" in doc["error"]
    assert open(mod, "rb").read() == b"OLD = 1\n"
    assert [f for f in os.listdir(host["site"] / "pkg") if f.endswith(".tmp")] == []


@pytest.fixture
def agents():
    """agents(n) -> n agent processes (local, over pipes); every one is closed after the test."""
    started = []

    def start(n):
        chans = [local_agent() for _ in range(n)]
        started.extend(chans)
        return chans

    yield start
    for ch in started:
        ch.close()


def _lock(ch, state, token, user="alice", **kw):
    return ch.call({"op": "lock", "state_dir": state, "holder": {"token": token, "user": user}, **kw}, 60)


def test_the_lock_lives_as_long_as_its_agent_process(host, agents):
    state = str(host["state"])
    a, b = agents(2)
    assert _lock(a, state, "t1")["acquired"]
    refused = _lock(b, state, "t2", "bob")
    assert not refused["acquired"]
    assert (refused["holder"]["user"], refused["holder"]["token"]) == ("alice", "t1")
    assert refused["holder"]["agent_pid"] == agent_pid(a)
    kill_agent(a)  # the controller was killed / its connection cut: nothing more is said
    assert _lock(b, state, "t2", "bob")["acquired"]


def test_only_the_holder_unlocks_and_the_next_run_takes_it_at_once(host, agents):
    state = str(host["state"])
    a, b = agents(2)
    _lock(a, state, "t1")
    assert not b.call({"op": "unlock", "state_dir": state, "token": "t1"}, 60)["released"]  # b holds nothing
    assert a.call({"op": "unlock", "state_dir": state, "token": "t1"}, 60)["released"]
    got = _lock(b, state, "t2", "bob")
    assert got["acquired"] and got["holder"]["generation"] == 2


def test_break_lock_needs_the_holders_token_and_ends_that_holder(host, agents):
    state = str(host["state"])
    a, b = agents(2)
    _lock(a, state, "t1")
    assert not _lock(b, state, "t2", "bob", **{"break": "not-the-token"})["acquired"]
    assert _lock(b, state, "t2", "bob", **{"break": "t1"})["acquired"]
    with pytest.raises(UnreachableError):  # the broken holder's agent is gone
        a.call({"op": "history", "state_dir": state}, 10)


def test_reading_a_dead_agents_error_output_ends_at_the_end_of_the_stream():
    """A pipe at its end stays "ready" to select(): the reader must stop at an empty read, not
    spin (it once hung a test run for 15 minutes at 100 % CPU)."""
    ch = local_agent()

    class AtEof:
        reads = 0

        def recv_stderr_ready(self) -> bool:
            return True

        def recv_stderr(self, n: int) -> bytes:
            AtEof.reads += 1
            if AtEof.reads > 1000:
                raise AssertionError("still reading an ended stream")
            return b"Traceback: boom\n" if AtEof.reads == 1 else b""

    ch._chan = AtEof()
    assert ch._stderr() == "Traceback: boom" and AtEof.reads == 2


def test_two_breakers_with_the_same_token_cannot_both_win(host, agents):
    state = str(host["state"])
    holder, *breakers = agents(3)
    _lock(holder, state, "t1")
    for ch in breakers:
        ch.call({"op": "hello"}, 30)  # both agents up, so the two lock requests really race
    results: list = [None, None]

    def run(i):
        results[i] = _lock(breakers[i], state, f"b{i}", f"breaker{i}", **{"break": "t1"})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(r["acquired"] for r in results) == [False, True]


def test_a_state_dir_the_tool_did_not_create_is_refused_and_left_alone(tmp_path):
    system = tmp_path / "lib"
    system.mkdir()
    (system / "dpkg").mkdir()
    system.chmod(0o755)
    doc = answer({"op": "lock", "state_dir": str(system), "holder": {"token": "t"}})
    assert not doc["ok"] and "not created by ddtree-ops" in doc["error"]
    assert stat.S_IMODE(system.stat().st_mode) == 0o755 and os.listdir(system) == ["dpkg"]
    fresh = tmp_path / "new" / "ddtree-ops"
    assert call({"op": "lock", "state_dir": str(fresh), "holder": {"token": "t"}})["acquired"]
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700 and (fresh / STATE_MARKER).is_file()


def test_a_corrupt_journal_is_reported_not_raised(host):
    (host["state"] / "journal.json").write_text('{"release": "r1", "st')
    facts = call({"op": "facts", "state_dir": str(host["state"]), "site_packages": str(host["site"]),
                  "unit_path": str(host["site"] / "x.service"), "paths": []})
    assert facts["journal"] is None and "not valid JSON" in facts["journal_error"]


def test_the_agent_runs_only_systemctl_and_journalctl_and_never_a_shell(host):
    doc = answer({"op": "run", "argv": ["sh", "-c", "touch /tmp/x"]})
    assert not doc["ok"] and "not a program the agent runs" in doc["error"]


def test_compile_uses_the_venvs_interpreter_and_reports_file_and_line(host):
    bad = base64.b64encode(b"x = 1\ndef f(:\n").decode()
    res = call({"op": "compile", "files": {"/x/ddtree_bad.py": bad}, "python": sys.executable})
    assert len(res["errors"]) == 1 and res["errors"][0].startswith("/x/ddtree_bad.py:2: SyntaxError")


def test_original_keeps_the_first_pre_state_of_each_path(host):
    mod = str(host["site"] / "pkg" / "mod.py")
    state = str(host["state"])
    call({"op": "backup", "state_dir": state, "release_id": "r1", "paths": [{"path": mod}]})
    with open(mod, "wb") as fh:
        fh.write(b"R1 = 1\n")
    call({"op": "backup", "state_dir": state, "release_id": "r2", "paths": [{"path": mod}]})
    manifest = json.load(open(f"{state}/original/manifest.json"))
    assert [e["sha256"] for e in manifest["entries"]] == [_sha(b"OLD = 1\n")]


def test_prune_keeps_the_newest_and_the_current_chain(host):
    state = str(host["state"])
    for i in range(6):
        call({"op": "release_write", "state_dir": state, "release_id": f"r{i}",
              "fields": {"created": i, "previous": f"r{i-1}" if i else None}})
    call({"op": "set_current", "state_dir": state, "release_id": "r2"})
    removed = call({"op": "prune", "state_dir": state, "keep": 2})["removed"]
    assert sorted(removed) == ["r0", "r3"]  # r1, r2 on the current chain; r4, r5 newest


def test_secret_files_leave_no_hash_and_their_values_are_blanked_from_log_tails(host, tmp_path):
    """The agent reports a secret file's mode and owner only, and blanks the values of its
    secret-named keys (and an EnvironmentFile's) out of what systemctl/journalctl print."""
    secrets = tmp_path / "secrets.yaml"
    secrets.write_text("api-key: 'sk-live-123456'\nport: 30000\n")
    envf = tmp_path / "env"
    envf.write_text("HF_TOKEN=hf_abcdef\nNCCL_P2P_DISABLE=0\n")
    facts = call({"op": "facts", "state_dir": str(host["state"]), "site_packages": str(host["site"]),
                  "unit_path": str(host["site"] / "x.service"), "paths": [], "secret_paths": [str(secrets)]})
    f = facts["files"][str(secrets)]
    assert f["exists"] and f["sha256"] is None and f["mode"] == stat.S_IMODE(secrets.stat().st_mode)
    values = secret_values([str(secrets), str(envf)], ["KEY", "TOKEN"])
    assert values == ["sk-live-123456", "hf_abcdef"]
    res = scrubbed({"stdout": "server_args={'api_key': 'sk-live-123456', 'port': 30000} hf_abcdef\n",
                    "stderr": ""}, values)
    assert res["stdout"] == "server_args={'api_key': '***', 'port': 30000} ***\n"


def test_a_lock_directory_left_by_an_older_version_is_respected_and_broken_only_by_its_token(host, agents):
    state = host["state"]
    (state / "lock").mkdir()
    (state / "lock" / "holder.json").write_text(json.dumps({"token": "old1", "user": "carol"}))
    [ch] = agents(1)
    refused = _lock(ch, str(state), "t1")
    assert not refused["acquired"] and refused["holder"]["legacy"] and refused["holder"]["user"] == "carol"
    assert _lock(ch, str(state), "t1", **{"break": "old1"})["acquired"]
    assert not (state / "lock").exists()
