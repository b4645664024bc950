"""Writing a value back into an inventory (`tune --write`): into the layer it came from, and
nothing else in the files changed.

An operator's inventory is a document people read: comments say why a budget is 16, anchors keep
hosts alike, keys are in the order someone chose. Loading it and dumping it again (PyYAML) would
lose all of that, so every edit here is a splice into the original text: the value's own
characters are replaced (found through `yaml.compose`'s marks, or the INI line), and a missing
key is one new line after the last key of its block, indented like its siblings.

Where the value goes is decided by the inventory's own precedence (inventory.py `_layers`, called,
not copied): `locate` finds the layer that wins for a host, and the file and position (YAML
mapping path, INI section or host line) that layer was read from. `plan_write` makes a
`WritePlan` (the files before and after, a unified diff, and the other hosts the edit reaches:
another host of the same group gets the value too). A key no layer sets goes into the vars of the
most specific group all the hosts share (the one whose vars apply last; `all` when they share
none), in the inventory file itself; a group without vars gets a `vars:` block (INI: a
`[group:vars]` section). Values are written as plain integers: a quoted "16" is a string, which
the inventory refuses for budget and topk_cap anyway. `apply_plan` writes the plan atomically and loads
the inventory again to prove the hosts now resolve to the new values, restoring the old text if
they do not. Every edited text is also read back before it is offered: the inventory it describes
must differ from the old one in the planned values only, or the edit is refused.

Refused, saying why (an operator edits those by hand): hosts whose value comes from different
layers (narrow --limit), a value shared through a YAML anchor or written through a merge key
(`<<`), adding a key to a flow-style mapping (`vars: {a: 1}`). budget and topk_cap have no
Ansible spellings (ansible_vars.ALIASES), so the key is always written under its own name.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Union

import yaml

from ..errors import InputError, InventoryError, shown
from .ansible_ini import _COMMENT, _SECTION_RE, graph_from_ini
from .ansible_vars import ALIASES
from .ansible_yaml import graph_from_yaml
from .atomic_file import write_atomically
from .host_patterns import HostPatternError, expand_host_entry
from .host_vars import FolderVars, load_folder_vars
from .inventory import Inventory, _layers, check_host_fields, load_inventory
from .inventory_file import read_graph
from .inventory_graph import ALL, UNGROUPED, InventoryGraph
from .schema import Invalid
from .yamlfile import YamlProblem, load_yaml

__all__ = ["WRITABLE_KEYS", "FileEdit", "KeyChange", "VarSource", "WritePlan", "apply_plan", "locate",
           "plan_write"]

WRITABLE_KEYS = ("budget", "topk_cap")  # what tune picks; checked in this order (topk_cap <= budget)
Position = Union[tuple[str, ...], str]  # a YAML mapping path, or an INI section / host line
_LayerId = tuple[str, str]  # ("group", name) | ("host", name) | ("file", path)
_STR, _MERGE = "tag:yaml.org,2002:str", "tag:yaml.org,2002:merge"
_PREFIX_RE = re.compile(r"(?:[&!]\S*\s+)*")  # an anchor or tag before a scalar: kept
_ALIAS_RE = re.compile(r"[^*]*\*[^\s,\[\]{}]+")  # up to the end of the next alias (*name)


@dataclass(frozen=True)
class VarSource:
    """Where the winning value of a var is written. `position` is the mapping path of the mapping
    that holds it in the YAML document (("all", "children", "gpu", "vars"); () for a vars file),
    or the INI section ("[gpu:vars]") or host line ("[gpu] gpu01"). `more`: further places the
    same layer writes it (a group defined twice, a host listed in two groups): edited together."""

    path: str
    kind: str  # "yaml" | "ini"
    layer: str  # as inventory.py names it: "group gpu vars", "host vars", "group_vars/gpu.yml"
    position: Position
    line: int | None  # 1-based line of the value; None: not written yet (a key to add)
    name: str  # the var as written there
    value: Any = None
    more: tuple[Position, ...] = ()

    def __str__(self) -> str:
        where = "/".join(self.position) if isinstance(self.position, tuple) else self.position
        line = f" line {self.line}" if self.line else ""
        return f"{self.path}{line} ({self.layer}{': ' + where if where else ''})"


@dataclass(frozen=True)
class FileEdit:
    path: str
    before: str
    after: str

    def diff(self) -> str:
        """A unified diff of the edit (difflib), the file named as given."""
        lines = difflib.unified_diff(self.before.splitlines(keepends=True), self.after.splitlines(keepends=True),
                                     fromfile=self.path, tofile=self.path)
        return "".join(ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n" for ln in lines)


@dataclass(frozen=True)
class KeyChange:
    key: str
    old: Any  # what the hosts resolve to now (the default when no layer sets it)
    new: int
    source: VarSource  # where it is written (for an added key: the section it goes into)
    added: bool  # no layer set it: a new line
    others: tuple[str, ...]  # hosts besides the plan's that take their value from the same place


@dataclass(frozen=True)
class WritePlan:
    inventory: str
    hosts: tuple[str, ...]
    edits: tuple[FileEdit, ...]
    changes: tuple[KeyChange, ...]
    unchanged: tuple[str, ...] = ()  # keys the hosts already resolve to the value asked for

    @property
    def other_hosts(self) -> tuple[str, ...]:
        """Hosts not asked for that the edit reaches: the CLI must name them before writing."""
        seen: dict[str, None] = {}
        for c in self.changes:
            seen.update(dict.fromkeys(c.others))
        return tuple(seen)

    def diff(self) -> str:
        return "".join(e.diff() for e in self.edits)

    def summary(self) -> list[str]:
        """One line per key, for the operator: what changes where, and for whom else."""
        out = []
        for c in self.changes:
            verb = "added to" if c.added else "in"
            also = f"; also changes hosts {', '.join(c.others)}" if c.others else ""
            out.append(f"{c.key}: {c.old} -> {c.new} {verb} {c.source}{also}")
        out += [f"{k}: {', '.join(self.hosts)} already resolve to the value asked for: no change"
                for k in self.unchanged]
        return out


# ------------------------------------------------------------------------------------------------
# The inventory as read, with the layers identified.

@dataclass(frozen=True)
class _Context:
    path: str
    kind: str
    graph: InventoryGraph
    folder: FolderVars
    base: str  # the folder vars file labels are relative to (host_vars.py)
    files: dict[int, str] = field(default_factory=dict)  # id(VarsFile.vars) → its path

    def layers(self, hname: str) -> list[tuple[_LayerId, str, dict]]:
        """The host's layers in the inventory's order, lowest first: (id, label, vars)."""
        groups = {id(g.vars): g.name for g in self.graph.groups.values()}
        out: list[tuple[_LayerId, str, dict]] = []
        for layer in _layers(self.graph, self.folder, hname):
            k = id(layer.vars)
            if k in self.files:
                lid: _LayerId = ("file", self.files[k])
            elif k in groups:
                lid = ("group", groups[k])
            else:
                lid = ("host", hname)
            out.append((lid, layer.where, layer.vars))
        return out


def _context(inventory_path: str | os.PathLike) -> _Context:
    path = Path(inventory_path)
    graph = read_graph(path)
    folder = load_folder_vars(graph.fname, graph.groups, graph.host_vars)
    base = os.path.realpath(os.path.dirname(os.path.abspath(graph.fname)))
    files = {id(f.vars): os.path.join(base, f.label) for kind in (folder.groups, folder.hosts)
             for fs in kind.values() for f in fs}
    return _Context(graph.fname, _kind(path), graph, folder, base, files)


def _kind(path: Path) -> str:
    """yaml or ini, as inventory_file.read_graph decides."""
    suffix = path.suffix.lower()
    if suffix in (".yml", ".yaml", ".json"):
        return "yaml"
    if suffix == ".ini":
        return "ini"
    try:
        return "yaml" if isinstance(load_yaml(path.read_bytes()), dict) else "ini"
    except YamlProblem:
        return "ini"


def _winner(ctx: _Context, hname: str, names: tuple[str, ...], edited: frozenset = frozenset()) -> _LayerId | None:
    """The last layer that sets one of `names` (or is one of `edited`, which will): the one that wins."""
    last = None
    for lid, _, vars_ in ctx.layers(hname):
        if lid in edited or any(n in vars_ for n in names):
            last = lid
    return last


def _names(key: str) -> tuple[str, ...]:
    return (key, *ALIASES.get(key, ()))


# ------------------------------------------------------------------------------------------------
# Finding a var in the text.

@dataclass(frozen=True)
class _Spot:
    position: Position
    line: int  # 1-based
    start: int  # the value's characters in the text
    end: int
    hosts: tuple[str, ...] = ()  # a host entry: every host it names (a range names several)
    problem: str | None = None  # why it cannot be edited in place


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start})") from None


def _newline(text: str) -> str:
    return "\r\n" if "\r\n" in text else "\n"


@dataclass
class _YamlDoc:
    """A YAML inventory or vars file composed (not constructed): nodes with their marks."""

    root: yaml.Node | None
    groups: dict[str, list[tuple[tuple[str, ...], yaml.Node | None]]] = field(default_factory=dict)
    entries: list[tuple[tuple[str, ...], tuple[str, ...], yaml.Node]] = field(default_factory=list)
    refs: dict[int, int] = field(default_factory=dict)  # node → how many places refer to it (aliases)
    owners: dict[int, set[str]] = field(default_factory=dict)  # a vars mapping → the groups reaching it

    @classmethod
    def parse(cls, text: str, fname: str, *, inventory: bool) -> _YamlDoc:
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError as e:
            raise InputError(f"{fname}: not valid YAML: {e}") from None
        doc = cls(root)
        doc._count(root)
        if inventory and isinstance(root, yaml.MappingNode):
            for k, v in root.value:
                doc._walk(_text_of(k), v, (_text_of(k),))
        return doc

    def _count(self, root: yaml.Node | None) -> None:
        stack = [root] if root is not None else []
        while stack:
            node = stack.pop()
            kids = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                    else node.value if isinstance(node, yaml.SequenceNode) else [])
            for kid in kids:
                self.refs[id(kid)] = self.refs.get(id(kid), 0) + 1
                if self.refs[id(kid)] == 1:
                    stack.append(kid)

    def _walk(self, name: str, node: yaml.Node, path: tuple[str, ...]) -> None:
        """Groups and host entries as ansible_yaml._walk reads them."""
        self.groups.setdefault(name, []).append((path, node))
        for section, body in _pairs(node):
            if section == "vars" and isinstance(body, yaml.MappingNode):
                self.owners.setdefault(id(body), set()).add(name)
            elif section == "children" and isinstance(body, yaml.MappingNode):
                for ck, cv in body.value:
                    self._walk(_text_of(ck), cv, (*path, "children", _text_of(ck)))
            elif section == "hosts" and isinstance(body, yaml.MappingNode):
                for ek, ev in body.value:
                    try:
                        names = tuple(expand_host_entry(_text_of(ek))[0])
                    except HostPatternError:
                        continue  # the inventory refused it already
                    self.entries.append(((*path, "hosts", _text_of(ek)), names, ev))

    def vars_mappings(self, owner: _LayerId | None, hname: str) -> list[tuple[tuple[str, ...], yaml.Node, tuple]]:
        """(path, mapping, hosts of a host entry) of every place that writes the owner's vars."""
        if owner is None:  # a vars file: the document is the mapping
            return [((), self.root, ())] if self.root is not None else []
        out, seen = [], set()
        if owner[0] == "group":
            for path, node in self.groups.get(owner[1], []):
                body = dict((s, b) for s, b in _pairs(node)).get("vars")
                if isinstance(body, yaml.MappingNode) and id(body) not in seen:
                    seen.add(id(body))
                    out.append(((*path, "vars"), body, ()))
        else:
            for path, names, body in self.entries:
                if hname in names and isinstance(body, yaml.MappingNode) and id(body) not in seen:
                    seen.add(id(body))
                    out.append((path, body, names))
        return out


def _text_of(node: yaml.Node) -> str:
    return node.value if isinstance(node, yaml.ScalarNode) else "?"


def _pairs(node: yaml.Node | None) -> list[tuple[str, yaml.Node]]:
    if not isinstance(node, yaml.MappingNode):
        return []
    return [(_text_of(k), v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.tag == _STR]


def _yaml_spots(text: str, fname: str, owner: _LayerId | None, hname: str, name: str,
                inventory: bool) -> tuple[list[_Spot], list[int]]:
    """Where the owner's vars write `name`, and the lines of merge keys (`<<`) among them."""
    doc = _YamlDoc.parse(text, fname, inventory=inventory)
    spots, merges = [], []
    for path, mapping, hosts in doc.vars_mappings(owner, hname):
        shared = doc.refs.get(id(mapping), 0) > 1 or len(doc.owners.get(id(mapping), ())) > 1
        for k, v in mapping.value:
            if k.tag == _MERGE:
                merges.append(k.start_mark.line + 1)
            if not (isinstance(k, yaml.ScalarNode) and k.tag == _STR and k.value == name):
                continue
            problem = None
            start, end = v.start_mark.index, v.end_mark.index
            if not isinstance(v, yaml.ScalarNode):
                problem = "is not a single value"
            elif shared or doc.refs.get(id(v), 0) > 1:
                problem = "is shared through a YAML anchor (&name / *name) with other entries: editing it would " \
                          "change them too"
            else:
                start += _PREFIX_RE.match(text, start, end).end() - start
            spots.append(_Spot(path, v.start_mark.line + 1, start, end, hosts, problem))
    return spots, merges


def _ini_lines(text: str) -> list[tuple[int, int, str, str, str]]:
    """(offset, 1-based line, group, section state, the line without its end) of each definition."""
    out = []
    group, state, offset = UNGROUPED, "hosts", 0
    for lineno, raw in enumerate(text.splitlines(keepends=True), 1):
        body = raw.rstrip("\r\n")
        line = body.strip().lstrip("\ufeff") if lineno == 1 else body.strip()
        if line and not line.startswith(_COMMENT):
            m = _SECTION_RE.match(line)
            if m:
                group, state = m.group(1), m.group(2) or "hosts"
                out.append((offset, lineno, group, "header:" + state, body))
            else:
                out.append((offset, lineno, group, state, body))
        offset += len(raw)
    return out


def _ini_spots(text: str, owner: _LayerId, hname: str, name: str) -> list[_Spot]:
    spots = []
    for offset, lineno, group, state, body in _ini_lines(text):
        if owner[0] == "group" and state == "vars" and group == owner[1] and "=" in body:
            key, _, value = body.partition("=")
            if key.strip() == name:
                start = offset + len(key) + 1 + (len(value) - len(value.lstrip()))
                spots.append(_Spot(f"[{group}:vars]", lineno, start, offset + len(body.rstrip())))
        elif owner[0] == "host" and state == "hosts":
            try:
                tokens = shlex.split(body, comments=True)
                names = tuple(expand_host_entry(tokens[0])[0]) if tokens else ()
            except (ValueError, HostPatternError):
                continue
            if hname not in names or not any(t.split("=", 1)[0] == name for t in tokens[1:]):
                continue
            found = list(re.finditer(rf"(?<=\s){re.escape(name)}=((?:'[^']*'|\"[^\"]*\"|[^\s'\"#])+)", body))
            problem = None if len(found) == 1 else f"is written in a way this tool does not edit ({shown(body)})"
            s, e = (found[0].span(1) if found else (0, 0))
            spots.append(_Spot(f"[{group}] {tokens[0]}", lineno, offset + s, offset + e, names, problem))
    return spots


def _spots(ctx: _Context, lid: _LayerId, hname: str, name: str, text: str) -> list[_Spot]:
    """Where the layer writes `name` in `text` (its file's text now); refuses when it cannot say."""
    if lid[0] == "file":
        fname, owner, kind = lid[1], None, "yaml"
    else:
        fname, owner, kind = ctx.path, lid, ctx.kind
    if kind == "ini":
        spots, merges = _ini_spots(text, lid, hname, name), []
    else:
        spots, merges = _yaml_spots(text, fname, owner, hname, name, inventory=owner is not None)
    if not spots:
        how = f" through the YAML merge key (<<) on line {merges[0]}" if merges else ""
        raise InputError(f"{fname}: {name} for host {hname} is set{how} in a way this tool cannot edit in "
                         f"place: set it by hand")
    return spots


def _label(ctx: _Context, lid: _LayerId, hname: str) -> str:
    return next(label for i, label, _ in ctx.layers(hname) if i == lid)


def _file_of(ctx: _Context, lid: _LayerId) -> tuple[str, str]:
    return (lid[1], "yaml") if lid[0] == "file" else (ctx.path, ctx.kind)


def _source(ctx: _Context, lid: _LayerId, hname: str, name: str, text: str, spots: list[_Spot]) -> VarSource:
    path, kind = _file_of(ctx, lid)
    value = next(v[name] for i, _, v in ctx.layers(hname) if i == lid)
    return VarSource(path, kind, _label(ctx, lid, hname), spots[0].position, spots[0].line, name, value,
                     tuple(s.position for s in spots[1:]))


def locate(inventory_path: str | os.PathLike, host_name: str, key: str) -> VarSource | None:
    """Where the value of `key` that `host_name` resolves to is written: the winning layer in the
    inventory's own order, and its file and position. None: no layer sets it (the default applies).
    A key with Ansible spellings (ssh_port: ansible_port, ...) is found under the one that counts."""
    ctx = _context(inventory_path)
    _check_hosts(ctx, [host_name])
    for name in _names(key):
        lid = _winner(ctx, host_name, (name,))
        if lid is not None and not (name != key and _unset_alias(ctx, host_name, name)):
            path, _ = _file_of(ctx, lid)
            text = _read_text(path)
            return _source(ctx, lid, host_name, name, text, _spots(ctx, lid, host_name, name, text))
    return None


def _unset_alias(ctx: _Context, hname: str, name: str) -> bool:
    """An Ansible name whose value says "not set" (ansible_vars._is_set): null, or interpreter discovery."""
    value = [v[name] for _, _, v in ctx.layers(hname) if name in v][-1]
    return value is None or (name == "ansible_python_interpreter" and value in
                             ("auto", "auto_silent", "auto_legacy", "auto_legacy_silent"))


def _check_hosts(ctx: _Context, hosts: list[str]) -> None:
    unknown = [h for h in hosts if h not in ctx.graph.host_vars]
    if unknown:
        raise InputError(f"{ctx.path}: no host named {shown(unknown[0])} (known: {', '.join(ctx.graph.host_vars)})")


# ------------------------------------------------------------------------------------------------
# Changing the text.

def _splice(text: str, spots: list[_Spot], value: int) -> str:
    for s in sorted(spots, key=lambda s: s.start, reverse=True):
        text = text[: s.start] + str(value) + text[s.end:]
    return text


def _after_last_line(text: str, node: yaml.Node) -> int:
    """The offset just past the line where a block mapping's last value ends (comments that
    follow it stay below the new line; those on the line stay on it)."""
    while True:
        if isinstance(node, yaml.MappingNode) and not node.flow_style and node.value:
            key, last = node.value[-1]
            after = key.end_mark.index
        elif isinstance(node, yaml.SequenceNode) and not node.flow_style and node.value:
            last = node.value[-1]
            after = node.value[-2].end_mark.index if len(node.value) > 1 else node.start_mark.index
        else:
            break
        if last.start_mark.index < after:  # an alias (*name): its marks are its anchor's, further up
            m = _ALIAS_RE.match(text, after)
            return _line_end(text, m.end() if m else after)
        node = last
    if node.end_mark.column == 0:  # a block scalar (| or >) ends at the start of the next line
        return node.end_mark.index
    return _line_end(text, node.end_mark.index)


def _line_end(text: str, at: int) -> int:
    nl = text.find("\n", at)
    return len(text) if nl < 0 else nl + 1


def _step(node: yaml.Node) -> int:
    """The indentation a block mapping's nested blocks use, relative to it (2 when none shows)."""
    col = node.value[0][0].start_mark.column
    for _, v in node.value:
        if isinstance(v, yaml.MappingNode) and not v.flow_style and v.value:
            return max(1, v.value[0][0].start_mark.column - col)
    return 2


def _insert(text: str, mapping: yaml.Node, lines: list[tuple[int, str]], step: int) -> tuple[str, int]:
    """`lines` ((depth, text)) after a block mapping's last key, at its keys' indentation. The new
    text, and the 1-based line of the last new line."""
    indent = mapping.value[0][0].start_mark.column
    nl = _newline(text)
    at = _after_last_line(text, mapping)
    lead = nl if at == len(text) and text and not text.endswith("\n") else ""
    new = lead + "".join(" " * (indent + depth * step) + s + nl for depth, s in lines)
    return text[:at] + new + text[at:], text[:at].count("\n") + len(lines) + (1 if lead else 0)


def _yaml_add(text: str, fname: str, group: str, key: str, value: int) -> tuple[str, Position, int]:
    doc = _YamlDoc.parse(text, fname, inventory=True)
    line = f"{key}: {value}"
    refusals = []
    defs = [(p, d) for p, d in doc.groups.get(group, []) if isinstance(d, yaml.MappingNode) and d.value]
    for path, d in defs:
        body = dict(_pairs(d)).get("vars")
        if isinstance(body, yaml.MappingNode) and body.value and not body.flow_style:
            if doc.refs.get(id(body), 0) > 1 or len(doc.owners.get(id(body), ())) > 1:
                refusals.append(f"its vars on line {body.start_mark.line + 1} are shared through a YAML anchor")
                continue
            new, at = _insert(text, body, [(0, line)], 2)
            return new, (*path, "vars"), at
        if body is not None:
            style = "a flow-style mapping ({...})" if isinstance(body, yaml.MappingNode) else "not a block mapping"
            refusals.append(f"its vars on line {body.start_mark.line + 1} are {style}, which this tool does not "
                            f"add keys to")
    for path, d in defs:
        if "vars" not in dict(_pairs(d)) and not d.flow_style and doc.refs.get(id(d), 0) <= 1:
            new, at = _insert(text, d, [(0, "vars:"), (1, line)], _step(d))
            return new, (*path, "vars"), at
    root = doc.root
    if group == ALL and not defs and isinstance(root, yaml.MappingNode) and not root.flow_style and root.value:
        step = _step(root)
        new, at = _insert(text, root, [(0, "all:"), (1, "vars:"), (2, line)], step)
        return new, (ALL, "vars"), at
    why = "; ".join(refusals) or "it has no block mapping there to add vars to"
    raise InputError(f"{fname}: cannot add {key}: {value} to group {group}'s vars: {why}. Add the line by hand")


def _ini_add(text: str, group: str, key: str, value: int) -> tuple[str, Position, int]:
    lines = _ini_lines(text)
    sections = [ln for ln in lines if ln[2] == group and ln[3] in ("header:vars", "vars")]
    nl = _newline(text)
    if sections:
        offset, lineno, _, _, body = sections[-1]
        header = [ln for ln in sections if ln[3] == "header:vars"][-1]
        siblings = [ln for ln in sections if ln[3] == "vars" and ln[0] > header[0] and "=" in ln[4]]
        sep = "="
        if siblings:
            m = re.match(r"^(\s*)[^=]*?(\s*=\s*)", siblings[-1][4])
            if m:
                sep = m.group(2)
                key = m.group(1) + key
        at = offset + len(body)
        at = text.find("\n", at) + 1 if text.find("\n", at) >= 0 else len(text)
        lead = nl if at == len(text) and not text.endswith("\n") else ""
        return text[:at] + lead + f"{key}{sep}{value}{nl}" + text[at:], f"[{group}:vars]", lineno + 1
    lead = "" if not text or text.endswith("\n") else nl
    gap = nl if text.strip() and not text.endswith(nl + nl) else ""
    new = f"{text}{lead}{gap}[{group}:vars]{nl}{key}={value}{nl}"
    return new, f"[{group}:vars]", new.count("\n")


def _add_group(ctx: _Context, hosts: list[str]) -> str:
    """The most specific group all the hosts share (the one whose vars apply last), `all` if none."""
    common = set(ctx.graph.host_groups(hosts[0]))
    for h in hosts[1:]:
        common &= set(ctx.graph.host_groups(h))
    common.discard(UNGROUPED)  # not a section anyone writes: hosts in no group get `all`
    order = [g for g in ctx.graph.host_groups(hosts[0]) if g in common]
    return order[-1] if order else ALL


# ------------------------------------------------------------------------------------------------
# Proving an edited text says what was meant.

def _graph_sig(graph: InventoryGraph) -> tuple:
    return ({n: (g.vars, g.hosts, g.children, g.parents, g.priority) for n, g in graph.groups.items()},
            graph.host_vars)


def _read_back(ctx: _Context, path: str, before: str, after: str, wanted: dict[tuple[str, str, str], int]) -> None:
    """`after` must read as `before` with the `wanted` vars ((kind, owner, key) → value) changed."""
    def graph(text: str) -> InventoryGraph:
        if ctx.kind == "ini":
            return graph_from_ini(text.lstrip("\ufeff"), path)
        return graph_from_yaml(load_yaml(text), path)

    try:
        if path != ctx.path:
            expected = dict(load_yaml(before))
            expected.update({k: v for (_, _, k), v in wanted.items()})
            ok = load_yaml(after) == expected
        else:
            old = graph(before)
            for (kind, owner, k), v in wanted.items():
                (old.groups[owner].vars if kind == "group" else old.host_vars[owner])[k] = v
            ok = _graph_sig(graph(after)) == _graph_sig(old)
    except (YamlProblem, InventoryError):
        ok = False
    if not ok:
        raise InputError(f"{path}: the edit would not read back as intended (only "
                         f"{', '.join(sorted({k for _, _, k in wanted}))} changed): set the value by hand")


# ------------------------------------------------------------------------------------------------

def plan_write(inventory_path: str | os.PathLike, hosts: list[str], values: dict[str, int]) -> WritePlan:
    """The edits that make every host in `hosts` resolve to `values` (budget / topk_cap), each
    written into the layer the hosts take it from now (or, for a key no layer sets, into the vars
    of the most specific group they share, in the inventory file). Nothing is written."""
    hosts = list(dict.fromkeys(hosts))
    if not hosts:
        raise InputError("--write: no hosts to write values for")
    for key, value in values.items():
        if key not in WRITABLE_KEYS:
            raise InputError(f"--write: {shown(key)} is not a key this tool writes ({', '.join(WRITABLE_KEYS)})")
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"--write: {key} must be an integer, got {shown(value)}")
    inv = load_inventory(inventory_path)
    ctx = _context(inventory_path)
    _check_hosts(ctx, hosts)
    originals: dict[str, str] = {}  # the files as read: sources and diffs refer to these
    texts: dict[str, str] = {}  # the files with the edits so far
    wanted: dict[str, dict[tuple[str, str, str], int]] = {}
    changes, unchanged = [], []
    new_values: dict[str, dict[str, int]] = {}  # host → key → value it will resolve to
    for key in (k for k in WRITABLE_KEYS if k in values):
        value = values[key]
        if all(getattr(inv.hosts[h], key) == value for h in hosts):
            unchanged.append(key)
            continue
        old = getattr(inv.hosts[hosts[0]], key)
        sources = _sources(ctx, key, hosts, originals)
        lid = _winner(ctx, hosts[0], (key,))
        if lid is None:
            group = _add_group(ctx, hosts)
            edited: frozenset = frozenset({("group", group)})
            path, kind = ctx.path, ctx.kind
            text = texts.setdefault(path, originals.setdefault(path, _read_text(path)))
            new, position, line = (_ini_add(text, group, key, value) if kind == "ini"
                                   else _yaml_add(text, path, group, key, value))
            source = VarSource(path, kind, f"group {group} vars", position, line, key)
            owners = [("group", group)]
        else:
            path, kind = _file_of(ctx, lid)
            spots = _spots(ctx, lid, hosts[0], key, texts.setdefault(path, originals[path]))
            bad = next((s for s in spots if s.problem), None)
            if bad:
                raise InputError(f"{path} line {bad.line}: {key} {bad.problem}; set it by hand")
            new = _splice(texts[path], spots, value)
            source = sources[hosts[0]]
            if lid[0] == "host":  # a host entry may name several hosts (a range): all get it
                owners = [("host", n) for n in dict.fromkeys(n for s in spots for n in s.hosts)]
            else:
                owners = [lid]
            edited = frozenset(owners)
        texts[path] = new
        for k, o in owners:
            wanted.setdefault(path, {})[(k, o if k != "file" else "", key)] = value
        takers = [h for h in ctx.graph.host_vars if _winner(ctx, h, (key,), edited) in edited]
        missing = [h for h in hosts if h not in takers]
        if missing:  # cannot happen while _winner and the edit agree; never write on a guess
            raise InputError(f"{path}: writing {key} at {source} would not reach host {missing[0]}")
        for h in takers:
            new_values.setdefault(h, {})[key] = value
        changes.append(KeyChange(key, old, value, source, lid is None, tuple(h for h in takers if h not in hosts)))
    _check_values(inv, new_values)
    edits = []
    for path, text in texts.items():
        before = originals[path]
        if text != before:
            _read_back(ctx, path, before, text, wanted.get(path, {}))
            edits.append(FileEdit(path, before, text))
    return WritePlan(str(inventory_path), tuple(hosts), tuple(edits), tuple(changes), tuple(unchanged))


def _sources(ctx: _Context, key: str, hosts: list[str], originals: dict[str, str]) -> dict[str, VarSource | None]:
    """Where each host takes `key` from (None: the default); refused unless it is one place for all."""
    sources: dict[str, VarSource | None] = {}
    found: dict[_LayerId, VarSource] = {}  # a group's or file's source, found once for all its hosts
    for h in hosts:
        lid = _winner(ctx, h, (key,))
        if lid is None:
            sources[h] = None
        elif lid in found:
            sources[h] = found[lid]
        else:
            path, _ = _file_of(ctx, lid)
            text = originals.setdefault(path, _read_text(path))
            sources[h] = _source(ctx, lid, h, key, text, _spots(ctx, lid, h, key, text))
            if lid[0] != "host":
                found[lid] = sources[h]
    _same_source(ctx, key, sources)
    return sources


def _same_source(ctx: _Context, key: str, sources: dict[str, VarSource | None]) -> None:
    by: dict[VarSource | None, list[str]] = {}
    for h, s in sources.items():
        by.setdefault(s, []).append(h)
    if len(by) > 1:
        parts = [f"{', '.join(hs)} from {s if s else 'the default (no layer sets it)'}" for s, hs in by.items()]
        raise InputError(f"{ctx.path}: the hosts take {key} from different places ({'; '.join(parts)}): "
                         f"one edit cannot set them all; narrow --limit to the hosts of one")


def _check_values(inv: Inventory, new_values: dict[str, dict[str, int]]) -> None:
    """Every host the edits reach must still be valid (topk_cap <= budget, bounds) with them."""
    for h, vals in new_values.items():
        try:
            check_host_fields(replace(inv.hosts[h], **vals), WRITABLE_KEYS)
        except Invalid as e:
            raise InputError(f"{inv.path}: host {h}: {e.field} {e.problem} with "
                             f"{', '.join(f'{k}={v}' for k, v in vals.items())}") from None


def apply_plan(plan: WritePlan) -> Inventory | None:
    """Write the plan's files (each atomically, its mode kept), after checking none changed since
    it was planned; then load the inventory again and check that every host the plan reaches
    resolves to its new values. If not, the old texts are put back and InputError raised.
    Returns the inventory as it now is (None for an empty plan)."""
    if not plan.edits:
        return None
    stale = [e.path for e in plan.edits if _read_text(e.path) != e.before]
    if stale:
        raise InputError(f"{stale[0]}: changed since it was read: nothing written; run again")
    written: list[FileEdit] = []
    try:
        for e in plan.edits:
            _write(e.path, e.after)
            written.append(e)
        inv = load_inventory(plan.inventory)
        for c in plan.changes:
            for h in (*plan.hosts, *c.others):
                got = getattr(inv.host(h), c.key)
                if got != c.new:
                    raise InputError(f"{plan.inventory}: after writing, host {h} resolves {c.key} to {shown(got)}, "
                                     f"not {c.new}")
    except BaseException as err:
        for e in reversed(written):
            _write(e.path, e.before)
        if isinstance(err, InputError):
            raise InputError(f"{err} (the files were restored)") from None
        raise
    return inv


def _write(path: str, text: str) -> None:
    real = os.path.realpath(path)  # a symlinked vars file stays a symlink
    write_atomically(real, text, mode=stat.S_IMODE(os.stat(real).st_mode))
