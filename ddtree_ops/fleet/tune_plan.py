"""What `ddtree-ops tune` will try, computed before any host is touched (a plain value).

  grid(budgets, topk_caps, inventory)   the configs: DFlash (the control), every budget × top-k cap with
                                        cap ≤ budget, and the inventory's own config
  workloads(base, concurrencies, temperatures, duration_s)
                                        one perf-gate workload per concurrency × temperature
  assign(configs, hosts, on_original)   the configs spread over the hosts, ceil(configs / hosts) deploys
                                        each at most, DFlash where it costs no restart

A config is applied by the same runbook as a deploy (fleet/tune.py). DFlash is the host's original
state (`rollback --to original`); a rollback cannot be undone by another rollback, so the control
is measured only on a host that already runs its original files (which costs no restart); with no
such host selected, the DFlash row is reported as not measured, saying why.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..config.workload_settings import CONCURRENCY_MAX, Workload
from ..errors import InputError

DEFAULT_BUDGETS = (4, 8, 16, 32)
DEFAULT_TOPK_CAPS = (1, 2, 4)
DEFAULT_CONCURRENCIES = (1, 4, 16)
DEFAULT_TEMPERATURES = (0.0, 0.7)
DEFAULT_DURATION_S = 10.0


@dataclass(frozen=True)
class TuneConfig:
    """One thing to measure: DFlash (`budget` None) or a DDTree budget / top-k cap."""

    budget: int | None
    topk_cap: int | None
    inventory: bool = False  # the inventory's own config (what runs today)

    @property
    def dflash(self) -> bool:
        return self.budget is None

    @property
    def kind(self) -> str:
        return "dflash" if self.dflash else "ddtree"

    @property
    def label(self) -> str:
        return "DFlash" if self.dflash else f"{self.budget}/{self.topk_cap}"

    def as_dict(self) -> dict[str, Any]:
        return {"config": self.label, "kind": self.kind, "budget": self.budget, "topk_cap": self.topk_cap,
                "inventory": self.inventory}


DFLASH = TuneConfig(None, None)


def _parse_list(text: str, flag: str, convert: Callable[[str], Any], what: str, example: str,
                lo: float, hi: float) -> tuple[Any, ...]:
    """"4,8,16" → (4, 8, 16): each `convert`ed and within lo..hi, sorted, each once; InputError
    naming the flag."""
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            v = convert(part)
        except ValueError:
            raise InputError(f"{flag}: {part!r} is not {what} (give a comma-separated list, like "
                             f"{flag} {example})") from None
        if math.isnan(v) or not lo <= v <= hi:
            raise InputError(f"{flag}: {part} is out of range {lo:g}..{hi:g}")
        out.append(v)
    return tuple(sorted(set(out)))


def parse_int_list(text: str, flag: str, lo: int, hi: int) -> tuple[int, ...]:
    return _parse_list(text, flag, int, "a whole number", "4,8,16", lo, hi)


def parse_float_list(text: str, flag: str, lo: float, hi: float) -> tuple[float, ...]:
    return _parse_list(text, flag, float, "a number", "0,0.7", lo, hi)


def grid(budgets: Sequence[int], topk_caps: Sequence[int], inventory: tuple[int, int] | None) -> list[TuneConfig]:
    """DFlash first, then each budget × cap with cap ≤ budget (a cap above the budget is the same tree
    as cap = budget, which the grid holds when the budget is one of the caps), smaller trees first;
    the inventory's config joins (marked) whether or not the grid has it."""
    configs = [DFLASH]
    seen: set[tuple[int, int]] = set()
    for b in sorted(budgets):
        for k in sorted(topk_caps):
            if k <= b and (b, k) not in seen:
                seen.add((b, k))
                configs.append(TuneConfig(b, k, inventory=(b, k) == inventory))
    if inventory is not None and inventory not in seen:
        configs.append(TuneConfig(*inventory, inventory=True))
    return configs


def as_flag(values: Sequence[float]) -> str:
    """(4, 8, 16) → "4,8,16": a default as its flag is written."""
    return ",".join(f"{v:g}" for v in values)


def workload_label(concurrency: int, temperature: float) -> str:
    return f"c{concurrency} T{temperature:g}"


def workloads(base: Workload, concurrencies: Sequence[int], temperatures: Sequence[float],
              duration_s: float) -> list[Workload]:
    """The perf gate's workload (its prompts, tokens, top-p, timeout) at each concurrency × temperature,
    `duration_s` per measurement, at least two requests per stream."""
    for c in concurrencies:
        if not 1 <= c <= CONCURRENCY_MAX:
            raise InputError(f"--concurrency: {c} is out of range 1..{CONCURRENCY_MAX}")
    return [dataclasses.replace(base, concurrency=c, temperature=t, duration_s=duration_s, min_requests=2 * c)
            for c in sorted(concurrencies) for t in sorted(temperatures)]


@dataclass(frozen=True)
class HostPlan:
    host: str
    configs: tuple[TuneConfig, ...]  # in the order they are applied

    @property
    def deploys(self) -> int:
        return sum(not c.dflash for c in self.configs)


def assign(configs: Sequence[TuneConfig], hosts: Sequence[str], on_original: Sequence[str]) -> list[HostPlan]:
    """The configs spread over `hosts`: the DFlash control first to a host in `on_original` (those
    running their original files: measured as they are, no restart), dropped when there is none (the
    caller reports it); then each DDTree config to the host with the fewest configs so far, none
    getting more than ceil(DDTree configs / hosts) deploys. Pure; deterministic for the same
    arguments."""
    if not hosts:
        raise InputError("tune: no host selected")
    plans: dict[str, list[TuneConfig]] = {h: [] for h in hosts}
    dflash = [c for c in configs if c.dflash]
    if dflash:
        home = next((h for h in hosts if h in on_original), None)
        if home is not None:
            plans[home].append(dflash[0])
    trees = [c for c in configs if not c.dflash]
    cap = math.ceil(len(trees) / len(hosts))  # deploys per host, at most

    def deploys(n: str) -> int:
        return sum(not x.dflash for x in plans[n])
    # Deal each to the host with the least to do so far (the DFlash control is measuring time too),
    # never past `cap` deploys: the hosts finish at about the same time.
    for c in trees:
        h = min((n for n in hosts if deploys(n) < cap), key=lambda n: (len(plans[n]), deploys(n), hosts.index(n)))
        plans[h].append(c)
    return [HostPlan(h, tuple(plans[h])) for h in hosts]
