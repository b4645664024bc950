"""Patch-set manifest format: strict validation, file accounting, digest, version targeting."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import yaml

from ddtree_ops.artifacts.patchset import check_sglang_version, load_patchset
from ddtree_ops.errors import InputError, PatchSetError

BASE = "71d17803" + "0" * 56
UTILS = b"def f():\n    return 1\n"
INFO = b"X = 2\n"


def write_ps(root: Path, manifest, files: dict[str, bytes] | None = None, name: str = "ddtree-temp") -> Path:
    d = root / name
    (d / "files").mkdir(parents=True, exist_ok=True)
    text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest, sort_keys=False)
    (d / "manifest.yaml").write_text(text)
    for rel, content in (files or {}).items():
        p = d / "files" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content)
    return d


def manifest(**over):
    m = {
        "name": "ddtree-temp",
        "version": "1.0.0",
        "sglang": "==0.5.23",
        "description": "DDTree for SGLang 0.5.23",
        "packages": ["sglang"],
        "files": [
            {"path": "sglang/srt/speculative/ddtree_utils.py", "action": "add"},
            {"path": "sglang/srt/speculative/dflash_info.py", "action": "replace", "base_sha256": BASE},
        ],
    }
    m.update(over)
    return m


FILES = {"sglang/srt/speculative/ddtree_utils.py": UTILS, "sglang/srt/speculative/dflash_info.py": INFO}


def entry(**over):
    e = {"path": "sglang/x.py", "action": "add"}
    e.update(over)
    return e


def load_one(tmp_path, e, content=b"x = 1\n"):
    """Load a patch set with the single entry `e`, shipping `content` at its (valid) path."""
    d = write_ps(tmp_path, manifest(files=[e]), {e["path"]: content})
    return load_patchset(str(d))


# --------------------------------------------------------------------------- happy path

def test_valid_patchset_loads_with_hashes_modes_and_sources(tmp_path):
    d = write_ps(tmp_path, manifest(), FILES)
    ps = load_patchset(str(d))
    assert (ps.name, ps.version, str(ps.sglang_spec)) == ("ddtree-temp", "1.0.0", "==0.5.23")
    assert ps.description == "DDTree for SGLang 0.5.23"
    assert [f.path for f in ps.files] == list(FILES)
    add, rep = ps.files
    assert (add.action, add.base_sha256, add.mode) == ("add", None, 0o644)
    assert (rep.action, rep.base_sha256) == ("replace", BASE)
    assert add.sha256 == hashlib.sha256(UTILS).hexdigest()
    assert add.source == d.resolve() / "files" / "sglang/srt/speculative/ddtree_utils.py"
    assert ps.manifest_sha256 == hashlib.sha256((d / "manifest.yaml").read_bytes()).hexdigest()
    assert ps.root == d.resolve()


def test_patchset_loads_by_name_from_patches_dir(tmp_path):
    write_ps(tmp_path, manifest(), FILES)
    assert load_patchset("ddtree-temp", patches_dir=tmp_path).name == "ddtree-temp"


def test_unknown_patchset_name_lists_known_ones(tmp_path):
    write_ps(tmp_path, manifest(), FILES)
    with pytest.raises(PatchSetError, match="known: ddtree-temp"):
        load_patchset("ddtree-tmp", patches_dir=tmp_path)


def test_manifest_name_must_match_directory_when_loaded_by_name(tmp_path):
    write_ps(tmp_path, manifest(name="other"), FILES)
    with pytest.raises(PatchSetError, match="directory name"):
        load_patchset("ddtree-temp", patches_dir=tmp_path)


def test_explicit_mode_is_parsed_as_octal(tmp_path):
    ps = load_one(tmp_path, entry(mode="0755"))
    assert ps.files[0].mode == 0o755


def test_patchset_error_is_an_input_error():
    assert issubclass(PatchSetError, InputError)


# --------------------------------------------------------------------------- manifest validation

@pytest.mark.parametrize(
    "path",
    ["../evil.py", "sglang/../../evil.py", "/usr/lib/python3/evil.py", "sglang\\evil.py",
     "sglang/./x.py", "sglang//x.py", "sglang/x.py/", "sglang/ev il.py", "sglang/x\n.py", "..", "C:/x.py", ""],
)
def test_patchset_rejects_path_escaping_site_packages(tmp_path, path):
    d = write_ps(tmp_path, manifest(files=[entry(path=path)]), {})
    with pytest.raises(PatchSetError) as ei:
        load_patchset(str(d))
    msg = str(ei.value)
    assert str(d.resolve() / "manifest.yaml") in msg and "files[0].path" in msg


def test_patchset_rejects_unlisted_file(tmp_path):
    d = write_ps(tmp_path, manifest(), {**FILES, "sglang/srt/speculative/stray.py": b"x=1\n"})
    with pytest.raises(PatchSetError, match="unlisted file files/sglang/srt/speculative/stray.py"):
        load_patchset(str(d))


def test_replace_without_base_hash_is_rejected(tmp_path):
    m = manifest()
    del m["files"][1]["base_sha256"]
    d = write_ps(tmp_path, m, FILES)
    with pytest.raises(PatchSetError, match=r"files\[1\] \(sglang/srt/speculative/dflash_info.py\)\.base_sha256"):
        load_patchset(str(d))


def test_add_with_base_hash_is_rejected(tmp_path):
    with pytest.raises(PatchSetError, match="not allowed for action 'add'"):
        load_one(tmp_path, entry(base_sha256=BASE))


@pytest.mark.parametrize("bad", [BASE.upper(), BASE[:-1], BASE + "0", "z" * 64, 123])
def test_base_hash_must_be_64_lowercase_hex(tmp_path, bad):
    with pytest.raises(PatchSetError, match="64 lowercase hex"):
        load_one(tmp_path, entry(action="replace", base_sha256=bad))


@pytest.mark.parametrize("key", ["name", "version", "sglang", "files"])
def test_missing_required_manifest_key_is_rejected(tmp_path, key):
    m = manifest()
    del m[key]
    d = write_ps(tmp_path, m, FILES)
    with pytest.raises(PatchSetError, match=f"field '{key}': is required"):
        load_patchset(str(d))


def test_unknown_manifest_key_is_rejected(tmp_path):
    d = write_ps(tmp_path, manifest(sglang_version="0.5.23"), FILES)
    with pytest.raises(PatchSetError, match="'sglang_version': unknown key"):
        load_patchset(str(d))


def test_unknown_entry_key_is_rejected(tmp_path):
    with pytest.raises(PatchSetError, match=r"files\[0\]\.sha: unknown key"):
        load_one(tmp_path, entry(sha=BASE))


@pytest.mark.parametrize(
    "field, value, fragment",
    [("name", "-bad", "'name'"), ("name", "a b", "'name'"), ("version", "one", "'version'"),
     ("version", 1.0, "quoted PEP 440 version"), ("sglang", "0.5.23", "'sglang'"), ("sglang", "", "'sglang'"),
     ("files", [], "'files'"), ("description", 5, "'description'")],
)
def test_bad_top_level_values_are_rejected(tmp_path, field, value, fragment):
    d = write_ps(tmp_path, manifest(**{field: value}), FILES)
    with pytest.raises(PatchSetError, match=fragment):
        load_patchset(str(d))


def test_unknown_action_is_rejected(tmp_path):
    with pytest.raises(PatchSetError, match=r"files\[0\] \(sglang/x.py\)\.action: must be one of add, replace"):
        load_one(tmp_path, entry(action="patch"))


def test_duplicate_paths_are_rejected(tmp_path):
    d = write_ps(tmp_path, manifest(files=[entry(), entry()]), {"sglang/x.py": b"x=1\n"})
    with pytest.raises(PatchSetError, match="listed twice"):
        load_patchset(str(d))


def test_listed_file_missing_from_files_dir_is_rejected(tmp_path):
    d = write_ps(tmp_path, manifest(), {"sglang/srt/speculative/ddtree_utils.py": UTILS})
    with pytest.raises(PatchSetError, match=r"files\[1\].*does not exist"):
        load_patchset(str(d))


def test_symlinked_file_is_rejected(tmp_path):
    d = write_ps(tmp_path, manifest(files=[entry()]), {})
    (tmp_path / "outside.py").write_bytes(b"x=1\n")
    (d / "files" / "sglang").mkdir()
    os.symlink(tmp_path / "outside.py", d / "files" / "sglang" / "x.py")
    with pytest.raises(PatchSetError, match="symlink"):
        load_patchset(str(d))


def test_symlinked_directory_is_rejected(tmp_path):
    d = write_ps(tmp_path, manifest(files=[entry()]), {})
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "x.py").write_bytes(b"x=1\n")
    os.symlink(tmp_path / "elsewhere", d / "files" / "sglang")
    with pytest.raises(PatchSetError, match="symlink"):
        load_patchset(str(d))


def test_directory_where_a_file_is_listed_is_rejected(tmp_path):
    d = write_ps(tmp_path, manifest(files=[entry()]), {"sglang/x.py/inner": b""})
    with pytest.raises(PatchSetError, match="not a regular file"):
        load_patchset(str(d))


@pytest.mark.parametrize("mode, fragment", [(420, "quoted octal"), ("644x", "quoted octal"), ("0666", "world-writable"),
                                            ("04755", "quoted octal"), ("0044", "unreadable")])
def test_bad_modes_are_rejected(tmp_path, mode, fragment):
    with pytest.raises(PatchSetError, match=fragment):
        load_one(tmp_path, entry(mode=mode))


def test_invalid_yaml_names_the_line(tmp_path):
    d = write_ps(tmp_path, "name: [unclosed\n", {})
    with pytest.raises(PatchSetError, match="not valid YAML at line"):
        load_patchset(str(d))


def test_missing_manifest_is_rejected(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(PatchSetError, match="manifest not found"):
        load_patchset(str(tmp_path / "empty"))


# --------------------------------------------------------------------------- python files

def test_syntax_error_is_not_raised_by_load_but_is_reported_by_syntax_errors(tmp_path):
    ps = load_one(tmp_path, entry(path="sglang/broken.py"), content=b"def f(:\n")
    assert [f.path for f in ps.python_files()] == ["sglang/broken.py"]
    errs = ps.syntax_errors()
    assert len(errs) == 1 and errs[0].startswith("sglang/broken.py:1:")


def test_python_files_lists_only_py_files(tmp_path):
    d = write_ps(tmp_path, manifest(files=[entry(path="sglang/a.py"), entry(path="sglang/data.json")]),
                 {"sglang/a.py": b"x=1\n", "sglang/data.json": b"{}"})
    ps = load_patchset(str(d))
    assert [f.path for f in ps.python_files()] == ["sglang/a.py"]
    assert ps.syntax_errors() == []


# --------------------------------------------------------------------------- digest

def test_digest_is_stable_across_locations_and_yaml_formatting(tmp_path):
    a = load_patchset(str(write_ps(tmp_path / "one", manifest(), FILES)))
    m = manifest()
    m["files"] = list(reversed(m["files"]))
    text = "# a comment\n" + yaml.safe_dump(m, sort_keys=True, default_flow_style=False)
    b = load_patchset(str(write_ps(tmp_path / "two", text, FILES)))
    assert a.manifest_sha256 != b.manifest_sha256
    assert a.digest() == b.digest()
    assert len(a.digest()) == 64


def test_digest_changes_when_file_content_changes(tmp_path):
    a = load_patchset(str(write_ps(tmp_path / "one", manifest(), FILES)))
    changed = dict(FILES, **{"sglang/srt/speculative/ddtree_utils.py": UTILS + b"# tweak\n"})
    b = load_patchset(str(write_ps(tmp_path / "two", manifest(), changed)))
    assert a.digest() != b.digest()


@pytest.mark.parametrize("change", ["mode", "version", "sglang", "base"])
def test_digest_changes_with_manifest_meaning(tmp_path, change):
    a = load_patchset(str(write_ps(tmp_path / "one", manifest(), FILES)))
    m = manifest()
    if change == "mode":
        m["files"][0]["mode"] = "0755"
    elif change == "version":
        m["version"] = "1.0.1"
    elif change == "sglang":
        m["sglang"] = "==0.5.24"
    else:
        m["files"][1]["base_sha256"] = "f" * 64
    b = load_patchset(str(write_ps(tmp_path / "two", m, FILES)))
    assert a.digest() != b.digest()


def test_digest_ignores_file_mtime(tmp_path):
    d = write_ps(tmp_path, manifest(), FILES)
    before = load_patchset(str(d)).digest()
    os.utime(d / "files" / "sglang/srt/speculative/ddtree_utils.py", (1, 1))
    assert load_patchset(str(d)).digest() == before


# --------------------------------------------------------------------------- version targeting

@pytest.mark.parametrize(
    "spec, version, ok",
    [("==0.5.23", "0.5.23", True), ("==0.5.23", "0.5.24", False), ("==0.5.23", "0.5.23.post1", False),
     (">=0.5.23,<0.6", "0.5.30", True), (">=0.5.23,<0.6", "0.6.0", False), ("==0.5.23", "not-a-version", False)],
)
def test_check_sglang_version(tmp_path, spec, version, ok):
    ps = load_patchset(str(write_ps(tmp_path, manifest(sglang=spec), FILES)))
    assert check_sglang_version(ps, version) is ok
