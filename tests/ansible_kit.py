"""What the ddtree.ops collection's tests share: the collection built with `ansible-galaxy
collection build` and installed from that tarball (never the source folder), and Ansible's tools
run from the test venv with that collection on their path."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kit import REPO, TestHost, host_tree

COLLECTION_SRC = REPO / "ansible_collections" / "ddtree" / "ops"
SCENARIO_DIR = REPO / "tests" / "ansible"
VENV_BIN = Path(sys.executable).parent
VERSION = "0.1.0"


@dataclass(frozen=True)
class Installed:
    tarball: Path
    path: Path  # the collections path (holds ansible_collections/ddtree/ops)

    @property
    def root(self) -> Path:
        return self.path / "ansible_collections" / "ddtree" / "ops"


def build_and_install(tmp: Path) -> Installed:
    out = tmp / "dist"
    run([str(VENV_BIN / "ansible-galaxy"), "collection", "build", str(COLLECTION_SRC), "--output-path", str(out)],
        cwd=tmp)
    tarball = out / f"ddtree-ops-{VERSION}.tar.gz"
    path = tmp / "collections"
    run([str(VENV_BIN / "ansible-galaxy"), "collection", "install", str(tarball), "-p", str(path)], cwd=tmp)
    return Installed(tarball, path)


def ansible_env(installed: Installed, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "ANSIBLE_COLLECTIONS_PATH": str(installed.path), "ANSIBLE_NOCOLOR": "1", "NO_COLOR": "1",
           "ANSIBLE_FORCE_COLOR": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    env.update(extra)
    return env


def run(argv: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300,
        check: bool = True) -> subprocess.CompletedProcess:
    """A tool's run, its output in the failure message when it fails."""
    p = subprocess.run(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {p.returncode}\n--- stdout\n{p.stdout[-6000:]}"
                             f"\n--- stderr\n{p.stderr[-4000:]}")
    return p


def managed_tree(th: TestHost) -> dict:
    """The host's tree (kit.host_tree) without the servers' own __pycache__ (written by whichever
    server imported the modules last, stamped with their mtimes): what the tool installs, backs up
    and restores, byte for byte."""
    tree = host_tree(th)
    return {**tree, "files": {p: v for p, v in tree["files"].items() if "/__pycache__/" not in p}}
