"""Fixtures of the fast tier: fake hosts (ddtree_ops.testing.fake_host) and small patch sets.
No test host, no SSH: a deploy against a fake host takes milliseconds, through the real
`HostSession`, `ReleaseStore` and `Services` (only the link below them is fake)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from ddtree_ops.testing.fake_host import UPSTREAM_BYTES, UPSTREAM_REL, ControllerKilled, FakeHost, fake_hosts

PROBE_REL = "sglang/srt/speculative/ddtree_probe.py"


def write_patchset(root: Path, files: dict[str, bytes], *, name: str = "fastps", version: str = "1.0.0") -> Path:
    """A patch set folder; UPSTREAM_REL is a `replace` of the fake hosts' upstream file."""
    d = root / f"{name}-{version}"
    entries = []
    for rel, data in files.items():
        dst = d / "files" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
        if rel == UPSTREAM_REL:
            entries.append({"path": rel, "action": "replace",
                            "base_sha256": hashlib.sha256(UPSTREAM_BYTES).hexdigest()})
        else:
            entries.append({"path": rel, "action": "add"})
    (d / "manifest.yaml").write_text(yaml.safe_dump({"name": name, "version": version, "sglang": "==0.5.23",
                                                     "packages": ["sglang"], "files": entries}, sort_keys=False))
    return d


def load(path: Path):
    from ddtree_ops.artifacts.patchset import load_patchset

    return load_patchset(str(path))


@pytest.fixture
def fake(tmp_path) -> FakeHost:
    """One fake host before a DDTree deploy: upstream files, the DFlash unit serving."""
    return fake_hosts(tmp_path / "hosts")[0]


@pytest.fixture
def fake_server(tmp_path) -> list[FakeHost]:
    """The two nodes of one multi-node server, rank 0 first."""
    return fake_hosts(tmp_path / "hosts", 2, multinode=True)


@pytest.fixture
def patchset(tmp_path):
    """Adds a module and replaces an upstream file, like the real payload."""
    return load(write_patchset(tmp_path / "ps", {PROBE_REL: b"PROBE = 1\n",
                                                  UPSTREAM_REL: UPSTREAM_BYTES + b"# patched\n"}, name="payload"))


@pytest.fixture
def versioned_patchset(tmp_path):
    """versioned_patchset(version, marker=b"") → a patch set whose module carries `marker`."""
    def make(version: str = "1.0.0", marker: bytes = b""):
        files = {PROBE_REL: b"PROBE = %r\n" % version.encode() + marker,
                 UPSTREAM_REL: UPSTREAM_BYTES + b"# patched\n"}
        return load(write_patchset(tmp_path / "ps" / marker.hex(), files, version=version))
    return make


def kill_deploy_at_call(fake: FakeHost, k: int, deploy, patchset: Path, opts) -> str:
    """`deploy(session, patchset, opts)` on `fake`, the controller killed at its k-th remote
    call; the fault is cleared again. Returns where it died, for assertion messages."""
    fake.fault_at_call, fake.calls = ("kill", k), 0
    with pytest.raises(ControllerKilled):
        deploy(fake.session(), patchset, opts)
    fake.fault_at_call = None
    return f"killed at deploy call {k} ({fake.events[-1]})"
