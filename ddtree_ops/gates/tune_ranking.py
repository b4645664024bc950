"""`ddtree-ops tune`'s judgement, pure: when a config's measurement is steady enough to rank, which
config wins each workload, by how much, and which one config to pick for the fleet.

  stop_repeating(samples, rule)      measure again, or rank what there is
  summarise(samples)                 a config's figures over its repeats (means, spread)
  winners(rows, objective)           per workload: the best config and its gains over DFlash and over
                                     the inventory's config, each with an interval
  pick(rows, winners, objective)     the one config to write or keep: best geometric mean over workloads

The noise model is deliberately plain. Each repeat of a workload is an independent measurement of
tok/s; a config's figure is the mean of its repeats and its uncertainty the relative half-range
(max − min) / 2 / mean. Two repeats are the least that shows any spread, so a row is measured at
least `min_repeats` times and again until the half-range is at most `max_spread` (3 % by default)
or `max_repeats` is reached; a row that never got steady is kept and ranked, but its winner is
flagged. A gain a/b is given with the interval [a_low / b_high, a_high / b_low] of the two
half-ranges, so "1.42x (1.35-1.49)"; a winner is *ranked* only when its low end is above the
runner-up's high end (the two intervals do not overlap), otherwise it is "within noise" of it and
the note says so. Half-ranges of 2-5 samples are wide on purpose: on a noisy machine they would
rather say "tie" than invent a winner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .workload import Measurement

DEFAULT_MIN_REPEATS = 2
DEFAULT_MAX_REPEATS = 5
DEFAULT_MAX_SPREAD = 0.03


@dataclass(frozen=True)
class RepeatRule:
    min_repeats: int = DEFAULT_MIN_REPEATS
    max_repeats: int = DEFAULT_MAX_REPEATS
    max_spread: float = DEFAULT_MAX_SPREAD  # relative half-range of tok/s that is steady enough


@dataclass(frozen=True)
class Objective:
    """What "best" means: the highest output tok/s, among the configs whose p99 TTFT and p99
    inter-token latency (each the worst over its repeats) are within the bounds given."""

    ttft_p99_max_s: float | None = None
    itl_p99_max_s: float | None = None

    @property
    def kind(self) -> str:
        bounded = self.ttft_p99_max_s is not None or self.itl_p99_max_s is not None
        return "throughput, latency-bounded" if bounded else "throughput"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "ttft_p99_max_s": self.ttft_p99_max_s, "itl_p99_max_s": self.itl_p99_max_s}

    def violation(self, row: Mapping[str, Any]) -> str | None:
        """Why `row` is out of bounds, or None."""
        ttft, itl = row.get("ttft_p99_s"), row.get("itl_p99_s")
        if self.ttft_p99_max_s is not None and (ttft is None or ttft > self.ttft_p99_max_s):
            return f"TTFT p99 {_ms(ttft)} over the bound {_ms(self.ttft_p99_max_s)}"
        if self.itl_p99_max_s is not None and (itl is None or itl > self.itl_p99_max_s):
            return f"ITL p99 {_ms(itl)} over the bound {_ms(self.itl_p99_max_s)}"
        return None


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.1f} ms"


def half_range(values: Sequence[float]) -> float | None:
    """(max − min) / 2 / mean; None for fewer than two values or a zero mean."""
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return (max(values) - min(values)) / 2 / mean if mean > 0 else None


def stop_repeating(tok_s: Sequence[float], rule: RepeatRule = RepeatRule()) -> bool:
    """True when the samples so far are enough: `max_repeats` of them, or at least `min_repeats`
    whose half-range is within `max_spread`."""
    n = len(tok_s)
    if n >= rule.max_repeats:
        return True
    if n < max(1, rule.min_repeats):
        return False
    spread = half_range(tok_s)
    return spread is None or spread <= rule.max_spread


def _mean(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return sum(got) / len(got) if got else None


def _worst(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return max(got) if got else None


def summarise(samples: Sequence[Measurement]) -> dict[str, Any]:
    """A row's figures over its repeats: mean tok/s and accept length, the latencies' p50 as a mean and
    their p99 as the worst repeat (a tail bound should hold in every repeat), errors summed."""
    tps = [m.output_tps for m in samples]
    requests = sum(m.requests for m in samples)
    errors = sum(m.errors for m in samples)
    return {
        "tok_s": _mean(tps), "tok_s_spread": half_range(tps), "repeats": len(samples),
        "samples_tok_s": [round(x, 3) for x in tps],
        "accept_length": _mean(m.accept_length for m in samples),
        "ttft_p50_s": _mean(m.ttft_p50_s for m in samples), "ttft_p99_s": _worst(m.ttft_p99_s for m in samples),
        "itl_p50_s": _mean(m.itl_p50_s for m in samples), "itl_p99_s": _worst(m.itl_p99_s for m in samples),
        "requests": requests, "errors": errors, "error_rate": errors / requests if requests else 0.0,
    }


# --------------------------------------------------------------------------- winners


@dataclass(frozen=True)
class Gain:
    ratio: float
    low: float
    high: float

    def as_dict(self) -> dict[str, float]:
        return {"ratio": round(self.ratio, 4), "low": round(self.low, 4), "high": round(self.high, 4)}

    def text(self) -> str:
        return f"{self.ratio:.2f}x ({self.low:.2f}-{self.high:.2f})"


def _bounds(row: Mapping[str, Any]) -> tuple[float, float]:
    tps = float(row["tok_s"])
    s = row.get("tok_s_spread") or 0.0
    return tps * (1 - s), tps * (1 + s)


def gain(row: Mapping[str, Any], over: Mapping[str, Any] | None) -> Gain | None:
    """`row`'s tok/s over `over`'s, with the interval of their half-ranges; None without a reference."""
    if over is None or not over.get("tok_s") or row.get("tok_s") is None:
        return None
    a_lo, a_hi = _bounds(row)
    b_lo, b_hi = _bounds(over)
    return Gain(row["tok_s"] / over["tok_s"], a_lo / b_hi, a_hi / b_lo if b_lo > 0 else math.inf)


def workload_key(row: Mapping[str, Any]) -> tuple[int, float]:
    return int(row["concurrency"]), float(row["temperature"])


@dataclass
class Winner:
    workload: str
    concurrency: int
    temperature: float
    row: Mapping[str, Any] | None
    vs_dflash: Gain | None = None
    vs_inventory: Gain | None = None
    ranked: bool = False
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        r = self.row or {}
        return {"workload": self.workload, "concurrency": self.concurrency, "temperature": self.temperature,
                "config": r.get("config"), "kind": r.get("kind"), "budget": r.get("budget"),
                "topk_cap": r.get("topk_cap"), "tok_s": r.get("tok_s"), "accept_length": r.get("accept_length"),
                "vs_dflash": self.vs_dflash.as_dict() if self.vs_dflash else None,
                "vs_inventory": self.vs_inventory.as_dict() if self.vs_inventory else None,
                "ranked": self.ranked, "note": "; ".join(self.notes) or None}


def _eligible(rows: Iterable[Mapping[str, Any]], objective: Objective) -> list[Mapping[str, Any]]:
    return [r for r in rows if r.get("status") == "ok" and r.get("tok_s") is not None
            and objective.violation(r) is None]


def winners(rows: Sequence[Mapping[str, Any]], objective: Objective = Objective()) -> list[Winner]:
    """One winner per workload (in the order the workloads first appear): the eligible row (ok, within
    the objective's bounds) with the highest mean tok/s; ties go to the smaller tree (less memory, less
    to go wrong), DFlash first."""
    order: list[tuple[int, float]] = []
    by_workload: dict[tuple[int, float], list[Mapping[str, Any]]] = {}
    for r in rows:
        k = workload_key(r)
        if k not in by_workload:
            order.append(k)
        by_workload.setdefault(k, []).append(r)
    out: list[Winner] = []
    for k in order:
        group = by_workload[k]
        name = group[0].get("workload") or f"c{k[0]} T{k[1]:g}"
        ok = sorted(_eligible(group, objective),
                    key=lambda r: (-r["tok_s"], r.get("kind") != "dflash", r.get("budget") or 0,
                                   r.get("topk_cap") or 0))
        w = Winner(name, k[0], k[1], ok[0] if ok else None)
        if not ok:
            w.notes.append("no config measured within the objective" if any(r.get("status") == "ok" for r in group)
                           else "no config measured")
            out.append(w)
            continue
        best = ok[0]
        dflash = next((r for r in group if r.get("kind") == "dflash" and r.get("status") == "ok"), None)
        inventory = next((r for r in group if r.get("inventory") and r.get("status") == "ok"), None)
        w.vs_dflash = gain(best, dflash) if best is not dflash else None
        w.vs_inventory = gain(best, inventory) if best is not inventory else None
        if len(ok) == 1:
            w.ranked = True
        else:
            second = ok[1]
            w.ranked = _bounds(best)[0] > _bounds(second)[1]
            if not w.ranked:
                w.notes.append(f"within noise of {second.get('config')} ({second['tok_s']:.1f} tok/s): "
                               f"measure longer (--duration) or more often to separate them")
        if (best.get("tok_s_spread") or 0) > DEFAULT_MAX_SPREAD and (best.get("repeats") or 0) >= 2:
            w.notes.append(f"its tok/s never got steady (±{best['tok_s_spread'] * 100:.1f} % over "
                           f"{best['repeats']} repeats)")
        if best is inventory:
            w.notes.append("the inventory's config already wins")
        out.append(w)
    return out


def pick(rows: Sequence[Mapping[str, Any]], objective: Objective = Objective()) -> dict[str, Any] | None:
    """The one DDTree config to write or keep for every workload at once: among configs measured ok
    and within bounds in *every* workload, the highest geometric mean of tok/s relative to each
    workload's best tree (so no workload's scale dominates). None when no config qualifies."""
    keys = sorted({workload_key(r) for r in rows})
    trees = [r for r in _eligible(rows, objective) if r.get("kind") == "ddtree"]
    best_tps = {k: max((r["tok_s"] for r in trees if workload_key(r) == k), default=None) for k in keys}
    if not keys or any(v is None for v in best_tps.values()):
        return None
    per_config: dict[str, dict[tuple[int, float], Mapping[str, Any]]] = {}
    for r in trees:
        per_config.setdefault(r["config"], {})[workload_key(r)] = r
    scored = []
    for config, by_key in per_config.items():
        if set(by_key) != set(keys):
            continue
        score = math.exp(sum(math.log(by_key[k]["tok_s"] / best_tps[k]) for k in keys) / len(keys))
        any_row = next(iter(by_key.values()))
        scored.append((score, any_row.get("budget") or 0, any_row.get("topk_cap") or 0, config, any_row))
    if not scored:
        return None
    scored.sort(key=lambda s: (-s[0], s[1], s[2]))
    score, _, _, config, row = scored[0]
    return {"config": config, "budget": row.get("budget"), "topk_cap": row.get("topk_cap"),
            "score": round(score, 4),
            "why": f"the highest geometric mean over the {len(keys)} workloads of tok/s relative to each "
                   f"workload's best tree ({score * 100:.1f} %)"}
