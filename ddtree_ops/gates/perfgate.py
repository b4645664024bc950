"""The canary performance gate: measure a fixed workload, compare it with a baseline, give a verdict.

A deploy changes the speculative-decoding modules of an SGLang 0.5.23 server, so "healthy" (the
health gate) is not enough: a release can answer every request and still be slower or accept
fewer draft tokens. Like Argo Rollouts' analysis with Kayenta, the gate runs the same workload
against the server before the change (baseline) and after it (canary), and in a rollout also
against peers not yet updated, and compares metric by metric: pass, marginal or fail.

The workload and its measurement are in workload.py, the settings (`Thresholds`, `perf_gate:`)
in config/perfgate_settings.py; here, pure functions of measurements:

  compare(...)                 the verdict per metric and overall, with reasons

Thresholds (defaults; `compare` documents the rules):

  metric            better   marginal when          fail when              ignored when the change is
  output tok/s      higher   drop > 3 %             drop > 10 %            ≤ 1 tok/s
  TTFT p50          lower    rise > 10 %            rise > 25 %            ≤ 20 ms
  TTFT p99          lower    rise > 20 %            rise > 50 %            ≤ 20 ms
  ITL p50           lower    rise > 10 %            rise > 25 %            ≤ 2 ms
  ITL p99           lower    rise > 20 %            rise > 50 %            ≤ 2 ms
  error rate        lower    > 0 and > reference    > 1 % (absolute)       -
  accept length     higher   drop > 5 %             drop > 15 %            ≤ 0.1 tokens
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from ..config.perfgate_settings import Thresholds
from .workload import Measurement

# --------------------------------------------------------------------------- verdicts

class Verdict(str, enum.Enum):
    """A metric's or the gate's result; ordered pass < marginal < fail."""

    PASS = "pass"
    MARGINAL = "marginal"
    FAIL = "fail"

    @property
    def rank(self) -> int:
        return _RANK[self]

    def __str__(self) -> str:
        return self.value


_RANK = {Verdict.PASS: 0, Verdict.MARGINAL: 1, Verdict.FAIL: 2}


def worst(verdicts: Iterable[Verdict]) -> Verdict:
    return max(verdicts, key=lambda v: v.rank, default=Verdict.PASS)


def _minus(text: str) -> str:
    return text.replace("-", "−")


def _pct(x: float) -> str:
    return _minus(f"{x * 100:+.1f} %")


def _limit_pct(x: float, sign: str) -> str:
    return f"{sign}{x * 100:g} %"


def _fmt_tps(v: float) -> str:
    return f"{v:.1f}"


def _fmt_s(v: float) -> str:
    return f"{v * 1000:.1f} ms"


def _fmt_rate(v: float) -> str:
    return f"{v * 100:.1f} %"


def _fmt_accept(v: float) -> str:
    return f"{v:.2f}"


@dataclass(frozen=True)
class _Metric:
    key: str  # Measurement attribute and the row's "metric"
    label: str
    higher_is_better: bool
    fmt: Callable[[float], str]
    marginal: str  # Thresholds attribute names
    fail: str
    floor: str | None
    floor_fmt: Callable[[float], str] = _fmt_tps


_METRICS: tuple[_Metric, ...] = (
    _Metric("output_tps", "output tok/s", True, _fmt_tps, "marginal_drop", "fail_drop", "tps_floor",
            lambda v: f"{v:g} tok/s"),
    _Metric("ttft_p50_s", "TTFT p50", False, _fmt_s, "ttft_p50_marginal", "ttft_p50_fail", "ttft_floor_s", _fmt_s),
    _Metric("ttft_p99_s", "TTFT p99", False, _fmt_s, "ttft_p99_marginal", "ttft_p99_fail", "ttft_floor_s", _fmt_s),
    _Metric("itl_p50_s", "ITL p50", False, _fmt_s, "itl_p50_marginal", "itl_p50_fail", "itl_floor_s", _fmt_s),
    _Metric("itl_p99_s", "ITL p99", False, _fmt_s, "itl_p99_marginal", "itl_p99_fail", "itl_floor_s", _fmt_s),
    _Metric("error_rate", "error rate", False, _fmt_rate, "error_rate_marginal", "error_rate_fail", None),
    _Metric("accept_length", "accept length", True, _fmt_accept, "accept_marginal_drop", "accept_fail_drop",
            "accept_floor", lambda v: f"{v:g}"),
)


@dataclass(frozen=True)
class GateRow:
    """One metric. `change` is the canary's relative change against the reference that decided
    the verdict (`against`: "baseline" or "peers"): (canary − ref) / ref; for error_rate the
    absolute difference canary − ref. None when there is nothing to compare."""

    metric: str
    label: str
    baseline: float | None
    canary: float | None
    peers: float | None
    change: float | None
    against: str
    verdict: Verdict
    limit: str
    reason: str | None  # why it is not "pass"

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "label": self.label, "baseline": self.baseline, "canary": self.canary,
                "peers": self.peers, "change": self.change, "against": self.against,
                "verdict": self.verdict.value, "limit": self.limit}


@dataclass(frozen=True)
class GateVerdict:
    """The gate's result: the worst row's verdict, the rows, and a reason per non-pass row."""

    verdict: Verdict
    baseline: Measurement
    canary: Measurement
    peers: Measurement | None
    rows: tuple[GateRow, ...]
    reasons: tuple[str, ...]
    thresholds: Thresholds = field(default_factory=Thresholds)

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict.value, "baseline": self.baseline.as_dict(),
                "canary": self.canary.as_dict(), "peers": self.peers.as_dict() if self.peers else None,
                "rows": [r.as_dict() for r in self.rows], "reasons": list(self.reasons),
                "thresholds": self.thresholds.as_dict()}

    def summary(self) -> str:
        """One line: the verdict and its first reason, e.g.
        "fail: output tok/s 212.0 → 150.3 (−29.1 %, limit −10 %) (+1 more)"."""
        if self.reasons:
            more = f" (+{len(self.reasons) - 1} more)" if len(self.reasons) > 1 else ""
            return f"{self.verdict.value}: {self.reasons[0]}{more}"
        tps = next(r for r in self.rows if r.metric == "output_tps")
        change = f" ({_pct(tps.change)})" if tps.change is not None else ""
        ref = tps.peers if tps.against == "peers" else tps.baseline
        was = _fmt_tps(ref) if ref is not None else "n/a"
        return (f"{self.verdict.value}: output tok/s {was} → {_fmt_tps(tps.canary or 0.0)}{change}; "
                f"all {len(self.rows)} metrics within limits")


def _limit_text(m: _Metric, t: Thresholds) -> str:
    marginal, fail = getattr(t, m.marginal), getattr(t, m.fail)
    if m.key == "error_rate":
        return f"marginal > {_limit_pct(marginal, '')} and above reference, fail > {_limit_pct(fail, '')}"
    sign = "−" if m.higher_is_better else "+"
    floor = f", changes ≤ {m.floor_fmt(getattr(t, m.floor))} ignored" if m.floor else ""
    return f"marginal {_limit_pct(marginal, sign)}, fail {_limit_pct(fail, sign)}{floor}"


def _judge(m: _Metric, t: Thresholds, ref: float | None, canary: float | None
           ) -> tuple[Verdict, float | None, str | None]:
    """(verdict, change, crossed limit) of `canary` against `ref` for one metric."""
    marginal, fail = getattr(t, m.marginal), getattr(t, m.fail)
    if m.key == "error_rate":
        assert canary is not None and ref is not None
        if canary > fail:
            return Verdict.FAIL, canary - ref, _limit_pct(fail, "")
        if canary > marginal and canary > ref:
            return Verdict.MARGINAL, canary - ref, f"{_limit_pct(marginal, '')} and above reference"
        return Verdict.PASS, canary - ref, None
    if ref is None:
        return Verdict.PASS, None, None  # nothing to compare with (e.g. no speculative decoding before)
    if canary is None:
        return Verdict.FAIL, None, "no canary value"
    change = (canary - ref) / ref if ref else None
    floor = getattr(t, m.floor) if m.floor else 0.0
    if m.higher_is_better:
        if ref - canary <= floor:
            return Verdict.PASS, change, None
        if canary < ref * (1 - fail):
            return Verdict.FAIL, change, _limit_pct(fail, "−")
        if canary < ref * (1 - marginal):
            return Verdict.MARGINAL, change, _limit_pct(marginal, "−")
        return Verdict.PASS, change, None
    if canary - ref <= floor:
        return Verdict.PASS, change, None
    if canary > ref * (1 + fail):
        return Verdict.FAIL, change, _limit_pct(fail, "+")
    if canary > ref * (1 + marginal):
        return Verdict.MARGINAL, change, _limit_pct(marginal, "+")
    return Verdict.PASS, change, None


def _reason(m: _Metric, against: str, ref: float | None, canary: float | None, change: float | None,
            limit: str) -> str:
    if canary is None:
        if m.key == "accept_length":
            return f"accept length: the canary reports no spec_accept_length ({against} had " \
                   f"{_fmt_accept(ref or 0.0)}; speculative decoding off?)"
        return f"{m.label}: no canary value (no successful request)"
    was = m.fmt(ref) if ref is not None else "n/a"
    frm = f"{was} → {m.fmt(canary)}" if against == "baseline" else f"peers {was} → canary {m.fmt(canary)}"
    if m.key == "error_rate":
        return f"{m.label} {frm} (limit {limit})"
    ch = f"{_pct(change)}, " if change is not None else ""
    return f"{m.label} {frm} ({ch}limit {limit})"


def compare(baseline: Measurement, canary: Measurement, thresholds: Thresholds | None = None, *,
            peers: Measurement | None = None) -> GateVerdict:
    """The gate's verdict on `canary` (the server after the change).

    Each metric is judged against the baseline (the same server before the change) and, when
    `peers` is given (servers not yet updated, measured at about the same time as the canary),
    also against the peers; the worse of the two verdicts counts, so a canary must hold up both
    to its own past and to the fleet's present (a baseline measured on a quiet cluster cannot
    hide a regression, and neither can a slow peer). Ties go to the baseline. Rules per metric:

    - a higher-is-better metric (output tok/s, accept length) fails when
      canary < ref × (1 − fail limit), is marginal when canary < ref × (1 − marginal limit);
    - a lower-is-better latency fails when canary > ref × (1 + fail limit), marginal likewise;
    - a change at or under the metric's floor (Thresholds.*_floor*) is always a pass;
    - the error rate fails above error_rate_fail whatever the reference had, and is marginal
      above error_rate_marginal when it is also above the reference's rate;
    - a reference without a value (no successful request; no speculative decoding) passes the
      metric, there being nothing to compare; a canary without a value where the reference had
      one fails it (a canary without spec_accept_length runs without speculative decoding).

    The overall verdict is the worst row's. Whether the measurements were complete
    (`Measurement.stopped`) is the caller's to check."""
    t = thresholds or Thresholds()
    rows: list[GateRow] = []
    fails: list[str] = []
    marginals: list[str] = []
    for m in _METRICS:
        b, c = getattr(baseline, m.key), getattr(canary, m.key)
        p = getattr(peers, m.key) if peers is not None else None
        verdict, change, crossed = _judge(m, t, b, c)
        against, ref = "baseline", b
        if peers is not None:
            pv, pchange, pcrossed = _judge(m, t, p, c)
            if pv.rank > verdict.rank:
                verdict, change, crossed, against, ref = pv, pchange, pcrossed, "peers", p
        reason = None
        if verdict is not Verdict.PASS:
            reason = _reason(m, against, ref, c, change, crossed or "")
            (fails if verdict is Verdict.FAIL else marginals).append(reason)
        rows.append(GateRow(m.key, m.label, b, c, p, change, against, verdict, _limit_text(m, t), reason))
    return GateVerdict(worst(r.verdict for r in rows), baseline, canary, peers, tuple(rows),
                       tuple(fails + marginals), t)


def format_rows(rows: Sequence[GateRow]) -> str:
    """A plain-text table of `rows` (metric, baseline, canary, peers, change, verdict, limit)."""
    by_key = {m.key: m for m in _METRICS}
    table = [("metric", "baseline", "canary", "peers", "change", "verdict", "limit")]
    for r in rows:
        m = by_key[r.metric]

        def fmt(v: float | None, m: _Metric = m) -> str:
            return "-" if v is None else m.fmt(v)
        if r.change is None:
            change = "-"
        elif r.metric == "error_rate":
            change = _minus(f"{r.change * 100:+.1f} pp")
        else:
            change = _pct(r.change)
        if r.against == "peers" and r.change is not None:
            change += " vs peers"
        table.append((r.label, fmt(r.baseline), fmt(r.canary), fmt(r.peers), change, r.verdict.value, r.limit))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    return "\n".join("  ".join([c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)] + [row[-1]]).rstrip()
                     for row in table)
