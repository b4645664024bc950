"""Where ddtree-ops finds its data: the unit templates and the patch sets.

The checkout's top-level ``templates/`` and ``patches/`` are the source of truth, and every
other module asks this one for them (`templates_dir()`, `patches_dir()`).

* A checkout, or an editable install of it (``pip install -e .``, what scripts/setup does):
  those two folders, beside the package.
* A wheel (``pip install .``, ``pipx install .``): the build (setup.py) copies them into the
  package as ``ddtree_ops/_data/templates/`` (plain files) and ``ddtree_ops/_data/patches.tar``.
  The patch sets travel as one tar because installers byte-compile every ``.py`` file they
  install: the patch sets' modules would get ``__pycache__/`` folders beside them, unlisted
  files the patch-set loader refuses. The tar also keeps every file's mode. It is unpacked on
  first use, once per process, into a private temporary folder that is removed at exit.

The installed package wins over a checkout around it, so a wheel never picks up a stray
``templates/`` folder that happens to sit next to its site-packages.
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import tarfile
import tempfile
import threading
from pathlib import Path

from ..errors import InputError

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # ddtree_ops/, not artifacts/
DATA_DIR = PACKAGE_DIR / "_data"  # only in an installed wheel
TEMPLATES = "templates"
PATCHES_TAR = "patches.tar"
CHECKOUT_DIR = PACKAGE_DIR.parent  # a checkout (or editable install) has templates/ and patches/ here

_lock = threading.Lock()
_unpacked: Path | None = None


def _checkout_has(name: str) -> bool:
    return (CHECKOUT_DIR / "pyproject.toml").is_file() and (CHECKOUT_DIR / name).is_dir()


def _missing(what: str, looked: list[Path]) -> InputError:
    return InputError(f"ddtree-ops cannot find its {what} (looked in {', '.join(map(str, looked))}): the "
                      f"installation is incomplete; reinstall it (pip install . / pipx install . from a checkout)")


def origin() -> str:
    """'wheel' when the data comes from the installed package, else 'checkout'."""
    return "wheel" if (DATA_DIR / TEMPLATES).is_dir() else "checkout"


def templates_dir() -> Path:
    """The folder of unit templates (*.j2)."""
    if (DATA_DIR / TEMPLATES).is_dir():
        return DATA_DIR / TEMPLATES
    if _checkout_has("templates"):
        return CHECKOUT_DIR / "templates"
    raise _missing("unit templates", [DATA_DIR / TEMPLATES, CHECKOUT_DIR / "templates"])


def patches_dir() -> Path:
    """The folder that holds the patch sets by name (patches/<name>/manifest.yaml)."""
    if (DATA_DIR / PATCHES_TAR).is_file():
        return _unpack(DATA_DIR / PATCHES_TAR)
    if _checkout_has("patches"):
        return CHECKOUT_DIR / "patches"
    raise _missing("patch sets", [DATA_DIR / PATCHES_TAR, CHECKOUT_DIR / "patches"])


def _unpack(archive: Path) -> Path:
    """`archive` unpacked once per process into a private folder: <tmp>/patches/<name>/..."""
    global _unpacked
    with _lock:
        if _unpacked is not None and _unpacked.is_dir():
            return _unpacked
        tmp = Path(tempfile.mkdtemp(prefix="ddtree-ops-data-"))  # mode 0700
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        dest = tmp / "patches"
        dest.mkdir()
        try:
            with tarfile.open(archive, mode="r:") as tf:
                for ti in tf:
                    parts = ti.name.split("/")  # as written: setup.py writes plain relative names
                    if not ti.isreg() or any(p in ("", ".", "..") for p in parts):
                        raise InputError(f"{archive}: unexpected member {ti.name!r}; reinstall ddtree-ops")
                    target = dest.joinpath(*parts)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with tf.extractfile(ti) as src, open(target, "xb") as out:
                        shutil.copyfileobj(src, out)
                    os.chmod(target, stat.S_IMODE(ti.mode) & 0o777)
        except (OSError, tarfile.TarError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise InputError(f"{archive}: cannot unpack the patch sets: {e}; reinstall ddtree-ops") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _unpacked = dest
        return dest
