"""Which reader an inventory file gets: YAML (.yml, .yaml, .json) or INI (.ini); a file with
another name or none (Ansible's `hosts`) is YAML when it reads as a YAML mapping, INI otherwise.
One file: a folder of inventories (which Ansible also takes) is refused, naming the way."""

from __future__ import annotations

from pathlib import Path

from ..errors import InventoryError
from .ansible_ini import graph_from_ini
from .ansible_yaml import graph_from_yaml
from .inventory_graph import InventoryGraph
from .yamlfile import YamlProblem, load_yaml

__all__ = ["read_graph"]

_YAML_EXTENSIONS = (".yml", ".yaml", ".json")


def read_graph(path: Path) -> InventoryGraph:
    fname = str(path)
    if path.is_dir():
        raise InventoryError(fname, None, None, "is a folder: name one inventory file (YAML or INI; its "
                                                "group_vars/ and host_vars/ folders beside it are read)")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InventoryError(fname, None, None, "file not found") from None
    except OSError as e:
        raise InventoryError(fname, None, None, f"cannot read: {e.strerror}") from None
    suffix = path.suffix.lower()
    if suffix in _YAML_EXTENSIONS:
        return graph_from_yaml(_yaml(data, fname), fname)
    if suffix == ".ini":
        return graph_from_ini(_text(data, fname), fname)
    try:
        doc = load_yaml(data)
    except YamlProblem:
        doc = None
    if isinstance(doc, dict):
        return graph_from_yaml(doc, fname)
    try:
        return graph_from_ini(_text(data, fname), fname)
    except InventoryError as e:
        raise InventoryError(fname, e.host, e.field, f"read as INI (it is not a YAML mapping; name it .yml to "
                                                     f"read it as YAML): {e.problem}") from None


def _yaml(data: bytes, fname: str) -> object:
    try:
        return load_yaml(data)
    except YamlProblem as e:
        raise InventoryError(fname, None, None, str(e)) from None


def _text(data: bytes, fname: str) -> str:
    try:
        return data.decode("utf-8-sig")  # an editor's byte-order mark is not part of the first line
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise InventoryError(fname, None, None, f"line {line}: not UTF-8 text (byte {e.start})") from None
