"""The real sglang 0.5.23 wheel, downloaded once and kept extracted between runs.

Where it is kept is decided here and nowhere else (`cache_dir`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path

from .errors import SandboxError
from .layout import SGLANG_VERSION
from .system import file_lock

CACHE_ENV = "DDTREE_OPS_CACHE"


def cache_dir(environ: Mapping[str, str] | None = None, module_file: str | os.PathLike = __file__) -> Path:
    """$DDTREE_OPS_CACHE when set; from a checkout (pyproject.toml beside the `ddtree_ops`
    package) its `.cache/`, shared with CI; installed elsewhere, the per-user cache
    ($XDG_CACHE_HOME or ~/.cache)/ddtree-ops."""
    env = os.environ if environ is None else environ
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    root = Path(module_file).resolve().parents[3]  # <root>/ddtree_ops/testing/sandbox/wheelcache.py
    if (root / "pyproject.toml").is_file():
        return root / ".cache"
    user_cache = Path(env.get("XDG_CACHE_HOME") or Path(env.get("HOME") or Path.home()) / ".cache")
    return user_cache / "ddtree-ops"


def sglang_site_tree() -> Path:
    """A folder holding `sglang/` and `sglang-0.5.23.dist-info/` extracted from the real wheel.

    Downloaded once with `pip download --no-deps` (the only network use, a package registry)
    and kept in `cache_dir()` so later runs and CI re-runs need no download.
    """
    cache = cache_dir()
    extracted = cache / f"sglang-{SGLANG_VERSION}-site"
    if (extracted / ".complete").exists():
        return extracted
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    with file_lock(cache / ".sglang.lock"):
        if (extracted / ".complete").exists():
            return extracted
        found = sorted(wheels.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if not found:
            r = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels),
                 f"sglang=={SGLANG_VERSION}"],
                capture_output=True, text=True,
            )
            found = sorted(wheels.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
            if r.returncode != 0 or not found:
                raise SandboxError(
                    f"could not download sglang=={SGLANG_VERSION} with pip (needed for the test hosts' "
                    f"site-packages): {r.stderr.strip()[-500:]}"
                )
        tmp = extracted.with_name(extracted.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with zipfile.ZipFile(found[0]) as zf:
            zf.extractall(tmp)
        (tmp / ".complete").write_text(found[0].name + "\n")
        shutil.rmtree(extracted, ignore_errors=True)
        tmp.rename(extracted)
    return extracted
