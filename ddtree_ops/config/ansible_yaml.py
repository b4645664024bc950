"""An Ansible YAML inventory → InventoryGraph.

Top-level keys are groups (usually just `all`); a group has `hosts` (entry → vars), `vars` and
`children` (name → group), each a mapping, null, or one name as a string. Host entries may be
ranges and carry a port (host_patterns.py). What Ansible only warns about (an unknown key in a
group, a group that is not a mapping) is refused here: a typo must not drop hosts silently.
"""

from __future__ import annotations

from typing import Any

from ..errors import InventoryError
from .host_patterns import HostPatternError, expand_host_entry
from .inventory_graph import InventoryGraph

__all__ = ["graph_from_yaml"]

_SECTIONS = ("hosts", "vars", "children")
_TOP = "the top level must be a mapping with the group 'all' (or other groups)"


def graph_from_yaml(doc: Any, fname: str) -> InventoryGraph:
    if not isinstance(doc, dict) or not doc:
        raise InventoryError(fname, None, None, _TOP)
    if "plugin" in doc:
        raise InventoryError(fname, None, None,
                             "is an inventory plugin's configuration (`plugin:`), which ddtree-ops does not run: "
                             "write its hosts out with `ansible-inventory -i FILE --list --yaml > hosts.yml` "
                             "and use that file")
    for key in _SECTIONS:
        if key in doc:
            raise InventoryError(fname, None, None, f"{_TOP}: {key!r} is a section of a group; put it under all")
    strays = [str(k) for k, v in doc.items() if k != "all" and isinstance(v, dict) and set(v) - set(_SECTIONS)]
    if strays:  # e.g. an anchor holding shared vars: no group
        raise InventoryError(fname, None, None,
                             f"unexpected top-level keys {', '.join(strays)}: the top level holds groups, and a group "
                             f"has only hosts, vars and children (shared vars go in a group's vars)")
    graph = InventoryGraph(fname)
    for gname, gdef in doc.items():
        _walk(graph, gname, gdef)
    graph.finish()
    return graph


def _walk(graph: InventoryGraph, gname: Any, gdef: Any) -> None:
    graph.add_group(gname)
    if gdef is None:
        return
    fname = graph.fname
    if not isinstance(gdef, dict):
        raise InventoryError(fname, None, f"group {gname}", "a group must be a mapping of hosts/vars/children")
    bad = set(gdef) - set(_SECTIONS)
    if bad:
        raise InventoryError(fname, None, f"group {gname}",
                             f"unknown keys {', '.join(sorted(map(str, bad)))}; a group has only hosts, vars "
                             f"and children")
    for section, body in gdef.items():  # in the order written, as Ansible adds them
        if isinstance(body, str):  # `children: gpu` is `children: {gpu: null}`
            body = {body: None}
        if body is None:
            continue
        if not isinstance(body, dict):
            what = {"vars": "vars must be a mapping", "hosts": "hosts must be a mapping of name → vars",
                    "children": "children must be a mapping of groups"}[section]
            raise InventoryError(fname, None, f"group {gname}.{section}", what)
        if section == "vars":
            for key, value in body.items():
                graph.set_group_var(gname, key, value)
        elif section == "children":
            for cname, cdef in body.items():
                _walk(graph, cname, cdef)
                graph.add_child(gname, cname)
        else:
            for entry, hvars in body.items():
                _add_entry(graph, gname, entry, hvars)


def _add_entry(graph: InventoryGraph, gname: str, entry: Any, hvars: Any) -> None:
    if not isinstance(entry, str):
        graph.add_host(gname, entry, hvars)  # refuses the name, saying how to quote it
        return
    try:
        names, port = expand_host_entry(entry)
    except HostPatternError as e:
        raise InventoryError(graph.fname, entry, None, str(e)) from None
    if hvars is not None and not isinstance(hvars, dict):
        raise InventoryError(graph.fname, entry, None, "host vars must be a mapping")
    for name in names:
        graph.add_host(gname, name, {**({"ansible_port": port} if port else {}), **(hvars or {})})
