"""The host side of a deploy, run locally on temp folders: it is plain Python, so its
guarantees (read-back verified backups, atomic writes, refusal of corrupted backups, stale
bytecode purge, private state) can be checked without any host."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import subprocess
import sys

import pytest

from ddtree_ops import remote_agent as agent


def call(req: dict) -> dict:
    """Exactly as the controller does it: the agent's source and the request on stdin."""
    payload = json.dumps({"agent": open(agent.__file__).read(), "request": req})
    r = subprocess.run([sys.executable, "-c", agent.BOOTSTRAP], input=payload, capture_output=True, text=True)
    doc = json.loads(r.stdout)
    assert doc["ok"], doc
    return doc["result"]


@pytest.fixture
def host(tmp_path):
    site = tmp_path / "site"
    (site / "pkg" / "__pycache__").mkdir(parents=True)
    (site / "pkg" / "mod.py").write_bytes(b"OLD = 1\n")
    os.chmod(site / "pkg" / "mod.py", 0o640)
    (site / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"stale")
    (site / "pkg" / "__pycache__" / "other.cpython-311.pyc").write_bytes(b"keep")
    return {"site": site, "state": tmp_path / "state"}


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


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
    payload = json.dumps({"agent": open(agent.__file__).read(), "request": {
        "op": "install", "state_dir": str(host["state"]), "files": [
            {"path": mod, "content_b64": base64.b64encode(b"X").decode(), "sha256": _sha(b"Y"), "mode": 0o644}]}})
    r = subprocess.run([sys.executable, "-c", agent.BOOTSTRAP], input=payload, capture_output=True, text=True)
    doc = json.loads(r.stdout)
    assert not doc["ok"] and "corrupted" in doc["error"]
    assert open(mod, "rb").read() == b"OLD = 1\n"
    assert [f for f in os.listdir(host["site"] / "pkg") if f.endswith(".tmp")] == []


def test_lock_is_exclusive_and_names_its_holder(host):
    state = str(host["state"])
    first = call({"op": "lock", "state_dir": state, "holder": {"token": "t1", "user": "alice"}})
    second = call({"op": "lock", "state_dir": state, "holder": {"token": "t2", "user": "bob"}})
    assert first["acquired"] and not second["acquired"]
    assert second["holder"]["user"] == "alice"
    assert not call({"op": "unlock", "state_dir": state, "token": "t2"})["released"]  # not bob's to release
    assert call({"op": "lock", "state_dir": state, "break": True, "holder": {"token": "t3", "user": "bob"}})["acquired"]


def test_compile_uses_the_hosts_interpreter_and_reports_file_and_line(host):
    bad = base64.b64encode(b"x = 1\ndef f(:\n").decode()
    res = call({"op": "compile", "state_dir": str(host["state"]), "files": {"/x/ddtree_bad.py": bad}})
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
