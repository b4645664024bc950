"""The venv's Python version, read from its files, never by running it (the agent is root); and
the SGLang version its site-packages holds (the `Version:` of each `sglang-*.dist-info/METADATA`).

`pyvenv.cfg` (beside the interpreter's folder, as Python finds it) says `version = 3.11.7` (venv,
virtualenv) or `version_info = 3.12.1` (uv); failing that, the `lib/pythonX.Y` folder of
site-packages says X.Y."""

import os
import re

from .files import text_lines

_CFG_VERSION = re.compile(r"^\s*(version|version_info)\s*=\s*([0-9]+\.[0-9]+[0-9A-Za-z.+-]*)\s*$")
_LIB_VERSION = re.compile(r"/lib(?:64)?/python([0-9]+\.[0-9]+)t?/(?:site|dist)-packages/?$")


def pyvenv_cfg_version(python):
    if not python:
        return None
    here = os.path.dirname(python)
    for cfg in (os.path.join(here, "pyvenv.cfg"), os.path.join(os.path.dirname(here), "pyvenv.cfg")):
        for line in text_lines(cfg, 1 << 16) or ():
            m = _CFG_VERSION.match(line)
            if m:
                return m.group(2)
    return None


def venv_python_version(python, site_packages):
    """"3.11.7", "3.11" (from the folder only), or None when neither says."""
    found = pyvenv_cfg_version(python)
    if found:
        return found
    m = _LIB_VERSION.search(site_packages or "")
    return m.group(1) if m else None


def sglang_dist_versions(site_packages):
    """The `Version:` of every sglang-*.dist-info in `site_packages`, in folder order ([]: none,
    or no such folder). More than one is a venv an upgrade left half done."""
    found = []
    try:
        entries = sorted(os.listdir(site_packages)) if site_packages else []
    except OSError:
        return found
    for entry in entries:
        if not (entry.startswith("sglang-") and entry.endswith(".dist-info")):
            continue
        try:
            with open(os.path.join(site_packages, entry, "METADATA"), encoding="utf-8") as fh:
                for line in fh:
                    if line.startswith("Version:"):
                        found.append(line.split(":", 1)[1].strip())
                        break
        except OSError:
            pass
    return found


def sglang_version_in(site_packages):
    """What the restore check compares: the one version, "A, B" for several, None for none."""
    found = sglang_dist_versions(site_packages)
    return ", ".join(found) if found else None
