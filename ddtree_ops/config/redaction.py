"""The one list of what counts as a secret, and how it is hidden.

Used wherever a value could leak: the inventory refuses secret flags in `extra_args` (they would
land in the unit file, `systemctl show` and the process list), the plan's unit diff is redacted
before it is printed or written to JSON, the server log lines the controller shows or returns
(a failed deploy's log tail, the health wait's progress line) are scrubbed, and the sandbox's
stand-in server masks them in its own lines.

`redact` hides what the text itself says is a secret: the value of a secret flag
(`--api-key v`), and of a secret-named field in the forms a server log, a config file or a unit
prints it -- SGLang's `server_args={'api_key': 'v', ...}` and `ServerArgs(api_key='v')`, YAML
`api-key: v`, JSON, `HF_TOKEN=v` -- and an `Authorization: Bearer v`. `scrub` does that and also
replaces every secret value the caller knows (the API key read from the operator's environment),
wherever it appears.
"""

from __future__ import annotations

import re
from typing import Iterable

# Launch flags whose value is a secret.
SECRET_FLAGS = ("--api-key", "--admin-api-key", "--hf-token", "--token")
# A variable or option holds a secret when one of the words of its name (split at `_` and `-`)
# is, or ends with, one of these: API_KEY, HF_TOKEN, APIKEY, DB_PASSWORD; not TOKENIZERS_PARALLELISM.
SECRET_NAME_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD")

MASK = "***"

# A long flag in a command line or a log line; whether it is a secret one is decided by
# is_secret_flag (and is_secret_name for spellings argparse would not accept, such as the
# `--api_key` a YAML key `api_key:` becomes in SGLang's "unrecognized arguments" error).
_FLAG = re.compile(r"--[A-Za-z][A-Za-z0-9_-]*")
# Its value: `=v`, ` v`, ` "v w"`. A `${VAR}` reference (the key comes from the unit's
# EnvironmentFile=) is not a secret and stays readable.
_VALUE = re.compile(r"(=|\s+)(?!\$\{)(\"[^\"]*\"|'[^']*'|\S+)")
# A named value: `name=value`, `name: value`, `'name': 'value'`, `"name": "value"`. The name
# is not part of a longer word or flag (`--api-key` is the flag rule's). The value is a
# quoted string (Python repr, YAML, JSON: escapes allowed) or, unquoted, what runs
# to the next space after `=`, or to the next `,;)}]` or the end of the line after `:`
# (a YAML value may hold spaces).
_NAMED = re.compile(r"""(?<![A-Za-z0-9_.-])(?P<q>['"]?)(?P<name>[A-Za-z_][A-Za-z0-9_-]*)(?P=q)"""
                    r"""[ \t]*(?P<sep>[=:])[ \t]*""")
_QUOTED = re.compile(r"'(?:[^'\\\n]|\\.)*'" + r'|"(?:[^"\\\n]|\\.)*"')
_BARE = {"=": re.compile(r"""[^\s'"&,;)}\]]+"""), ":": re.compile(r"""[^\s'"\[{(,;)}\]][^\n,;)}\]]*""")}
# An unquoted value that says there is no secret: a number, None/null/true/false, `${VAR}`.
_HARMLESS = re.compile(r"^(?:[-+]?[0-9][0-9.eE+-]*|None|null|Null|NULL|~|true|false|True|False|\$\{.*)$")
_BEARER = re.compile(r"(?i)(\bbearer[ \t]+)([A-Za-z0-9._~+/=-]+)")


def is_secret_flag(flag: str) -> bool:
    """`--api-key`, `--api-key=...`, or an abbreviation argparse would accept for one of them
    (`--api-ke`, `--hf-tok`): a flag whose value must never be in argv or a unit."""
    name = flag.split("=", 1)[0]
    return name.startswith("--") and len(name) > 2 and any(f.startswith(name) for f in SECRET_FLAGS)


def is_secret_name(name: str) -> bool:
    """A variable, option or field name that holds a secret (api_key, HF_TOKEN, db-password)."""
    words = [w for w in re.split(r"[_\-]+", name.upper()) if w]
    return any(w.endswith(s) for w in words for s in SECRET_NAME_WORDS)


def redact(text: str) -> str:
    """`text` with the values of secret flags, secret-named fields and bearer tokens replaced by
    ***; quotes around a value are kept (`api_key='***'`)."""
    return _BEARER.sub(lambda m: m.group(1) + MASK, _redact_fields(_redact_flags(text)))


def scrub(text: str, secrets: Iterable[str | None] = ()) -> str:
    """`redact(text)` after replacing every one of `secrets` (values the controller knows, such as
    the API key from the operator's environment) by ***, wherever it appears."""
    for value in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(value, MASK)
    return redact(text)


def scrub_lines(lines: Iterable[str], secrets: Iterable[str | None] = ()) -> list[str]:
    """`scrub` for each line of a log tail."""
    known = [s for s in secrets if s]
    return [scrub(line, known) for line in lines]


def _redact_flags(text: str) -> str:
    """A secret flag's value always; a secret-named flag's (`--db-password`, `--api_key`) unless
    it is another flag (the name was a switch) or says there is no secret (a number)."""
    out, pos = [], 0
    for flag in _FLAG.finditer(text):
        name = flag.group()
        listed = is_secret_flag(name)
        if flag.start() < pos or not (listed or is_secret_name(name.lstrip("-"))):
            continue
        value = _VALUE.match(text, flag.end())
        if value and (listed or not (value.group(2).startswith("-") or _HARMLESS.match(value.group(2)))):
            out += [text[pos:value.start(2)], MASK]
            pos = value.end()
    return "".join(out) + text[pos:]


def _redact_fields(text: str) -> str:
    out, pos = [], 0
    for m in _NAMED.finditer(text):
        if m.start() < pos or not is_secret_name(m.group("name")):
            continue
        start = m.end()
        quoted = _QUOTED.match(text, start)
        if quoted:
            quote = text[start]
            out += [text[pos:start], quote + MASK + quote]
            pos = quoted.end()
            continue
        bare = _BARE[m.group("sep")].match(text, start)
        if not bare:
            continue
        value = bare.group().rstrip()
        if _HARMLESS.match(value):
            continue
        out += [text[pos:start], MASK]
        pos = start + len(value)
    return "".join(out) + text[pos:]
