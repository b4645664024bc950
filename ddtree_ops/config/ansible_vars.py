"""Ansible's connection variables as inventory keys.

| Ansible var                                                   | inventory key   |
| ------------------------------------------------------------- | --------------- |
| `ansible_host` (`ansible_ssh_host`)                           | `address`       |
| `ansible_port` (`ansible_ssh_port`)                           | `ssh_port`      |
| `ansible_user` (`ansible_ssh_user`)                           | `ssh_user`      |
| `ansible_ssh_private_key_file` (`ansible_private_key_file`)   | `identity_file` |
| `ansible_python_interpreter`                                  | `agent_python`  |

`ansible_python_interpreter` is the host's system Python, which Ansible's modules run on: that is
what the agent runs on too (`agent_python`), never the SGLang venv's `python`. Its `auto*` values
(Ansible's interpreter discovery) leave the default. Two names of one key that resolve to
different values are refused, naming both and where each was set: which one Ansible would use
depends on the connection plugin, and guessing would connect somewhere else. Every other
`ansible_*` var is Ansible's business and ignored. Values are the resolved vars as
`ansible-inventory --list` shows them; a Jinja template (`{{ ... }}`) in a value the tool uses is
refused, as nothing here expands it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import InventoryError, shown

__all__ = ["ALIASES", "ANSIBLE_PREFIX", "FoldedVars", "fold_ansible_vars"]

ANSIBLE_PREFIX = "ansible_"
ALIASES: dict[str, tuple[str, ...]] = {
    "address": ("ansible_host", "ansible_ssh_host"),
    "ssh_port": ("ansible_port", "ansible_ssh_port"),
    "ssh_user": ("ansible_user", "ansible_ssh_user"),
    "identity_file": ("ansible_ssh_private_key_file", "ansible_private_key_file"),
    "agent_python": ("ansible_python_interpreter",),
}
_DISCOVERY = frozenset({"auto", "auto_silent", "auto_legacy", "auto_legacy_silent"})


@dataclass(frozen=True)
class FoldedVars:
    vars: dict[str, Any]  # inventory keys only
    written: dict[str, str]  # inventory key → the name it was given as (ansible_port, ...)


def fold_ansible_vars(merged: Mapping[str, Any], origin: Mapping[str, str], fname: str, host: str) -> FoldedVars:
    """`merged` (resolved vars, `origin`: var → where it was set) with Ansible's names folded into
    ours and the rest of ansible_* dropped."""
    out = {k: v for k, v in merged.items() if not k.startswith(ANSIBLE_PREFIX)}
    written: dict[str, str] = {}
    for key, names in ALIASES.items():
        given = [(n, _coerced(n, merged[n])) for n in (key, *names) if n in merged and _is_set(n, merged[n])]
        for name, value in given[1:]:
            first, first_value = given[0]
            if value != first_value:
                raise InventoryError(fname, host, name,
                                     f"{shown(value)} ({origin.get(name, '?')}) disagrees with {first} "
                                     f"{shown(first_value)} ({origin.get(first, '?')}): they name the same "
                                     f"setting, keep one")
        if given:
            written[key] = given[0][0]
            out[key] = given[0][1]
    for key, value in out.items():
        if _has_template(value):
            raise InventoryError(fname, host, written.get(key, key),
                                 f"{shown(value)} is a Jinja template ({origin.get(written.get(key, key), '?')}): "
                                 f"ddtree-ops does not expand templates; write the value out")
    return FoldedVars(vars=out, written=written)


def _is_set(name: str, value: Any) -> bool:
    if not name.startswith(ANSIBLE_PREFIX):
        return True  # our own key: validated as given, null included
    return value is not None and not (name == "ansible_python_interpreter" and value in _DISCOVERY)


def _coerced(name: str, value: Any) -> Any:
    """Ansible takes a port written as text ('2222'); our own keys stay strict."""
    if name in ("ansible_port", "ansible_ssh_port") and isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return value


def _has_template(value: Any) -> bool:
    if isinstance(value, str):
        return "{{" in value or "{%" in value
    if isinstance(value, dict):
        return any(_has_template(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_template(v) for v in value)
    return False
