"""A patch set's manifest as tables of fields (artifacts/patchset_manifest.py), from data: every
row refuses a bad value naming its field, the defaults and the cross-field rule of base_sha256,
and the schema helpers the tables need (config/schema.py: ABSENT, joined, exact_mapping)."""

from __future__ import annotations

import copy

import pytest

from ddtree_ops.artifacts.patchset_manifest import (
    DEFAULT_MODE,
    FILE_FIELDS,
    MANIFEST_FIELDS,
    ManifestEntry,
    parse_manifest,
)
from ddtree_ops.config.schema import ABSENT, Field, Invalid, apply, exact_mapping, joined, known_keys

BASE = "ab" * 32
GOOD = {
    "name": "ddtree-temp", "version": "1.0.0", "sglang": "==0.5.23", "description": "two files",
    "packages": ["sglang"],
    "files": [{"path": "sglang/a.py", "action": "add"},
              {"path": "sglang/b.py", "action": "replace", "base_sha256": BASE, "mode": "0755"}],
}


def edited(edit) -> dict:
    doc = copy.deepcopy(GOOD)
    edit(doc)
    return doc


def test_a_good_manifest_reads_as_typed_values_with_its_defaults():
    m = parse_manifest(GOOD)
    assert (m.name, m.version, str(m.sglang_spec), m.description) == ("ddtree-temp", "1.0.0", "==0.5.23", "two files")
    assert m.files == (ManifestEntry("sglang/a.py", "add", None, DEFAULT_MODE),
                       ManifestEntry("sglang/b.py", "replace", BASE, 0o755))
    bare = parse_manifest(edited(lambda d: (d.pop("description"), d["files"][0].update(mode=None))))
    assert bare.description == "" and bare.files[0].mode == 0o644
    assert parse_manifest(edited(lambda d: d.update(description=None))).description == ""


# One case per row of both tables (the last test checks that none is left out): the edit, the
# field as the message names it, and what it says.
CASES = [
    (lambda d: d.update(name="-bad"), "name", "must match [A-Za-z0-9]"),
    (lambda d: d.pop("name"), "name", "is required: the patch set's name"),
    (lambda d: d.update(version=1.0), "version", 'must be a quoted PEP 440 version string such as "1.0.0", got 1.0'),
    (lambda d: d.update(version="one"), "version", "'one' is not a PEP 440 version"),
    (lambda d: d.update(sglang="0.5.23"), "sglang", "'0.5.23' is not a PEP 440 specifier"),
    (lambda d: d.update(sglang=" "), "sglang", "must be a quoted PEP 440 specifier"),
    (lambda d: d.update(description=5), "description", "must be a string"),
    (lambda d: d.update(files=[]), "files", "must be a non-empty list"),
    (lambda d: d.pop("files"), "files", "is required"),
    (lambda d: d.update(sglang_version="x"), "sglang_version",
     "unknown key; allowed: description, files, name, packages"),
    (lambda d: d["files"][0].update(path="../x.py"), "files[0].path", "must not contain '..'"),
    (lambda d: d["files"][0].pop("path"), "files[0].path", "is required: a path relative to site-packages"),
    (lambda d: d["files"][0].update(action="patch"), "files[0] (sglang/a.py).action",
     "must be one of add, replace, got 'patch'"),
    (lambda d: d["files"][0].pop("action"), "files[0] (sglang/a.py).action", "is required: one of add, replace"),
    (lambda d: d["files"][0].update(base_sha256=BASE), "files[0] (sglang/a.py).base_sha256",
     "is not allowed for action 'add'"),
    (lambda d: d["files"][0].update(base_sha256=None), "files[0] (sglang/a.py).base_sha256",
     "is not allowed for action 'add'"),
    (lambda d: d["files"][1].pop("base_sha256"), "files[1] (sglang/b.py).base_sha256",
     "is required for action 'replace'"),
    (lambda d: d["files"][1].update(base_sha256=BASE.upper()), "files[1] (sglang/b.py).base_sha256",
     "must be 64 lowercase hex digits"),
    (lambda d: d["files"][1].update(mode=644), "files[1] (sglang/b.py).mode", "must be a quoted octal string"),
    (lambda d: d["files"][1].update(mode="0666"), "files[1] (sglang/b.py).mode", "0666 makes the file world-writable"),
    (lambda d: d["files"][1].update(mode="0044"), "files[1] (sglang/b.py).mode", "0044 leaves the file unreadable"),
    (lambda d: d["files"][0].update(sha=BASE), "files[0].sha", "unknown key; allowed: action, base_sha256, mode"),
    (lambda d: d["files"].append("x.py"), "files[2]", "must be a mapping of action, base_sha256, mode, path"),
    (lambda d: d["files"].append({"path": "sglang/a.py", "action": "add"}), "files[2] (sglang/a.py).path",
     "is listed twice"),
    (lambda d: d.pop("packages"), "packages", "is required: the top-level packages the set writes into"),
    (lambda d: d.update(packages=[]), "packages", "must be a non-empty list of top-level package names"),
    (lambda d: d.update(packages="sglang"), "packages", "must be a non-empty list of top-level package names"),
    (lambda d: d.update(packages=["sglang/srt"]), "packages", "'sglang/srt' is not a top-level package name"),
    (lambda d: d.update(packages=["sglang", "sglang"]), "packages", "names a package twice"),
    (lambda d: d.update(packages=["sitecustomize"]), "packages", "'sitecustomize' is a *customize.py"),
    (lambda d: d["files"][0].update(path="torch/a.py"), "files[0].path",
     "'torch/a.py' is outside the packages the manifest names (sglang)"),
    (lambda d: d["files"][0].update(path="sglang"), "files[0].path", "'sglang' is outside the packages"),
    (lambda d: d["files"][0].update(path="sglang.pth"), "files[0].path", "'sglang.pth' is a .pth file"),
]


def test_a_path_inside_a_named_package_passes_and_one_beside_it_is_refused():
    two = parse_manifest(edited(lambda d: (d.update(packages=["sglang", "sgl_kernel"]),
                                           d["files"][0].update(path="sgl_kernel/a.py"))))
    assert two.packages == ("sglang", "sgl_kernel") and two.files[0].path == "sgl_kernel/a.py"
    with pytest.raises(Invalid, match="outside the packages"):  # control: the same path, its package not named
        parse_manifest(edited(lambda d: d["files"][0].update(path="sgl_kernel/a.py")))


@pytest.mark.parametrize("edit, field, problem", CASES)
def test_each_rule_refuses_naming_the_field(edit, field, problem):
    with pytest.raises(Invalid) as e:
        parse_manifest(edited(edit))
    assert (e.value.field, e.value.problem.startswith(problem)) == (field, True), (e.value.field, e.value.problem)


def test_every_row_of_both_tables_has_a_refusing_case():
    named = {field.split(".")[-1] if "[" in field else field for _, field, _ in CASES}
    assert known_keys(MANIFEST_FIELDS) | known_keys(FILE_FIELDS) <= named


def test_a_manifest_that_is_not_a_mapping_is_refused_as_a_whole():
    with pytest.raises(Invalid) as e:
        parse_manifest(["name", "version"])
    assert e.value.field is None and "must be a mapping with name, version, sglang and files" in e.value.problem


# --------------------------------------------------------------------------- schema helpers

def _seen(value, done):
    return "absent" if value is ABSENT else value


@pytest.mark.parametrize("raw, out", [({}, "absent"), ({"k": None}, None), ({"k": 3}, 3)])
def test_an_absent_default_hands_absence_to_the_check_apart_from_null(raw, out):
    assert apply((Field("k", _seen, ABSENT),), raw) == {"k": out}
    assert apply((Field("k", _seen, None),), raw) == {"k": None if out == "absent" else out}  # control


def test_a_nested_field_joins_with_a_dot_and_a_list_index_without_one():
    assert joined("health", "load_deadline_s") == "health.load_deadline_s"
    assert joined("files", "[0].path") == "files[0].path"
    assert joined("files", None) == "files"


def test_an_exact_mapping_refuses_a_missing_or_extra_key_and_runs_its_rows():
    fields = (Field("a", lambda v, d: v * 2), Field("b", lambda v, d: v))
    assert exact_mapping(fields, {"a": 1, "b": 2}) == {"a": 2, "b": 2}
    for bad, problem in [({"a": 1}, "must have exactly the keys a, b, has ['a']"),
                         ({"a": 1, "b": 2, "c": 3}, "must have exactly the keys a, b, has ['a', 'b', 'c']"),
                         ([1, 2], "must be a mapping of exactly the keys a, b, got [1, 2]")]:
        with pytest.raises(Invalid) as e:
            exact_mapping(fields, bad)
        assert e.value.problem == problem
