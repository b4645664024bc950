"""Patch sets: the DDTree files shipped into an SGLang site-packages.

Layout::

    patches/<name>/manifest.yaml
    patches/<name>/files/<path relative to site-packages>

manifest.yaml::

    name: ddtree-temp
    version: 1.0.0                 # PEP 440 version of the patch set
    sglang: "==0.5.23"             # PEP 440 specifier of the SGLang versions it targets
    description: optional text
    files:
      - path: sglang/srt/speculative/ddtree_utils.py
        action: add                # a new file (it may exist from an earlier release of this set)
        mode: "0644"               # optional quoted octal, default 0644
      - path: sglang/srt/speculative/dflash_info.py
        action: replace            # an upstream file, backed up first
        base_sha256: 71d1...       # sha256 of the upstream file it expects (64 lowercase hex)

`load_patchset` validates everything and raises PatchSetError naming the manifest and the
entry. Python syntax is not checked here: preflight compiles `PatchSet.python_files()` with
the host's own Python, which is the one that matters.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from ..config.schema import NAME_RE
from ..config.yamlfile import YamlProblem, load_yaml
from ..errors import PatchSetError, shown
from .resources import patches_dir as default_patches_dir

MANIFEST = "manifest.yaml"
FILES_DIR = "files"
DEFAULT_MODE = 0o644
ACTIONS = ("add", "replace")

_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_MODE_RE = re.compile(r"^0?[0-7]{3}$")
# One path component: what Python package paths need, nothing a shell or systemd treats specially.
_COMPONENT_RE = re.compile(r"^[A-Za-z0-9_.+@=,-]+$")

_TOP_KEYS = {"name", "version", "sglang", "description", "files"}
_TOP_REQUIRED = {"name", "version", "sglang", "files"}
_FILE_KEYS = {"path", "action", "base_sha256", "mode"}


@dataclass(frozen=True)
class PatchFile:
    path: str  # relative to site-packages, posix, normalised
    action: str  # "add" or "replace"
    base_sha256: str | None  # replace: the upstream file's expected sha256; add: None
    mode: int
    sha256: str  # of the shipped content
    source: Path  # the shipped file on this machine


@dataclass(frozen=True)
class PatchSet:
    name: str
    version: str
    sglang_spec: SpecifierSet
    description: str
    files: tuple[PatchFile, ...]
    root: Path
    manifest_sha256: str

    def python_files(self) -> tuple[PatchFile, ...]:
        """The shipped .py files (preflight compiles them with the host's Python)."""
        return tuple(f for f in self.files if f.path.endswith(".py"))

    def syntax_errors(self) -> list[str]:
        """Compile the .py files with *this* Python; 'path:line: message' for each failure."""
        errs = []
        for f in self.python_files():
            try:
                compile(f.source.read_bytes(), f.path, "exec", dont_inherit=True)
            except SyntaxError as e:
                errs.append(f"{f.path}:{e.lineno}: {e.msg}")
        return errs

    def canonical(self) -> dict[str, Any]:
        """The manifest's meaning, independent of YAML formatting, comments and file order."""
        return {
            "name": self.name,
            "version": self.version,
            "sglang": str(self.sglang_spec),
            "description": self.description,
            "files": [
                {"path": f.path, "action": f.action, "base_sha256": f.base_sha256,
                 "mode": "%04o" % f.mode, "sha256": f.sha256}
                for f in sorted(self.files, key=lambda f: f.path)
            ],
        }

    def digest(self) -> str:
        """sha256 hex over the canonical manifest and every file's path, mode and content hash.

        Stable across machines and checkouts (no mtimes, no absolute paths); changes when any
        shipped byte, mode, action, base hash, version or target specifier changes.
        """
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(b"ddtree-ops-patchset-v1\n" + blob.encode()).hexdigest()

    @property
    def label(self) -> str:
        return f"{self.name}-{self.version}"


def check_sglang_version(ps: PatchSet, version_str: str) -> bool:
    """Whether SGLang `version_str` satisfies the patch set's specifier (PEP 440 rules:
    pre-releases match only when the specifier names one). An unparsable version → False."""
    try:
        v = Version(str(version_str).strip())
    except InvalidVersion:
        return False
    return ps.sglang_spec.contains(v)


def _sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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


def _resolve(ref: str, patches_dir: str | Path | None) -> tuple[Path, bool]:
    """(directory, loaded_by_name)."""
    if not isinstance(ref, str) or not ref:
        raise PatchSetError(f"patch set reference must be a name or a directory, got {shown(ref)}")
    if "/" not in ref and os.sep not in ref and ref not in (".", "..") and NAME_RE.match(ref):
        base = Path(patches_dir) if patches_dir is not None else default_patches_dir()
        cand = base / ref
        if cand.is_dir():
            return cand, True
        if not Path(ref).is_dir():
            known = sorted(p.name for p in base.iterdir() if (p / MANIFEST).is_file()) if base.is_dir() else []
            raise PatchSetError(
                f"no patch set named {shown(ref)} in {base} (known: {', '.join(known) or 'none'})"
            )
    p = Path(ref)
    if not p.is_dir():
        raise PatchSetError(f"patch set directory {shown(ref)} does not exist")
    return p, False


def load_patchset(ref: str, patches_dir: str | Path | None = None) -> PatchSet:
    """Load and validate a patch set by name (under `patches_dir`, default `resources.patches_dir()`)
    or by directory path. Raises PatchSetError naming the manifest and the entry/field."""
    root, by_name = _resolve(ref, patches_dir)
    root = root.resolve()
    mpath = root / MANIFEST
    mname = str(mpath)

    def fail(where: str | None, problem: str) -> None:
        raise PatchSetError(f"{mname}: {where}: {problem}" if where else f"{mname}: {problem}")

    try:
        raw = mpath.read_bytes()
    except FileNotFoundError:
        raise PatchSetError(f"{mname}: manifest not found") from None
    except OSError as e:
        raise PatchSetError(f"{mname}: cannot read: {e.strerror}") from None
    try:
        doc = load_yaml(raw)
    except YamlProblem as e:
        raise PatchSetError(f"{mname}: {e}") from None

    if not isinstance(doc, dict):
        fail(None, "the manifest must be a mapping with name, version, sglang and files")
    unknown = sorted(str(k) for k in set(doc) - _TOP_KEYS)
    if unknown:
        fail(f"field {shown(unknown[0])}", f"unknown key; allowed: {', '.join(sorted(_TOP_KEYS))}")
    missing = sorted(_TOP_REQUIRED - set(doc))
    if missing:
        fail(f"field {shown(missing[0])}", "is required")

    name = doc["name"]
    if not isinstance(name, str) or not NAME_RE.match(name):
        fail("field 'name'", f"must match [A-Za-z0-9][A-Za-z0-9_.-]* (max 64), got {shown(name)}")
    if by_name and name != root.name:
        fail("field 'name'", f"{shown(name)} differs from its directory name {shown(root.name)}")

    version = doc["version"]
    if not isinstance(version, str):
        fail("field 'version'", f"must be a quoted PEP 440 version string such as \"1.0.0\", got {shown(version)}")
    try:
        Version(version)
    except InvalidVersion:
        fail("field 'version'", f"{shown(version)} is not a PEP 440 version")

    spec_s = doc["sglang"]
    if not isinstance(spec_s, str) or not spec_s.strip():
        fail("field 'sglang'", f"must be a quoted PEP 440 specifier such as \"==0.5.23\", got {shown(spec_s)}")
    try:
        spec = SpecifierSet(spec_s)
    except InvalidSpecifier:
        fail("field 'sglang'",
             f"{shown(spec_s)} is not a PEP 440 specifier (write e.g. \"==0.5.23\" or \">=0.5.23,<0.6\")")

    description = doc.get("description")
    if description is None:
        description = ""
    if not isinstance(description, str):
        fail("field 'description'", "must be a string")

    entries = doc["files"]
    if not isinstance(entries, list) or not entries:
        fail("field 'files'", "must be a non-empty list of {path, action, ...} entries")

    files_dir = root / FILES_DIR
    if files_dir.is_symlink() or not files_dir.is_dir():
        fail(None, f"{files_dir} must be a directory (not a symlink) holding the shipped files")

    pfiles: list[PatchFile] = []
    seen: set[str] = set()
    for i, e in enumerate(entries):
        where = f"files[{i}]"
        if not isinstance(e, dict):
            fail(where, "each entry must be a mapping with path and action")
        bad = sorted(str(k) for k in set(e) - _FILE_KEYS)
        if bad:
            fail(f"{where}.{bad[0]}", f"unknown key; allowed: {', '.join(sorted(_FILE_KEYS))}")
        for req in ("path", "action"):
            if req not in e:
                fail(f"{where}.{req}", "is required")
        path = e["path"]
        problem = check_rel_path(path)
        if problem:
            fail(f"{where}.path", problem)
        where = f"files[{i}] ({path})"
        if path in seen:
            fail(f"{where}.path", "is listed twice")
        seen.add(path)

        action = e["action"]
        if action not in ACTIONS:
            fail(f"{where}.action", f"must be one of {', '.join(ACTIONS)}, got {shown(action)}")
        base = e.get("base_sha256")
        if action == "replace":
            if base is None:
                fail(f"{where}.base_sha256", "is required for action 'replace' (sha256 of the upstream file)")
            if not isinstance(base, str) or not _SHA_RE.match(base):
                fail(f"{where}.base_sha256", f"must be 64 lowercase hex digits, got {shown(base)}")
        elif "base_sha256" in e:
            fail(f"{where}.base_sha256", "is not allowed for action 'add' (there is no upstream file)")

        mode_v = e.get("mode", None)
        if mode_v is None:
            mode = DEFAULT_MODE
        else:
            if not isinstance(mode_v, str) or not _MODE_RE.match(mode_v):
                fail(f"{where}.mode", f"must be a quoted octal string such as \"0644\", got {shown(mode_v)}")
            mode = int(mode_v, 8)
            if not mode & 0o400:
                fail(f"{where}.mode", f"{mode_v} leaves the file unreadable to its owner")
            if mode & 0o002:
                fail(f"{where}.mode", f"{mode_v} makes the file world-writable")

        src = files_dir / path
        # Walk the components with lstat so a symlinked directory cannot smuggle anything in.
        cur = files_dir
        for part in path.split("/"):
            cur = cur / part
            try:
                st = os.lstat(cur)
            except FileNotFoundError:
                fail(f"{where}", f"the shipped file {src} does not exist")
            except OSError as ex:
                fail(f"{where}", f"cannot stat {cur}: {ex.strerror}")
            if stat.S_ISLNK(st.st_mode):
                fail(f"{where}", f"{cur} is a symlink; ship regular files only")
        if not stat.S_ISREG(st.st_mode):
            fail(f"{where}", f"{src} is not a regular file")
        pfiles.append(PatchFile(path=path, action=action, base_sha256=base if action == "replace" else None,
                                mode=mode, sha256=_sha256_file(src), source=src))

    # Everything under files/ must be listed: an unlisted file is a forgotten entry or junk.
    for dirpath, dirnames, filenames in os.walk(files_dir, followlinks=False):
        for d in list(dirnames):
            full = Path(dirpath) / d
            if full.is_symlink():
                fail(None, f"{full} is a symlink; ship regular files only")
        for fn in filenames:
            full = Path(dirpath) / fn
            rel = full.relative_to(files_dir).as_posix()
            if rel not in seen:
                fail(None, f"unlisted file {FILES_DIR}/{rel}: add it to files: or delete it")

    return PatchSet(
        name=name, version=version, sglang_spec=spec, description=description,
        files=tuple(pfiles), root=root, manifest_sha256=hashlib.sha256(raw).hexdigest(),
    )
