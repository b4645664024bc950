"""An Ansible INI inventory → InventoryGraph, read as Ansible's ini plugin reads it.

    gpu01 ansible_host=10.0.0.1          # before any section: ungrouped
    [gpu]                                 # hosts of group gpu
    gpu[02:03] ansible_user=deploy        # ranges; NAME:PORT sets ansible_port
    [gpu:vars]                            # KEY=VALUE for the whole group
    budget=16
    [fleet:children]                      # groups in group fleet (declared here or later)
    gpu

A value is a Python literal when it reads as one (`16` is a number, `True` a boolean, `[1, 2]` a
list, `'x'` a string), otherwise the text as written: Ansible's `ast.literal_eval` rule. Lines
starting with `#` or `;` are comments; on a host line `#` starts a comment as in a shell.
Errors name the file and the line.
"""

from __future__ import annotations

import ast
import re
import shlex
import warnings
from dataclasses import dataclass, field
from typing import Any

from ..errors import InventoryError, shown
from .host_patterns import HostPatternError, expand_host_entry
from .inventory_graph import UNGROUPED, InventoryGraph

__all__ = ["graph_from_ini", "parse_ini_value"]

_SECTION_RE = re.compile(r"^\[([^:\]\s]+)(?::(\w+))?\]\s*(?:#.*)?$")
_GROUP_NAME_RE = re.compile(r"^([^:\]\s]+)\s*(?:#.*)?$")
_COMMENT = ("#", ";")


@dataclass
class _Pending:
    """Names used before their [group] or [group:children] section: Ansible allows that."""

    vars_only: dict[str, int] = field(default_factory=dict)  # group → line of its [g:vars]
    children: dict[str, list[tuple[str, int]]] = field(default_factory=dict)  # child → [(parent, line)]


def graph_from_ini(text: str, fname: str) -> InventoryGraph:
    graph = InventoryGraph(fname)
    pending = _Pending()
    group, state = UNGROUPED, "hosts"
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(_COMMENT):
            continue
        try:
            m = _SECTION_RE.match(line)
            if m:
                group, state = m.group(1), m.group(2) or "hosts"
                _open_section(graph, pending, group, state, lineno)
            else:
                _definition(graph, pending, line, group, state, lineno)
        except InventoryError as e:
            if e.problem.startswith("line "):
                raise
            raise InventoryError(e.file, e.host, e.field, f"line {lineno}: {e.problem}") from None
    _check_pending(fname, pending)
    graph.finish()
    return graph


def _error(fname: str, where: str, problem: str) -> InventoryError:
    return InventoryError(fname, None, None, f"{where}: {problem}")


def _open_section(graph: InventoryGraph, pending: _Pending, group: str, state: str, lineno: int) -> None:
    if state not in ("hosts", "children", "vars"):
        raise _error(graph.fname, f"line {lineno}",
                     f"section [{group}:{state}] has an unknown type {state!r} (hosts, vars or children)")
    if group not in graph.groups and state == "vars":
        pending.vars_only.setdefault(group, lineno)  # must be declared somewhere else too
    graph.add_group(group)
    if state != "vars":
        pending.vars_only.pop(group, None)
        for parent, _ in pending.children.pop(group, []):
            graph.add_child(parent, group)


def _definition(graph: InventoryGraph, pending: _Pending, line: str, group: str, state: str, lineno: int) -> None:
    """A line inside a section: a host, a KEY=VALUE or a child group, as the section says."""
    where = f"line {lineno}"
    if line.startswith("[") and line.endswith("]"):
        raise _error(graph.fname, where, f"{shown(line)} is not a section: [GROUP], [GROUP:vars] or "
                                         f"[GROUP:children], without spaces")
    if state == "hosts":
        _host_line(graph, group, line, where)
    elif state == "vars":
        key, value = _var_line(graph.fname, line, where)
        graph.set_group_var(group, key, value)
    else:
        _child_line(graph, pending, group, line, lineno)


def _host_line(graph: InventoryGraph, group: str, line: str, where: str) -> None:
    fname = graph.fname
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError as e:
        raise _error(fname, where, f"cannot read the host line: {e}") from None
    if not tokens:
        return
    try:
        names, port = expand_host_entry(tokens[0])
    except HostPatternError as e:
        raise _error(fname, where, str(e)) from None
    hvars: dict[str, Any] = {"ansible_port": port} if port else {}
    for token in tokens[1:]:
        if "=" not in token:
            raise _error(fname, where, f"expected KEY=VALUE after the host name, got {shown(token)}")
        key, value = token.split("=", 1)
        hvars[key] = parse_ini_value(value, fname, where)
    for name in names:
        graph.add_host(group, name, dict(hvars))


def _var_line(fname: str, line: str, where: str) -> tuple[str, Any]:
    if "=" not in line:
        raise _error(fname, where, f"expected KEY=VALUE, got {shown(line)}")
    key, value = (part.strip() for part in line.split("=", 1))
    return key, parse_ini_value(value, fname, where)


def _child_line(graph: InventoryGraph, pending: _Pending, group: str, line: str, lineno: int) -> None:
    m = _GROUP_NAME_RE.match(line)
    if not m:
        raise _error(graph.fname, f"line {lineno}", f"expected a group name, got {shown(line)}")
    child = m.group(1)
    if child in graph.groups:
        graph.add_child(group, child)
    else:
        pending.children.setdefault(child, []).append((group, lineno))


def _check_pending(fname: str, pending: _Pending) -> None:
    for child, parents in pending.children.items():
        parent, lineno = parents[-1]
        raise _error(fname, f"line {lineno}", f"section [{parent}:children] names the group {child!r}, "
                                             f"which has no [{child}] or [{child}:children] section")
    for group, lineno in pending.vars_only.items():
        raise _error(fname, f"line {lineno}", f"section [{group}:vars] is for a group that has no [{group}] "
                                             f"or [{group}:children] section")


def parse_ini_value(text: str, fname: str = "<inventory>", where: str = "") -> Any:
    """What Ansible makes of an INI value: a Python literal when it reads as one, else the text."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError):
        return text
    except (RecursionError, MemoryError):
        raise _error(fname, where, "a value is nested too deeply") from None
    return _plain(value)


def _plain(value: Any) -> Any:
    """Tuples and sets become lists, bytes text, complex numbers and `...` the text of them."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    if value is ... or isinstance(value, complex):
        return "..." if value is ... else str(value)
    return value
