"""Declarative field validation: a table of `Field`s and the small validators they name.

A validator is a function ``check(value, done) -> value`` that returns the (normalised) value or
raises `Invalid` with what is wrong *and what is allowed*; `done` holds the fields of the same
table validated before it (a bound such as "topk_cap ≤ budget" or a default such as "base_url
from address and port" reads them). `apply` runs a table over a mapping; the caller turns
`Invalid` into its own error type with the file, host and field named (see inventory.py).

Every integer range in the tool goes through `check_int` (bools are refused: YAML's `yes` is not
a budget), so the inventory, `--budget/--topk-cap` and the render-time re-check agree. Every
string field refuses what YAML 1.1 made of an unquoted word (`no` → False, `010` → 8, `1.10` →
1.1, `2024-01-02` → a date) with a message saying to quote it (`yaml_hint`); values quoted in
messages are cut to 80 characters (`errors.shown`).
"""

from __future__ import annotations

import datetime
import ipaddress
import math
import os
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Mapping, Sequence

from ..errors import shown
from .redaction import is_secret_flag, is_secret_name

Check = Callable[[Any, Mapping[str, Any]], Any]

# systemd.unit(5): "valid unit names consist of a 'unit name prefix' and a suffix ...
# ASCII letters, digits, ':', '-', '_', '.', and '\'"; '@' separates a template instance.
_UNIT_SUFFIXES = (
    "service", "socket", "device", "mount", "automount", "swap", "target", "path",
    "timer", "slice", "scope",
)
_UNIT_RE = re.compile(r"^[A-Za-z0-9:_.\\-]+(@[A-Za-z0-9:_.\\-]*)?\.(%s)$" % "|".join(_UNIT_SUFFIXES))
_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
# Host, group and patch-set names.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Launch arguments travel into a systemd ExecStart= line; we allow what flags and paths need.
_ARG_CHARS = "[A-Za-z0-9_./:=,@+%-]"
_ARG_RE = re.compile(r"^%s+$" % _ARG_CHARS)
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_URL_RE = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+(:[0-9]{1,5})?(/[A-Za-z0-9._~/-]*)?$")
_TEMPLATE_RE = re.compile(r"^[A-Za-z0-9_.-]+\.j2$")


class Invalid(ValueError):
    """A value is not allowed. `problem` says what is allowed; `field` is set by `apply`."""

    def __init__(self, problem: str, field: str | None = None):
        self.problem, self.field = problem, field
        super().__init__(problem)


@dataclass(frozen=True)
class Field:
    """One row of a table.

    `default` is used when the key is absent (a callable default, also when it is null, is
    computed from the fields validated before it); OMIT leaves an absent key out of the result;
    ABSENT hands an absent key to `check` as the ABSENT marker (a rule such as "required for one
    action, refused for the other" reads an earlier field to decide); a null value is None when
    the default is None, else it goes to `check` (which may take null as "none", like an empty
    list). `required` (what is needed, e.g. "an absolute path") makes a null value an error.
    `attr` renames the result. A field whose `check` is None is a known key validated elsewhere.
    """

    name: str
    check: Check | None
    default: Any = None
    required: str | None = None
    attr: str | None = None


OMIT = object()
ABSENT = object()  # as a default, it is the value an absent key gives its check


def yaml_hint(value: Any) -> str:
    """Why `value`, where a string belongs, is not one: what YAML 1.1 makes of an unquoted word."""
    if isinstance(value, bool):
        return " (YAML reads unquoted yes/no/on/off/true/false as a boolean: quote the value)"
    if isinstance(value, (int, float)):
        return (" (YAML reads an unquoted number as one: 010 is 8, 0x10 is 16, 1:30 is 90, 1.10 is 1.1: "
                "quote the value)")
    if isinstance(value, (datetime.date, datetime.datetime)):
        return " (YAML reads an unquoted 2024-01-02 as a date: quote the value)"
    return ""


def not_string(value: Any, allowed: str) -> Invalid:
    """The error for a value that should be a string: what is allowed, what came, and the hint."""
    return Invalid(f"must be {allowed}, got {shown(value)}{yaml_hint(value)}")


def apply(table: Sequence[Field], raw: Mapping[str, Any]) -> dict[str, Any]:
    """Validate `raw` with `table`, in table order: {attr or name: value}. Raises Invalid with
    `field` set to the table's field name (nested tables: 'health.load_deadline_s')."""
    done: dict[str, Any] = {}
    out: dict[str, Any] = {}
    for f in table:
        if f.check is None:
            continue
        if f.name in raw:
            value = raw[f.name]
        elif f.default is OMIT:
            continue
        else:
            value = None if callable(f.default) else f.default
        if value is None and callable(f.default):  # absent or null: derived from earlier fields
            value = f.default(done)
        try:
            if value is None and f.required:
                raise Invalid(f"is required: {f.required}")
            result = None if value is None and f.default is None else f.check(value, done)
        except Invalid as e:
            e.field = joined(f.name, e.field)
            raise
        done[f.name] = result
        out[f.attr or f.name] = result
    return out


def joined(outer: str, inner: str | None) -> str:
    """The name of field `inner` inside `outer`: 'health.load_deadline_s', 'files[0].path'."""
    if inner is None:
        return outer
    return f"{outer}{inner}" if inner.startswith("[") else f"{outer}.{inner}"


def known_keys(table: Sequence[Field]) -> set[str]:
    return {f.name for f in table}


# --------------------------------------------------------------------------- numbers

def check_int(value: Any, lo: int, hi: int, *, hi_label: str | None = None, note: str = "") -> int:
    """`value` if it is an int (not a bool) in lo..hi, else Invalid('must be an integer lo..hi, got v')."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        note = f" ({note})" if note else ""
        raise Invalid(f"must be an integer {lo}..{hi_label or hi}{note}, got {shown(value)}")
    return value


def int_range(lo: int, hi: int | str) -> Check:
    """An integer lo..hi; `hi` may name an earlier field of the table (topk_cap ≤ budget)."""

    def check(value: Any, done: Mapping[str, Any]) -> int:
        if isinstance(hi, str):
            return check_int(value, lo, done[hi], hi_label=f"{hi} ({done[hi]})")
        return check_int(value, lo, hi)
    return check


def number_range(lo: float, hi: float) -> Check:
    """An int or float (not a bool) in lo..hi, as a float."""

    def check(value: Any, done: Mapping[str, Any]) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
            raise Invalid(f"must be a number {lo}..{hi}, got {shown(value)}")
        return float(value)
    return check


@dataclass(frozen=True)
class CountOrShare:
    """A number of targets (`count`), or a share of them (`percent`, 25 for "25%")."""

    count: int | None = None
    percent: Fraction | None = None

    def of(self, total: int) -> int:
        """Resolved against `total` targets: never more than total; a share rounds down but is at
        least 1 (as Ansible's `serial`)."""
        if total <= 0:
            return 0
        if self.percent is not None:
            return max(1, min(total, math.floor(self.percent * total / 100)))
        return min(total, self.count or 1)

    @property
    def everything(self) -> bool:
        return self.percent == 100

    def __str__(self) -> str:
        return f"{float(self.percent):g}%" if self.percent is not None else str(self.count)


_SHARE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def count_or_share(what: str = "a number of targets (1 or more) or a share of them such as 25% (above 0, "
                               "at most 100%)") -> Check:
    """An int >= 1, its digits as a string, or "P%" with 0 < P <= 100, as CountOrShare."""

    def check(value: Any, done: Mapping[str, Any]) -> CountOrShare:
        if isinstance(value, CountOrShare):
            return value
        text = value.strip() if isinstance(value, str) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return CountOrShare(count=value)
        if text is not None and text.isdigit() and int(text) >= 1:
            return CountOrShare(count=int(text))
        m = _SHARE_RE.match(text) if text is not None else None
        if m and 0 < Fraction(m.group(1)) <= 100:
            return CountOrShare(percent=Fraction(m.group(1)))
        raise Invalid(f"must be {what}, got {shown(value)}{yaml_hint(value) if isinstance(value, bool) else ''}")
    return check


# --------------------------------------------------------------------------- strings

def check_path(val: str) -> str:
    """Absolute, normalised, printable, no '..' and no whitespace-control characters."""
    if not val.startswith("/"):
        raise Invalid(f"must be an absolute path, got {shown(val)}")
    if any(ord(c) < 32 or ord(c) == 127 for c in val):
        raise Invalid(f"must not contain control characters (newline, tab, ...): {shown(val)}")
    if " " in val:
        raise Invalid(f"must not contain spaces (it travels into systemd and shell command lines): {shown(val)}")
    parts = val.split("/")
    if ".." in parts or "." in parts:
        raise Invalid(f"must not contain '.' or '..' components: {shown(val)}")
    if "//" in val or (len(val) > 1 and val.endswith("/")):
        raise Invalid(f"must be normalised (no '//' and no trailing '/'): {shown(val)}")
    return val


def abs_path(*, expand_user: bool = False, not_in: Sequence[str] = (), why: str = "is not allowed") -> Check:
    """An absolute, normalised path (`~` expanded first with expand_user), none of `not_in`."""

    def check(value: Any, done: Mapping[str, Any]) -> str:
        if not isinstance(value, str) or not value:
            raise not_string(value, "an absolute path")
        path = check_path(os.path.expanduser(value) if expand_user else value)
        if path in not_in:
            raise Invalid(f"{path} {why}")
        return path
    return check


def matching(regex: re.Pattern, allowed: str) -> Check:
    """A string matching `regex`; `allowed` describes it for the message."""

    def check(value: Any, done: Mapping[str, Any]) -> str:
        if not isinstance(value, str) or not regex.match(value):
            raise not_string(value, allowed)
        return value
    return check


def user_name() -> Check:
    return matching(_USER_RE, "a POSIX user name ([a-z_][a-z0-9_-]*, at most 32 characters)")


def env_name(what: str = "an environment variable name") -> Check:
    return matching(_ENV_NAME_RE, f"{what} ([A-Za-z_][A-Za-z0-9_]*)")


def module_name() -> Check:
    return matching(_MODULE_RE, "a dotted Python module name")


def template_name() -> Check:
    return matching(_TEMPLATE_RE, "a template file name under templates/ ending in .j2")


def http_url() -> Check:
    """An http(s) URL without a trailing '/'."""

    def check(value: Any, done: Mapping[str, Any]) -> str:
        if not isinstance(value, str) or not _URL_RE.match(value):
            raise not_string(value, "an http(s) URL such as http://10.0.0.5:30000")
        return value.rstrip("/")
    return check


def ip_address(example: str = "0.0.0.0 or 127.0.0.1") -> Check:
    def check(value: Any, done: Mapping[str, Any]) -> str:
        try:
            if not isinstance(value, str):  # ip_address() takes an int as an address: 0 is 0.0.0.0
                raise TypeError
            ipaddress.ip_address(value)
        except (ValueError, TypeError):
            raise not_string(value, f"an IP address such as {example}") from None
        return value
    return check


def host_address() -> Check:
    """An IP address or a DNS name."""

    def check(value: Any, done: Mapping[str, Any]) -> str:
        if not isinstance(value, str) or not value:
            raise not_string(value, "an IP address or DNS name")
        try:
            ipaddress.ip_address(value)
        except ValueError:
            if not _HOSTNAME_RE.match(value):
                raise Invalid(f"{shown(value)} is neither an IP address nor a DNS name") from None
        return value
    return check


def address_list() -> Check:
    """IP addresses or DNS names: a list, one name, or null (none)."""
    one = host_address()

    def check(value: Any, done: Mapping[str, Any]) -> tuple[str, ...]:
        names = [value] if isinstance(value, str) else [] if value is None else value
        if not isinstance(names, (list, tuple)):
            raise Invalid(f"must be a list of IP addresses or DNS names, got {shown(value)}")
        return tuple(one(n, done) for n in names)
    return check


def launch_value() -> Check:
    """A value on the launch command line: a local path or a hub id such as moonshotai/Kimi-K2.6."""

    def check(value: Any, done: Mapping[str, Any]) -> str:
        if not isinstance(value, str) or not value:
            raise not_string(value, "a model directory or a model id")
        if not _ARG_RE.match(value) or ".." in value.split("/"):
            raise Invalid(f"{shown(value)} must use only {_ARG_CHARS} and no '..' components")
        return value
    return check


def is_valid_unit_name(name: Any) -> bool:
    return isinstance(name, str) and len(name) <= 255 and bool(_UNIT_RE.fullmatch(name))


def check_unit(value: Any, *, service: bool = False) -> str:
    if not isinstance(value, str):
        raise not_string(value, "a systemd unit name such as sglang.service")
    if not is_valid_unit_name(value):
        raise Invalid(f"{shown(value)} is not a valid systemd unit name (letters, digits, ':', '-', '_', '.', "
                      f"'\\', one '@', and a suffix such as .service)")
    if service and not value.endswith(".service"):
        raise Invalid(f"{shown(value)} must be a .service unit")
    return value


def unit_name(*, service: bool = False) -> Check:
    return lambda value, done: check_unit(value, service=service)


def unit_list(*, not_field: str | None = None) -> Check:
    """Unit names: a list, one name, or null (none); never the unit named by field `not_field`."""

    def check(value: Any, done: Mapping[str, Any]) -> tuple[str, ...]:
        units = [value] if isinstance(value, str) else [] if value is None else value
        if not isinstance(units, (list, tuple)):
            raise Invalid(f"must be a list of unit names, got {shown(value)}")
        for u in units:
            check_unit(u)
        if not_field and done[not_field] in units:
            raise Invalid(f"the unit {done[not_field]} cannot conflict with itself")
        return tuple(units)
    return check


def launch_args(secret_hint: str) -> Check:
    """Extra launch arguments: a list of strings (or one space-separated string) with only safe
    characters and no secret flag (`secret_hint` says where the secret goes instead). A number in
    the list is refused: YAML has already turned `010` into 8 and `1.10` into 1.1."""

    def check(value: Any, done: Mapping[str, Any]) -> tuple[str, ...]:
        args = value.split() if isinstance(value, str) else [] if value is None else value
        if not isinstance(args, (list, tuple)):
            raise Invalid(f"must be a list of arguments (or one space-separated string), got {shown(value)}")
        out = []
        for a in args:
            if not isinstance(a, str):
                raise Invalid(f"each argument must be a string, got {shown(a)}{yaml_hint(a)}")
            if not _ARG_RE.match(a):
                raise Invalid(f"argument {shown(a)} has characters outside {_ARG_CHARS}")
            if is_secret_flag(a):
                raise Invalid(f"{a.split('=', 1)[0]} must not be in extra_args: it would land in the unit file, "
                              f"`systemctl show` and the process list. {secret_hint}")
            if is_config_flag(a):
                raise Invalid(f"{a.split('=', 1)[0]} must not be in extra_args: the unit passes SGLang's one "
                              f"--config file itself (SGLang allows only one, and ignores `--config=FILE`). "
                              f"{secret_hint}")
            out.append(a)
        return tuple(out)
    return check


def is_config_flag(arg: str) -> bool:
    """`--config`, `--config=FILE` or an abbreviation argparse would take for it (`--conf`)."""
    name = arg.split("=", 1)[0]
    return len(name) >= len("--conf") and "--config".startswith(name)


def yaml_file() -> Check:
    """An absolute path (like abs_path) ending in .yaml or .yml: SGLang's `--config` refuses any
    other file name (sglang/srt/utils/server_args_config_parser.py, `_validate_yaml_file`)."""
    path_check = abs_path()

    def check(value: Any, done: Mapping[str, Any]) -> str:
        path = path_check(value, done)
        if not path.lower().endswith((".yaml", ".yml")):
            raise Invalid(f"must name a YAML file ending in .yaml or .yml (SGLang's --config refuses others), "
                          f"got {shown(path)}")
        return path
    return check


def env_mapping() -> Check:
    """NAME: value pairs for Environment= lines (null: none), as a tuple of (name, value). Values
    must be strings: unquoted, `CUDA_VISIBLE_DEVICES: 010` is the number 8 and `X: yes` is True."""

    def check(value: Any, done: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
        env = {} if value is None or value == [] else value
        if not isinstance(env, dict):
            raise Invalid(f"must be a mapping NAME: value, got {shown(value)}")
        out = []
        for k, v in env.items():
            if not isinstance(k, str) or not _ENV_NAME_RE.match(k):
                raise Invalid(f"variable name {shown(k)} is not valid ([A-Za-z_][A-Za-z0-9_]*)")
            if not isinstance(v, str):
                raise Invalid(f"{k}: value must be a string, got {shown(v)}"
                              f"{yaml_hint(v) or ' (write it in quotes)'}")
            sval = v
            if is_secret_name(k):
                raise Invalid(f"{k}: looks like a secret and would land in the unit file and its backups; put "
                              f"{k}=value in the file named by environment_file (mode 0600) instead")
            if any(ord(ch) < 32 for ch in sval) or any(ch in sval for ch in '"\\%$'):
                raise Invalid(f"{k}: value must not contain control characters, quotes, '\\', '%' or '$'")
            out.append((k, sval))
        return tuple(out)
    return check


def non_empty_string() -> Check:
    def check(value: Any, done: Mapping[str, Any]) -> str:
        if not isinstance(value, str) or not value:
            raise not_string(value, "a non-empty string")
        return value
    return check


def boolean() -> Check:
    """true or false (YAML's unquoted yes/no/on/off too); never a string or a number."""

    def check(value: Any, done: Mapping[str, Any]) -> bool:
        if not isinstance(value, bool):
            raise Invalid(f"must be true or false, got {shown(value)}")
        return value
    return check


def optional(inner: Check) -> Check:
    """`inner`, or None for null."""
    return lambda value, done: None if value is None else inner(value, done)


def mapping(fields: Sequence[Field], value: Any) -> dict[str, Any]:
    """A nested mapping (null: empty) validated by `fields`: Invalid for something else, for an
    unknown key (naming it) and for a bad value (`apply`)."""
    allowed = ", ".join(sorted(known_keys(fields)))
    raw = {} if value is None else value
    if not isinstance(raw, dict):
        raise Invalid(f"must be a mapping of {allowed}, got {shown(value)}")
    unknown = sorted(str(k) for k in set(raw) - known_keys(fields))
    if unknown:
        raise Invalid(f"unknown key; allowed: {allowed}", unknown[0])
    return apply(fields, raw)


def exact_mapping(fields: Sequence[Field], value: Any) -> dict[str, Any]:
    """A mapping with exactly the keys of `fields`, nothing missing and nothing more (a file the
    tool writes itself, such as a bundle's manifest), validated by them (`apply`)."""
    keys = ", ".join(sorted(known_keys(fields)))
    if not isinstance(value, dict):
        raise Invalid(f"must be a mapping of exactly the keys {keys}, got {shown(value)}")
    if set(value) != known_keys(fields):
        raise Invalid(f"must have exactly the keys {keys}, has {shown(sorted(str(k) for k in value))}")
    return apply(fields, value)


def table(fields: Sequence[Field], build: Callable[..., Any]) -> Check:
    """A nested mapping validated by `fields` (null: empty); `build(**values)` makes the result."""
    return lambda value, done: build(**mapping(fields, value))
