"""Every ddtree*.py module imports with only stdlib + torch + numpy + other
sglang.srt.speculative.ddtree* modules available (the test hosts' stand-in
server imports them without SGLang's third-party dependencies)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import FILES_DIR


def test_ddtree_modules_import_light():
    mods = sorted(p.stem for p in (FILES_DIR / "sglang/srt/speculative").glob("ddtree*.py"))
    assert {"ddtree_utils", "ddtree_verify", "ddtree_worker", "ddtree_args"} <= set(mods)
    code = textwrap.dedent(
        f"""
        import sys, importlib.abc
        ALLOWED = set(sys.stdlib_module_names) | {{"torch", "numpy", "sglang"}}
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                top = name.split(".")[0]
                if top not in ALLOWED and not top.startswith("_"):
                    raise ImportError("blocked third-party import: " + name)
                if top == "sglang" and name.count(".") >= 3 and not name.split(".")[3].startswith("ddtree"):
                    raise ImportError("blocked sglang internal: " + name)
                return None
        import torch  # allowed, import before the blocker (its own deps)
        sys.meta_path.insert(0, Block())
        sys.path.insert(0, {str(FILES_DIR)!r})
        for m in {mods!r}:
            __import__("sglang.srt.speculative." + m)
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
