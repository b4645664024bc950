"""Host entries as Ansible writes them in an inventory: `gpu[01:03]`, `db[a:c]-x`, `h1:2222`.

A range `[BEGIN:END]` or `[BEGIN:END:STEP]` expands to one host per value, numbers zero-padded to
the width of BEGIN when BEGIN starts with 0 (`[01:10]`: 01..10), single letters in
`string.ascii_letters` order; several ranges multiply. A trailing `:PORT` sets `ansible_port` for
every host of the entry. Expansion is bounded: `h[0:99999999]` is a typo, not a fleet.
"""

from __future__ import annotations

import re
import string

__all__ = ["MAX_HOSTS_PER_ENTRY", "HostPatternError", "expand_host_entry"]

MAX_HOSTS_PER_ENTRY = 4096

# A name (with [..] ranges, whose ':' are not a port) and an optional ':PORT'.
_ENTRY_RE = re.compile(r"^(?P<name>(?:[^:\[\]\s]|\[[^\]]*\])+)(?::(?P<port>[0-9]{1,5}))?$")
_RANGE_RE = re.compile(r"\[([^\]]*)\]")


class HostPatternError(ValueError):
    """A host entry that is not a name, a range or NAME:PORT; the text says why."""


def expand_host_entry(entry: str) -> tuple[list[str], int | None]:
    """The host names an inventory entry stands for, and the port it gives them (None: none)."""
    if entry.strip().endswith(":"):
        raise HostPatternError(f"host entry {entry!r} ends in ':' (which introduces a port)")
    m = _ENTRY_RE.match(entry.strip())
    if not m:
        raise HostPatternError(f"host entry {entry!r} is not NAME, NAME[BEGIN:END] or NAME:PORT")
    port = int(m.group("port")) if m.group("port") else None
    if port is not None and not 1 <= port <= 65535:
        raise HostPatternError(f"host entry {entry!r}: port {port} is not 1..65535")
    return _expand(m.group("name"), entry), port


def _expand(name: str, entry: str) -> list[str]:
    m = _RANGE_RE.search(name)
    if not m:
        return [name]
    head, tail = name[: m.start()], name[m.end():]
    out: list[str] = []
    for value in _range_values(m.group(1), entry):
        for rest in _expand(tail, entry):
            out.append(head + value + rest)
            if len(out) > MAX_HOSTS_PER_ENTRY:
                raise HostPatternError(f"host entry {entry!r} expands to more than {MAX_HOSTS_PER_ENTRY} hosts")
    return out


def _range_values(spec: str, entry: str) -> list[str]:
    bounds = spec.split(":")
    if len(bounds) not in (2, 3):
        raise HostPatternError(f"host entry {entry!r}: a range is [BEGIN:END] or [BEGIN:END:STEP], got [{spec}]")
    begin, end = bounds[0] or "0", bounds[1]
    step_text = bounds[2] if len(bounds) == 3 else "1"
    if not end:
        raise HostPatternError(f"host entry {entry!r}: the range [{spec}] has no end")
    if not step_text.isdigit() or int(step_text) < 1:
        raise HostPatternError(f"host entry {entry!r}: the step of [{spec}] must be a positive integer")
    step = int(step_text)
    if begin in string.ascii_letters and end in string.ascii_letters:
        i, j = string.ascii_letters.index(begin), string.ascii_letters.index(end)
        if i > j:
            raise HostPatternError(f"host entry {entry!r}: the range [{spec}] ends before it begins")
        return list(string.ascii_letters[i:j + 1:step])
    if not (begin.isdigit() and end.isdigit()):
        raise HostPatternError(f"host entry {entry!r}: [{spec}] is neither a number nor a letter range")
    width = len(begin) if begin.startswith("0") and len(begin) > 1 else 0
    if width and len(end) != width:
        raise HostPatternError(f"host entry {entry!r}: a zero-padded range needs BEGIN and END of one width, "
                               f"got [{spec}]")
    lo, hi = int(begin), int(end)
    if lo > hi:
        raise HostPatternError(f"host entry {entry!r}: the range [{spec}] ends before it begins")
    if (hi - lo) // step + 1 > MAX_HOSTS_PER_ENTRY:
        raise HostPatternError(f"host entry {entry!r} expands to more than {MAX_HOSTS_PER_ENTRY} hosts")
    return [str(v).zfill(width) for v in range(lo, hi + 1, step)]
