"""What a unit's [Service] section says about the process it starts: the user and groups it runs
as, its environment settings and its working directory, read as systemd reads them.

The launch check runs the server's argument parser on the host with exactly this identity and
environment (host/agent/unit_identity.py resolves it there): the parse must never run with more
rights than the server itself. Read here, on the controller, from the unit the deploy installs;
the EnvironmentFile= files themselves are read on the host (they may hold secrets).

systemd's rules (systemd.exec(5), systemd.syntax(7)): a later assignment replaces an earlier one,
an empty assignment resets a list, Environment= words are unquoted with C escapes undone, `%%` is
a literal `%`. Other specifiers (`%h`, `%u`, ...) are left as written: the units this tool
renders escape every `%`, so they hold none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .units import _logical_lines

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SIMPLE_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
                   "\\": "\\", '"': '"', "'": "'", "s": " "}
_HEX_LENGTH = {"x": 2, "u": 4, "U": 8}


@dataclass(frozen=True)
class ServiceExec:
    user: str | None = None  # None: no User= (the process runs as root)
    group: str | None = None
    supplementary_groups: tuple[str, ...] = ()
    environment: tuple[str, ...] = ()  # "NAME=value", in order (a later one wins)
    environment_files: tuple[str, ...] = ()  # as written: a leading "-" means "if it exists"
    working_directory: str | None = None

    @property
    def runs_as_root(self) -> bool:
        return self.user in (None, "root", "0")


def _unescape_specifiers(value: str) -> str:
    return re.sub(r"%(.)", lambda m: "%" if m.group(1) == "%" else m.group(0), value)


def _c_unescape_one(text: str, i: int) -> tuple[str, int]:
    """The character a backslash escape at text[i] (the char after the backslash) stands for,
    and the index after it; an unknown escape keeps its backslash."""
    ch = text[i] if i < len(text) else ""
    if ch in _SIMPLE_ESCAPES:
        return _SIMPLE_ESCAPES[ch], i + 1
    if ch in _HEX_LENGTH:
        digits = text[i + 1:i + 1 + _HEX_LENGTH[ch]]
        if len(digits) == _HEX_LENGTH[ch] and all(c in "0123456789abcdefABCDEF" for c in digits):
            return chr(int(digits, 16)), i + 1 + len(digits)
    if re.match(r"[0-7]{3}", text[i:i + 3]):
        return chr(int(text[i:i + 3], 8)), i + 3
    return "\\" + ch, i + 1


def unit_words(value: str) -> list[str]:
    """A setting's value split into words as systemd does for Environment= (extract_first_word
    with unquoting and C unescaping): whitespace separates, single or double quotes group,
    quotes may open mid-word, backslash escapes work inside and outside quotes."""
    words: list[str] = []
    cur: list[str] = []
    in_word = False
    quote = ""
    i = 0
    while i < len(value):
        ch = value[i]
        if ch == "\\":
            text, i = _c_unescape_one(value, i + 1)
            cur.append(text)
            in_word = True
            continue
        if quote:
            if ch == quote:
                quote = ""
            else:
                cur.append(ch)
        elif ch in "\"'":
            quote, in_word = ch, True
        elif ch.isspace():
            if in_word:
                words.append("".join(cur))
                cur, in_word = [], False
        else:
            cur.append(ch)
            in_word = True
        i += 1
    if in_word:
        words.append("".join(cur))
    return words


def _service_assignments(unit_text: str) -> list[tuple[str, str]]:
    """(key, value) of every assignment in the [Service] section(s), in order."""
    out = []
    section = None
    for line in _logical_lines(unit_text):
        s = line.strip()
        if not s or s.startswith(("#", ";")):
            continue
        if s.startswith("[") and s.endswith("]"):
            section = s[1:-1]
            continue
        key, eq, value = s.partition("=")
        if eq and section == "Service":
            out.append((key.strip(), value.strip()))
    return out


def service_exec(unit_text: str) -> ServiceExec:
    """The identity, environment and working directory settings of a unit's [Service] section."""
    single: dict[str, str | None] = {"User": None, "Group": None, "WorkingDirectory": None}
    groups: list[str] = []
    env: list[str] = []
    files: list[str] = []
    for key, value in _service_assignments(unit_text):
        if key in single:
            single[key] = _unescape_specifiers(value) or None
        elif key == "SupplementaryGroups":
            groups = groups + [_unescape_specifiers(w) for w in unit_words(value)] if value else []
        elif key == "Environment":
            words = [_unescape_specifiers(w) for w in unit_words(value)]
            env = env + [w for w in words if _NAME_RE.match(w.partition("=")[0]) and "=" in w] if value else []
        elif key == "EnvironmentFile":
            files = files + [_unescape_specifiers(value)] if value else []
    return ServiceExec(single["User"], single["Group"], tuple(groups), tuple(env), tuple(files),
                       single["WorkingDirectory"])
