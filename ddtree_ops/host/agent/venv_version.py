"""The venv's Python version, read from its files, never by running it (the agent is root).

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
