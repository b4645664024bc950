"""The DDTree payload: found beside the installed sglang, imported as SGLang does, its API looked up."""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

# Names under which the payload may expose the reference tree sampler (first found wins).
SAMPLING_FUNCTION_NAMES = (
    "tree_speculative_sampling_reference",
    "tree_speculative_sampling_target_only_reference",
    "tree_speculative_sampling_target_only",
)


class PayloadError(Exception):
    """A payload function raised or returned something unusable."""


def find_site_packages(fallback: str | None) -> Path | None:
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]).resolve().parent
    if fallback:
        sp = Path(fallback).resolve()
        if (sp / "sglang").is_dir():
            sys.path.insert(0, str(sp))
            importlib.invalidate_caches()
            return sp
    return None


def list_ddtree_modules(site_packages: Path | None) -> list[Path]:
    if site_packages is None:
        return []
    return sorted((site_packages / "sglang" / "srt" / "speculative").glob("ddtree*.py"))


def prepare_parent_packages(site_packages: Path) -> str | None:
    """Make ``sglang.srt.speculative`` importable before the DDTree modules are imported.

    The real package is imported first. On a test host the venv holds the real sglang
    0.5.23 files without SGLang's dependencies (orjson, transformers, ...), so
    ``sglang/__init__.py`` fails for reasons that have nothing to do with the payload;
    then ``sglang``, ``sglang.srt`` and ``sglang.srt.speculative`` are replaced by bare
    package stubs pointing at the same folders, and the DDTree modules (and whatever they
    import themselves) are still imported from their files. Returns the reason when the
    stubs were needed, None otherwise."""
    try:
        importlib.import_module("sglang.srt.speculative")
        return None
    except Exception as exc:  # noqa: BLE001
        reason = f"{type(exc).__name__}: {exc}"
    for name in list(sys.modules):
        if name == "sglang" or name.startswith("sglang."):
            del sys.modules[name]
    parent = None
    for name, rel in (("sglang", "sglang"), ("sglang.srt", "sglang/srt"),
                      ("sglang.srt.speculative", "sglang/srt/speculative")):
        path = str(site_packages / rel)
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [path]
        mod = types.ModuleType(name)
        mod.__spec__ = spec
        mod.__path__ = [path]
        mod.__package__ = name
        sys.modules[name] = mod
        if parent is not None:
            setattr(parent, name.rsplit(".", 1)[1], mod)
        parent = mod
    importlib.invalidate_caches()
    return reason


def sha256_short(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


class DDTreeFunctions:
    def __init__(self, build, compile_retrieve, sampling, sampling_name: str):
        self.build = build
        self.compile_retrieve = compile_retrieve
        self.sampling = sampling
        self.sampling_name = sampling_name


def lookup_ddtree_functions() -> DDTreeFunctions | None:
    """The payload API from ``sglang.srt.speculative.ddtree_utils``; a function missing
    there is looked up in the other imported ``ddtree*`` modules (sorted)."""
    prefix = "sglang.srt.speculative."
    main_mod = sys.modules.get(prefix + "ddtree_utils")
    if main_mod is None:
        return None
    others = [sys.modules[n] for n in sorted(sys.modules)
              if n.startswith(prefix + "ddtree") and n != prefix + "ddtree_utils"
              and sys.modules[n] is not None]
    mods = [main_mod, *others]

    def find(*names: str):
        for mod in mods:
            for name in names:
                fn = getattr(mod, name, None)
                if callable(fn):
                    return fn, name
        return None, ""

    build, _ = find("build_ddtree_tree")
    compile_retrieve, _ = find("compile_ddtree_retrieve")
    sampling, name = find(*SAMPLING_FUNCTION_NAMES)
    if build is None or compile_retrieve is None or sampling is None:
        return None
    return DDTreeFunctions(build, compile_retrieve, sampling, name)
