"""A patch set's manifest.yaml as a table of fields: one row per key, for the top level and for
a file entry, each row with its own rule (config/schema.py runs the tables).

`parse_manifest(doc)` turns the loaded YAML into a `Manifest` or raises `Invalid` naming the
field as a message shows it: `name`, `files[0].path` (the path itself is what is wrong), or
`files[1] (sglang/x.py).base_sha256` (an entry whose path is known). Files on disk are not
looked at here: patchset.py checks the shipped files against the entries.

`packages` names the top-level packages the set may write into (`[sglang]`): every path must lie
inside one of them, so a patch set cannot drop a module, a `.pth` or a `*.dist-info` beside them.
What no release may ship at all (bytecode, `.pth`, `*customize.py`) is release_members.py's rule.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Any, Mapping

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from ..config.schema import ABSENT, NAME_RE, Field, Invalid, apply, joined, known_keys, mapping
from ..errors import shown
from .release_members import member_problem

DEFAULT_MODE = 0o644
ACTIONS = ("add", "replace")

_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_MODE_RE = re.compile(r"^0?[0-7]{3}$")
# One path component: what Python package paths need, nothing a shell or systemd treats specially.
_COMPONENT_RE = re.compile(r"^[A-Za-z0-9_.+@=,-]+$")
# A top-level package: an importable name, one component.
_PACKAGE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class ManifestEntry:
    """One `files:` entry, validated; `base_sha256` is None for an added file."""

    path: str
    action: str
    base_sha256: str | None
    mode: int


@dataclass(frozen=True)
class Manifest:
    name: str
    version: str
    sglang_spec: SpecifierSet
    description: str
    packages: tuple[str, ...]
    files: tuple[ManifestEntry, ...]


# --------------------------------------------------------------------------- rules of one value

def check_rel_path(path: Any) -> str | None:
    """None if `path` is an acceptable site-packages-relative path, else the problem."""
    if not isinstance(path, str) or not path:
        return f"must be a non-empty string, got {shown(path)}"
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        return f"must not contain control characters: {shown(path)}"
    if any(c.isspace() for c in path):
        return f"must not contain whitespace: {shown(path)}"
    if "\\" in path:
        return f"must use '/' separators, not backslashes: {shown(path)}"
    if path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        return f"must be relative to site-packages, not absolute: {shown(path)}"
    parts = path.split("/")
    if ".." in parts:
        return f"must not contain '..' (it would escape site-packages): {shown(path)}"
    if "." in parts or "" in parts or posixpath.normpath(path) != path:
        return f"must be normalised (no '.', '//' or trailing '/'): {shown(path)}"
    for part in parts:
        if not _COMPONENT_RE.match(part):
            return f"component {shown(part)} has characters outside [A-Za-z0-9_.+@=,-]: {shown(path)}"
    return None


def _rel_path(value: Any, done: Mapping[str, Any]) -> str:
    problem = check_rel_path(value)
    if problem:
        raise Invalid(problem)
    refused = member_problem(value)
    if refused:
        raise Invalid(f"{shown(value)} {refused}")
    return value


def _action(value: Any, done: Mapping[str, Any]) -> str:
    if value not in ACTIONS:
        raise Invalid(f"must be one of {', '.join(ACTIONS)}, got {shown(value)}")
    return value


def _base_sha256(value: Any, done: Mapping[str, Any]) -> str | None:
    """Required for 'replace' (the upstream file it expects), refused for 'add' (there is none)."""
    if done["action"] == "add":
        if value is ABSENT:
            return None
        raise Invalid("is not allowed for action 'add' (there is no upstream file)")
    if value is ABSENT or value is None:
        raise Invalid("is required for action 'replace' (sha256 of the upstream file)")
    if not isinstance(value, str) or not _SHA_RE.match(value):
        raise Invalid(f"must be 64 lowercase hex digits, got {shown(value)}")
    return value


def _mode(value: Any, done: Mapping[str, Any]) -> int:
    if not isinstance(value, str) or not _MODE_RE.match(value):
        raise Invalid(f"must be a quoted octal string such as \"0644\", got {shown(value)}")
    mode = int(value, 8)
    if not mode & 0o400:
        raise Invalid(f"{value} leaves the file unreadable to its owner")
    if mode & 0o002:
        raise Invalid(f"{value} makes the file world-writable")
    return mode


def _default_mode(done: Mapping[str, Any]) -> str:
    return f"{DEFAULT_MODE:04o}"


def _name(value: Any, done: Mapping[str, Any]) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise Invalid(f"must match [A-Za-z0-9][A-Za-z0-9_.-]* (max 64), got {shown(value)}")
    return value


def _version(value: Any, done: Mapping[str, Any]) -> str:
    if not isinstance(value, str):
        raise Invalid(f"must be a quoted PEP 440 version string such as \"1.0.0\", got {shown(value)}")
    try:
        Version(value)
    except InvalidVersion:
        raise Invalid(f"{shown(value)} is not a PEP 440 version") from None
    return value


def _specifier(value: Any, done: Mapping[str, Any]) -> SpecifierSet:
    if not isinstance(value, str) or not value.strip():
        raise Invalid(f"must be a quoted PEP 440 specifier such as \"==0.5.23\", got {shown(value)}")
    try:
        return SpecifierSet(value)
    except InvalidSpecifier:
        raise Invalid(f"{shown(value)} is not a PEP 440 specifier (write e.g. \"==0.5.23\" or "
                      f"\">=0.5.23,<0.6\")") from None


def _description(value: Any, done: Mapping[str, Any]) -> str:
    if not isinstance(value, str):
        raise Invalid("must be a string")
    return value


def _no_description(done: Mapping[str, Any]) -> str:
    return ""


def _packages(value: Any, done: Mapping[str, Any]) -> tuple[str, ...]:
    """A non-empty list of top-level package names, none twice."""
    if not isinstance(value, list) or not value:
        raise Invalid(f"must be a non-empty list of top-level package names such as [sglang], got {shown(value)}")
    for name in value:
        if not isinstance(name, str) or not _PACKAGE_RE.match(name):
            raise Invalid(f"{shown(name)} is not a top-level package name (one importable name, no '/')")
        if member_problem(name + "/__init__.py"):
            raise Invalid(f"{shown(name)} {member_problem(name + '/__init__.py')}")
    if len(set(value)) != len(value):
        raise Invalid(f"names a package twice: {shown(value)}")
    return tuple(value)


def package_problem(path: str, packages: tuple[str, ...]) -> str | None:
    """None if `path` lies inside one of `packages` (a file below the package folder), else why not."""
    top, _, rest = path.partition("/")
    if top in packages and rest:
        return None
    return f"{shown(path)} is outside the packages the manifest names ({', '.join(packages)})"


# --------------------------------------------------------------------------- the tables

FILE_FIELDS: tuple[Field, ...] = (
    Field("path", _rel_path, required="a path relative to site-packages"),
    Field("action", _action, required=f"one of {', '.join(ACTIONS)}"),
    Field("base_sha256", _base_sha256, ABSENT),
    Field("mode", _mode, _default_mode),  # absent or null: 0644
)


def _entry_field(index: int, raw: Any, inner: str | None) -> str:
    """`files[i].path` until the entry's path is known good, then `files[i] (PATH).field`."""
    path = raw.get("path") if isinstance(raw, dict) else None
    known = inner not in (None, "path") and isinstance(raw, dict) and set(raw) <= known_keys(FILE_FIELDS) \
        and check_rel_path(path) is None
    return joined(f"[{index}] ({path})" if known else f"[{index}]", inner)


def _entries(value: Any, done: Mapping[str, Any]) -> tuple[ManifestEntry, ...]:
    """The `files:` list: a non-empty list of entries (FILE_FIELDS), no path listed twice."""
    if not isinstance(value, list) or not value:
        raise Invalid("must be a non-empty list of {path, action, ...} entries")
    out: list[ManifestEntry] = []
    seen: set[str] = set()
    for i, raw in enumerate(value):
        try:
            entry = ManifestEntry(**mapping(FILE_FIELDS, raw))
        except Invalid as e:
            raise Invalid(e.problem, _entry_field(i, raw, e.field)) from None
        if entry.path in seen:
            raise Invalid("is listed twice", f"[{i}] ({entry.path}).path")
        outside = package_problem(entry.path, done["packages"])
        if outside:
            raise Invalid(outside, f"[{i}].path")
        seen.add(entry.path)
        out.append(entry)
    return tuple(out)


MANIFEST_FIELDS: tuple[Field, ...] = (
    Field("name", _name, required="the patch set's name, as its directory is named"),
    Field("version", _version, required="a PEP 440 version such as \"1.0.0\""),
    Field("sglang", _specifier, required="a PEP 440 specifier such as \"==0.5.23\"", attr="sglang_spec"),
    Field("description", _description, _no_description),  # absent or null: ""
    Field("packages", _packages, required="the top-level packages the set writes into, such as [sglang]"),
    Field("files", _entries, required="a list of {path, action, ...} entries"),
)


def parse_manifest(doc: Any) -> Manifest:
    """The loaded manifest.yaml as a Manifest; Invalid naming the field (None: the whole
    document)."""
    if not isinstance(doc, dict):
        raise Invalid("the manifest must be a mapping with name, version, sglang and files")
    unknown = sorted(str(k) for k in set(doc) - known_keys(MANIFEST_FIELDS))
    if unknown:
        raise Invalid(f"unknown key; allowed: {', '.join(sorted(known_keys(MANIFEST_FIELDS)))}", unknown[0])
    return Manifest(**apply(MANIFEST_FIELDS, doc))
