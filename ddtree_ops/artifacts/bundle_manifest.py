"""A bundle's manifest, bundle.json: its caps, the names a member may have, the bundle id, and
the manifest itself as tables of fields (config/schema.py runs them).

The manifest is written by the tool and read from anyone, so every key must be there and no
other (`exact_mapping`), every value has its row's type and form, and the id must match the
content. `parse_bundle_manifest(data)` returns the manifest and its entries by path, or raises
`Invalid` whose `problem` is the whole message after "bundle FILE: ", e.g.
"bundle.json: files[0].size must be an integer 0..67108864, got '12'".
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Mapping

from ..config.schema import Field, Invalid, check_int, exact_mapping, joined
from ..errors import shown
from .release_members import member_problem

FORMAT = "ddtree-ops-bundle/1"
MANIFEST = "bundle.json"
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*-[0-9a-f]{16}$")
SHA_RE = re.compile(r"^[0-9a-f]{64}$")

MAX_MEMBERS = 10_000  # files in the archive
MAX_MEMBER = 64 * 1024 * 1024  # one file
MAX_JSON_DEPTH = 8  # nesting of bundle.json ([ and {); the real one has 3
MAX_NAME = 1024  # characters of a member name


# --------------------------------------------------------------------------- member names

_TEMPLATE_MEMBER_RE = re.compile(r"^templates/[A-Za-z0-9_.-]+\.j2$")


def name_problem(name: str) -> str | None:
    """None if `name` is a canonical bundle member name, else what is wrong with it.

    Canonical: printable ASCII, relative, '/'-separated with no empty, '.' or '..' component, no
    backslash, no trailing '/', at most MAX_NAME characters; and one of `bundle.json`,
    `patchset/manifest.yaml`, `patchset/files/<path>`, `templates/<name>.j2`; a patch-set file
    is none that no release may ship (release_members.py: bytecode, `.pth`, `*customize.py`)."""
    if not name:
        return "the name is empty"
    if len(name) > MAX_NAME:
        return f"the name is longer than {MAX_NAME} characters"
    if any(not 32 <= ord(c) < 127 for c in name):
        return "the name has characters outside printable ASCII"
    if "\\" in name:
        return "the name contains a backslash"
    if name.startswith("/"):
        return "the name is absolute"
    if name.endswith("/"):
        return "the name ends with '/' (a folder)"
    parts = name.split("/")
    if "" in parts:
        return "the name has an empty component ('//')"
    if "." in parts or ".." in parts:
        return "the name has a '.' or '..' component"
    if name in (MANIFEST, "patchset/manifest.yaml") or _TEMPLATE_MEMBER_RE.match(name):
        return None
    if name.startswith("patchset/files/"):
        return member_problem(name[len("patchset/files/"):])
    return "only bundle.json, patchset/manifest.yaml, patchset/files/... and templates/*.j2 may be in a bundle"


# --------------------------------------------------------------------------- the id

def bundle_id(name: str, version: str, digest: str, files: list[dict]) -> str:
    """`<name>-<version>-<16 hex>`: equal patch sets and members give an equal id."""
    canon = json.dumps({"format": FORMAT, "patchset": {"name": name, "version": version, "digest": digest},
                        "files": files}, sort_keys=True, separators=(",", ":"))
    return f"{name}-{version}-{hashlib.sha256(canon.encode()).hexdigest()[:16]}"


# --------------------------------------------------------------------------- JSON, strictly

def _json_depth(text: str) -> int:
    depth = deepest = 0
    for m in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', text):
        c = m.group()
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {shown(k)} appears twice")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _load_json(data: bytes) -> Any:
    """bundle.json's text as JSON: UTF-8, shallow, no key twice, no NaN or Infinity."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise Invalid(f"{MANIFEST}: is not UTF-8 text") from None
    if _json_depth(text) > MAX_JSON_DEPTH:
        raise Invalid(f"{MANIFEST}: is nested more than {MAX_JSON_DEPTH} levels deep")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:
        raise Invalid(f"{MANIFEST}: is not valid JSON: {e}") from None


# --------------------------------------------------------------------------- the tables

def _string(value: Any, done: Mapping[str, Any]) -> str:
    if not isinstance(value, str):
        raise Invalid(f"must be a string, got {shown(value)}")
    return value


def _digest(value: Any, done: Mapping[str, Any]) -> str:
    if not isinstance(value, str) or not SHA_RE.match(value):
        raise Invalid(f"{shown(value)} is not 64 lowercase hex digits")
    return value


def _sha256(value: Any, done: Mapping[str, Any]) -> str:
    if not isinstance(value, str) or not SHA_RE.match(value):
        raise Invalid(f"must be 64 lowercase hex digits, got {shown(value)}")
    return value


def _member_path(value: Any, done: Mapping[str, Any]) -> str:
    problem = name_problem(value) if isinstance(value, str) else "is not a string"
    if problem or value == MANIFEST:
        raise Invalid(f"{shown(value)}: {problem or 'the manifest does not list itself'}")
    return value


def _size(value: Any, done: Mapping[str, Any]) -> int:
    return check_int(value, 0, MAX_MEMBER)


def _id(value: Any, done: Mapping[str, Any]) -> str:
    if not isinstance(value, str) or not ID_RE.match(value):
        raise Invalid(f"{shown(value)} is not a bundle id (<name>-<version>-<16 hex>)")
    return value


FILE_FIELDS: tuple[Field, ...] = (
    Field("path", _member_path, required="a member name"),
    Field("size", _size, required=f"an integer 0..{MAX_MEMBER}"),
    Field("sha256", _sha256, required="64 lowercase hex digits"),
)


def _files(value: Any, done: Mapping[str, Any]) -> dict[str, dict]:
    """The `files` list as {path: entry}: each entry exactly FILE_FIELDS, no path twice."""
    if not isinstance(value, list) or len(value) > MAX_MEMBERS:
        raise Invalid(f"must be a list of at most {MAX_MEMBERS} entries")
    listed: dict[str, dict] = {}
    for i, raw in enumerate(value):
        try:
            entry = exact_mapping(FILE_FIELDS, raw)
        except Invalid as e:
            raise Invalid(e.problem, joined(f"[{i}]", e.field)) from None
        if entry["path"] in listed:
            raise Invalid(f"lists {shown(entry['path'])} twice")
        listed[entry["path"]] = raw
    return listed


PATCHSET_FIELDS: tuple[Field, ...] = (  # who the patch set inside is
    Field("name", _string, required="a string"),
    Field("version", _string, required="a string"),
    Field("digest", _digest, required="64 lowercase hex digits"),
    Field("sglang", _string, required="a string"),
)

MANIFEST_FIELDS: tuple[Field, ...] = (
    Field("format", None),  # checked first: the format decides which table reads the rest
    Field("id", _id, required="the bundle id"),
    Field("patchset", lambda value, done: exact_mapping(PATCHSET_FIELDS, value), required="a mapping"),
    Field("files", _files, required="a list of {path, size, sha256} entries"),
)


def _problem(e: Invalid) -> str:
    """As a message shows it: "bundle.json: files[0].size must be ..." (the field, then what is wrong)."""
    return f"{MANIFEST}: {e.field} {e.problem}" if e.field else f"{MANIFEST}: {e.problem}"


def parse_bundle_manifest(data: bytes) -> tuple[dict, dict[str, dict]]:
    """bundle.json → (manifest, {path: file entry}); Invalid with the whole message otherwise."""
    doc = _load_json(data)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else None
        raise Invalid(f"unknown format {shown(found)} (expected {FORMAT})")
    try:
        values = exact_mapping(MANIFEST_FIELDS, doc)
    except Invalid as e:
        raise Invalid(_problem(e)) from None
    listed, psinfo = values["files"], values["patchset"]
    if not any(n.startswith("templates/") for n in listed):
        raise Invalid("has no unit templates")
    if "patchset/manifest.yaml" not in listed:
        raise Invalid("has no patchset/manifest.yaml")
    expect = bundle_id(psinfo["name"], psinfo["version"], psinfo["digest"], [listed[n] for n in sorted(listed)])
    if expect != values["id"]:
        raise Invalid(f"id {values['id']} does not match its content ({expect}): the bundle was modified")
    return doc, listed
