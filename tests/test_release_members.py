"""A release ships only what it declares, where it may, and leaves no bytecode to shadow it.

* a patch set folder: files outside the manifest's `packages`, `.pth`, `*customize.py`,
  `__pycache__/`, `.pyc`/`.pyo`, symlinks and non-regular files are refused at load, one line
  naming the file (bundles: tests/test_bundle_hostile.py);
* the agent's bytecode purge: every installed or restored module loses its cached bytecode
  whatever order the files came in, and a rollback leaves the bytecode of files it did not
  change alone;
* drift at backup: a file edited between preflight and backup is not backed up and replaced;
  the deploy stops with exit 2 and the host as preflight saw it, and --force goes ahead.

No test host: the fast tier (the agent's ops run in-process; the deploy runs on a fake host).
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

import pytest
import yaml

from ddtree_ops.artifacts.patchset import load_patchset
from ddtree_ops.artifacts.release_members import member_problem
from ddtree_ops.errors import EXIT_BAD_INPUT, EXIT_ROLLED_BACK, ChangedSincePreflight, PatchSetError
from ddtree_ops.fleet.multinode import deploy_server
from ddtree_ops.fleet.rollout import Target
from ddtree_ops.host.agent.backup import op_backup, op_restore
from ddtree_ops.host.agent.install import op_install
from ddtree_ops.host.agent.protocol import Backup, BackupPath, Install, InstallFile, Restore
from ddtree_ops.host.agent.statedir import ensure_state_dir
from ddtree_ops.host.hooks import Hooks
from ddtree_ops.runbook.deploy import deploy_host
from ddtree_ops.runbook.events import quiet
from ddtree_ops.runbook.options import DeployOptions
from ddtree_ops.runbook.results import Outcome
from ddtree_ops.testing.fake_host import UPSTREAM_BYTES, UPSTREAM_REL

OPTS = DeployOptions(reconnect_s=5)
GOOD = "sglang/srt/speculative/ddtree_probe.py"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- patch set folders

def write_ps(root: Path, files: dict[str, bytes], *, listed: list[str] | None = None,
             packages: list[str] | None = None) -> Path:
    """A patch set folder shipping `files`; the manifest lists `listed` (default: all of them)."""
    d = root / "ps"
    for rel, data in files.items():
        (d / "files" / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / "files" / rel).write_bytes(data)
    (d / "files").mkdir(parents=True, exist_ok=True)
    entries = [{"path": rel, "action": "add"} for rel in (files if listed is None else listed)]
    (d / "manifest.yaml").write_text(yaml.safe_dump({"name": "ps", "version": "1.0.0", "sglang": "==0.5.23",
                                                     "packages": packages or ["sglang"], "files": entries}))
    return d


def refused_at_load(d: Path, match: str) -> str:
    with pytest.raises(PatchSetError) as e:
        load_patchset(str(d))
    line = str(e.value)
    assert "\n" not in line and match in line and e.value.exit_code == EXIT_BAD_INPUT, line
    return line


REFUSED = [
    ("sglang/evil.pth", "is a .pth file"),
    ("sglang/sitecustomize.py", "is a *customize.py"),
    ("sglang/usercustomize.py", "is a *customize.py"),
    ("sglang/srt/ddtree_customize.py", "is a *customize.py"),
    ("sglang/srt/__pycache__/server_args.cpython-311.pyc", "is under __pycache__/"),
    ("sglang/srt/server_args.pyc", "is bytecode"),
    ("sglang/srt/server_args.pyo", "is bytecode"),
]


@pytest.mark.parametrize("rel, why", REFUSED)
def test_a_listed_member_that_runs_at_start_or_shadows_source_is_refused_naming_it(tmp_path, rel, why):
    line = refused_at_load(write_ps(tmp_path, {GOOD: b"P = 1\n", rel: b"import os\n"}), why)
    assert rel in line


@pytest.mark.parametrize("rel, why", REFUSED)
def test_an_unlisted_member_of_a_refused_kind_is_named_for_what_it_is(tmp_path, rel, why):
    line = refused_at_load(write_ps(tmp_path, {GOOD: b"P = 1\n", rel: b"import os\n"}, listed=[GOOD]), why)
    named = line.split(": ", 1)[1].split(" ", 1)[0]  # the file, or the __pycache__ folder holding it
    assert named.startswith("files/sglang/") and f"files/{rel}".startswith(named), line


def test_an_allowed_member_loads_and_one_outside_the_named_packages_is_refused(tmp_path):
    ps = load_patchset(str(write_ps(tmp_path / "a", {GOOD: b"P = 1\n", "sglang/srt/customize_args.py": b"C = 1\n"})))
    assert {f.path for f in ps.files} == {GOOD, "sglang/srt/customize_args.py"} and ps.packages == ("sglang",)
    line = refused_at_load(write_ps(tmp_path / "b", {GOOD: b"P = 1\n", "torch/hook.py": b"H = 1\n"}),
                           "'torch/hook.py' is outside the packages the manifest names (sglang)")
    assert "files[1].path" in line
    # control: the same file loads once its package is named
    ps = load_patchset(str(write_ps(tmp_path / "c", {GOOD: b"P = 1\n", "torch/hook.py": b"H = 1\n"},
                                    packages=["sglang", "torch"])))
    assert "torch/hook.py" in {f.path for f in ps.files}


def test_the_digest_changes_with_the_packages_a_set_may_write_into(tmp_path):
    one = load_patchset(str(write_ps(tmp_path / "a", {GOOD: b"P = 1\n"})))
    two = load_patchset(str(write_ps(tmp_path / "b", {GOOD: b"P = 1\n"}, packages=["sglang", "sgl_kernel"])))
    assert one.digest() != two.digest()


def test_the_real_payload_declares_sglang_as_its_only_package():
    assert load_patchset("ddtree-temp").packages == ("sglang",)


@pytest.mark.parametrize("make, why", [
    (lambda p: os.symlink("/etc/passwd", p), "is a symlink"),
    (lambda p: os.mkfifo(p), "is not a regular file"),
    (lambda p: p.mkdir(), "is not a regular file"),
], ids=["symlink", "fifo", "folder"])
def test_a_listed_member_that_is_not_a_regular_file_is_refused(tmp_path, make, why):
    d = write_ps(tmp_path, {GOOD: b"P = 1\n"}, listed=[GOOD, "sglang/odd.py"])
    make(d / "files" / "sglang" / "odd.py")
    assert "sglang/odd.py" in refused_at_load(d, why)


def test_an_unlisted_fifo_is_refused_as_not_a_regular_file(tmp_path):
    d = write_ps(tmp_path, {GOOD: b"P = 1\n"})
    os.mkfifo(d / "files" / "sglang" / "pipe")
    refused_at_load(d, "files/sglang/pipe is not a regular file")


@pytest.mark.parametrize("rel", ["sglang/x.py", "sglang/srt/pth_utils.py", "sglang/custom.py",
                                 "sglang/srt/pycache_notes.py", "sglang/data.json"])
def test_names_that_only_resemble_refused_ones_pass_the_member_rule(rel):
    assert member_problem(rel) is None


# --------------------------------------------------------------------------- the bytecode purge

def _install(paths: list[tuple[str, bytes]]) -> dict:
    files = [InstallFile(p, base64.b64encode(d).decode(), _sha(d), 0o644) for p, d in paths]
    return op_install(Install("/unused", files))


def _pyc(folder: Path, stem: str) -> Path:
    cache = folder / "__pycache__"
    cache.mkdir(exist_ok=True)
    p = cache / f"{stem}.cpython-311.pyc"
    p.write_bytes(b"stale bytecode")
    return p


def test_bytecode_written_after_its_module_in_one_install_does_not_survive(tmp_path):
    mod = tmp_path / "m.py"
    pyc = tmp_path / "__pycache__" / "m.cpython-311.pyc"
    (tmp_path / "__pycache__").mkdir()
    _install([(str(mod), b"M = 1\n"), (str(pyc), b"shadowing bytecode")])
    assert mod.read_bytes() == b"M = 1\n" and not pyc.exists()
    # control: the same bytecode with no module of its own installed stays (the purge is per module)
    _install([(str(pyc), b"shadowing bytecode")])
    assert pyc.exists()


def test_an_install_purges_the_cached_bytecode_of_each_module_whatever_the_order(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    stale = [_pyc(tmp_path, "a"), _pyc(tmp_path, "b")]
    other = _pyc(tmp_path, "untouched")
    _install([(str(b), b"B = 1\n"), (str(a), b"A = 1\n")])
    assert [p.exists() for p in stale] == [False, False] and other.exists()


def _backup(tmp_path: Path, paths: list[BackupPath], rid: str = "r1"):
    ensure_state_dir(str(tmp_path / "state"))  # as the deploy lock leaves it
    return op_backup(Backup(str(tmp_path / "state"), rid, paths))


def _restore(tmp_path: Path, rid: str = "r1"):
    return op_restore(Restore(str(tmp_path / "state"), str(tmp_path / "state" / "releases" / rid / "backup")))


def test_a_restore_purges_the_bytecode_of_the_files_it_put_back_and_only_those(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    changed, kept, added = site / "changed.py", site / "kept.py", site / "added.py"
    changed.write_bytes(b"OLD = 1\n")
    kept.write_bytes(b"KEPT = 1\n")
    _backup(tmp_path, [BackupPath(str(p)) for p in (changed, kept, added)])
    changed.write_bytes(b"NEW = 1\n")
    added.write_bytes(b"ADDED = 1\n")
    stale_changed, stale_added, kept_pyc = _pyc(site, "changed"), _pyc(site, "added"), _pyc(site, "kept")
    reply = _restore(tmp_path)
    assert {r["path"]: r["action"] for r in reply.restored} == {
        str(changed): "restored", str(kept): "unchanged", str(added): "removed"}
    assert changed.read_bytes() == b"OLD = 1\n" and not added.exists()
    assert not stale_changed.exists() and not stale_added.exists()
    assert kept_pyc.exists()  # the rollback never changed kept.py: its bytecode is not its business


def test_a_restore_that_changes_no_file_touches_no_bytecode(tmp_path):
    """The rollback of an install that failed before writing a file (a read-only site-packages)
    must not write there in turn."""
    site = tmp_path / "site"
    site.mkdir()
    mod = site / "mod.py"
    mod.write_bytes(b"M = 1\n")
    _backup(tmp_path, [BackupPath(str(mod))])
    pyc = _pyc(site, "mod")
    reply = _restore(tmp_path)
    assert [r["action"] for r in reply.restored] == ["unchanged"] and "purged" not in reply.restored[0]
    assert pyc.exists()
    mod.write_bytes(b"M = 2\n")  # control: once the file differs, the restore does purge
    assert _restore(tmp_path).restored[0]["purged"] == [str(pyc)] and not pyc.exists()


# --------------------------------------------------------------------------- drift at backup (agent)

def test_a_backup_refuses_a_file_that_changed_since_preflight_and_writes_nothing(tmp_path):
    mod, new = tmp_path / "mod.py", tmp_path / "new.py"
    mod.write_bytes(b"EDITED = 1\n")
    reply = _backup(tmp_path, [BackupPath(str(mod), expect_sha256=_sha(b"M = 1\n")),
                               BackupPath(str(new), expect_absent=True)])
    assert [(c.index, c.found_sha256) for c in reply.changed] == [(0, _sha(b"EDITED = 1\n"))]
    assert reply.manifest is None and not (tmp_path / "state" / "releases").exists()
    new.write_bytes(b"APPEARED = 1\n")
    reply = _backup(tmp_path, [BackupPath(str(mod), expect_sha256=_sha(b"EDITED = 1\n")),
                               BackupPath(str(new), expect_absent=True)])
    assert [c.index for c in reply.changed] == [1] and not (tmp_path / "state" / "releases").exists()


def test_a_backup_of_files_as_preflight_read_them_or_sent_without_expectations_goes_ahead(tmp_path):
    mod = tmp_path / "mod.py"
    mod.write_bytes(b"M = 1\n")
    checked = _backup(tmp_path, [BackupPath(str(mod), expect_sha256=_sha(b"M = 1\n")),
                                 BackupPath(str(tmp_path / "new.py"), expect_absent=True)])
    assert checked.changed == [] and [e["existed"] for e in checked.manifest["entries"]] == [True, False]
    mod.write_bytes(b"EDITED = 1\n")
    unchecked = _backup(tmp_path, [BackupPath(str(mod))], rid="r2")  # as an older controller sends it
    assert unchecked.changed == [] and unchecked.manifest["entries"][0]["sha256"] == _sha(b"EDITED = 1\n")


# --------------------------------------------------------------------------- drift at backup (deploy)

class EditBeforeBackup(Hooks):
    """An operator edits a target file while the deploy is between preflight and backup."""

    def __init__(self, fake, rel: str, data: bytes):
        self.fake, self.rel, self.data = fake, rel, data

    def pause(self, point: str) -> None:
        if point == "before-backup":
            self.fake.write(f"{self.fake.host.site_packages}/{self.rel}", self.data)


def _served_by(fake) -> str:
    return "ddtree" if fake.units[fake.host.unit].active == "active" else "dflash"


def test_a_file_edited_between_preflight_and_backup_is_refused_with_exit_2_and_the_host_untouched(fake, patchset):
    edited = UPSTREAM_BYTES + b"# hand edit\n"
    hooks = EditBeforeBackup(fake, UPSTREAM_REL, edited)
    with pytest.raises(ChangedSincePreflight) as e:
        deploy_host(fake.session(hooks), patchset, OPTS)
    msg = str(e.value)
    assert e.value.exit_code == EXIT_BAD_INPUT and "\n" not in msg
    assert msg.startswith(f"{fake.host.name}: ") and f"{UPSTREAM_REL} changed since preflight" in msg
    assert fake.read(f"{fake.host.site_packages}/{UPSTREAM_REL}") == edited
    assert fake.read(f"{fake.host.site_packages}/{GOOD}") is None
    assert _served_by(fake) == "dflash" and "agent install" not in fake.events
    assert not any(ev.startswith("systemctl stop") or ev.startswith("systemctl restart") for ev in fake.events)
    store = fake.session().store
    hist = store.history()
    assert store.facts([])["journal"] is None and hist["current"] is None and not hist["original"]
    assert [(r["outcome"], r["backup_present"]) for r in hist["releases"]] == [
        ("refused at backup: a file changed since preflight; nothing changed", False)]
    assert not list(fake.path(f"{store.state_dir}/releases").glob("*/backup*"))
    # the next run plans against the edit: preflight itself now calls it drift
    with pytest.raises(Exception, match="drift"):
        deploy_host(fake.session(), patchset, OPTS)


def test_with_force_a_file_edited_between_preflight_and_backup_is_backed_up_and_replaced(fake, patchset):
    edited = UPSTREAM_BYTES + b"# hand edit\n"
    forced = DeployOptions(reconnect_s=5, force=True)
    r = deploy_host(fake.session(EditBeforeBackup(fake, UPSTREAM_REL, edited)), patchset, forced)
    assert r.outcome == Outcome.DEPLOYED
    assert fake.read(f"{fake.host.site_packages}/{UPSTREAM_REL}") == UPSTREAM_BYTES + b"# patched\n"


@pytest.mark.parametrize("node", [0, 1])
def test_a_server_node_edited_before_its_backup_refuses_and_nodes_already_changed_roll_back(fake_server, patchset,
                                                                                            node):
    """Node 0 backs up first: refused there, no node changed (exit 2). Refused on node 1, node 0
    had already installed its files, so it is rolled back (exit 3) and the message says why."""
    edited = UPSTREAM_BYTES + b"# hand edit\n"
    hooks = {fake_server[node].host.name: EditBeforeBackup(fake_server[node], UPSTREAM_REL, edited)}
    before = [fake.tree(fake.host.site_packages) for fake in fake_server]
    before[node][f"/{fake_server[node].host.site_packages.lstrip('/')}/{UPSTREAM_REL}"] = edited
    by_name = {n.host.name: n for n in fake_server}
    rows = deploy_server(Target("server1", tuple(n.host for n in fake_server)), patchset, OPTS,
                         connect=lambda h: by_name[h.name].session(hooks.get(h.name, Hooks())), report=quiet)
    want = (Outcome.REFUSED, EXIT_BAD_INPUT) if node == 0 else (Outcome.ROLLED_BACK, EXIT_ROLLED_BACK)
    assert {(r.outcome, r.exit_code) for r in rows} == {want}
    assert all("changed since preflight" in r.message for r in rows), [r.message for r in rows]
    assert [fake.tree(fake.host.site_packages) for fake in fake_server] == before
    assert "agent restore" in fake_server[0].events if node == 1 else "agent backup" not in fake_server[1].events
