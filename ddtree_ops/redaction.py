"""The one list of what counts as a secret, and how it is hidden.

Used wherever a value could leak: the inventory refuses secret flags in `extra_args` (they would
land in the unit file, `systemctl show` and the process list), the plan's unit diff is redacted
before it is printed or written to JSON, and the sandbox's stand-in server masks them in its log.
"""

from __future__ import annotations

import re

# Launch flags whose value is a secret.
SECRET_FLAGS = ("--api-key", "--admin-api-key", "--hf-token", "--token")
# A variable or option whose name contains one of these words holds a secret.
SECRET_NAME_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")

MASK = "***"

# `--api-key=v`, `--api-key v`, `--api-key "v w"`. A `${VAR}` reference (the key comes from the
# unit's EnvironmentFile=) is not a secret and stays readable.
_FLAG_VALUE = re.compile(
    r"(%s)(=|\s+)(?!\$\{)(\"[^\"]*\"|'[^']*'|\S+)" % "|".join(re.escape(f) for f in SECRET_FLAGS))
# `SOME_API_KEY=value` in an Environment= line or a shell-like text.
_NAME_VALUE = re.compile(r"([A-Za-z0-9_]*(?:%s)[A-Za-z0-9_]*=)([^\"\s]+)" % "|".join(SECRET_NAME_WORDS))


def is_secret_flag(flag: str) -> bool:
    """`--api-key` or `--api-key=...`: a flag whose value must never be in argv or a unit."""
    return flag.split("=", 1)[0] in SECRET_FLAGS


def is_secret_name(name: str) -> bool:
    """A variable, option or field name that holds a secret (api_key, HF_TOKEN, db-password)."""
    upper = name.upper()
    return any(w in upper for w in SECRET_NAME_WORDS)


def redact(text: str) -> str:
    """`text` with the values of secret flags and secret-named assignments replaced by ***."""
    return _NAME_VALUE.sub(r"\1" + MASK, _FLAG_VALUE.sub(r"\1\2" + MASK, text))
