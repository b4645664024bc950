"""Text from outside the tool, made safe to print on a terminal or into a CI log.

Hosts, servers and files send text the tool prints: error messages, unit states, release ids,
server log lines. A terminal obeys what such text may carry -- ESC sequences (a clipboard write
`ESC]52`, a window title `ESC]0`, a line erase `ESC[2K`), BEL, backspace and CR that overwrite
what the operator already sees, C1 controls (U+0080-U+009F: CSI and OSC in one character), and
Unicode format characters such as bidi overrides (U+202A-U+202E, U+2066-U+2069) that reorder a
line on screen. `terminal_safe` shows each of them as its Python escape (`\\x1b`, `\\u202e`)
instead: an operator sees that something odd was sent, and nothing is silently dropped.

Every path by which the tool writes to stdout or stderr uses this one function (the tables, the
live view, the plain progress lines, error lines); the HTML report uses it before escaping HTML.
A newline is kept only where the caller prints a multi-line block on purpose (a log tail).
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

# Control (Cc), format (Cf: bidi, zero width, ...), lone surrogates (Cs: no terminal can be sent
# one, and encoding it would fail) and the Unicode line and paragraph separators (Zl, Zp).
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
# Printable ASCII and tab are never unsafe: only the rest is looked up, one character at a time.
_CANDIDATE = re.compile(r"[^\t\x20-\x7e]")
_CANDIDATE_KEEPING_NEWLINES = re.compile(r"[^\t\n\x20-\x7e]")
_NAMED = {"\n": "\\n", "\r": "\\r"}  # as Python writes them: the two an operator knows by sight


def _shown(ch: str) -> str:
    if unicodedata.category(ch) not in _UNSAFE_CATEGORIES:
        return ch
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def terminal_safe(value: Any, *, keep_newlines: bool = False) -> str:
    """`str(value)` with every control, format and separator character shown as its escape.

    Tabs stay (harmless, and log lines use them). Newlines are shown as `\\n` unless
    `keep_newlines`: a line the caller prints as one line stays one line, so text from outside
    cannot start a line of its own that looks like the tool's."""
    text = value if isinstance(value, str) else str(value)
    pattern = _CANDIDATE_KEEPING_NEWLINES if keep_newlines else _CANDIDATE
    return pattern.sub(lambda m: _shown(m.group()), text)

