"""The perf gate's settings as the inventory writes them (`perf_gate:`): whether the canary is
measured, with which workloads, and the thresholds of its verdict.

  Thresholds                   when a metric is marginal or failing (the rules: gates/perfgate.py)
  PerfGateSettings             enabled, workloads, thresholds, compare_peers
  parse_perf_gate(doc, where)  the inventory's `perf_gate` mapping, validated

Workloads. `perf_gate.workloads` is a list of cases, each a mapping of the workload keys
(concurrency, max_new_tokens, temperature, top_p, duration_s, min_requests, request_timeout_s)
and an optional `name`; the same keys at the top of `perf_gate` are every entry's defaults (and
`prompts_file` is shared). Without `workloads`:

  - the top level sets `concurrency` or `temperature`: it describes its one workload, and that
    one is measured (an inventory written before `workloads` existed gates as it did);
  - otherwise: DEFAULT_WORKLOADS, today's concurrency-4 T 0.7 case and a batch-1 greedy case
    (concurrency 1, temperature 0), both with the top level's other keys.

An empty list and the same case twice (concurrency, max_new_tokens, temperature and top_p alike)
are refused, as are two entries of one name.

Settings only: measuring is gates/workload.py, the verdict gates/perfgate.py.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from ..errors import InputError, shown
from .schema import Field, Invalid, boolean, int_range, mapping, number_range
from .workload_settings import (
    CONCURRENCY_MAX,
    DEFAULT_CONCURRENCY,
    DEFAULT_DURATION_S,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MIN_REQUESTS,
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    DEFAULT_WORKLOADS,
    Workload,
    load_prompts,
)

# Thresholds. Drops and rises are relative to the reference (baseline or peers); floors are
# absolute and a change at or under its floor never counts, so noise on small numbers (TTFT
# 2 ms → 3 ms is +50 %) cannot fail a release.
MARGINAL_DROP = 0.03  # output tok/s
FAIL_DROP = 0.10
TTFT_P50_MARGINAL = 0.10
TTFT_P50_FAIL = 0.25
TTFT_P99_MARGINAL = 0.20  # tails are noisier: p99 of ~100 requests is close to their maximum
TTFT_P99_FAIL = 0.50
ITL_P50_MARGINAL = 0.10
ITL_P50_FAIL = 0.25
ITL_P99_MARGINAL = 0.20
ITL_P99_FAIL = 0.50
ERROR_RATE_MARGINAL = 0.0  # absolute: any error the reference did not have is marginal
ERROR_RATE_FAIL = 0.01  # absolute: above 1 % fails whatever the reference had
ACCEPT_MARGINAL_DROP = 0.05  # mean spec_accept_length
ACCEPT_FAIL_DROP = 0.15
TPS_FLOOR = 1.0  # tok/s
TTFT_FLOOR_S = 0.020  # TTFT includes queueing and prefill: tens of ms of jitter are normal
ITL_FLOOR_S = 0.002
ACCEPT_FLOOR = 0.1  # tokens per verify step


@dataclass(frozen=True)
class Thresholds:
    """When the canary is marginal or failing, metric by metric (the table in gates/perfgate.py's
    docstring).

    Relative limits are fractions of the reference: output tok/s fails when
    canary < reference × (1 − fail_drop); a latency fails when canary > reference × (1 + *_fail).
    A change at or under the metric's absolute floor never counts. The error rate is absolute:
    fail above `error_rate_fail`; marginal above `error_rate_marginal` when it is also above the
    reference's rate."""

    marginal_drop: float = MARGINAL_DROP
    fail_drop: float = FAIL_DROP
    ttft_p50_marginal: float = TTFT_P50_MARGINAL
    ttft_p50_fail: float = TTFT_P50_FAIL
    ttft_p99_marginal: float = TTFT_P99_MARGINAL
    ttft_p99_fail: float = TTFT_P99_FAIL
    itl_p50_marginal: float = ITL_P50_MARGINAL
    itl_p50_fail: float = ITL_P50_FAIL
    itl_p99_marginal: float = ITL_P99_MARGINAL
    itl_p99_fail: float = ITL_P99_FAIL
    error_rate_marginal: float = ERROR_RATE_MARGINAL
    error_rate_fail: float = ERROR_RATE_FAIL
    accept_marginal_drop: float = ACCEPT_MARGINAL_DROP
    accept_fail_drop: float = ACCEPT_FAIL_DROP
    tps_floor: float = TPS_FLOOR
    ttft_floor_s: float = TTFT_FLOOR_S
    itl_floor_s: float = ITL_FLOOR_S
    accept_floor: float = ACCEPT_FLOOR

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class PerfGateSettings:
    """The inventory's `perf_gate`. Absent or null: disabled. A mapping: enabled unless it says
    `enabled: false` (writing the section is asking for the gate)."""

    enabled: bool = False
    workloads: tuple[Workload, ...] = DEFAULT_WORKLOADS  # each measured and judged; the worst verdict wins
    thresholds: Thresholds = field(default_factory=Thresholds)
    compare_peers: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "workloads", tuple(self.workloads))
        if not self.workloads:
            raise ValueError("the perf gate needs at least one workload")

    @property
    def workload(self) -> Workload:
        """The first workload (today's case by default): for callers that measure one."""
        return self.workloads[0]


_ratio = number_range(0, 1)  # a share: a drop, an error rate
_increase = number_range(0, 10)  # a latency rise, relative


def _at_most(inner: Callable[[Any, Mapping[str, Any]], float], bound: str) -> Callable[..., float]:
    """`inner`, and ≤ the earlier field `bound` (a marginal limit never beyond its fail limit)."""

    def check(value: Any, done: Mapping[str, Any]) -> float:
        v = inner(value, done)
        if v > done[bound]:
            raise Invalid(f"must be ≤ {bound} ({done[bound]:g}), got {shown(value)}")
        return v
    return check


def _top_p(value: Any, done: Mapping[str, Any]) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise Invalid(f"must be a number > 0 and ≤ 1, got {shown(value)}")
    return float(value)


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 _.:=+-]{0,39}$")


def _workload_name(value: Any, done: Mapping[str, Any]) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value) or value != value.strip():
        raise Invalid(f"must be a short name (1..40 letters, digits, spaces and _.:=+-, starting with a letter "
                      f"or digit), got {shown(value)}")
    return value


def _prompts_file(value: Any, done: Mapping[str, Any]) -> str:
    if not isinstance(value, str) or not value or "\0" in value:
        raise Invalid(f"must be a path to a file of prompts, got {shown(value)}")
    return value


# Fail limits come before their marginal limits: the marginal check reads them.
THRESHOLD_FIELDS: tuple[Field, ...] = (
    Field("fail_drop", _ratio, FAIL_DROP),
    Field("marginal_drop", _at_most(_ratio, "fail_drop"), MARGINAL_DROP),
    Field("ttft_p50_fail", _increase, TTFT_P50_FAIL),
    Field("ttft_p50_marginal", _at_most(_increase, "ttft_p50_fail"), TTFT_P50_MARGINAL),
    Field("ttft_p99_fail", _increase, TTFT_P99_FAIL),
    Field("ttft_p99_marginal", _at_most(_increase, "ttft_p99_fail"), TTFT_P99_MARGINAL),
    Field("itl_p50_fail", _increase, ITL_P50_FAIL),
    Field("itl_p50_marginal", _at_most(_increase, "itl_p50_fail"), ITL_P50_MARGINAL),
    Field("itl_p99_fail", _increase, ITL_P99_FAIL),
    Field("itl_p99_marginal", _at_most(_increase, "itl_p99_fail"), ITL_P99_MARGINAL),
    Field("error_rate_fail", _ratio, ERROR_RATE_FAIL),
    Field("error_rate_marginal", _at_most(_ratio, "error_rate_fail"), ERROR_RATE_MARGINAL),
    Field("accept_fail_drop", _ratio, ACCEPT_FAIL_DROP),
    Field("accept_marginal_drop", _at_most(_ratio, "accept_fail_drop"), ACCEPT_MARGINAL_DROP),
    Field("tps_floor", number_range(0, 1e6), TPS_FLOOR),
    Field("ttft_floor_s", number_range(0, 60), TTFT_FLOOR_S),
    Field("itl_floor_s", number_range(0, 10), ITL_FLOOR_S),
    Field("accept_floor", number_range(0, 100), ACCEPT_FLOOR),
)

PERF_GATE_FIELDS: tuple[Field, ...] = (
    Field("enabled", boolean(), True),
    Field("prompts_file", _prompts_file, None),
    Field("concurrency", int_range(1, CONCURRENCY_MAX), DEFAULT_CONCURRENCY),
    Field("max_new_tokens", int_range(1, 4096), DEFAULT_MAX_NEW_TOKENS),
    Field("temperature", number_range(0, 2), DEFAULT_TEMPERATURE),
    Field("top_p", _top_p, DEFAULT_TOP_P),
    Field("duration_s", number_range(1, 3600), DEFAULT_DURATION_S),
    Field("min_requests", int_range(1, 100_000), DEFAULT_MIN_REQUESTS),
    Field("request_timeout_s", number_range(1, 3600), DEFAULT_REQUEST_TIMEOUT_S),
    Field("compare_peers", boolean(), True),
    Field("thresholds", None),  # a nested table: validated by parse_perf_gate, naming its fields
    Field("workloads", None),  # a list of tables: validated by parse_perf_gate, naming the entry
)

# The keys of one workload: at the top of `perf_gate` (every entry's defaults) and in each entry.
WORKLOAD_KEYS: tuple[str, ...] = ("concurrency", "max_new_tokens", "temperature", "top_p", "duration_s",
                                  "min_requests", "request_timeout_s")
# Set at the top without `workloads`, either one says the operator described their one workload.
_ONE_WORKLOAD_KEYS = ("concurrency", "temperature")


def _mapping(doc: Any, where: str, fields_: Sequence[Field]) -> dict[str, Any]:
    """`doc` (null: empty) validated by `fields_`; InputError naming `where` and the field."""
    try:
        return mapping(fields_, doc)
    except Invalid as e:
        raise InputError(f"{where}{'.' + e.field if e.field else ''}: {e.problem}") from None


def _entry_fields(top: Mapping[str, Any]) -> tuple[Field, ...]:
    """The table of one `workloads` entry: the workload keys, defaulting to the top level's."""
    by_name = {f.name: f for f in PERF_GATE_FIELDS}
    return (Field("name", _workload_name, None),
            *(Field(k, by_name[k].check, top[k]) for k in WORKLOAD_KEYS))


def _workloads(doc: Mapping[str, Any], values: Mapping[str, Any], where: str) -> tuple[Workload, ...]:
    """The cases `doc` asks for (the module's docstring says which), each checked, none twice."""
    top = {k: values[k] for k in WORKLOAD_KEYS}
    entries = doc.get("workloads")
    if entries is None:
        if any(k in doc for k in _ONE_WORKLOAD_KEYS):
            return (Workload(**top),)
        return tuple(replace(w, **{k: v for k, v in top.items() if k not in _ONE_WORKLOAD_KEYS})
                     for w in DEFAULT_WORKLOADS)
    if not isinstance(entries, list) or not entries:
        raise InputError(f"{where}.workloads: must be a non-empty list of workloads (mappings of "
                         f"{', '.join(('name',) + WORKLOAD_KEYS)}), got {shown(entries)}")
    table = _entry_fields(top)
    found: list[Workload] = []
    for i, entry in enumerate(entries):
        at = f"{where}.workloads[{i}]"
        if not isinstance(entry, dict):
            raise InputError(f"{at}: must be a mapping of {', '.join(sorted(f.name for f in table))}, "
                             f"got {shown(entry)}")
        w = Workload(**_mapping(entry, at, table))
        for j, other in enumerate(found):
            if other.case == w.case:
                raise InputError(f"{at}: the same case as workloads[{j}] ({other.label}: concurrency, "
                                 f"max_new_tokens, temperature and top_p alike); measure each case once")
            if w.name is not None and other.name == w.name:
                raise InputError(f"{at}.name: {shown(w.name)} is the name of workloads[{j}] too")
        found.append(w)
    return tuple(found)


def parse_perf_gate(doc: Any, where: str = "perf_gate", *, base_dir: str | None = None) -> PerfGateSettings:
    """The inventory's `perf_gate` mapping as settings; null or absent: the gate disabled.

    Keys: enabled, prompts_file, concurrency, max_new_tokens, temperature, top_p, duration_s,
    min_requests, request_timeout_s, compare_peers, thresholds (the fields of `Thresholds`),
    workloads (a list of the workload keys and `name`; the module's docstring says what its
    absence means).
    A relative `prompts_file` is read from `base_dir` (the inventory's folder), on the
    controller, now: a bad file is refused before any host changes. Raises InputError as
    "<where>.<field>: <problem>", e.g. "perf_gate.thresholds.fail_drop: must be a number 0..1, got 2"."""
    if doc is None:
        return PerfGateSettings()
    values = _mapping(doc, where, PERF_GATE_FIELDS)
    thresholds = Thresholds(**_mapping(doc.get("thresholds"), f"{where}.thresholds", THRESHOLD_FIELDS))
    workloads = _workloads(doc, values, where)
    path = values["prompts_file"]
    if path is not None:
        full = os.path.join(base_dir, os.path.expanduser(path)) if base_dir else os.path.expanduser(path)
        try:
            prompts = load_prompts(full)
        except InputError as e:
            raise InputError(f"{where}.prompts_file: {e}") from None
        workloads = tuple(replace(w, prompts=prompts, prompts_file=full) for w in workloads)
    return PerfGateSettings(enabled=values["enabled"], workloads=workloads, thresholds=thresholds,
                            compare_peers=values["compare_peers"])
