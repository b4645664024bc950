"""bundle.json as tables of fields (artifacts/bundle_manifest.py), from data: a truthful manifest
reads back, and every row refuses a bad value with the message naming the field; the id must
match the content. The archive around it is tests/test_bundle_hostile.py's."""

from __future__ import annotations

import copy
import json

import pytest

from ddtree_ops.artifacts.bundle_manifest import (
    FILE_FIELDS,
    MANIFEST_FIELDS,
    MAX_MEMBER,
    PATCHSET_FIELDS,
    bundle_id,
    parse_bundle_manifest,
)
from ddtree_ops.config.schema import Invalid, known_keys

SHA = "0f" * 32
FILES = [{"path": "patchset/files/sglang/a.py", "size": 4, "sha256": SHA},
         {"path": "patchset/manifest.yaml", "size": 90, "sha256": SHA},
         {"path": "templates/sglang-ddtree.service.j2", "size": 700, "sha256": SHA}]
PATCHSET = {"name": "ps", "version": "1.0.0", "digest": "ab" * 32, "sglang": "==0.5.23"}


def manifest(edit=None, *, keep_id: bool = False) -> bytes:
    """bundle.json after `edit`, its id recomputed from the content unless `keep_id` or the edit
    is of the id itself."""
    doc = {"format": "ddtree-ops-bundle/1", "id": "", "patchset": copy.deepcopy(PATCHSET),
           "files": copy.deepcopy(FILES)}
    doc["id"] = first_id = bundle_id("ps", "1.0.0", PATCHSET["digest"], doc["files"])
    if edit:
        edit(doc)
        keep_id = keep_id or doc.get("id") != first_id
        if not keep_id and isinstance(doc.get("patchset"), dict) and isinstance(doc.get("files"), list):
            try:
                doc["id"] = bundle_id(doc["patchset"]["name"], doc["patchset"]["version"],
                                      doc["patchset"]["digest"], sorted(doc["files"], key=lambda f: f["path"]))
            except (KeyError, TypeError):
                pass
    return json.dumps(doc).encode()


def test_a_truthful_manifest_reads_back_with_its_entries_by_path():
    doc, listed = parse_bundle_manifest(manifest())
    assert doc["patchset"] == PATCHSET and list(listed) == [f["path"] for f in FILES]
    assert listed["templates/sglang-ddtree.service.j2"]["size"] == 700


CASES = [
    (lambda m: m.update(format="ddtree-ops-bundle/2"), "unknown format 'ddtree-ops-bundle/2' (expected"),
    (lambda m: m.update(hooks=[]), "bundle.json: must have exactly the keys files, format, id, patchset, has"),
    (lambda m: m.pop("files"), "bundle.json: must have exactly the keys"),
    (lambda m: m.update(id=12), "bundle.json: id 12 is not a bundle id (<name>-<version>-<16 hex>)"),
    (lambda m: m.update(id=None), "bundle.json: id is required: the bundle id"),
    (lambda m: m.update(patchset=["x"]), "bundle.json: patchset must be a mapping of exactly the keys digest, name"),
    (lambda m: m["patchset"].pop("sglang"), "bundle.json: patchset must have exactly the keys"),
    (lambda m: m["patchset"].update(name=5), "bundle.json: patchset.name must be a string, got 5"),
    (lambda m: m["patchset"].update(version=None), "bundle.json: patchset.version is required: a string"),
    (lambda m: m["patchset"].update(sglang=["==1"]), "bundle.json: patchset.sglang must be a string"),
    (lambda m: m["patchset"].update(digest="AB" * 32), "bundle.json: patchset.digest 'ABAB"),
    (lambda m: m.update(files={}), "bundle.json: files must be a list of at most 10000 entries"),
    (lambda m: m["files"].append("x"), "bundle.json: files[3] must be a mapping of exactly the keys path, sha256"),
    (lambda m: m["files"][0].pop("sha256"), "bundle.json: files[0] must have exactly the keys path, sha256, size"),
    (lambda m: m["files"][0].update(path="templates/../x.j2"), "bundle.json: files[0].path 'templates/../x.j2': "
                                                               "the name has a '.' or '..' component"),
    (lambda m: m["files"][0].update(path="bundle.json"), "files[0].path 'bundle.json': the manifest does not list"),
    (lambda m: m["files"][0].update(path=7), "bundle.json: files[0].path 7: is not a string"),
    (lambda m: m["files"][0].update(size="4"), f"bundle.json: files[0].size must be an integer 0..{MAX_MEMBER}, "
                                               f"got '4'"),
    (lambda m: m["files"][0].update(size=True), "bundle.json: files[0].size must be an integer"),
    (lambda m: m["files"][0].update(size=MAX_MEMBER + 1), "bundle.json: files[0].size must be an integer"),
    (lambda m: m["files"][0].update(sha256=SHA.upper()), "bundle.json: files[0].sha256 must be 64 lowercase hex"),
    (lambda m: m["files"].append(dict(m["files"][0])), "bundle.json: files lists 'patchset/files/sglang/a.py' twice"),
    (lambda m: m["files"].pop(2), "has no unit templates"),
    (lambda m: m["files"].pop(1), "has no patchset/manifest.yaml"),
]


@pytest.mark.parametrize("edit, message", CASES)
def test_each_rule_refuses_with_a_message_naming_the_field(edit, message):
    with pytest.raises(Invalid) as e:
        parse_bundle_manifest(manifest(edit))
    assert e.value.problem.startswith(message) or message in e.value.problem, e.value.problem


def test_every_row_has_a_refusing_case():
    said = " ".join(message for _, message in CASES)
    for name in known_keys(MANIFEST_FIELDS) | known_keys(PATCHSET_FIELDS) | known_keys(FILE_FIELDS):
        assert name in said, name


def test_an_id_that_does_not_match_the_content_is_refused():
    changed = manifest(lambda m: m["files"][0].update(size=5), keep_id=True)
    with pytest.raises(Invalid, match="does not match its content .*: the bundle was modified"):
        parse_bundle_manifest(changed)
    parse_bundle_manifest(manifest(lambda m: m["files"][0].update(size=5)))  # control: the id recomputed


@pytest.mark.parametrize("data, message", [
    (b"\xff{}", "bundle.json: is not UTF-8 text"),
    (b"[" * 9 + b"]" * 9, "bundle.json: is nested more than 8 levels deep"),
    (b'{"format": NaN}', "bundle.json: is not valid JSON: NaN is not JSON"),
    (b'{"a": 1, "a": 2}', "bundle.json: is not valid JSON: the key 'a' appears twice"),
    (b"[1]", "unknown format None"),
])
def test_what_is_not_strict_json_is_refused_before_any_table(data, message):
    with pytest.raises(Invalid) as e:
        parse_bundle_manifest(data)
    assert e.value.problem == message or e.value.problem.startswith(message), e.value.problem
