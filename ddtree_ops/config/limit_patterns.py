"""`--limit` as Ansible reads a host pattern (ansible.inventory.manager), strict where Ansible warns.

- Patterns are separated by `,` (or, when there is no comma, by `:` outside `[...]`, unless the
  whole text is one address such as `h1:22` or an IPv6 address).
- Plain patterns add hosts, `&PATTERN` keeps only hosts it also matches, `!PATTERN` removes the
  hosts it matches; they apply in that order, whatever order they were written in. With no plain
  pattern, `all` is implied (`!canary` is every host but the canary group).
- A pattern is `all` or `*`, a host or group name, a shell glob (`gpu*`, `gpu0?`, `gpu[12]`) or,
  after `~`, a regular expression matched from the start of the name. A name that is a host is that
  host; otherwise group names are tried first (a group stands for its hosts and its children's),
  and host names too when nothing matched or the pattern is a glob or regex.
- `PATTERN[I]`, `PATTERN[I:J]`, `PATTERN[I:]` take hosts by position (from 0, J included) from
  what PATTERN matched.

Stricter than Ansible (which warns and goes on): a pattern that matches nothing, a subscript past
the end and a limit that leaves no host are errors naming the pattern; `@FILE` is not read.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import InputError

__all__ = ["HostIndex", "select_names", "split_patterns"]

_SUBSCRIPT_RE = re.compile(r"^(.+)\[(?:(-?[0-9]+)|([0-9]+)([:-])([0-9]*))\]$")
_COLON_PARTS_RE = re.compile(r"(?:[^\s:\[\]]|\[[^\]]*\])+")
# One address with an optional port, ranges allowed: Ansible's parse_address(allow_ranges=True).
_RANGE = r"\[(?:[a-z]:[a-z]|[0-9]+:[0-9]+)(?::[0-9]+)?\]"
_LABEL = rf"(?:\w|{_RANGE})(?:[\w-]|{_RANGE})*(?<![_-])"
_ADDRESS_RE = re.compile(rf"^(?:{_LABEL}(?:\.{_LABEL})*|\[[^\]]+\])(?::[0-9]+)?$", re.I)
_GLOB_CHARS = (".", "?", "*", "[")


@dataclass(frozen=True)
class HostIndex:
    """What patterns match against: host names in inventory order, and each group's hosts in
    Ansible's order (its own, then its children's), groups in the order the inventory adds them."""

    hosts: Sequence[str]
    groups: Mapping[str, Sequence[str]]
    where: str = "<inventory>"  # the inventory file, for messages


def split_patterns(limit: str) -> list[str]:
    if "," in limit:
        parts = limit.split(",")
    elif _is_one_address(limit.strip()):
        parts = [limit]
    else:
        parts = _COLON_PARTS_RE.findall(limit)
    return [p.strip() for p in parts if p.strip()]


def _is_one_address(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).version == 6
    except ValueError:
        return bool(_ADDRESS_RE.match(text))


def select_names(limit: str, index: HostIndex) -> list[str]:
    """The host names `limit` selects, in inventory order. Raises InputError naming the pattern."""
    patterns = split_patterns(limit)
    if not patterns:
        raise InputError(f"{index.where}: --limit {limit!r} names no host pattern")
    plain = [p for p in patterns if p[0] not in "&!"] or ["all"]
    ordered = plain + [p for p in patterns if p[0] == "&"] + [p for p in patterns if p[0] == "!"]
    chosen: dict[str, None] = {}
    host_names = set(index.hosts)
    for p in ordered:
        if p in host_names:
            chosen[p] = None
            continue
        matched = set(_match_one(p[1:] if p[0] in "&!" else p, p, index))
        if p[0] == "!":
            chosen = {h: None for h in chosen if h not in matched}
        elif p[0] == "&":
            chosen = {h: None for h in chosen if h in matched}
        else:
            chosen.update(dict.fromkeys(matched))
    if not chosen:
        raise InputError(f"{index.where}: --limit {limit!r} leaves no host (every host it matches is excluded "
                         f"or outside an '&' group)")
    return [h for h in index.hosts if h in chosen]


def _match_one(pattern: str, written: str, index: HostIndex) -> list[str]:
    if not pattern:
        raise InputError(f"{index.where}: --limit pattern {written!r} names no host or group")
    if pattern.startswith("@"):
        raise InputError(f"{index.where}: --limit {written!r}: reading hosts from a file (@FILE) is not supported; "
                         f"list them comma-separated")
    expr, subscript = _split_subscript(pattern)
    found = _enumerate(expr, written, index)
    if not found:
        raise InputError(f"{index.where}: --limit pattern {written!r} matches no host or group "
                         f"(hosts: {_some(index.hosts)}; groups: {_some(index.groups)})")
    if subscript is None:
        return found
    start, end = subscript
    try:
        picked = [found[start]] if end is None else found[start:(len(found) - 1 if end == -1 else end) + 1]
    except IndexError:
        picked = []
    if not picked:
        raise InputError(f"{index.where}: --limit pattern {written!r}: {expr!r} matches {len(found)} host(s), "
                         f"positions 0..{len(found) - 1}")
    return picked


def _split_subscript(pattern: str) -> tuple[str, tuple[int, int | None] | None]:
    if pattern.startswith("~"):
        return pattern, None
    m = _SUBSCRIPT_RE.match(pattern)
    if not m:
        return pattern, None
    expr, index, start, _, end = m.groups()
    if index is not None:
        return expr, (int(index), None)
    return expr, (int(start), int(end) if end else -1)


def _enumerate(pattern: str, written: str, index: HostIndex) -> list[str]:
    """Ansible's _enumerate_matches: groups first; hosts too when no group matched or the
    pattern is a glob or a regex. Duplicates stay (a subscript counts them, as Ansible's does)."""
    match = _matcher(pattern, written, index.where)
    groups = [g for g in index.groups if match(g)]
    found = [h for g in groups for h in index.groups[g]]
    if not groups or pattern.startswith("~") or any(c in pattern for c in _GLOB_CHARS):
        found += [h for h in index.hosts if match(h)]
    return found


def _matcher(pattern: str, written: str, where: str):
    if pattern.startswith("~"):
        try:
            regex = re.compile(pattern[1:])
        except re.error as e:
            raise InputError(f"{where}: --limit pattern {written!r} is not a valid regular expression: {e}") from None
        return lambda name: regex.match(name) is not None
    glob = re.compile(fnmatch.translate(pattern))
    return lambda name: glob.match(name) is not None


def _some(names: Sequence[str] | Mapping[str, object], most: int = 20) -> str:
    listed = list(names)
    more = f", … ({len(listed) - most} more)" if len(listed) > most else ""
    return (", ".join(listed[:most]) or "none") + more
