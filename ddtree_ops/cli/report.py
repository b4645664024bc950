"""A rollout as one self-contained HTML page (`deploy --report FILE.html`, `rollback --report ...`).

The page is read after the fact, often away from the machine that ran the rollout (attached to a
ticket, opened from a mail), so it needs nothing but itself: inline CSS, inline SVG, no scripts,
no fonts or images fetched from anywhere. A Content-Security-Policy in the page says the same to
the browser, so even a mistake in escaping could not run a script or reach the network.

Everything in the document is untrusted text (host names, messages, log lines and step details
come from the hosts): every value goes through `_t` (control, format and bidi characters shown as
their escapes by `terminal_safe`, as on the terminal; secrets masked again; then html.escape)
before it reaches the page, in HTML and in SVG alike.

Input: `RolloutResult.to_dict()` (plus optional "patchset" and "bundle"). A step's "t" is the
time at the END of the step, so a phase runs from the previous step's t (or, for the host's first
step, its own t) to its own t.
"""

from __future__ import annotations

import html
import math
import os
import time
from pathlib import Path
from typing import Any

from ..config.atomic_file import write_atomically
from ..config.redaction import scrub
from ..config.terminal import terminal_safe
from ..host.heal_note import HEAL_STEP, healed_notes
from ..runbook.events import StepDone

# -- text --------------------------------------------------------------------------------------

def _clean(value: Any) -> str:
    """A value as plain, displayable text: str(), with control and format characters and lone
    surrogates (which JSON allows and UTF-8 cannot encode) shown as their escapes; newlines and
    tabs kept (a log line's layout)."""
    return terminal_safe("" if value is None else value, keep_newlines=True)


def _t(value: Any, *, secret: bool = False) -> str:
    """Escaped for HTML text and attribute values (quotes too). `secret=True` for text that came
    from a host (messages, logs, details): masked again, whatever built the document."""
    s = _clean(value)
    return html.escape(scrub(s) if secret else s, quote=True)


def _lines(lines: Any) -> list[str]:
    """Log lines, each cleaned on its own (a newline inside one stays a line break; tabs kept)."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    if not isinstance(lines, (list, tuple)):
        return []
    return [scrub(_clean(x)) for x in lines]


def _num(value: Any) -> float | None:
    """A finite number, or None: the document may carry None, text or NaN where a number goes."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _seconds(value: Any) -> str:
    s = _num(value)
    if s is None:
        return "—"
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(s, 60)
    return f"{int(m)} min {sec:04.1f} s" if m < 60 else f"{int(m // 60)} h {int(m % 60):02d} min"


def _utc(ts: float | None) -> str:
    return "—" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def _shorten(s: str, n: int) -> str:
    """Cut before escaping (cutting escaped text could split an entity); the full value goes in a
    <title> next to it."""
    return s if len(s) <= n else s[: n - 1] + "…"


def _plain(value: Any) -> str:
    """patchset / bundle may be a name or a small mapping (name, version, digest): one line."""
    if isinstance(value, dict):
        return ", ".join(f"{k}={_plain(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(_plain(v) for v in value)
    return _clean(value)


# -- colours -----------------------------------------------------------------------------------

# Phases are coloured by what they do, not one colour per step name (twenty hues cannot be told
# apart); each bar also carries its step name as a label or tooltip. Unknown names are "other".
PHASE_GROUPS: list[tuple[str, str, tuple[str, ...]]] = [
    ("prepare", "#4e79a7", ("preflight", "baseline", "backup", "install", "daemon-reload", "launch check")),
    ("drain & stop", "#f28e2b", ("drain", "deregister", "stop conflicts", "stop", "gpus free")),
    ("start & load", "#9c6ade", ("restart", "wait for weights", "starting", "weights", "cuda graphs", "warm-up",
                                 "serving")),
    ("gates", "#59a14f", ("health gate", "perf gate", "soak")),
    ("commit", "#1b7a3e", ("register", "commit", "committed")),
    ("rollback", "#e15759", ("rolled back", HEAL_STEP)),
    ("no change", "#b0b7bf", ("unchanged",)),
]
OTHER_COLOUR = "#8c8c8c"
FAIL_COLOUR = "#c0182b"
_STEP_GROUP = {name: (group, colour) for group, colour, names in PHASE_GROUPS for name in names}

VERDICT_COLOURS = {"pass": "#1b7a3e", "marginal": "#b26b00", "fail": FAIL_COLOUR}
SOURCE_COLOURS = {"baseline": "#9aa5b1", "canary": "#2f6fb5", "peers": "#8a5cc2"}

_OK_OUTCOMES = {"deploy": {"deployed", "unchanged"}, "rollback": {"rolled_back"}}
_WARN_OUTCOMES = {"rolled_back", "reverted", "interrupted", "locked", "refused", "revert_refused"}


def step_group(name: str) -> tuple[str, str]:
    """(group, colour) of a step name. The rollback's own steps ("rollback", "restore",
    "rollback: healthy", ...) are all the rollback's colour, whatever comes after the prefix."""
    if name in _STEP_GROUP:
        return _STEP_GROUP[name]
    if name.startswith("rollback") or name == "restore":
        return _STEP_GROUP["rolled back"]
    return "other", OTHER_COLOUR


def step_colour(name: str) -> str:
    return step_group(name)[1]


# The `rollback` command's own steps, on a host it brought back healthy, are its success, not a
# failure: they take the colour of what they do. A deploy's rollback (the deploy failed) and a
# rollback that did not end healthy keep the rollback's red.
_UNDONE_GROUPS = {"rollback": "prepare", "restore": "prepare", "rollback: restarted": "start & load",
                  "rollback: waiting": "start & load", "rollback: healthy": "gates", "rolled back": "commit"}
_HEALTHY_AGAIN = {"rolled_back", "interrupted"}


def host_step_group(name: str, host: dict, action: str = "deploy") -> tuple[str, str]:
    """(group, colour) of a step of `host`: as `step_group`, except in a `rollback` run the steps
    of a host it brought back healthy (rolled_back; or interrupted, exit 3, having run to its end)."""
    group = step_group(name)
    healthy = _clean(host.get("outcome")) in _HEALTHY_AGAIN and host.get("exit_code") in (0, 3)
    if action != "rollback" or group[0] != "rollback" or not healthy:
        return group
    target = _UNDONE_GROUPS.get(name, "start & load" if name.startswith("rollback: ") else "prepare")
    return target, next(c for g, c, _ in PHASE_GROUPS if g == target)


def _outcome_class(action: str, outcome: str) -> str:
    if outcome in _OK_OUTCOMES.get(action, set()):
        return "good"
    if outcome == "skipped":
        return "muted"
    return "warn" if outcome in _WARN_OUTCOMES else "bad"


def _failed(action: str, host: dict) -> bool:
    """A host whose log a person will want: not a success and not merely skipped."""
    outcome = _clean(host.get("outcome"))
    if outcome == "skipped":
        return False
    return outcome not in _OK_OUTCOMES.get(action, set()) or host.get("exit_code") not in (0, None)


# -- phases ------------------------------------------------------------------------------------

def host_phases(host: dict) -> list[dict[str, Any]]:
    """The host's steps as intervals: [{step, start, end, detail}] in absolute seconds. Steps
    without a usable time are dropped (the document may be partial); order is as recorded."""
    phases: list[dict[str, Any]] = []
    prev: float | None = None
    done = (StepDone.from_record(_clean(host.get("host")), rec) for rec in host.get("steps") or [])
    for st in (s for s in done if s is not None):
        start = st.t if prev is None else min(prev, st.t)  # a clock that stepped back: no negative bar
        phases.append({"step": _clean(st.step) or "?", "start": start, "end": st.t, "detail": st.detail})
        prev = st.t
    return phases


def _run_start(hosts: list[dict]) -> float | None:
    starts = [p[0]["start"] for p in (host_phases(h) for h in hosts) if p]
    return min(starts) if starts else None


def _rollback_from(phases: list[dict]) -> int:
    """Index of the first step of the rollback (len(phases) when there was none)."""
    rollback = _STEP_GROUP["rolled back"]
    return next((i for i, p in enumerate(phases) if step_group(p["step"]) == rollback), len(phases))


def _failed_phase(phases: list[dict], failed_step: str) -> int | None:
    """Which bar is the failed step, when it was recorded at all (a step is recorded when it ends,
    so the one that failed usually is not): the first of that name before the rollback, since
    the rollback may repeat names."""
    if not failed_step:
        return None
    return next((i for i, p in enumerate(phases[:_rollback_from(phases)]) if p["step"] == failed_step), None)


def _nice_step(span: float, ticks: int = 8) -> float:
    """An axis step of 1, 2 or 5 × 10^k giving about `ticks` ticks."""
    raw = max(span / ticks, 1e-9)
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


# -- sections ----------------------------------------------------------------------------------

CSS = """
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color: #1d2329; background: #fff; margin: 0 auto; padding: 24px 32px; max-width: 1360px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px;
     border-bottom: 1px solid #d5dbe1; padding-bottom: 4px; }
h3 { font-size: 15px; margin: 18px 0 6px; } h4 { font-size: 13px; margin: 0 0 4px; }
.badge { display: inline-block; padding: 1px 9px; border-radius: 10px; font-weight: 600;
         font-size: 12px; color: #fff; vertical-align: middle; }
.good { color: #1b7a3e; } .warn { color: #a35a00; } .bad { color: #c0182b; } .muted { color: #6b7580; }
.badge.good, .badge.pass { background: #1b7a3e; color: #fff; }
.badge.warn, .badge.marginal { background: #b26b00; color: #fff; }
.badge.bad, .badge.fail { background: #c0182b; color: #fff; }
.badge.muted, .badge.none { background: #8c96a0; color: #fff; }
table { border-collapse: collapse; margin: 4px 0 8px; }
th, td { text-align: left; padding: 4px 10px; border-bottom: 1px solid #e3e7eb; vertical-align: top; }
th { background: #f3f5f7; font-weight: 600; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.num, td.nowrap { white-space: nowrap; }
table.meta th { background: none; color: #55606b; font-weight: 500; padding-left: 0; }
td.msg { max-width: 520px; overflow-wrap: anywhere; font-size: 12.5px; color: #3b444d; }
.abort { background: #fdecee; border-left: 4px solid #c0182b; padding: 8px 12px; margin: 10px 0; }
.legend span { display: inline-block; margin: 0 14px 4px 0; font-size: 12.5px; }
.legend i { display: inline-block; width: 12px; height: 12px; border-radius: 2px; margin-right: 5px;
            vertical-align: -1px; }
svg { display: block; max-width: 100%; height: auto; font-family: inherit; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(300px, 1fr)); gap: 12px; }
.card { border: 1px solid #e0e5ea; border-radius: 6px; padding: 8px 10px; break-inside: avoid; }
.card .limit { font-size: 12px; color: #55606b; margin-top: 2px; }
pre { background: #f6f8fa; border: 1px solid #e0e5ea; border-radius: 6px; padding: 8px 10px;
      font: 12px/1.4 ui-monospace, "DejaVu Sans Mono", monospace; white-space: pre-wrap;
      overflow-wrap: anywhere; max-height: 480px; overflow: auto; }
details { margin: 4px 0; } summary { cursor: pointer; color: #33506e; }
section.host { break-inside: avoid-page; }
footer { margin-top: 32px; font-size: 12px; color: #6b7580; }
@media print {
  body { padding: 0; max-width: none; font-size: 11px; }
  * { -webkit-print-color-adjust: exact; print-color-adjust: exact; }
  pre { max-height: none; overflow: visible; }
  h2 { break-after: avoid; } .card, table, svg { break-inside: avoid; }
}
"""

# No script, no network: what the page is allowed to do, stated to the browser.
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def _canary_count(doc: dict) -> int:
    """Targets in the canary: the document's "canary" (the CLI writes it), else the CLI's default
    for the action (deploy 1, rollback none)."""
    n = doc.get("canary")
    if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
        return n
    return 0 if _clean(doc.get("action")) == "rollback" else 1


def batch_labels(batches: list[list[Any]], canary: int) -> list[str]:
    """The batches as the CLI names them while it runs (fleet/rollout.py): a batch holding the
    first `canary` targets is "canary", the others "batch 1", "batch 2", ... counted after it."""
    first = {_clean(n) for n in [n for b in batches for n in b][:canary]}
    labels, k = [], 0
    for b in batches:
        if b and _clean(b[0]) in first:
            labels.append("canary")
        else:
            k += 1
            labels.append(f"batch {k}")
    return labels


# exit code → (badge text, class): what the run left, as the README's exit codes say it
_RESULTS = {0: ("OK", "good"), 2: ("REFUSED: nothing changed", "warn"), 3: ("ROLLED BACK: healthy", "warn"),
            4: ("A PERSON MUST LOOK", "bad"), 5: ("LOCKED", "warn")}


def _header(doc: dict, title: str, generated_at: float | None, run_start: float | None) -> str:
    action = _clean(doc.get("action") or "rollout")
    code = doc.get("exit_code")
    text, cls = _RESULTS.get(code, ("FAILED", "bad")) if isinstance(code, int) else ("FAILED", "bad")
    status = f'<span class="badge {cls}">{_t(text)}</span> exit code {_t(code)}'
    rows = [("action", _t(action)), ("result", status), *_first_rows(doc)]
    for key in ("patchset", "bundle"):
        if doc.get(key) not in (None, "", {}):
            rows.append((key, _t(_plain(doc[key]))))
    rows.append(("duration", _t(_seconds(doc.get("seconds")))))
    if run_start is not None:
        rows.append(("started", _t(_utc(run_start))))
    hosts = doc.get("hosts") or []
    rows.append(("hosts", str(len(hosts))))
    batches = [b if isinstance(b, list) else [b] for b in doc.get("batches") or []]
    if batches:
        parts = [f"<b>{_t(label)}</b>: {_t(', '.join(_clean(n) for n in b))}"
                 for label, b in zip(batch_labels(batches, _canary_count(doc)), batches, strict=True)]
        rows.append(("batches", "<br>".join(parts)))
    if doc.get("reverted"):
        rows.append(("reverted", _t(", ".join(_clean(r) for r in doc["reverted"]))))
    notes = doc.get("notes") or []
    if notes:
        rows.append(("notes", "<br>".join(_t(n, secret=True) for n in notes)))
    if generated_at is not None:
        rows.append(("report written", _t(_utc(generated_at))))
    meta = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    abort = ""
    if doc.get("aborted"):
        reason = doc.get("abort_reason") or "no reason recorded"
        abort = f'<div class="abort"><b>Rollout aborted:</b> {_t(reason, secret=True)}</div>'
    return f'<header><h1>{_t(title)}</h1>{abort}<table class="meta">{meta}</table></header>'


def _exit_cell(outcome: str, code: Any) -> str:
    """A host the rollout never started has no exit code of its own: "not run" (with the code
    when an interrupt made it count, as exit 1), never a bare 0 that reads as a success."""
    if outcome != "skipped":
        return _t(code)
    return "not run" if code in (0, None) else f"not run ({_t(code)})"


def _first_rows(doc: dict) -> list[tuple[str, str]]:
    """What an operator asks first: what changed into what, who ran it, what clients saw."""
    rows = []
    change = doc.get("change") if isinstance(doc.get("change"), dict) else {}
    if change.get("to"):
        rows.append(("change", f'{_t(change.get("from") or "—")} <b>→</b> {_t(change["to"])}'))
    if doc.get("ran_by"):
        rows.append(("run by", _t(doc["ran_by"])))
    rows.append(("client errors", _client_errors(doc.get("client_errors"))))
    return rows


def _client_errors(sample: Any) -> str:
    """Requests clients sent through the router during the run and how many failed, when a
    sample was taken; otherwise said plainly: nothing in a rollout measures it on its own."""
    if not isinstance(sample, dict) or _num(sample.get("requests")) is None:
        return '<span class="muted">not measured (no traffic sample through the router in this run)</span>'
    sent, failed = int(_num(sample["requests"]) or 0), int(_num(sample.get("failed")) or 0)
    cls = "good" if failed == 0 else "bad"
    via = f' through {_t(sample["router"])}' if sample.get("router") else ""
    return f'<span class="{cls}">{failed} of {sent} requests failed</span>{via}'


SERVING_METRICS = (("accept_length", "accept length", "{:.2f}"), ("output_tps", "output tok/s", "{:,.0f}"))


def serving_before_after(h: dict) -> tuple[dict, dict, str] | None:
    """(before, after, where from) for a host: the server's own figures read before the change and
    after it (`serving`, cheap reads of /server_info and /metrics), or the performance gate's
    baseline and canary; None when neither was taken."""
    serving = h.get("serving") if isinstance(h.get("serving"), dict) else None
    if serving and (isinstance(serving.get("before"), dict) or isinstance(serving.get("after"), dict)):
        return serving.get("before") or {}, serving.get("after") or {}, _clean(serving.get("source") or "server")
    gate = h.get("perf_gate") if isinstance(h.get("perf_gate"), dict) else None
    if gate and (isinstance(gate.get("baseline"), dict) or isinstance(gate.get("canary"), dict)):
        return gate.get("baseline") or gate.get("peers") or {}, gate.get("canary") or {}, "perf gate"
    return None


def _serving_section(hosts: list[dict]) -> str:
    def cell(before: dict, after: dict, key: str, fmt: str) -> str:
        b, a = _num(before.get(key)), _num(after.get(key))
        shown = [fmt.format(v) if v is not None else "—" for v in (b, a)]
        return f'<td class="num">{_t(shown[0])} → {_t(shown[1])}</td>'
    rows = []
    for h in hosts:
        found = serving_before_after(h)
        name = f'<td class="nowrap"><b>{_t(h.get("host"))}</b></td>'
        if found is None:
            rows.append(f'<tr class="serving-row">{name}<td colspan="3" class="muted">not measured</td></tr>')
            continue
        before, after, source = found
        rows.append(f'<tr class="serving-row">{name}'
                    + "".join(cell(before, after, k, fmt) for k, _, fmt in SERVING_METRICS)
                    + f"<td>{_t(source)}</td></tr>")
    head = "<tr><th>host</th>" + "".join(f"<th>{label} before → after</th>" for _, label, _ in SERVING_METRICS)
    return f'<h2>Serving before → after</h2><table class="serving">{head}<th>from</th></tr>{"".join(rows)}</table>'


def _summary(doc: dict) -> str:
    action = _clean(doc.get("action"))
    rows = []
    for h in doc.get("hosts") or []:
        outcome = _clean(h.get("outcome"))
        gate = h.get("perf_gate") if isinstance(h.get("perf_gate"), dict) else None
        verdict = _clean(gate.get("verdict")) if gate else ""
        gate_cell = f'<span class="badge {_t(verdict)}">{_t(verdict)}</span>' if gate else "—"
        msg = _clean(h.get("message"))
        if h.get("repaired"):
            msg = f"repaired first: {_clean(h['repaired'])}" + (f"; {msg}" if msg else "")
        for note in healed_notes(h.get("steps")):  # what the host did alone, before this run
            msg = _clean(note) + (f"; {msg}" if msg else "")
        rows.append(
            f'<tr class="host-row" data-host="{_t(h.get("host"))}"><td class="nowrap"><b>{_t(h.get("host"))}</b></td>'
            f'<td class="{_outcome_class(action, outcome)}">{_t(outcome)}</td>'
            f'<td class="num">{_exit_cell(outcome, h.get("exit_code"))}</td>'
            f'<td class="nowrap">{_t(h.get("release") or "—")}</td>'
            f'<td class="bad">{_t(h.get("failed_step") or "")}</td>'
            f'<td class="num">{_t(_seconds(h.get("seconds")))}</td><td>{gate_cell}</td>'
            f'<td class="msg">{_t(msg, secret=True)}</td></tr>')
    head = ("<tr><th>host</th><th>outcome</th><th>exit</th><th>release</th><th>failed step</th>"
            "<th>time</th><th>perf gate</th><th>message</th></tr>")
    return f'<h2>Hosts</h2><table class="summary">{head}{"".join(rows)}</table>'


# Timeline geometry, in SVG user units (the SVG scales to the page width).
TL_WIDTH, TL_LABEL, TL_ROW, TL_BAR, TL_TOP = 1200, 220, 30, 20, 26


def timeline_svg(hosts: list[dict], action: str = "deploy") -> str:
    """A Gantt chart: one row per host, one bar per phase, x = seconds from the run's start (the
    earliest step of any host), so batches show as rows starting later. Bar widths are exactly
    proportional to durations (`data-seconds`); a phase too short to see also gets a tick."""
    start = _run_start(hosts)
    if start is None:
        return '<p class="muted">No step of any host has a time: no timeline.</p>'
    ends = [p["end"] for h in hosts for p in host_phases(h)]
    span = max(max(ends) - start, 1.0)
    plot = TL_WIDTH - TL_LABEL - 20
    scale = plot / span  # user units per second
    height = TL_TOP + TL_ROW * len(hosts) + 28
    out = [f'<svg class="timeline" viewBox="0 0 {TL_WIDTH} {height}" width="{TL_WIDTH}" '
           f'height="{height}" role="img" aria-label="timeline of each host\'s phases">']
    # Axis: grid lines and labels first, so bars draw over them.
    step = _nice_step(span)
    x_tick = 0.0
    while x_tick <= span + 1e-9:
        x = TL_LABEL + x_tick * scale
        label = f"{x_tick:g} s"
        out.append(f'<line x1="{x:.2f}" y1="{TL_TOP - 6}" x2="{x:.2f}" y2="{height - 22}" '
                   f'stroke="#e3e7eb" stroke-width="1"/>'
                   f'<text x="{x:.2f}" y="{TL_TOP - 10}" font-size="11" fill="#55606b" '
                   f'text-anchor="middle">{_t(label)}</text>')
        x_tick += step
    out.append(f'<text x="{TL_LABEL}" y="{height - 6}" font-size="11" fill="#55606b">seconds from the '
               f'run\'s start ({_t(_utc(start))})</text>')
    for row, h in enumerate(hosts):
        out.append(_timeline_row(h, row, start, scale, action))
    out.append("</svg>")
    return "".join(out)


def _timeline_row(h: dict, row: int, start: float, scale: float, action: str) -> str:
    name = _clean(h.get("host"))
    y = TL_TOP + row * TL_ROW
    by = y + (TL_ROW - TL_BAR) / 2
    parts = [f'<g class="tl-row" data-host="{_t(name)}">']
    if row % 2:  # zebra stripe, drawn first so the label and bars sit on it
        parts.append(f'<rect x="0" y="{y}" width="{TL_WIDTH}" height="{TL_ROW}" fill="#f4f6f8"/>')
    parts.append(f'<text x="{TL_LABEL - 8}" y="{y + TL_ROW / 2 + 4}" font-size="12.5" text-anchor="end" '
                 f'fill="#1d2329"><title>{_t(name)}</title>{_t(_shorten(name, 30))}</text>')
    phases = host_phases(h)
    if not phases:
        outcome = _clean(h.get("outcome")) or "no steps"
        parts.append(f'<text x="{TL_LABEL + 4}" y="{y + TL_ROW / 2 + 4}" font-size="12" fill="#6b7580" '
                     f'font-style="italic">{_t(outcome)}: no steps recorded</text></g>')
        return "".join(parts)
    failed_step = _clean(h.get("failed_step"))
    failed_at = _failed_phase(phases, failed_step)
    for i, p in enumerate(phases):
        x = TL_LABEL + (p["start"] - start) * scale
        secs = p["end"] - p["start"]
        w = secs * scale
        colour = host_step_group(p["step"], h, action)[1]
        tip = f'{p["step"]}: {secs:.1f} s' + (f' — {_clean(p["detail"])}' if p["detail"] else "")
        failed = i == failed_at
        stroke = f' stroke="{FAIL_COLOUR}" stroke-width="2.5"' if failed else ' stroke="#fff" stroke-width="0.5"'
        parts.append(f'<rect class="phase{" failed" if failed else ""}" data-step="{_t(p["step"])}" '
                     f'data-seconds="{secs:.3f}" x="{x:.3f}" y="{by}" width="{w:.3f}" height="{TL_BAR}" '
                     f'fill="{colour}"{stroke}><title>{_t(tip, secret=True)}</title></rect>')
        if w < 1.5:  # too thin to see: a tick in the phase's colour shows it happened
            parts.append(f'<line x1="{x + w / 2:.2f}" y1="{by - 2}" x2="{x + w / 2:.2f}" y2="{by + TL_BAR + 2}" '
                         f'stroke="{colour}" stroke-width="2"/>')
        elif w > len(p["step"]) * 6.3 + 8:  # the label fits inside the bar
            parts.append(f'<text x="{x + w / 2:.2f}" y="{by + TL_BAR / 2 + 4}" font-size="11" fill="#fff" '
                         f'text-anchor="middle" pointer-events="none">{_t(p["step"])}</text>')
    if failed_step:
        # Mark the failure: on its bar when the step was recorded, else where the host's run went
        # wrong (the end of the last step before the rollback, or of its last step).
        if failed_at is not None:
            fx = TL_LABEL + (phases[failed_at]["end"] - start) * scale
        else:
            before = phases[:_rollback_from(phases)] or phases
            fx = TL_LABEL + (before[-1]["end"] - start) * scale
        parts.append(f'<g class="fail-mark"><title>failed at {_t(failed_step)}</title>'
                     f'<path d="M{fx - 6:.2f},{by - 6} L{fx + 6:.2f},{by - 6} L{fx:.2f},{by + 3} Z" '
                     f'fill="{FAIL_COLOUR}"/></g>')
    parts.append("</g>")
    return "".join(parts)


def _legend(hosts: list[dict], action: str = "deploy") -> str:
    """Only the groups that appear, each with the step names it stands for in this run."""
    seen: dict[str, list[str]] = {}
    for h in hosts:
        for p in host_phases(h):
            group = host_step_group(p["step"], h, action)[0]
            names = seen.setdefault(group, [])
            if p["step"] not in names:
                names.append(p["step"])
    colours = {g: c for g, c, _ in PHASE_GROUPS} | {"other": OTHER_COLOUR}
    items = [f'<span><i style="background:{colours[g]}"></i><b>{_t(g)}</b>: {_t(", ".join(seen[g]))}</span>'
             for g in [*(g for g, _, _ in PHASE_GROUPS), "other"] if g in seen]
    items.append(f'<span><i style="background:{FAIL_COLOUR};clip-path:polygon(0 0,100% 0,50% 75%)"></i>'
                 f'failed step</span>')
    return f'<div class="legend">{"".join(items)}</div>'


# -- perf gate ---------------------------------------------------------------------------------

# metric -> (what people call it, unit shown, factor from the document's unit, which way is better)
METRICS: dict[str, tuple[str, str, float, str]] = {
    "output_tps": ("output throughput", "tok/s", 1.0, "higher"),
    "ttft_p50_s": ("time to first token p50", "ms", 1000.0, "lower"),
    "ttft_p99_s": ("time to first token p99", "ms", 1000.0, "lower"),
    "itl_p50_s": ("inter-token latency p50", "ms", 1000.0, "lower"),
    "itl_p99_s": ("inter-token latency p99", "ms", 1000.0, "lower"),
    "error_rate": ("error rate", "%", 100.0, "lower"),
    "accept_length": ("accept length", "tokens", 1.0, "higher"),
}


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    digits = 0 if abs(v) >= 100 else 1 if abs(v) >= 10 else 2
    return f"{v:,.{digits}f} {unit}".rstrip()


def metric_svg(row: dict) -> str:
    """One metric: a horizontal bar per source (baseline, canary, peers) on a shared scale from
    zero, so the eye compares lengths; missing sources are listed as "—"."""
    metric = _clean(row.get("metric"))
    _, unit, factor, _ = METRICS.get(metric, (metric, "", 1.0, ""))
    values = {s: (_num(row.get(s)) * factor if _num(row.get(s)) is not None else None) for s in SOURCE_COLOURS}
    present = [s for s in SOURCE_COLOURS if s in row]
    top = max([abs(v) for v in values.values() if v is not None] or [0.0]) or 1.0
    label_w, plot_w, bar_h, gap = 70, 170, 16, 6
    height = len(present) * (bar_h + gap) + 4
    out = [f'<svg class="metric" data-metric="{_t(metric)}" viewBox="0 0 320 {height}" width="320" '
           f'height="{height}" role="img" aria-label="{_t(metric)}">']
    for i, src in enumerate(present):
        y = 2 + i * (bar_h + gap)
        v = values[src]
        w = 0.0 if v is None else abs(v) / top * plot_w
        out.append(f'<text x="{label_w - 6}" y="{y + bar_h - 4}" font-size="11.5" text-anchor="end" '
                   f'fill="#3b444d">{src}</text>')
        out.append(f'<rect class="bar" data-source="{src}" x="{label_w}" y="{y}" width="{w:.2f}" '
                   f'height="{bar_h}" rx="2" fill="{SOURCE_COLOURS[src]}"/>')
        out.append(f'<text x="{label_w + w + 5:.2f}" y="{y + bar_h - 4}" font-size="11.5" fill="#1d2329">'
                   f'{_t(_fmt(v, unit))}</text>')
    out.append("</svg>")
    return "".join(out)


def _metric_card(row: dict) -> str:
    metric = _clean(row.get("metric"))
    name, _, _, better = METRICS.get(metric, (metric, "", 1.0, ""))
    verdict = _clean(row.get("verdict"))
    change = _num(row.get("change"))
    change_s = "" if change is None else f" · {change * 100:+.1f}% vs baseline"
    hint = f" ({better} is better)" if better else ""
    limit = row.get("limit")
    return (f'<div class="card gate-row" data-metric="{_t(metric)}"><h4>{_t(name)}'
            f'<span class="muted" style="font-weight:400">{_t(hint)}{_t(change_s)}</span> '
            f'<span class="badge {_t(verdict)}">{_t(verdict or "—")}</span></h4>{metric_svg(row)}'
            f'{f"<div class=limit>limit: {_t(limit)}</div>" if limit not in (None, "") else ""}</div>')


def _samples_table(gate: dict) -> str:
    """What each figure rests on: requests, errors, tokens, wall time per source."""
    cols = [s for s in SOURCE_COLOURS if isinstance(gate.get(s), dict)]
    if not cols:
        return ""
    fields = [("requests", "requests", "{:,.0f}"), ("errors", "errors", "{:,.0f}"),
              ("output_tokens", "output tokens", "{:,.0f}"), ("wall_s", "wall time (s)", "{:,.1f}")]
    head = "<tr><th>sample</th>" + "".join(f"<th>{s}</th>" for s in cols) + "</tr>"
    body = []
    for key, label, fmt in fields:
        cells = []
        for s in cols:
            v = _num(gate[s].get(key))
            cells.append(f'<td class="num">{_t(fmt.format(v) if v is not None else "—")}</td>')
        body.append(f"<tr><th>{label}</th>{''.join(cells)}</tr>")
    return f'<table class="samples">{head}{"".join(body)}</table>'


def _gate_section(h: dict) -> str:
    gate = h["perf_gate"]
    verdict = _clean(gate.get("verdict"))
    rows = [r for r in gate.get("rows") or [] if isinstance(r, dict)]
    reasons = [r for r in gate.get("reasons") or []]
    reasons_html = ("<ul>" + "".join(f"<li>{_t(r, secret=True)}</li>" for r in reasons) + "</ul>") if reasons else ""
    legend = "".join(f'<span><i style="background:{c}"></i>{s}</span>' for s, c in SOURCE_COLOURS.items()
                     if s in {k for r in rows for k in r} or isinstance(gate.get(s), dict))
    return (f'<section class="gate host" data-host="{_t(h.get("host"))}"><h3>{_t(h.get("host"))} '
            f'<span class="badge {_t(verdict)}">{_t(verdict or "no verdict")}</span></h3>{reasons_html}'
            f'<div class="legend">{legend}</div>'
            f'<div class="charts">{"".join(_metric_card(r) for r in rows)}</div>{_samples_table(gate)}</section>')


# -- failures ----------------------------------------------------------------------------------

def _steps_table(h: dict, run_start: float | None) -> str:
    phases = host_phases(h)
    if not phases:
        return ""
    base = phases[0]["start"] if run_start is None else run_start
    rows = "".join(
        f'<tr><td>{_t(p["step"])}</td><td class="num">{p["start"] - base:.1f}</td>'
        f'<td class="num">{p["end"] - p["start"]:.1f}</td><td class="msg">{_t(p["detail"], secret=True)}</td></tr>'
        for p in phases)
    return (f'<details><summary>steps of {_t(h.get("host"))}</summary><table><tr><th>step</th>'
            f'<th>start (s)</th><th>seconds</th><th>detail</th></tr>{rows}</table></details>')


def _failure_section(h: dict, run_start: float | None) -> str:
    log = _lines(h.get("log"))
    pre = (f"<pre>{html.escape(chr(10).join(log), quote=True)}</pre>" if log
           else '<p class="muted">No log lines were collected for this host.</p>')
    step = h.get("failed_step")
    return (f'<section class="failure host" data-host="{_t(h.get("host"))}"><h3>{_t(h.get("host"))} — '
            f'{_t(h.get("outcome"))}{f" at {_t(step)}" if step else ""}</h3>'
            f'<p>{_t(h.get("message") or "", secret=True)}</p>{pre}{_steps_table(h, run_start)}</section>')


# -- the page ----------------------------------------------------------------------------------

def render_report(doc: dict, *, title: str | None = None, generated_at: float | None = None) -> str:
    """The rollout document as one HTML page. Pure: the same document (and `generated_at`, left
    off the page when None) gives the same bytes."""
    hosts = [h for h in doc.get("hosts") or [] if isinstance(h, dict)]
    action = _clean(doc.get("action") or "rollout")
    title = title if title is not None else f"ddtree-ops {action} report"
    run_start = _run_start(hosts)
    gated = [h for h in hosts if isinstance(h.get("perf_gate"), dict)]
    failed = [h for h in hosts if _failed(action, h)]
    body = [_header(doc, title, generated_at, run_start), _summary({**doc, "hosts": hosts}), _serving_section(hosts),
            "<h2>Timeline</h2>", _legend(hosts, action), timeline_svg(hosts, action)]
    if gated:
        body.append("<h2>Performance gate</h2>")
        body.extend(_gate_section(h) for h in gated)
    if failed:
        body.append("<h2>Failed hosts</h2>")
        body.extend(_failure_section(h, run_start) for h in failed)
    other = [h for h in hosts if h not in failed and host_phases(h)]
    if other:
        body.append("<h2>Steps</h2>" + "".join(_steps_table(h, run_start) for h in other))
    body.append("<footer>Written by ddtree-ops. Self-contained: no scripts, nothing fetched.</footer>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_t(title)}</title><style>{CSS}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def write_report(path: str | os.PathLike, doc: dict, *, title: str | None = None,
                 generated_at: float | None = None) -> Path:
    """Write the page atomically (a temp file in the same folder, fsync, os.replace): a reader
    or a crash never sees half a report, and an older report stays whole until replaced."""
    path = Path(path)
    page = render_report(doc, title=title, generated_at=time.time() if generated_at is None else generated_at)
    write_atomically(path, page)
    return path


__all__ = ["render_report", "write_report", "timeline_svg", "metric_svg", "host_phases"]
