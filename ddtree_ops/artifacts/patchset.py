"""Patch sets: the DDTree files shipped into an SGLang site-packages.

Layout::

    patches/<name>/manifest.yaml
    patches/<name>/files/<path relative to site-packages>

manifest.yaml::

    name: ddtree-temp
    version: 1.0.0                 # PEP 440 version of the patch set
    sglang: "==0.5.23"             # PEP 440 specifier of the SGLang versions it targets
    description: optional text
    packages: [sglang]             # the top-level packages every path must lie inside
    files:
      - path: sglang/srt/speculative/ddtree_utils.py
        action: add                # a new file (it may exist from an earlier release of this set)
        mode: "0644"               # optional quoted octal, default 0644
      - path: sglang/srt/speculative/dflash_info.py
        action: replace            # an upstream file, backed up first
        base_sha256: 71d1...       # sha256 of the upstream file it expects (64 lowercase hex)

`load_patchset` validates everything and raises PatchSetError naming the manifest and the
entry: the manifest's rules are a table of fields (patchset_manifest.py), the shipped files
are checked here: regular files reached through no symlink, nothing under files/ that is not
listed, and nothing a release may never ship (release_members.py: bytecode, `.pth`,
`*customize.py`), whether listed or not. Python syntax is not checked here: preflight compiles
`PatchSet.python_files()` with the host's own Python, which is the one that matters.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ..config.schema import NAME_RE, Invalid
from ..config.yamlfile import YamlProblem, load_yaml
from ..errors import PatchSetError, shown
from .patchset_manifest import ManifestEntry, parse_manifest
from .release_members import member_problem
from .resources import patches_dir as default_patches_dir

MANIFEST = "manifest.yaml"
FILES_DIR = "files"


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
    packages: tuple[str, ...]
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
            "packages": sorted(self.packages),
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
    mname = str(root / MANIFEST)
    raw, doc = _read_manifest(root / MANIFEST)
    try:
        manifest = parse_manifest(doc)
    except Invalid as e:
        raise _error(mname, _where(e.field), e.problem) from None
    if by_name and manifest.name != root.name:
        raise _error(mname, "field 'name'", f"{shown(manifest.name)} differs from its directory name "
                                            f"{shown(root.name)}")
    files_dir = root / FILES_DIR
    if files_dir.is_symlink() or not files_dir.is_dir():
        raise _error(mname, None, f"{files_dir} must be a directory (not a symlink) holding the shipped files")
    pfiles = tuple(_shipped(mname, files_dir, i, e) for i, e in enumerate(manifest.files))
    _no_unlisted_files(mname, files_dir, {e.path for e in manifest.files})
    return PatchSet(
        name=manifest.name, version=manifest.version, sglang_spec=manifest.sglang_spec,
        description=manifest.description, packages=manifest.packages, files=pfiles, root=root,
        manifest_sha256=hashlib.sha256(raw).hexdigest(),
    )


def _error(mname: str, where: str | None, problem: str) -> PatchSetError:
    return PatchSetError(f"{mname}: {where}: {problem}" if where else f"{mname}: {problem}")


def _where(field: str | None) -> str | None:
    """A top-level key as "field 'name'"; an entry's field as it is ("files[0] (x.py).mode")."""
    if field is None:
        return None
    return field if field.startswith("files[") else f"field {shown(field)}"


def _read_manifest(mpath: Path) -> tuple[bytes, Any]:
    """(the manifest's bytes, its YAML); PatchSetError when it cannot be read or parsed."""
    try:
        raw = mpath.read_bytes()
    except FileNotFoundError:
        raise PatchSetError(f"{mpath}: manifest not found") from None
    except OSError as e:
        raise PatchSetError(f"{mpath}: cannot read: {e.strerror}") from None
    try:
        return raw, load_yaml(raw)
    except YamlProblem as e:
        raise PatchSetError(f"{mpath}: {e}") from None


def _shipped(mname: str, files_dir: Path, index: int, entry: ManifestEntry) -> PatchFile:
    """The entry's shipped file under files/: there, a regular file, reached through no symlink
    (each component is lstat'ed, so a symlinked directory cannot smuggle anything in)."""
    where = f"files[{index}] ({entry.path})"
    src = files_dir / entry.path
    cur = files_dir
    for part in entry.path.split("/"):
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            raise _error(mname, where, f"the shipped file {src} does not exist") from None
        except OSError as ex:
            raise _error(mname, where, f"cannot stat {cur}: {ex.strerror}") from None
        if stat.S_ISLNK(st.st_mode):
            raise _error(mname, where, f"{cur} is a symlink; ship regular files only")
    if not stat.S_ISREG(st.st_mode):
        raise _error(mname, where, f"{src} is not a regular file")
    return PatchFile(path=entry.path, action=entry.action, base_sha256=entry.base_sha256, mode=entry.mode,
                     sha256=_sha256_file(src), source=src)


def _no_unlisted_files(mname: str, files_dir: Path, listed: set[str]) -> None:
    """Everything under files/ must be listed: an unlisted file is a forgotten entry or junk, and
    one no release may ship (a __pycache__ folder, a .pth) is named as such."""
    for dirpath, dirnames, filenames in os.walk(files_dir, followlinks=False):
        for d in dirnames:
            full = Path(dirpath) / d
            if full.is_symlink():
                raise _error(mname, None, f"{full} is a symlink; ship regular files only")
        for fn in [*dirnames, *filenames]:
            rel = (Path(dirpath) / fn).relative_to(files_dir).as_posix()
            refused = member_problem(rel)
            if refused:
                raise _error(mname, None, f"{FILES_DIR}/{rel} {refused}")
        for fn in filenames:
            rel = (Path(dirpath) / fn).relative_to(files_dir).as_posix()
            if not stat.S_ISREG(os.lstat(Path(dirpath) / fn).st_mode):
                raise _error(mname, None, f"{FILES_DIR}/{rel} is not a regular file (a symlink, fifo, socket "
                                          f"or device); ship regular files only")
            if rel not in listed:
                raise _error(mname, None, f"unlisted file {FILES_DIR}/{rel}: add it to files: or delete it")
