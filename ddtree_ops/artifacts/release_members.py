"""What a release may ship into site-packages, whatever the patch set or bundle says.

A shipped file must be reviewed source that runs only when the server imports it. Four kinds of
file run without being imported, or shadow what was reviewed, and are refused by name:

* `*.pth`: site.py executes its `import` lines in every interpreter that uses the venv;
* `sitecustomize` / `usercustomize` (any `*customize.py`, or a package of that name): imported
  by site.py at every interpreter start;
* anything under `__pycache__/`, and `.pyc`/`.pyo`: bytecode the host would run instead of the
  source it was compiled from (the host compiles the reviewed source itself).

Symlinks and non-regular files are refused where the files are read (patchset.py, bundle.py).
"""

from __future__ import annotations

BYTECODE_DIR = "__pycache__"
_BYTECODE_SUFFIXES = (".pyc", ".pyo")
_SITE_HOOKS = ("sitecustomize", "usercustomize")


def member_problem(rel: str) -> str | None:
    """None if the site-packages-relative path `rel` ('/'-separated) may be shipped, else why not."""
    parts = rel.split("/")
    folded = [p.casefold() for p in parts]
    name = folded[-1]
    if BYTECODE_DIR in folded:
        return "is under __pycache__/: bytecode is never shipped (the host compiles the reviewed source)"
    if name.endswith(_BYTECODE_SUFFIXES):
        return "is bytecode (.pyc/.pyo): it would run instead of the reviewed source"
    if name.endswith(".pth"):
        return "is a .pth file: site.py runs its import lines in every interpreter of the venv"
    if name.endswith("customize.py") or any(p.split(".", 1)[0] in _SITE_HOOKS for p in folded):
        return "is a *customize.py (sitecustomize/usercustomize): site.py imports it at every interpreter start"
    return None
