"""`ddtree-ops metrics`: what `status` knows, as Prometheus text exposition (format 0.0.4).

Every metric is a gauge with a `host` label; strings (release, rollout, patch set, bundle) are
labels of one `_info` series of value 1, as node exporter's own info metrics are. A value status
does not know (an unreachable host's budget, a release without a perf-gate record) is left out,
never written as 0: an alert on "budget == 0" must not fire for a host nobody could read.
Label values come from hosts: they are cut to MAX_LABEL_CHARS, made terminal-safe and escaped
(backslash, double quote, newline). `metrics --out` writes through config/atomic_file.py: node
exporter's textfile collector must never read half a file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from ..config.terminal import terminal_safe
from ..gates.perfgate import Verdict

PREFIX = "ddtree_ops_"
MAX_LABEL_CHARS = 200

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Sample:
    labels: Labels
    value: float


@dataclass
class Family:
    name: str
    help: str
    samples: list[Sample] = field(default_factory=list)


def escape_label(value: Any) -> str:
    """A label value as the exposition writes it; control and format characters first shown as
    their escapes (terminal_safe), since the text is printed on a terminal as well as scraped."""
    text = terminal_safe(str(value)[:MAX_LABEL_CHARS])
    return text.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def render(families: Iterable[Family]) -> str:
    """The exposition text: HELP and TYPE before each family's samples; an empty family is left out."""
    out = []
    for fam in families:
        if not fam.samples:
            continue
        out += [f"# HELP {fam.name} {escape_help(fam.help)}", f"# TYPE {fam.name} gauge"]
        for s in fam.samples:
            labels = ",".join(f'{k}="{escape_label(v)}"' for k, v in s.labels)
            out.append(f"{fam.name}{{{labels}}} {_number(s.value)}" if labels else f"{fam.name} {_number(s.value)}")
    return "\n".join(out) + "\n" if out else ""


# -- from status rows -------------------------------------------------------------------------

def _num(value: Any) -> Optional[float]:
    """A finite number, or None (missing, a string, a bool, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _canary(row: dict[str, Any]) -> dict[str, Any]:
    gate = row.get("perf_gate")
    canary = gate.get("canary") if isinstance(gate, dict) else None
    return canary if isinstance(canary, dict) else {}


def _verdict(row: dict[str, Any]) -> Optional[str]:
    gate = row.get("perf_gate")
    v = gate.get("verdict") if isinstance(gate, dict) else None
    return v if v in {x.value for x in Verdict} else None


def _healthy(row: dict[str, Any]) -> Optional[float]:
    if row.get("node_rank") and row["node_rank"] >= 1:  # only rank 0 serves HTTP
        return None
    return 1.0 if row.get("health") == 200 else 0.0


def _text(value: Any) -> str:
    return "" if value is None else str(value)


FAMILIES: tuple[tuple[str, str], ...] = (
    ("host_reachable", "1 when the host answered over SSH and its agent ran."),
    ("host_healthy", "1 when the server's /health answered 200 (rank 0 of a server only)."),
    ("host_ok", "1 when status found the host reachable, without drift and healthy (its exit code 0)."),
    ("host_drift_files", "Files whose sha256 differs from what the current release installed."),
    ("host_config_drift", "Settings the host runs that differ from the inventory (patch set, budget, topk, "
                          "unit, flags)."),
    ("host_release_info", "The current release (value 1): release, rollout, patch set, bundle, algorithm, unit."),
    ("host_budget", "Draft nodes per step in the active unit's ExecStart."),
    ("host_topk_cap", "Candidates per depth in the active unit's ExecStart."),
    ("host_accept_length", "Average speculative accept length the server reports (/server_info)."),
    ("perf_gate_accept_length", "Accept length the current release's canary measured in its performance gate."),
    ("perf_gate_output_tokens_per_second", "Output tokens per second the current release's canary measured "
                                           "in its performance gate."),
    ("perf_gate_verdict", "The current release's performance-gate verdict: 1 for the verdict it got, 0 for "
                          "the others."),
    ("host_status_seconds", "Seconds status took to read the host."),
)


def _values(row: dict[str, Any]) -> dict[str, list[tuple[Labels, Optional[float]]]]:
    """Each family's (extra labels, value) for one status row."""
    reachable = bool(row.get("reachable"))
    canary = _canary(row)
    verdict = _verdict(row)
    info: Labels = (("release", _text(row.get("release"))), ("rollout", _text(row.get("rollout"))),
                    ("patchset", _text(row.get("patchset"))), ("bundle", _text(row.get("bundle"))),
                    ("algorithm", _text(row.get("algorithm"))), ("unit", _text(row.get("active_unit"))))
    return {
        "host_reachable": [((), 1.0 if reachable else 0.0)],
        "host_healthy": [((), _healthy(row))],
        "host_ok": [((), 1.0 if row.get("ok") else 0.0)],
        "host_drift_files": [((), float(len(row.get("drift") or [])) if reachable else None)],
        "host_config_drift": [((), float(len(row.get("config_drift") or [])) if reachable else None)],
        "host_release_info": [(info, 1.0 if reachable else None)],
        "host_budget": [((), _num(row.get("budget")))],
        "host_topk_cap": [((), _num(row.get("topk_cap")))],
        "host_accept_length": [((), _num(row.get("avg_accept_length")))],
        "perf_gate_accept_length": [((), _num(canary.get("accept_length")))],
        "perf_gate_output_tokens_per_second": [((), _num(canary.get("output_tps")))],
        "perf_gate_verdict": [((("verdict", v.value),), (1.0 if v.value == verdict else 0.0) if verdict else None)
                              for v in Verdict],
        "host_status_seconds": [((), _num(row.get("seconds")))],
    }


def status_families(rows: list[dict[str, Any]]) -> list[Family]:
    """The metric families of `status` rows, samples in the rows' order."""
    families = {name: Family(PREFIX + name, text) for name, text in FAMILIES}
    for row in rows:
        for name, values in _values(row).items():
            for extra, value in values:
                if value is not None:
                    families[name].samples.append(Sample((("host", _text(row.get("host"))),) + extra, value))
    return list(families.values())


def status_exposition(rows: list[dict[str, Any]]) -> str:
    return render(status_families(rows))


