"""`group_vars/` and `host_vars/` beside the inventory file, read as Ansible's host_group_vars
plugin reads them.

For a group or host NAME, the first that exists of `NAME`, `NAME.yml`, `NAME.yaml`, `NAME.json`
in the folder is used: a file is one mapping of vars; a folder holds such files (no extension,
.yml, .yaml or .json; hidden files and backups ending in `~` skipped; sub-folders read too), applied
in name order, a later file winning. Empty files are nothing. Files for groups or hosts the
inventory does not have are not read. Refused, naming the file: an ansible-vault encrypted file or
value (the controller cannot decrypt), YAML that is not a mapping, a key given twice in one file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..errors import InventoryError
from .yamlfile import YamlProblem, load_yaml

__all__ = ["FolderVars", "VarsFile", "load_folder_vars"]

VARS_EXTENSIONS = ("", ".yml", ".yaml", ".json")
_VAULT_HEADER = b"$ANSIBLE_VAULT;"
_MAX_DEPTH = 8  # sub-folders of a group's folder: a symlink loop is not a configuration


@dataclass(frozen=True)
class VarsFile:
    label: str  # relative to the inventory's folder, as messages name it: group_vars/gpu.yml
    vars: dict[str, Any]


@dataclass(frozen=True)
class FolderVars:
    groups: dict[str, tuple[VarsFile, ...]] = field(default_factory=dict)
    hosts: dict[str, tuple[VarsFile, ...]] = field(default_factory=dict)


def load_folder_vars(inventory_file: str, groups: Iterable[str], hosts: Iterable[str]) -> FolderVars:
    """The vars files of every group and host the inventory has (nothing when there are no folders)."""
    base = os.path.realpath(os.path.dirname(os.path.abspath(inventory_file)))  # beside the name given, as Ansible
    return FolderVars(groups=_read_kind(base, "group_vars", groups), hosts=_read_kind(base, "host_vars", hosts))


def _read_kind(base: str, kind: str, names: Iterable[str]) -> dict[str, tuple[VarsFile, ...]]:
    folder = os.path.join(base, kind)
    if not os.path.lexists(folder):
        return {}
    if not os.path.isdir(folder):
        raise InventoryError(folder, None, None, f"{kind} beside the inventory must be a folder")
    out: dict[str, tuple[VarsFile, ...]] = {}
    for name in names:
        files = tuple(_read_file(base, path) for path in _found_files(folder, name))
        files = tuple(f for f in files if f.vars)
        if files:
            out[name] = files
    return out


def _found_files(folder: str, name: str) -> list[str]:
    for ext in VARS_EXTENSIONS:
        path = os.path.join(folder, name + ext)
        if os.path.exists(path):
            return _folder_files(path, 0) if os.path.isdir(path) else [path]
    return []


def _folder_files(folder: str, depth: int) -> list[str]:
    if depth > _MAX_DEPTH:
        raise InventoryError(folder, None, None, f"vars folders nest deeper than {_MAX_DEPTH} (a symlink loop?)")
    found: list[str] = []
    for entry in sorted(os.listdir(folder)):
        if entry.startswith(".") or entry.endswith("~"):
            continue
        path, ext = os.path.join(folder, entry), os.path.splitext(entry)[1]
        if os.path.isdir(path) and not ext:
            found.extend(_folder_files(path, depth + 1))
        elif os.path.isfile(path) and ext in VARS_EXTENSIONS:
            found.append(path)
    return found


def _read_file(base: str, path: str) -> VarsFile:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InventoryError(path, None, None, f"cannot read: {e.strerror}") from None
    if data.lstrip().startswith(_VAULT_HEADER):
        raise InventoryError(path, None, None, _vault_problem("the file"))
    try:
        doc = load_yaml(data)
    except YamlProblem as e:
        problem = _vault_problem("a value (`!vault`)") if "'!vault'" in str(e) else str(e)
        raise InventoryError(path, None, None, problem) from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise InventoryError(path, None, None, f"must be a mapping of vars, got a {type(doc).__name__}")
    for key in doc:
        if not isinstance(key, str):
            raise InventoryError(path, None, str(key), "a var name must be a string")
    return VarsFile(label=os.path.relpath(path, base), vars=doc)


def _vault_problem(what: str) -> str:
    return (f"{what} is encrypted with ansible-vault, which ddtree-ops does not decrypt: keep the vars it "
            f"reads in a plain file (secrets go in secrets_config or environment_file on the host)")
