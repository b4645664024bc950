"""Release bundles: one immutable, byte-reproducible artifact per (patch set, templates).

Layout of `<id>.tar.gz` (POSIX ustar/GNU tar in gzip):

    bundle.json                     the manifest (first member)
    patchset/manifest.yaml          the patch set, as in patches/<name>/
    patchset/files/<path>           ...
    templates/<name>.j2             every unit template

`bundle.json` holds the format, the patch set's name/version/digest and, for every other member,
its path, size and sha256; `id` is `<name>-<version>-<first 16 hex of sha256(canonical file list
+ patch-set identity)>`, so equal inputs give an equal id. Members are in sorted order with mtime
0, uid/gid 0, empty owner names and mode 0644; gzip has mtime 0 and no file name: the same
inputs give the same bytes on any machine.

`open_bundle` verifies everything before anything uses it: a readable gzip stream to its end (a
truncated file fails the CRC/length check), only regular files at safe relative paths, exactly the
listed members, each sha256, the id, and the patch set loading to the recorded digest. Any problem
is a BundleError (exit 2), raised before any connection is made.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import shutil
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .errors import BundleError, InputError
from .patchset import PatchSet, load_patchset
from .resources import templates_dir as default_templates_dir

FORMAT = "ddtree-ops-bundle/1"
MANIFEST = "bundle.json"
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*-[0-9a-f]{16}$")
MAX_MEMBER = 64 * 1024 * 1024


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _bundle_id(name: str, version: str, digest: str, files: list[dict]) -> str:
    canon = json.dumps({"format": FORMAT, "patchset": {"name": name, "version": version, "digest": digest},
                        "files": files}, sort_keys=True, separators=(",", ":"))
    return f"{name}-{version}-{_sha(canon.encode())[:16]}"


def _collect(ps: PatchSet, templates_dir: Path) -> dict[str, bytes]:
    members: dict[str, bytes] = {"patchset/manifest.yaml": (ps.root / "manifest.yaml").read_bytes()}
    for f in ps.files:
        members[f"patchset/files/{f.path}"] = f.source.read_bytes()
    tdir = Path(templates_dir)
    templates = sorted(p for p in tdir.glob("*.j2") if p.is_file())
    if not templates:
        raise InputError(f"no unit templates (*.j2) in {tdir}")
    for t in templates:
        members[f"templates/{t.name}"] = t.read_bytes()
    return members


def _tar_bytes(members: dict[str, bytes]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name in [MANIFEST] + sorted(n for n in members if n != MANIFEST):
            data = members[name]
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime, ti.mode = len(data), 0, 0o644
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            ti.type = tarfile.REGTYPE
            tf.addfile(ti, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=9) as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


@dataclass
class BuiltBundle:
    id: str
    path: Path
    sha256: str
    manifest: dict


def build_bundle(patchset: str, out_dir: str | Path, templates_dir: str | Path | None = None) -> BuiltBundle:
    ps = load_patchset(patchset)
    members = _collect(ps, Path(templates_dir) if templates_dir else default_templates_dir())
    files = [{"path": n, "size": len(d), "sha256": _sha(d)} for n, d in sorted(members.items())]
    bid = _bundle_id(ps.name, ps.version, ps.digest(), files)
    manifest = {"format": FORMAT, "id": bid,
                "patchset": {"name": ps.name, "version": ps.version, "digest": ps.digest(),
                             "sglang": str(ps.sglang_spec)},
                "files": files}
    members[MANIFEST] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    data = _tar_bytes(members)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{bid}.tar.gz"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return BuiltBundle(bid, path, _sha(data), manifest)


@dataclass
class OpenBundle:
    """A verified bundle, extracted into a private temp folder (removed by close())."""

    id: str
    path: Path
    sha256: str
    manifest: dict
    patchset: PatchSet
    templates_dir: Path
    _tmp: Path

    def close(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "OpenBundle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _safe_name(name: str) -> bool:
    p = PurePosixPath(name)
    return (bool(name) and not p.is_absolute() and ".." not in p.parts and "." not in p.parts
            and "\\" not in name and all(32 <= ord(c) < 127 for c in name) and not name.endswith("/"))


def read_members(path: str | Path) -> dict[str, bytes]:
    """Every member's bytes, in order, refusing anything but regular files at safe paths."""
    p = Path(path)
    try:
        blob = p.read_bytes()
    except FileNotFoundError:
        raise BundleError(f"bundle {p} does not exist") from None
    except OSError as e:
        raise BundleError(f"bundle {p}: cannot read: {e.strerror}") from None
    try:
        raw = gzip.decompress(blob)  # checks the CRC and length: a truncated bundle fails here
    except (OSError, EOFError, zlib.error) as e:
        raise BundleError(f"bundle {p} is not a complete gzip file (truncated or corrupted): {e}") from None
    members: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
            for ti in tf:
                if not ti.isreg():
                    raise BundleError(f"bundle {p}: member {ti.name!r} is not a regular file")
                if not _safe_name(ti.name) or ti.name in members:
                    raise BundleError(f"bundle {p}: unsafe or duplicate member name {ti.name!r}")
                if ti.size > MAX_MEMBER:
                    raise BundleError(f"bundle {p}: member {ti.name!r} is too large ({ti.size} bytes)")
                fh = tf.extractfile(ti)
                data = fh.read() if fh else b""
                if len(data) != ti.size:
                    raise BundleError(f"bundle {p}: member {ti.name!r} is truncated")
                members[ti.name] = data
    except tarfile.TarError as e:
        raise BundleError(f"bundle {p} is not a valid tar archive: {e}") from None
    if not members:
        raise BundleError(f"bundle {p} is empty")
    return members


def open_bundle(path: str | Path) -> OpenBundle:
    """Verify a bundle completely, extract it, load its patch set. BundleError on any problem."""
    p = Path(path)
    members = read_members(p)
    first = next(iter(members))
    if first != MANIFEST:
        raise BundleError(f"bundle {p}: the first member must be {MANIFEST}, got {first!r}")
    try:
        manifest = json.loads(members[MANIFEST])
    except ValueError as e:
        raise BundleError(f"bundle {p}: {MANIFEST} is not JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise BundleError(f"bundle {p}: unknown format {found!r} (expected {FORMAT})")
    bid, files, psinfo = manifest.get("id"), manifest.get("files"), manifest.get("patchset")
    if not isinstance(bid, str) or not _ID_RE.match(bid) or not isinstance(files, list) or not isinstance(psinfo, dict):
        raise BundleError(f"bundle {p}: {MANIFEST} lacks a valid id, files or patchset")
    listed = {}
    for f in files:
        if not isinstance(f, dict) or not isinstance(f.get("path"), str) or not isinstance(f.get("sha256"), str):
            raise BundleError(f"bundle {p}: malformed file entry {f!r}")
        listed[f["path"]] = f
    actual = set(members) - {MANIFEST}
    if actual != set(listed):
        extra, missing = sorted(actual - set(listed)), sorted(set(listed) - actual)
        raise BundleError(f"bundle {p}: members differ from the manifest (unlisted: {extra}, missing: {missing})")
    for name, f in listed.items():
        got = _sha(members[name])
        if got != f["sha256"] or len(members[name]) != f.get("size"):
            raise BundleError(f"bundle {p}: {name} has sha256 {got[:16]}…, the manifest says {str(f['sha256'])[:16]}…: "
                              f"the bundle was modified")
    try:
        expect = _bundle_id(psinfo["name"], psinfo["version"], psinfo["digest"],
                            [listed[n] for n in sorted(listed)])
    except (KeyError, TypeError):
        raise BundleError(f"bundle {p}: {MANIFEST} patchset entry is incomplete") from None
    if expect != bid:
        raise BundleError(f"bundle {p}: id {bid} does not match its content ({expect}): the bundle was modified")
    stem = p.name[:-len(".tar.gz")] if p.name.endswith(".tar.gz") else None
    if stem and _ID_RE.match(stem) and stem != bid:
        raise BundleError(f"bundle {p}: named {stem} but its content is {bid}")
    if not any(n.startswith("templates/") for n in listed):
        raise BundleError(f"bundle {p}: has no unit templates")
    tmp = Path(tempfile.mkdtemp(prefix="ddtree-ops-bundle-"))
    try:
        for name, data in members.items():
            dst = tmp / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
        try:
            ps = load_patchset(str(tmp / "patchset"))
        except InputError as e:
            raise BundleError(f"bundle {p}: its patch set does not load: {e}") from None
        if ps.digest() != psinfo["digest"] or ps.name != psinfo["name"] or ps.version != psinfo["version"]:
            raise BundleError(f"bundle {p}: patch set digest {ps.digest()[:16]}… differs from the manifest's")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return OpenBundle(bid, p, _sha(p.read_bytes()), manifest, ps, tmp / "templates", tmp)
