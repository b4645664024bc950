"""One host's inventory from the variables Ansible resolved for it: what the `ddtree.ops`
collection's action plugins hand the tool (ansible_collections/ddtree/ops).

Inside a play Ansible has already merged the host's vars (inventory, group_vars, host_vars,
extra vars; AWX's inventories and credentials) and they reach the plugin as one mapping, beside
Ansible's own magic vars and whatever other roles use. The tool's keys are picked out of it by
name (the inventory schema's keys and the five `ansible_*` connection vars of ansible_vars.py);
everything else is Ansible's business and left out, as `ansible_*` is in an inventory file. The
result is an ordinary one-host inventory document, validated by the same code as a file, so a bad
value fails with the same message naming the host and the field.

Ansible fills `ansible_host` with the host's name when no var sets it: that is the tool's own
default (a host without an address is reached at its name), not a value to weigh against an
`address` the inventory sets, so it is dropped.

A `perf_gate.prompts_file` given relative is relative to the host's inventory (Ansible's
`inventory_dir`), as in a file; it is made absolute here because the document is written elsewhere.
A multi-node server needs all its nodes in one run: one Ansible task is one host, so its members
are refused with a pointer to the CLI.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from ..errors import InventoryError
from .ansible_vars import ALIASES
from .inventory import inventory_keys

__all__ = ["host_inventory_doc", "host_var_names"]

_ANSIBLE_NAMES = frozenset(n for names in ALIASES.values() for n in names)
_MULTINODE = ("multinode", "node_rank", "nnodes", "dist_init_addr")


def host_var_names() -> frozenset[str]:
    """The vars of a host the tool reads (its inventory keys and Ansible's connection vars): the
    ones a caller needs to render, the rest it may leave alone."""
    return inventory_keys() | _ANSIBLE_NAMES


def host_inventory_doc(name: str, hostvars: Mapping[str, Any], *, inventory_dir: str | None = None,
                       where: str = "ansible hostvars") -> dict[str, Any]:
    """`{"all": {"hosts": {name: vars}}}` with the tool's vars of `hostvars`, plain values only."""
    name = str(name)  # a tagged str (ansible-core 2.19) is not a plain value for YAML
    wanted = host_var_names()
    picked: dict[str, Any] = {}
    for key in sorted(k for k in hostvars if k in wanted):
        picked[str(key)] = _plain(hostvars[key], where, name, str(key))
    if picked.get("ansible_host") == name:
        del picked["ansible_host"]  # Ansible's default, not a setting (module docstring)
    if any(picked.get(k) not in (None, False) for k in _MULTINODE):
        raise InventoryError(where, name, next(k for k in _MULTINODE if picked.get(k) not in (None, False)),
                             "a multi-node server's nodes deploy together, which one Ansible task (one host) "
                             "cannot do: deploy it with the ddtree-ops CLI")
    gate = picked.get("perf_gate")
    if isinstance(gate, dict) and isinstance(gate.get("prompts_file"), str) and inventory_dir:
        path = os.path.expanduser(gate["prompts_file"])
        picked["perf_gate"] = {**gate, "prompts_file": os.path.normpath(os.path.join(inventory_dir, path))}
    return {"all": {"hosts": {name: picked}}}


def _plain(value: Any, where: str, host: str, key: str) -> Any:
    """Ansible's values are str/int/dict subclasses (unsafe text, tagged values in 2.19): plain
    types from here on, and anything else (an undefined, an object) refused by name."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        raise InventoryError(where, host, key, f"is a {type(value).__name__}, not a value ddtree-ops reads "
                                               f"(text, a number, a list or a mapping)") from None
