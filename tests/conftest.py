"""Shared fixtures: one set of real sandbox hosts per test session, reset per test, and small
patch sets built from the real sglang 0.5.23 files.

Sandbox tests need root, iproute2, util-linux and OpenSSH sshd. Without them they are skipped,
except under DDTREE_OPS_STRICT=1 (set by .ci/run), where a missing prerequisite is a failure:
CI must never go green by skipping the tests that matter.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
STRICT = os.environ.get("DDTREE_OPS_STRICT") == "1"
SANDBOX_HOSTS = int(os.environ.get("DDTREE_OPS_TEST_HOSTS", "4"))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _require_sandbox() -> None:
    from ddtree_ops.sandbox import missing_prerequisites

    missing = missing_prerequisites()
    if missing:
        msg = "sandbox prerequisites missing: " + "; ".join(missing)
        if STRICT:
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory):
    """Real test hosts (network + mount namespaces, sshd, systemctl, sglang files)."""
    _require_sandbox()
    from ddtree_ops.sandbox import Sandbox

    sb = Sandbox(tmp_path_factory.mktemp("sandbox"))
    try:
        sb.up(SANDBOX_HOSTS, load_seconds=0.3)
        yield sb
    finally:
        sb.down()


@dataclass
class TestHost:
    """One sandbox host as a test sees it."""

    name: str
    sandbox: object
    inventory: Path  # the sandbox inventory (possibly with per-test overrides)

    @property
    def host(self):
        from ddtree_ops.inventory import load_inventory

        return load_inventory(self.inventory).hosts[self.name]

    def ssh(self, argv: list[str], check: bool = True, stdin: str | None = None):
        from ddtree_ops.transport import connect

        with connect(self.host) as conn:
            return conn.run(argv, check=check, stdin=stdin)

    def read(self, path: str) -> bytes | None:
        r = self.ssh(["sh", "-c", 'test -f "$1" && base64 -w0 "$1" || echo MISSING', "sh", path])
        out = r.stdout.strip()
        if out == "MISSING":
            return None
        import base64

        return base64.b64decode(out)

    def snapshot(self, paths: list[str]) -> dict[str, str | None]:
        """sha256 (or None) of each path, in one round trip."""
        script = 'for p in "$@"; do if [ -f "$p" ]; then sha256sum "$p"; else echo "- $p"; fi; done'
        out = self.ssh(["sh", "-c", script, "sh", *paths]).stdout
        snap = {}
        for line in out.splitlines():
            digest, path = line.split(None, 1)
            snap[path] = None if digest == "-" else digest
        return snap

    def unit_state(self, unit: str) -> str:
        return self.ssh(["systemctl", "is-active", unit], check=False).stdout.strip()

    def main_pid(self, unit: str) -> int | None:
        out = self.ssh(["systemctl", "show", "-p", "MainPID", unit], check=False).stdout.strip()
        pid = int(out.split("=", 1)[1] or 0) if out.startswith("MainPID=") else 0
        return pid or None

    def with_vars(self, tmp_path: Path, **host_vars) -> "TestHost":
        """A copy of the inventory where this host has extra vars (e.g. fault knobs)."""
        doc = yaml.safe_load(Path(self.sandbox.inventory_path).read_text())
        hosts = doc["all"]["children"]["sandbox"]["hosts"]
        hosts[self.name] = {**hosts[self.name], **host_vars}
        out = tmp_path / f"inventory-{self.name}-{len(list(tmp_path.glob('inventory-*')))}.yaml"
        out.write_text(yaml.safe_dump(doc, sort_keys=False))
        return TestHost(self.name, self.sandbox, out)

    def base_extra_args(self) -> list[str]:
        doc = yaml.safe_load(Path(self.sandbox.inventory_path).read_text())
        return list(doc["all"]["vars"]["extra_args"])


@pytest.fixture
def fresh_host(sandbox) -> TestHost:
    """sbx1, reset to the state before any deploy (upstream files, DFlash unit running)."""
    sandbox.reset_host("sbx1")
    return TestHost("sbx1", sandbox, Path(sandbox.inventory_path))


@pytest.fixture
def fresh_hosts(sandbox) -> list[TestHost]:
    """Every sandbox host, each reset to the state before any deploy."""
    out = []
    for h in sandbox.hosts():
        sandbox.reset_host(h.name)
        out.append(TestHost(h.name, sandbox, Path(sandbox.inventory_path)))
    return out


# ---------------------------------------------------------------------------------------------
# patch sets


def upstream_file(rel: str) -> bytes:
    from ddtree_ops.sandbox import sglang_site_tree

    return (sglang_site_tree() / rel).read_bytes()


def make_patchset(root: Path, files: dict[str, bytes], *, name: str = "testps", version: str = "1.0.0",
                  sglang: str = "==0.5.23", replace: tuple[str, ...] | None = None) -> Path:
    """A patch set folder: each rel path → content; paths that exist upstream are `replace`
    (with the real base hash), the others `add`."""
    from ddtree_ops.sandbox import sglang_site_tree

    site = sglang_site_tree()
    d = root / name
    entries = []
    for rel, data in files.items():
        dst = d / "files" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
        upstream = site / rel
        if (replace is None and upstream.exists()) or (replace is not None and rel in replace):
            entries.append({"path": rel, "action": "replace", "base_sha256": sha256_bytes(upstream.read_bytes())})
        else:
            entries.append({"path": rel, "action": "add"})
    manifest = {"name": name, "version": version, "sglang": sglang, "files": entries}
    (d / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return d


DFLASH_INFO = "sglang/srt/speculative/dflash_info.py"


@pytest.fixture
def good_patchset(tmp_path) -> Path:
    """Adds a ddtree module and replaces an upstream file: the shape of the real payload."""
    return make_patchset(tmp_path, {
        "sglang/srt/speculative/ddtree_probe.py": b"PROBE = 'ddtree-ops test patch set'\n",
        DFLASH_INFO: upstream_file(DFLASH_INFO) + b"\n# patched by the ddtree-ops tests\n",
    })


# ---------------------------------------------------------------------------------------------
# running the CLI for real


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> CliResult:
    """`ddtree-ops ARGS` in a subprocess, as an operator or a pipeline runs it."""
    full_env = {**os.environ, **(env or {})}
    r = subprocess.run([sys.executable, "-m", "ddtree_ops", *args], capture_output=True, text=True,
                       timeout=timeout, env=full_env, stdin=subprocess.DEVNULL)
    return CliResult(r.returncode, r.stdout, r.stderr)


@pytest.fixture
def cli():
    return run_cli


def snapshot_paths(th: TestHost, rels: list[str]) -> list[str]:
    h = th.host
    return [f"{h.site_packages}/{r}" for r in rels] + [h.unit_path] + [f"/etc/systemd/system/{u}" for u in h.conflicts]


__all__ = ["TestHost", "make_patchset", "upstream_file", "run_cli", "snapshot_paths", "copy"]
