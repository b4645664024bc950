"""The one list of what counts as a secret, and how it is hidden.

Used wherever a value could leak: the inventory refuses secret flags in `extra_args` (they would
land in the unit file, `systemctl show` and the process list), the plan's unit diff is redacted
before it is printed or written to JSON, and the sandbox's stand-in server masks them in its log.
"""

from __future__ import annotations

import re

# Launch flags whose value is a secret.
SECRET_FLAGS = ("--api-key", "--admin-api-key", "--hf-token", "--token")
# A variable or option holds a secret when one of the words of its name (split at `_` and `-`)
# is, or ends with, one of these: API_KEY, HF_TOKEN, APIKEY, DB_PASSWORD; not TOKENIZERS_PARALLELISM.
SECRET_NAME_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD")

MASK = "***"

# A long flag in a command line; whether it is a secret one is is_secret_flag's decision.
_FLAG = re.compile(r"--[A-Za-z][A-Za-z0-9-]*")
# Its value: `=v`, ` v`, ` "v w"`. A `${VAR}` reference (the key comes from the unit's
# EnvironmentFile=) is not a secret and stays readable.
_VALUE = re.compile(r"(=|\s+)(?!\$\{)(\"[^\"]*\"|'[^']*'|\S+)")
# `NAME=value` in an Environment= line or a shell-like text; a secret when NAME is one.
_NAME_VALUE = re.compile(r"(?<![A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*)=([^\"\s]+)")


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
    """`text` with the values of secret flags and secret-named assignments replaced by ***."""
    return _redact_names(_redact_flags(text))


def _redact_flags(text: str) -> str:
    out, pos = [], 0
    for flag in _FLAG.finditer(text):
        if flag.start() < pos or not is_secret_flag(flag.group()):
            continue
        value = _VALUE.match(text, flag.end())
        if value:
            out += [text[pos:value.start(2)], MASK]
            pos = value.end()
    return "".join(out) + text[pos:]


def _redact_names(text: str) -> str:
    return _NAME_VALUE.sub(lambda m: f"{m.group(1)}={MASK}" if is_secret_name(m.group(1)) else m.group(0), text)
