"""Build hook: put the checkout's templates/ and patches/ into the wheel (everything else is in
pyproject.toml).

The top-level folders stay the source of truth. A wheel build copies them into the package as
ddtree_ops/_data/templates/<file> and ddtree_ops/_data/patches.tar, where ddtree_ops/resources.py
finds them. The patch sets go in as one tar, not as files, because installers (pip, pipx)
byte-compile every .py file they install: the patch sets' modules would get __pycache__/ folders
beside them, which the patch-set loader refuses as unlisted files. The tar keeps each file's
mode, and is reproducible (sorted members, mtime 0, no owner names). Bytecode found in the
checkout is left out; a symlink fails the build (the loader would refuse it anyway).

An editable install (pip install -e .) copies nothing: resources.py reads the checkout's
folders directly, so edits there take effect at once.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import tarfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py as _build_py

ROOT = Path(__file__).resolve().parent
DATA = Path("ddtree_ops", "_data")
TEMPLATES, PATCHES_TAR = "templates", "patches.tar"


def _is_bytecode(name: str) -> bool:
    return name == "__pycache__" or name.endswith((".pyc", ".pyo"))


def _files(top: Path) -> list[Path]:
    """Regular files under `top`, sorted, without bytecode; a symlink is an error, and so is a
    missing or empty folder (an sdist without it would otherwise give a wheel without data)."""
    if not top.is_dir():
        raise SystemExit(f"setup.py: {top} is missing; build from a checkout or a complete sdist")
    out = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if not _is_bytecode(d))
        for name in sorted(dirnames + filenames):
            p = Path(dirpath, name)
            if p.is_symlink():
                raise SystemExit(f"setup.py: {p} is a symlink; ship regular files only")
        out += [Path(dirpath, f) for f in sorted(filenames) if not _is_bytecode(f)]
    if not out:
        raise SystemExit(f"setup.py: {top} holds no files")
    return sorted(out)


def patches_tar(top: Path) -> bytes:
    """Every file under `top` (the patches/ folder), relative to it, in a reproducible tar."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for p in _files(top):
            data = p.read_bytes()
            ti = tarfile.TarInfo(p.relative_to(top).as_posix())
            ti.size, ti.mtime, ti.mode = len(data), 0, stat.S_IMODE(p.stat().st_mode)
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            tf.addfile(ti, io.BytesIO(data))
    return raw.getvalue()


class build_py(_build_py):
    """build_py that also writes ddtree_ops/_data/ into the build folder (never into the checkout)."""

    def _data_outputs(self) -> list[str]:
        base = Path(self.build_lib) / DATA
        tdir = ROOT / TEMPLATES
        return [str(base / PATCHES_TAR)] + [str(base / TEMPLATES / p.relative_to(tdir)) for p in _files(tdir)]

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # resources.py reads the checkout
        base = Path(self.build_lib) / DATA
        shutil.rmtree(base, ignore_errors=True)  # nothing stale from an earlier build
        (base / TEMPLATES).mkdir(parents=True)
        tdir = ROOT / TEMPLATES
        for p in _files(tdir):
            dst = base / TEMPLATES / p.relative_to(tdir)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, dst)
            os.chmod(dst, stat.S_IMODE(p.stat().st_mode))
        (base / PATCHES_TAR).write_bytes(patches_tar(ROOT / "patches"))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        return outputs if getattr(self, "editable_mode", False) else outputs + self._data_outputs()


if __name__ == "__main__":  # how setuptools' build backend runs this file (tests import it by path)
    setup(cmdclass={"build_py": build_py})
