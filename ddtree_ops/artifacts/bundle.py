"""Release bundles: one immutable, byte-reproducible artifact per (patch set, templates).

Layout of `<id>.tar.gz` (GNU tar in gzip):

    bundle.json                     the manifest (first member)
    patchset/manifest.yaml          the patch set, as in patches/<name>/
    patchset/files/<path>           ...
    templates/<name>.j2             every unit template

`bundle.json` holds the format, the patch set's name/version/digest and, for every other member,
its path, size and sha256; `id` is `<name>-<version>-<first 16 hex of sha256(canonical file list
+ patch-set identity)>`, so equal inputs give an equal id. Members are in sorted order with mtime
0, uid/gid 0, empty owner names and mode 0644; gzip has mtime 0 and no file name: the same
inputs give the same bytes on any machine. `--sign-key` adds `<id>.tar.gz.sig`, an OpenSSH
signature (`ssh-keygen -Y sign`, namespace `ddtree-ops-bundle`) of the file's bytes.

A bundle may come from someone else, so `open_bundle` treats it as hostile until proven otherwise
and refuses (BundleError, exit 2, one line naming the file) before anything uses it:

* authenticity first, on the raw bytes, before any of them is parsed: `expect_id` (the bundle id
  or the file's sha256) and, when the inventory names signers, the OpenSSH signature;
* then one streaming pass that decompresses and parses without keeping more than one member in
  memory, under caps (compressed size, uncompressed size, member count, member size, manifest
  size and JSON nesting), with its own small tar reader: only regular files, canonical names
  (`templates/./x.j2`, `templates//x.j2`, `/x`, `a/../b`, backslashes, duplicates, a name that
  is both a file and a folder: refused), only `bundle.json`, `patchset/manifest.yaml`,
  `patchset/files/...` and `templates/*.j2`; the gzip CRC and length checked to the end;
* bundle.json by its tables (bundle_manifest.py: every key there and no other, each value of
  its row's type and form); every member against it (size before reading, sha256 after), the id
  against the content;
* only then a second pass writes the members into a private temp folder (O_EXCL: nothing is ever
  overwritten), checking the same hashes again, and the patch set is loaded to its digest.

`OpenBundle` is a context manager: the temp folder goes away on exit, on any error and on
Ctrl-C. A refused bundle leaves nothing behind.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

from ..config.schema import Invalid
from ..errors import BundleError, InputError, shown
from .bundle_manifest import (
    FORMAT,
    ID_RE,
    MANIFEST,
    MAX_MEMBER,
    MAX_MEMBERS,
    MAX_NAME,
    SHA_RE,
    bundle_id,
    name_problem,
    parse_bundle_manifest,
)
from .patchset import PatchSet, load_patchset
from .resources import templates_dir as default_templates_dir
from .signature_policy import SignatureCheck, SignerPolicy, bundle_check

# Caps: a bundle over any of them is refused as soon as the cap is crossed, before the rest is read.
MAX_BUNDLE_BYTES = 64 * 1024 * 1024  # the .tar.gz file itself
MAX_UNCOMPRESSED = 256 * 1024 * 1024  # every decompressed byte: headers, data, padding
MAX_MANIFEST = 4 * 1024 * 1024  # bundle.json (10 000 entries take about 1 MiB)
MAX_PATCHSET_MANIFEST = 1024 * 1024  # patchset/manifest.yaml
MAX_TRAILER = 1024 * 1024  # zero bytes after the tar end-of-archive block
MAX_SIGNATURE = 64 * 1024  # the .sig file

# Signatures: OpenSSH's `ssh-keygen -Y sign/verify` (ssh-keygen(1), "-Y sign"), this namespace.
SIG_NAMESPACE = "ddtree-ops-bundle"
SIG_SUFFIX = ".sig"
SSH_KEYGEN = "ssh-keygen"
SSH_KEYGEN_TIMEOUT_S = 120

_CHUNK = 64 * 1024
_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _fail(p: Path | str, problem: str) -> BundleError:
    """The error for bundle `p`: one line, naming the file."""
    return BundleError(_one_line(f"bundle {p}: {problem}"))


# --------------------------------------------------------------------------- building

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
    for name, data in members.items():  # what open_bundle would refuse is not built
        problem = name_problem(name) or (f"is larger than {MAX_MEMBER} bytes" if len(data) > MAX_MEMBER else None)
        if problem:
            raise InputError(f"cannot bundle {name}: {problem}")
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
    signature: Path | None = None


def build_bundle(patchset: str, out_dir: str | Path, templates_dir: str | Path | None = None,
                 sign_key: str | Path | None = None) -> BuiltBundle:
    ps = load_patchset(patchset)
    members = _collect(ps, Path(templates_dir) if templates_dir else default_templates_dir())
    files = [{"path": n, "size": len(d), "sha256": _sha(d)} for n, d in sorted(members.items())]
    bid = bundle_id(ps.name, ps.version, ps.digest(), files)
    manifest = {"format": FORMAT, "id": bid,
                "patchset": {"name": ps.name, "version": ps.version, "digest": ps.digest(),
                             "sglang": str(ps.sglang_spec)},
                "files": files}
    members[MANIFEST] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    data = _tar_bytes(members)
    if len(data) > MAX_BUNDLE_BYTES:
        raise InputError(f"the bundle would be {len(data)} bytes, over the {MAX_BUNDLE_BYTES} a bundle may have")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{bid}.tar.gz"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    sig = sign_bundle(path, sign_key) if sign_key else None
    return BuiltBundle(bid, path, _sha(data), manifest, sig)


# --------------------------------------------------------------------------- signatures

def signature_path(bundle: str | Path) -> Path:
    return Path(str(bundle) + SIG_SUFFIX)


def _ssh_keygen() -> str:
    exe = shutil.which(SSH_KEYGEN)
    if not exe:
        raise InputError(f"{SSH_KEYGEN} (OpenSSH) is not installed: bundle signatures need it")
    return exe


def _tool_message(stderr: bytes, fallback: str) -> str:
    lines = [ln.strip() for ln in stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith("Signing data on standard input")]
    text = _one_line("; ".join(lines))
    return (text[:300] + "…" if len(text) > 300 else text) if text else fallback


def sign_bundle(bundle: str | Path, key: str | Path) -> Path:
    """Write `<bundle>.sig`: `ssh-keygen -Y sign -f KEY -n ddtree-ops-bundle` over the bundle's bytes
    (on stdin; the signature comes on stdout and is written atomically). `key` is a private key, or
    a public key whose private half is in ssh-agent. InputError (exit 2) when signing fails."""
    bundle, key = Path(bundle), Path(key).expanduser()
    if not key.is_file():
        raise InputError(f"--sign-key {key}: no such key file")
    argv = [_ssh_keygen(), "-Y", "sign", "-f", str(key), "-n", SIG_NAMESPACE]
    with open(bundle, "rb") as fh:
        try:
            r = subprocess.run(argv, stdin=fh, capture_output=True, timeout=SSH_KEYGEN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise InputError(f"signing {bundle} with {key}: ssh-keygen did not finish in "
                             f"{SSH_KEYGEN_TIMEOUT_S} s (a passphrase prompt?)") from None
    if r.returncode != 0 or b"BEGIN SSH SIGNATURE" not in r.stdout:
        raise InputError(f"signing {bundle} with {key} failed: "
                         f"{_tool_message(r.stderr, f'ssh-keygen exited with {r.returncode}')}")
    sig = signature_path(bundle)
    tmp = sig.with_name(sig.name + ".tmp")
    tmp.write_bytes(r.stdout)
    tmp.replace(sig)
    return sig


def _verify_signature(p: Path, fh: BinaryIO, sig: Path, policy: SignerPolicy) -> tuple[str, str]:
    """Feed the bytes of `fh` to `ssh-keygen -Y verify` for `policy`; (sha256 of what was fed,
    the signer's description). BundleError unless the signature is good."""
    signers = Path(policy.allowed_signers)
    if not signers.is_file():
        raise _fail(p, f"cannot check its signature: the allowed signers file {signers} (bundle_signers."
                       f"allowed_signers) does not exist")
    argv = [_ssh_keygen(), "-Y", "verify", "-f", str(signers), "-I", policy.identity, "-n", SIG_NAMESPACE,
            "-s", str(sig)]
    h = hashlib.sha256()
    fh.seek(0)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err)
        try:
            try:
                for chunk in iter(lambda: fh.read(_CHUNK), b""):
                    h.update(chunk)
                    proc.stdin.write(chunk)
            except BrokenPipeError:  # ssh-keygen gave up early (an unreadable signature): its message says why
                for chunk in iter(lambda: fh.read(_CHUNK), b""):
                    h.update(chunk)
            finally:
                try:
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
            code = proc.wait(timeout=SSH_KEYGEN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise _fail(p, f"ssh-keygen did not verify the signature within {SSH_KEYGEN_TIMEOUT_S} s") from None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out.seek(0)
        err.seek(0)
        said, why = out.read(4096).decode("utf-8", "replace").strip(), err.read(4096)
    if code != 0:
        raise _fail(p, f"signature {sig.name} is not a good signature by {policy.identity!r} in {signers}: "
                       f"{_tool_message(why + b'; ' + said.encode(), f'ssh-keygen exited with {code}')}")
    return h.hexdigest(), _one_line(said) or f"signed by {policy.identity}"


# --------------------------------------------------------------------------- reading: names

class _Names:
    """Canonical, unique names; no name that is both a file and a folder."""

    def __init__(self, p: Path):
        self.p, self.files, self.dirs = p, set(), set()

    def add(self, name: str) -> None:
        problem = name_problem(name)
        if problem:
            raise _fail(self.p, f"member {shown(name)}: {problem}")
        if name in self.files:
            raise _fail(self.p, f"member {shown(name)} appears twice")
        if name in self.dirs:
            raise _fail(self.p, f"member {shown(name)} is a file, but other members are inside it as a folder")
        parts = name.split("/")
        for i in range(1, len(parts)):
            d = "/".join(parts[:i])
            if d in self.files:
                raise _fail(self.p, f"member {shown(name)} is inside {shown(d)}, which is a file")
            self.dirs.add(d)
        self.files.add(name)


# --------------------------------------------------------------------------- reading: streams

class _RawReader:
    """The bundle file as gzip reads it; hashes every byte read."""

    def __init__(self, fh: BinaryIO):
        self.fh, self.sha = fh, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(_CHUNK if n is None or n < 0 else n)
        self.sha.update(data)
        return data

    def drain(self) -> str:
        while self.read(_CHUNK):
            pass
        return self.sha.hexdigest()


class _Capped:
    """The decompressed stream, refused once it passes MAX_UNCOMPRESSED."""

    def __init__(self, p: Path, gz: gzip.GzipFile):
        self.p, self.gz, self.total = p, gz, 0
        self.end_of_archive = 0  # `total` when the tar end-of-archive block was read

    def read(self, n: int) -> bytes:
        """Up to `n` bytes (fewer only at the end of the stream)."""
        parts, want = [], n
        while want > 0:
            data = self.gz.read(min(want, _CHUNK))
            if not data:
                break
            self.total += len(data)
            if self.total > MAX_UNCOMPRESSED:
                raise _fail(self.p, f"decompresses to more than {MAX_UNCOMPRESSED} bytes (a gzip bomb?)")
            parts.append(data)
            want -= len(data)
        return b"".join(parts)

    def exact(self, n: int, what: str) -> bytes:
        data = self.read(n)
        if len(data) != n:
            raise _fail(self.p, f"the archive ends inside {what} (truncated)")
        return data


def _octal(field: bytes) -> int | None:
    if field[:1] and field[0] & 0x80:  # GNU base-256: only for sizes over 8 GiB
        return None
    digits = field.split(b"\0", 1)[0].strip(b" ")
    if not digits or any(c not in b"01234567" for c in digits):
        return None
    return int(digits, 8)


_TYPE_NAMES = {b"1": "a hard link", b"2": "a symbolic link", b"3": "a character device", b"4": "a block device",
               b"5": "a folder", b"6": "a FIFO", b"7": "a contiguous file", b"x": "a pax extended header",
               b"g": "a pax global header", b"K": "a GNU long link name", b"S": "a GNU sparse file",
               b"M": "a GNU multi-volume part", b"V": "a GNU volume label", b"N": "a GNU old long name"}


def _header(p: Path, hdr: bytes, index: int) -> tuple[bytes, int, bytes]:
    """(type flag, size, name bytes) of one 512-byte tar header; BundleError if it is not one."""
    where = f"tar header #{index + 1}"
    stored = _octal(hdr[148:156])
    unsigned = sum(hdr[:148]) + 8 * 32 + sum(hdr[156:])
    signed = unsigned - 256 * sum(1 for b in hdr[:148] + hdr[156:] if b >= 128)  # bytes as signed chars
    if stored is None or stored not in (unsigned, signed):
        raise _fail(p, f"{where} is not a tar header (bad checksum): not a tar archive, or corrupted")
    magic = hdr[257:265]
    if magic != b"ustar  \0" and hdr[257:263] != b"ustar\0":
        raise _fail(p, f"{where} is not a ustar/GNU tar header")
    size = _octal(hdr[124:136])
    if size is None:
        raise _fail(p, f"{where} has an unreadable size field")
    name = hdr[:100].split(b"\0", 1)[0]
    if hdr[257:263] == b"ustar\0":  # POSIX ustar: the name may be split into prefix/name
        prefix = hdr[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return hdr[156:157], size, name


def _decode(p: Path, raw: bytes) -> str:
    if any(not 32 <= b < 127 for b in raw):
        raise _fail(p, f"member {shown(raw)}: the name has characters outside printable ASCII")
    return raw.decode("ascii")


MemberSink = Callable[[str, int, Iterable[bytes]], None]


def _scan(p: Path, fh: BinaryIO, sink: MemberSink) -> str:
    """One pass over the bundle open on `fh`: gzip → tar, members in order to `sink(name, size,
    chunks)`, every cap and name rule enforced on the way, the gzip stream checked to its end.
    Returns the sha256 of the file's bytes."""
    fh.seek(0)
    raw = _RawReader(fh)
    try:
        with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
            s = _Capped(p, gz)
            _scan_tar(p, s, sink)
            while True:  # after the end-of-archive block: zeros only (tar pads to a record), and few
                rest = s.read(_CHUNK)
                if not rest:
                    break
                if rest.strip(b"\0"):
                    raise _fail(p, "has data after the end of the tar archive")
                if s.total - s.end_of_archive > MAX_TRAILER:
                    raise _fail(p, f"has more than {MAX_TRAILER} bytes of padding after the tar archive "
                                   f"(a gzip bomb?)")
    except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError; CRC/length: at the end
        raise _fail(p, f"is not a complete gzip file (truncated or corrupted): {e}") from None
    return raw.drain()


def _scan_tar(p: Path, s: _Capped, sink: MemberSink) -> None:
    names = _Names(p)
    longname: bytes | None = None
    declared = members = 0
    index = 0
    while True:
        hdr = s.read(_BLOCK)
        if len(hdr) < _BLOCK:
            raise _fail(p, "the tar archive ends without its end-of-archive block (truncated)")
        if hdr == _ZERO_BLOCK:
            if longname is not None:
                raise _fail(p, "the tar archive ends after a long name without its member")
            s.end_of_archive = s.total
            break
        kind, size, name_b = _header(p, hdr, index)
        index += 1
        if kind == b"L":  # GNU long name: the next header's name, as data
            if longname is not None or size > MAX_NAME + 1:
                raise _fail(p, f"tar header #{index} is a GNU long name that is too long or repeated")
            longname = s.exact(-(-size // _BLOCK) * _BLOCK, "a long name")[:size].split(b"\0", 1)[0]
            continue
        name = _decode(p, longname if longname is not None else name_b)
        longname = None
        if kind not in (b"0", b"\0"):
            what = _TYPE_NAMES.get(kind, f"of tar type {shown(kind)}")
            raise _fail(p, f"member {shown(name)} is {what}: only regular files may be in a bundle")
        members += 1
        if members > MAX_MEMBERS:
            raise _fail(p, f"has more than {MAX_MEMBERS} members")
        names.add(name)
        if size > MAX_MEMBER:
            raise _fail(p, f"member {shown(name)} is too large ({size} bytes; at most {MAX_MEMBER})")
        declared += size
        if declared > MAX_UNCOMPRESSED:
            raise _fail(p, f"its members add up to more than {MAX_UNCOMPRESSED} bytes")
        left = [size]

        def chunks(left: list[int] = left, name: str = name) -> Iterable[bytes]:
            while left[0] > 0:
                data = s.exact(min(left[0], _CHUNK), f"member {shown(name)}")
                left[0] -= len(data)
                yield data

        sink(name, size, chunks())
        for _ in chunks():  # whatever the sink left unread
            pass
        pad = -size % _BLOCK
        if pad:
            s.exact(pad, f"member {shown(name)}")


# --------------------------------------------------------------------------- reading: the manifest

def _parse_manifest(p: Path, data: bytes) -> tuple[dict, dict[str, dict]]:
    """bundle.json → (manifest, {path: file entry}): bundle_manifest.py's tables; BundleError."""
    try:
        return parse_bundle_manifest(data)
    except Invalid as e:
        raise _fail(p, e.problem) from None


class _Verifier:
    """The member sink of both passes: bundle.json first, then exactly the listed members, each
    with its listed size and sha256; with `dest`, each written there (never over anything)."""

    def __init__(self, p: Path, dest: Path | None = None, manifest_bytes: bytes | None = None):
        self.p, self.dest, self.expected_manifest = p, dest, manifest_bytes
        self.manifest_bytes: bytes | None = None
        self.manifest: dict = {}
        self.listed: dict[str, dict] = {}
        self.seen: set[str] = set()

    def __call__(self, name: str, size: int, chunks: Iterable[bytes]) -> None:
        p = self.p
        if self.manifest_bytes is None:
            if name != MANIFEST:
                raise _fail(p, f"the first member must be {MANIFEST}, got {shown(name)}")
            if size > MAX_MANIFEST:
                raise _fail(p, f"{MANIFEST} is larger than {MAX_MANIFEST} bytes")
            self.manifest_bytes = b"".join(chunks)
            if self.expected_manifest is not None and self.manifest_bytes != self.expected_manifest:
                raise _fail(p, "the file changed while it was being read")
            self.manifest, self.listed = _parse_manifest(p, self.manifest_bytes)
            self._write(name, [self.manifest_bytes])
            return
        entry = self.listed.get(name)
        if entry is None:
            raise _fail(p, f"member {shown(name)} is not listed in {MANIFEST}: the bundle was modified")
        if size != entry["size"]:
            raise _fail(p, f"member {name} has {size} bytes, {MANIFEST} says {entry['size']}: the bundle was modified")
        if name == "patchset/manifest.yaml" and size > MAX_PATCHSET_MANIFEST:
            raise _fail(p, f"{name} is larger than {MAX_PATCHSET_MANIFEST} bytes")
        h = hashlib.sha256()

        def hashed() -> Iterable[bytes]:
            for c in chunks:
                h.update(c)
                yield c

        self._write(name, hashed())
        got = h.hexdigest()
        if got != entry["sha256"]:
            raise _fail(p, f"{name} has sha256 {got[:16]}…, {MANIFEST} says {entry['sha256'][:16]}…: "
                           f"the bundle was modified")
        self.seen.add(name)

    def _write(self, name: str, chunks: Iterable[bytes]) -> None:
        if self.dest is None:
            for _ in chunks:
                pass
            return
        dst = self.dest / name
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
            with os.fdopen(fd, "wb") as out:
                for c in chunks:
                    out.write(c)
        except FileExistsError:  # a case-insensitive file system folds two names into one
            raise _fail(self.p, f"member {shown(name)} names the same file as another one on this file system") \
                from None
        except OSError as e:
            raise BundleError(_one_line(f"bundle {self.p}: cannot extract {name} into {self.dest}: "
                                        f"{e.strerror or e}")) from None

    def finish(self) -> None:
        if self.manifest_bytes is None:
            raise _fail(self.p, "is empty")
        missing = sorted(set(self.listed) - self.seen)
        if missing:
            raise _fail(self.p, f"members listed in {MANIFEST} are missing: {shown(missing)}")


# --------------------------------------------------------------------------- opening

@dataclass
class OpenBundle:
    """A verified bundle, extracted into a private temp folder (removed by close() / `with`)."""

    id: str
    path: Path
    sha256: str
    manifest: dict
    patchset: PatchSet
    templates_dir: Path
    _tmp: Path
    signed_by: tuple[str, ...] = ()  # ssh-keygen's "Good signature for ..." per checked policy

    def close(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "OpenBundle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_expect_id(value: str) -> str:
    """`--expect-id`: a bundle id or a sha256 (64 hex digits, any case) → its canonical form."""
    v = value.strip()
    if re.match(r"^[0-9A-Fa-f]{64}$", v):
        return v.lower()
    if ID_RE.match(v):
        return v
    raise InputError(f"--expect-id {shown(value)}: give the bundle id (<name>-<version>-<16 hex>) or the "
                     f"sha256 of the bundle file (64 hex digits)")


def open_bundle(path: str | Path, *, expect_id: str | None = None,
                signers: Iterable[SignerPolicy] = ()) -> OpenBundle:
    """Verify a bundle completely, extract it, load its patch set. BundleError on any problem.

    `expect_id`: the bundle id or the file's sha256 it must have. `signers`: the inventory's
    policies; with any, `<path>.sig` is verified against each (a missing one is refused when one
    of them is `required`). Use as a context manager: the temp folder is removed on exit."""
    p = Path(path)
    expect = check_expect_id(expect_id) if expect_id is not None else None
    policies = list(dict.fromkeys(signers))
    try:
        fh = open(p, "rb")
    except FileNotFoundError:
        raise _fail(p, "does not exist") from None
    except OSError as e:
        raise _fail(p, f"cannot read: {e.strerror or e}") from None
    with fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise _fail(p, "is not a regular file")
        if st.st_size == 0:
            raise _fail(p, "is an empty file")
        if st.st_size > MAX_BUNDLE_BYTES:
            raise _fail(p, f"is {st.st_size} bytes; a bundle may have at most {MAX_BUNDLE_BYTES}")
        try:
            return _open(p, fh, expect, policies)
        except OSError as e:
            raise _fail(p, f"cannot read: {e.strerror or e}") from None


def _check_signature(p: Path, fh: BinaryIO, policies: list[SignerPolicy]) -> tuple[str, tuple[str, ...]]:
    """(sha256 of the file, who signed it per policy). The raw bytes only: nothing is parsed yet."""
    sig = signature_path(p)
    check = bundle_check(policies, sig.exists())
    if check is SignatureCheck.MISSING:
        raise _fail(p, f"has no signature ({sig.name} not found) and the inventory requires one "
                       f"(bundle_signers.required): sign it with `ddtree-ops bundle --sign-key KEY`")
    if check is SignatureCheck.SKIP:
        fh.seek(0)
        h = hashlib.sha256()
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            h.update(chunk)
        return h.hexdigest(), ()
    try:
        sst = os.lstat(sig)
    except OSError as e:
        raise _fail(p, f"cannot read its signature {sig}: {e.strerror or e}") from None
    if not stat.S_ISREG(sst.st_mode) or sst.st_size > MAX_SIGNATURE:
        raise _fail(p, f"its signature {sig.name} is not a regular file of at most {MAX_SIGNATURE} bytes")
    sha, who = None, []
    for pol in policies:
        got, said = _verify_signature(p, fh, sig, pol)
        if sha is not None and got != sha:
            raise _fail(p, "the file changed while it was being read")
        sha = got
        who.append(said)
    return sha, tuple(who)


def _open(p: Path, fh: BinaryIO, expect: str | None, policies: list[SignerPolicy]) -> OpenBundle:
    # 1. Authenticity, on the raw bytes.
    sha, signed_by = _check_signature(p, fh, policies)
    if expect is not None and SHA_RE.match(expect) and expect != sha:
        raise _fail(p, f"expected {expect} (--expect-id), but the file's sha256 is {sha}")
    # 2. Verify everything, writing nothing.
    check = _Verifier(p)
    if _scan(p, fh, check) != sha:
        raise _fail(p, "the file changed while it was being read")
    check.finish()
    bid = check.manifest["id"]
    if expect is not None and not SHA_RE.match(expect) and expect != bid:
        raise _fail(p, f"expected {expect} (--expect-id), but it is {bid} (sha256 {sha})")
    stem = p.name[:-len(".tar.gz")] if p.name.endswith(".tar.gz") else None
    if stem and ID_RE.match(stem) and stem != bid:
        raise _fail(p, f"named {stem} but its content is {bid}")
    # 3. Extract what was verified (checked again on the way) and load the patch set.
    tmp = Path(tempfile.mkdtemp(prefix="ddtree-ops-bundle-"))
    try:
        extract = _Verifier(p, tmp, check.manifest_bytes)
        if _scan(p, fh, extract) != sha:
            raise _fail(p, "the file changed while it was being read")
        extract.finish()
        psinfo = check.manifest["patchset"]
        try:
            ps = load_patchset(str(tmp / "patchset"))
        except InputError as e:
            raise _fail(p, f"its patch set does not load: {str(e).replace(str(tmp), '')}") from None
        if ps.digest() != psinfo["digest"] or ps.name != psinfo["name"] or ps.version != psinfo["version"]:
            raise _fail(p, f"patch set digest {ps.digest()[:16]}… differs from the manifest's")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return OpenBundle(bid, p, sha, check.manifest, ps, tmp / "templates", tmp, signed_by)
