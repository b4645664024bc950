"""Where the data comes from (ddtree_ops/resources.py) and how setup.py packs the patch sets."""

from __future__ import annotations

import importlib.util
import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from ddtree_ops.artifacts import resources
from ddtree_ops.artifacts.patchset import load_patchset
from ddtree_ops.errors import InputError
from kit import REPO


@pytest.fixture(scope="module")
def setup_py():
    """setup.py as a module (its setup() call only runs as __main__, as the build backend runs it)."""
    spec = importlib.util.spec_from_file_location("ddtree_ops_setup_py", REPO / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """resources with no unpacked archive yet, its temp folders under tmp_path."""
    monkeypatch.setattr(resources, "_unpacked", None)
    monkeypatch.setattr(resources.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return resources


def write_tree(root: Path, files: dict[str, tuple[bytes, int]]) -> Path:
    for rel, (data, mode) in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.chmod(p, mode)
    return root


def test_setup_packs_the_patch_sets_reproducibly_with_modes_and_without_bytecode(setup_py, tmp_path):
    top = write_tree(tmp_path / "patches", {
        "ps/manifest.yaml": (b"name: ps\n", 0o644),
        "ps/files/pkg/run.sh": (b"#!/bin/sh\n", 0o755),
        "ps/files/pkg/mod.py": (b"x = 1\n", 0o640),
        "ps/files/pkg/__pycache__/mod.cpython-311.pyc": (b"junk", 0o644),
        "ps/files/pkg/stale.pyc": (b"junk", 0o644),
    })
    first = setup_py.patches_tar(top)
    os.utime(top / "ps/manifest.yaml", (1, 1))
    assert setup_py.patches_tar(top) == first  # no mtimes, owners or order from the file system
    with tarfile.open(fileobj=io.BytesIO(first)) as tf:
        got = {ti.name: (stat.S_IMODE(ti.mode), ti.mtime, ti.uname, tf.extractfile(ti).read()) for ti in tf}
    assert got == {
        "ps/files/pkg/mod.py": (0o640, 0, "", b"x = 1\n"),
        "ps/files/pkg/run.sh": (0o755, 0, "", b"#!/bin/sh\n"),
        "ps/manifest.yaml": (0o644, 0, "", b"name: ps\n"),
    }


def test_setup_refuses_symlinks_and_a_missing_or_empty_folder(setup_py, tmp_path):
    top = write_tree(tmp_path / "patches", {"ps/manifest.yaml": (b"x", 0o644)})
    (top / "ps" / "link").symlink_to("/etc/passwd")
    with pytest.raises(SystemExit, match="is a symlink"):
        setup_py.patches_tar(top)
    with pytest.raises(SystemExit, match="is missing"):
        setup_py.patches_tar(tmp_path / "nothing")
    (tmp_path / "empty" / "__pycache__").mkdir(parents=True)
    with pytest.raises(SystemExit, match="holds no files"):
        setup_py.patches_tar(tmp_path / "empty")


def test_the_packed_real_patch_sets_unpack_to_the_same_patch_set(setup_py, fresh, tmp_path, monkeypatch):
    data = tmp_path / "_data"
    (data / "templates").mkdir(parents=True)
    (data / "patches.tar").write_bytes(setup_py.patches_tar(REPO / "patches"))
    monkeypatch.setattr(resources, "DATA_DIR", data)
    pdir = resources.patches_dir()
    assert pdir.is_relative_to(tmp_path / "tmp") and resources.patches_dir() == pdir  # unpacked once
    assert resources.origin() == "wheel" and resources.templates_dir() == data / "templates"
    assert load_patchset("ddtree-temp").digest() == load_patchset("ddtree-temp", patches_dir=REPO / "patches").digest()
    assert stat.S_IMODE(os.stat(pdir.parent).st_mode) == 0o700  # private to this user


@pytest.mark.parametrize("name", ["../evil", "/abs", "a/../../evil", "./x"])
def test_an_archive_member_outside_the_folder_is_refused(fresh, tmp_path, monkeypatch, name):
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tf:
        ti = tarfile.TarInfo(name)
        ti.size = 1
        tf.addfile(ti, io.BytesIO(b"x"))
    data = tmp_path / "_data"
    data.mkdir()
    (data / "patches.tar").write_bytes(raw.getvalue())
    monkeypatch.setattr(resources, "DATA_DIR", data)
    with pytest.raises(InputError, match="unexpected member"):
        resources.patches_dir()
    assert not (tmp_path / "evil").exists() and not list((tmp_path / "tmp").iterdir())


def test_missing_data_is_a_clear_input_error(monkeypatch, tmp_path):
    monkeypatch.setattr(resources, "DATA_DIR", tmp_path / "_data")
    monkeypatch.setattr(resources, "CHECKOUT_DIR", tmp_path)
    with pytest.raises(InputError, match="cannot find its unit templates.*reinstall"):
        resources.templates_dir()
    with pytest.raises(InputError, match="cannot find its patch sets"):
        resources.patches_dir()


def test_a_folder_beside_site_packages_is_not_taken_for_a_checkout(monkeypatch, tmp_path):
    """An installed package's parent is site-packages: its stray templates/ is not ours."""
    (tmp_path / "templates").mkdir()
    monkeypatch.setattr(resources, "DATA_DIR", tmp_path / "ddtree_ops" / "_data")
    monkeypatch.setattr(resources, "CHECKOUT_DIR", tmp_path)
    with pytest.raises(InputError):
        resources.templates_dir()
    (tmp_path / "pyproject.toml").write_text("")
    assert resources.templates_dir() == tmp_path / "templates"
