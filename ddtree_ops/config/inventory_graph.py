"""Hosts and groups as Ansible models them, whichever file format they came from.

Both readers (ansible_yaml.py, ansible_ini.py) fill one `InventoryGraph`; inventory.py resolves
each host's vars from it. The rules are Ansible's (ansible.inventory.data/group/helpers):

- `all` holds every group; `ungrouped` (its first child) every host in no other group;
- a group's depth is its longest path from `all`; a host's groups are ordered by (depth,
  `ansible_group_priority`, name), which is the order their vars apply in (later wins);
- a group's hosts are its own, then its children's, breadth first, each once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import InventoryError, shown
from .schema import NAME_RE

__all__ = ["ALL", "UNGROUPED", "GroupNode", "InventoryGraph"]

ALL, UNGROUPED = "all", "ungrouped"
_QUOTE_NAME = "quote it (YAML reads unquoted yes/no/on/off/true/false as booleans and 010 as the number 8)"


@dataclass
class GroupNode:
    name: str
    vars: dict[str, Any] = field(default_factory=dict)
    hosts: list[str] = field(default_factory=list)  # direct members, in the order given
    children: list[str] = field(default_factory=list)
    parents: list[str] = field(default_factory=list)
    priority: int = 1  # ansible_group_priority: among groups of one depth, higher applies later


@dataclass
class InventoryGraph:
    fname: str
    groups: dict[str, GroupNode] = field(default_factory=dict)  # in the order Ansible adds them
    host_vars: dict[str, dict[str, Any]] = field(default_factory=dict)  # inline vars, first-seen order
    # Indexes filled on first use once the graph is built; any change empties them.
    _depths: dict[str, int] = field(default_factory=dict, repr=False)
    _direct: dict[str, list[str]] = field(default_factory=dict, repr=False)  # host → groups listing it

    def __post_init__(self) -> None:
        self.add_group(ALL)
        self.add_group(UNGROUPED)
        self.add_child(ALL, UNGROUPED)

    # -- building --------------------------------------------------------------------------------

    def add_group(self, name: Any) -> GroupNode:
        if not isinstance(name, str):
            raise InventoryError(self.fname, None, f"group {name}",
                                 f"a group name must be a string, got {shown(name)}: {_QUOTE_NAME}")
        if not NAME_RE.match(name):
            raise InventoryError(self.fname, None, f"group {name}",
                                 "invalid group name (letters, digits, '_', '.', '-'; max 64)")
        return self.groups.setdefault(name, GroupNode(name))

    def add_child(self, parent: str, child: str) -> None:
        self._depths.clear()
        self._direct.clear()
        if child == ALL:
            raise InventoryError(self.fname, None, f"group {parent}", "'all' cannot be a child group")
        if child == parent or parent in self._descendants(child):
            raise InventoryError(self.fname, None, f"group {child}", f"groups form a cycle (through {parent})")
        p, c = self.groups[parent], self.groups[child]
        if child not in p.children:
            p.children.append(child)
            c.parents.append(parent)

    def add_host(self, group: str, name: Any, vars_: Any) -> None:
        if not isinstance(name, str):  # `yes:` is True, `010:` is 8
            raise InventoryError(self.fname, str(name), None,
                                 f"a host name must be a string, got {shown(name)}: {_QUOTE_NAME}")
        if not NAME_RE.match(name):
            raise InventoryError(self.fname, name, None, "host names use letters, digits, '_', '.', '-' (max 64)")
        if vars_ is None:
            vars_ = {}
        if not isinstance(vars_, dict):
            raise InventoryError(self.fname, name, None, "host vars must be a mapping")
        known = self.host_vars.setdefault(name, {})
        for key, value in vars_.items():
            if key in known and known[key] != value:
                raise InventoryError(self.fname, name, str(key),
                                     f"the host is defined twice with different values ({shown(known[key])} and "
                                     f"{shown(value)}): give it once")
            known[key] = value
        members = self.groups[group].hosts
        if name not in members:
            members.append(name)
            self._direct.clear()

    def set_group_var(self, group: str, key: Any, value: Any) -> None:
        if key == "ansible_group_priority":
            if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).lstrip("-").isdigit():
                raise InventoryError(self.fname, None, f"group {group}.vars.ansible_group_priority",
                                     f"must be an integer, got {shown(value)}")
            self.groups[group].priority = int(value)
            return
        gvars = self.groups[group].vars
        if key in gvars and gvars[key] != value:
            raise InventoryError(self.fname, None, f"group {group}.vars.{key}",
                                 f"given twice with different values ({shown(gvars[key])} and {shown(value)})")
        gvars[key] = value

    def finish(self) -> None:
        """What Ansible's reconcile_inventory does: orphan groups under all, lone hosts in ungrouped."""
        for g in self.groups.values():
            if g.name != ALL and not g.parents:
                self.add_child(ALL, g.name)
        in_a_group = {h for g in self.groups.values() if g.name not in (ALL, UNGROUPED) for h in g.hosts}
        ungrouped = self.groups[UNGROUPED].hosts
        ungrouped[:] = [h for h in ungrouped if h not in in_a_group]
        ungrouped.extend(h for h in self.groups[ALL].hosts if h not in in_a_group and h not in ungrouped)
        self._direct.clear()
        if not self.host_vars:
            raise InventoryError(self.fname, None, None, "no hosts defined")

    # -- reading ---------------------------------------------------------------------------------

    def _descendants(self, name: str) -> list[str]:
        """Child groups breadth first, each once (Ansible's get_descendants(preserve_ordering))."""
        out: list[str] = []
        frontier = list(self.groups[name].children)
        while frontier:
            nxt: list[str] = []
            for g in frontier:
                if g not in out:
                    out.append(g)
                    nxt.extend(self.groups[g].children)
            frontier = nxt
        return out

    def members(self, name: str) -> tuple[str, ...]:
        """Every host of the group: its own, then its descendants', each once."""
        seen: dict[str, None] = {}
        for g in [name, *self._descendants(name)]:
            seen.update(dict.fromkeys(self.groups[g].hosts))
        return tuple(seen)

    def depth(self, name: str) -> int:
        """The longest path from `all` (Ansible's Group.depth)."""
        memo = self._depths

        def d(g: str) -> int:
            if g not in memo:
                memo[g] = max((d(p) + 1 for p in self.groups[g].parents), default=0)
            return memo[g]
        return d(name)

    def host_groups(self, host: str) -> list[str]:
        """The groups a host belongs to (directly or through a child group), `all` excluded, in the
        order their vars apply: (depth, priority, name), as Ansible's sort_groups."""
        if not self._direct:
            for g in self.groups.values():
                for h in g.hosts:
                    self._direct.setdefault(h, []).append(g.name)
        direct = self._direct.get(host, [])
        found: set[str] = set()
        stack = list(direct)
        while stack:
            g = stack.pop()
            if g not in found:
                found.add(g)
                stack.extend(self.groups[g].parents)
        found.discard(ALL)
        return sorted(found, key=lambda g: (self.depth(g), self.groups[g].priority, g))
