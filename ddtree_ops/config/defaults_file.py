"""The defaults file: values for the flags an operator types on every run.

Found, first match wins (never merged): the file named by $DDTREE_OPS_CONFIG (which must exist),
`ddtree-ops.toml` in the current folder, or the `[tool.ddtree-ops]` table of `./pyproject.toml`::

    inventory = "inventory/prod.yaml"   # relative paths are relative to the defaults file
    forks = 5
    batch = "25%"                       # or a number of targets
    report_dir = "reports"              # deploy/rollback write reports/<command>-<UTC time>.html

A flag wins over the environment (DDTREE_OPS_INVENTORY), which wins over this file, which wins
over the built-in default (the CLI hands these values to click as its `default_map`). `--limit`
is deliberately not a key: what a run touches is read on its command line. An unknown key, a
value of the wrong type, a file that is not TOML: exit 2 naming the file and the key. A
`pyproject.toml` that is not valid TOML is refused too: its section may hold the `batch` that
keeps a deploy from hitting every host at once, and silently going without it would.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from ..errors import DefaultsFileError, shown
from .schema import Field, Invalid, apply, int_range, known_keys, not_string

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ENV_VAR = "DDTREE_OPS_CONFIG"
FILE_NAME = "ddtree-ops.toml"
PYPROJECT = "pyproject.toml"
SECTION = "ddtree-ops"  # [tool.ddtree-ops]
SIZE_MAX = 1024 * 1024
FORKS_MAX = 1000  # cli/flag_ranges.py's bound on --forks, which checks the value again
_COUNT_OR_SHARE_RE = re.compile(r"^\s*([0-9]+)\s*(%?)\s*$")
_NOT_KEYS = {"limit": "what a run touches belongs on its command line: give --limit there",
             # The fleet's capacity is the inventory's to say; here it would beat the inventory's value
             # as a flag does, for every inventory this file is used with.
             "max_unavailable": "it is the fleet's, set it in the inventory (or give --max-unavailable)"}


@dataclass(frozen=True)
class Defaults:
    """The defaults found (None: not set); `source` is the file they came from (None: no file)."""

    source: str | None = None
    inventory: str | None = None
    forks: int | None = None
    batch: str | None = None
    report_dir: str | None = None

    def given(self) -> dict[str, Any]:
        """The keys the file sets, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "source" and getattr(self, f.name) is not None}


def _path_under(base: str):
    def check(value: Any, done: Mapping[str, Any]) -> str:
        if not isinstance(value, str) or not value.strip():
            raise not_string(value, "a path (relative to the defaults file's folder, or absolute)")
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise Invalid(f"must not contain control characters: {shown(value)}")
        return os.path.normpath(os.path.join(base, os.path.expanduser(value)))
    return check


def _count_or_share(what: str, *, zero_ok: bool = False):
    """N (a number of targets) or "P%" (0 < P <= 100), as the flag's text."""
    def check(value: Any, done: Mapping[str, Any]) -> str:
        text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
        m = _COUNT_OR_SHARE_RE.match(text) if isinstance(text, str) else None
        if m is None or (not zero_ok and int(m.group(1)) == 0) or (m.group(2) and int(m.group(1)) > 100):
            raise Invalid(f"must be {what}: a positive number of targets such as 2, or a share such as \"25%\" "
                          f"(at most 100%), got {shown(value)}")
        return f"{int(m.group(1))}{m.group(2)}"
    return check


def _table(base: str) -> tuple[Field, ...]:
    return (
        Field("inventory", _path_under(base), None),
        Field("forks", int_range(1, FORKS_MAX), None),
        Field("batch", _count_or_share("targets per batch"), None),
        Field("report_dir", _path_under(base), None),
    )


def parse_defaults(doc: Any, source: str, base_dir: str) -> Defaults:
    """The validated defaults of the mapping `doc` read from `source`."""
    table = _table(base_dir)
    if not isinstance(doc, dict):
        raise DefaultsFileError(source, None, f"[tool.{SECTION}] must be a table, got {shown(doc)}")
    for key in doc:
        if key in _NOT_KEYS:
            raise DefaultsFileError(source, key, f"is not a defaults key: {_NOT_KEYS[key]}")
        if key not in known_keys(table):
            raise DefaultsFileError(source, key, f"unknown key; allowed: {', '.join(sorted(known_keys(table)))}")
    try:
        values = apply(table, doc)
    except Invalid as e:
        raise DefaultsFileError(source, e.field, e.problem) from None
    return Defaults(source=source, **values)


def find_defaults_file(cwd: str | os.PathLike | None = None,
                       environ: Mapping[str, str] | None = None) -> tuple[Path, bool] | None:
    """(the defaults file, whether it is a pyproject.toml) or None. $DDTREE_OPS_CONFIG must name
    an existing file."""
    env = os.environ if environ is None else environ
    here = Path(cwd) if cwd is not None else Path.cwd()
    named = env.get(ENV_VAR, "")
    if named:
        p = here / os.path.expanduser(named)
        if not p.is_file():
            raise DefaultsFileError(named, None, f"${ENV_VAR} names this file, which does not exist or is not a file")
        return p, p.name == PYPROJECT
    if (here / FILE_NAME).is_file():
        return here / FILE_NAME, False
    if (here / PYPROJECT).is_file():
        return here / PYPROJECT, True
    return None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = f.read(SIZE_MAX + 1)
    except OSError as e:
        raise DefaultsFileError(str(path), None, f"cannot read: {e.strerror or e}") from None
    if len(raw) > SIZE_MAX:
        raise DefaultsFileError(str(path), None, f"larger than {SIZE_MAX} bytes")
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise DefaultsFileError(str(path), None, "not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise DefaultsFileError(str(path), None, f"not valid TOML: {e}") from None


def load_defaults(cwd: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> Defaults:
    """The defaults in force for a command run in `cwd` (default: the current folder)."""
    found = find_defaults_file(cwd, environ)
    if found is None:
        return Defaults()
    path, is_pyproject = found
    doc = _read_toml(path)
    base = str(path.parent.resolve())
    if not is_pyproject:
        return parse_defaults(doc, str(path), base)
    tool = doc.get("tool", {})
    section = tool.get(SECTION) if isinstance(tool, dict) else None
    if section is None:
        return Defaults()
    return parse_defaults(section, f"{path} [tool.{SECTION}]", base)
