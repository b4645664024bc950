"""What a host runs, against what the inventory (and, when the operator names it, the patch set
or bundle) says it should: per field, both values. `status` reports each difference and exits 1.

Only a host that runs a release of this tool is compared: a host still on its upstream server
has not been deployed yet, which is no drift."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..artifacts.units import exec_start_words, render_unit
from ..config.inventory import Host
from ..errors import InputError


@dataclass(frozen=True)
class Expected:
    """The release the operator says the hosts should run (`status --patchset/--bundle`)."""

    label: str
    patchset_digest: str
    bundle_id: str | None = None
    templates_dir: str | None = None  # a bundle's templates: the unit is rendered from them


@dataclass(frozen=True)
class FieldDrift:
    field: str
    inventory: Any  # what the inventory (or the named release) says
    host: Any  # what the host runs

    def to_dict(self) -> dict[str, Any]:
        return {"field": self.field, "inventory": self.inventory, "host": self.host}

    def brief(self) -> str:
        if self.field == "flags" and isinstance(self.inventory, list):
            parts = [f"{verb} {_short(words)}" for verb, words in (("lacks", self.inventory), ("adds", self.host))
                     if words]
            return "flags: the host's unit " + ", ".join(parts) + " (against the inventory's)"
        return f"{self.field} {_short(self.host)} (inventory: {_short(self.inventory)})"


def _short(v: Any) -> str:
    if v is None:
        return "none"
    return " ".join(v) if isinstance(v, (list, tuple)) else str(v)


@dataclass(frozen=True)
class Running:
    """What status read on the host."""

    release: str | None
    patchset: str | None
    patchset_digest: str | None
    bundle: str | None
    budget: int | None
    topk_cap: int | None
    active_unit: str | None
    unit_text: str | None  # the active unit's file


def flag_difference(expected: list[str], running: list[str]) -> tuple[list[str], list[str]]:
    """Launch words the inventory's unit has and the running one lacks, and the other way round
    (order kept; a repeated word counts as often as it occurs)."""
    def minus(a: list[str], b: list[str]) -> list[str]:
        rest = list(b)
        out = []
        for w in a:
            if w in rest:
                rest.remove(w)
            else:
                out.append(w)
        return out
    return minus(expected, running), minus(running, expected)


def compare(host: Host, running: Running, expected: Expected | None = None) -> list[FieldDrift]:
    """Every field where the host differs from the inventory; [] for a host with no release."""
    if running.release is None:
        return []
    out: list[FieldDrift] = []
    if expected is not None:
        if running.patchset_digest != expected.patchset_digest:
            out.append(FieldDrift("patchset", expected.label, running.patchset))
        if expected.bundle_id and running.bundle != expected.bundle_id:
            out.append(FieldDrift("bundle", expected.bundle_id, running.bundle))
    for name, want, got in (("budget", host.budget, running.budget), ("topk_cap", host.topk_cap, running.topk_cap)):
        if want != got:
            out.append(FieldDrift(name, want, got))
    if running.active_unit != host.unit:
        out.append(FieldDrift("unit", host.unit, running.active_unit))
        return out  # another unit's launch line is not ours to compare
    out.extend(_flags(host, running, expected))
    return out


def _flags(host: Host, running: Running, expected: Expected | None) -> list[FieldDrift]:
    # Rendered with the budget and topk the host runs: those differences are reported on their own.
    as_running = replace(host, budget=running.budget or host.budget, topk_cap=running.topk_cap or host.topk_cap)
    try:
        want = exec_start_words(render_unit(as_running, expected.templates_dir if expected else None)) or []
    except InputError as e:
        return [FieldDrift("flags", f"(the inventory's unit does not render: {e})", None)]
    got = exec_start_words(running.unit_text or "") or []
    missing, extra = flag_difference(want, got)
    if not missing and not extra:
        return []
    return [FieldDrift("flags", missing, extra)]
