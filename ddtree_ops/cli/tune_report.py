"""A tune as one self-contained HTML page (`tune --report FILE.html`): which tree won, by how much,
and the plots an operator reads to believe it.

Same rules as the rollout report (cli/report.py, whose escaping, CSS and Content-Security-Policy
this page reuses so there is one of each): inline CSS and SVG written by hand, no script, nothing
fetched; every value from the document goes through `_t` before it reaches the page, in HTML and
in SVG alike, because host names, configs and failure reasons come from hosts and from servers.

The plots are the ones a person tuning speculative decoding draws by hand: for each workload
(concurrency, temperature), tok/s against budget with one line per topk cap (a wide tree pays
off at batch 1 and loses at batch 16, and these lines show where), DFlash as a dashed horizontal
line (the control: a tree below it is a tree not worth running), the inventory's config ringed
(what runs today), the winner starred, and configs that failed drawn as an "x" on the axis with
their reason as a tooltip (a failure is a result, not a hole in the plot). The same panels for
accept length, which tells a slow tree that drafts well (verify cost) from one that drafts badly.
Budgets are spaced by log2 because the grid doubles (4, 8, 16, 32). Every panel shares one x
axis and one colour per topk cap, so panels can be compared by eye; each has its own y axis from
zero (tok/s at concurrency 16 dwarfs batch 1).

Input: the tune's JSON document (`tune --json`). It may be partial (an interrupted tune, a failed
config with null numbers, fields missing): nothing here assumes a field is present or a number.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

from ..config.atomic_file import write_atomically
from .report import CSP, CSS, FAIL_COLOUR, _clean, _nice_step, _num, _seconds, _shorten, _t, _utc

# -- reading the document ----------------------------------------------------------------------

DFLASH = "DFlash"
METRIC_LABELS = {"tok_s": ("output throughput", "tok/s"), "accept_length": ("accept length", "tokens")}

# One colour per topk cap, the same in every panel (the tableau-10 hues the rollout report uses).
CAP_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#ff9da7")
DFLASH_COLOUR = "#55606b"
WINNER_COLOUR = "#d4a000"


def _int(value: Any) -> int | None:
    """A positive whole number (budget, topk cap) or None: JSON may give 16.0, "16", null or -1."""
    v = _num(value)
    return int(v) if v is not None and v > 0 and v == int(v) else None


def _dicts(value: Any) -> list[dict]:
    return [x for x in value if isinstance(x, dict)] if isinstance(value, (list, tuple)) else []


def _temp(value: Any) -> str:
    t = _num(value)
    return "?" if t is None else f"{t:g}"


def workload_label(d: dict) -> str:
    """A workload's name: its label ("workload" in a row or winner, "label" in `workloads`), else
    made from its concurrency and temperature as the tune names them ("c4 T0.7")."""
    label = _clean(d.get("workload") if d.get("workload") not in (None, "") else d.get("label"))
    if label:
        return label
    c = _int(d.get("concurrency"))
    return f"c{c if c is not None else '?'} T{_temp(d.get('temperature'))}"


def _is_dflash(d: dict) -> bool:
    return _clean(d.get("kind")).lower() == "dflash" or _clean(d.get("config")).lower() == "dflash" or (
        d.get("kind") in (None, "") and d.get("budget") is None and d.get("topk_cap") is None)


def config_name(d: dict) -> str:
    """"DFlash" for the control, else "budget/topk cap" ("16/4"), else the document's own name."""
    if _is_dflash(d):
        return DFLASH
    budget, cap = _int(d.get("budget")), _int(d.get("topk_cap"))
    if budget is not None and cap is not None:
        return f"{budget}/{cap}"
    return _clean(d.get("config")) or "?"


def _inventory_config(doc: dict) -> str | None:
    grid = doc.get("grid") if isinstance(doc.get("grid"), dict) else {}
    inv = grid.get("inventory_config")
    return config_name({"kind": "ddtree", **inv}) if isinstance(inv, dict) and inv else None


def _grid_values(doc: dict, key: str, rows: list[dict], row_key: str) -> tuple[int, ...]:
    """The grid's budgets (or topk caps) with every one a row or the inventory's config used."""
    grid = doc.get("grid") if isinstance(doc.get("grid"), dict) else {}
    listed = grid.get(key) if isinstance(grid.get(key), (list, tuple)) else []
    found = {_int(v) for v in listed}
    inv = grid.get("inventory_config")
    if isinstance(inv, dict):
        found.add(_int(inv.get(row_key)))
    found |= {_int(r.get(row_key)) for r in rows if not _is_dflash(r)}
    return tuple(sorted(v for v in found if v is not None))


def gain_text(gain: Any) -> str:
    """A ratio with its interval as the winners table shows it: "1.42x (1.35–1.49)", "—" if none."""
    if not isinstance(gain, dict) or _num(gain.get("ratio")) is None:
        return "—"
    ratio, low, high = _num(gain.get("ratio")), _num(gain.get("low")), _num(gain.get("high"))
    interval = f" ({low:.2f}–{high:.2f})" if low is not None and high is not None else ""
    return f"{ratio:.2f}x{interval}"


@dataclass(frozen=True)
class Mark:
    """One configuration's figure in one panel: its value (None when it failed or was not
    measured), its relative spread over repeats, and what the page says about it."""

    config: str
    budget: int | None
    topk_cap: int | None
    value: float | None
    spread: float | None
    failed: bool
    reason: str
    host: str
    repeats: int | None
    inventory: bool
    winner: bool


@dataclass(frozen=True)
class Panel:
    """One plot: a workload's `metric` against budget. `lines` holds, per topk cap, the configs
    with a value, by budget; `failed` the tree configs that failed; `dflash` the control's row."""

    workload: str
    concurrency: int | None
    temperature: float | None
    metric: str
    budgets: tuple[int, ...]
    lines: dict[int, tuple[Mark, ...]]
    failed: tuple[Mark, ...]
    dflash: Mark | None
    winner: str | None

    @property
    def marks(self) -> list[Mark]:
        return [m for line in self.lines.values() for m in line] + list(self.failed)


def _workloads(doc: dict, rows: list[dict]) -> list[dict]:
    """The workloads in the tune's order, then any only the rows name (a partial document)."""
    seen: dict[str, dict] = {}
    for w in [*_dicts(doc.get("workloads")), *rows]:
        seen.setdefault(workload_label(w), w)
    return list(seen.values())


def _winners(doc: dict) -> dict[str, dict]:
    return {workload_label(w): w for w in _dicts(doc.get("winners"))}


def _mark(row: dict, metric: str, inventory: str | None, winner: str | None) -> Mark:
    name = config_name(row)
    failed = _clean(row.get("status")) != "ok"
    reason = _clean(row.get("reason")) or ("failed (no reason recorded)" if failed else "")
    repeats = _int(row.get("repeats"))
    return Mark(config=name, budget=None if name == DFLASH else _int(row.get("budget")),
                topk_cap=None if name == DFLASH else _int(row.get("topk_cap")),
                value=None if failed else _num(row.get(metric)),
                spread=None if failed or metric != "tok_s" else _num(row.get("tok_s_spread")),
                failed=failed, reason=reason, host=_clean(row.get("host")), repeats=repeats,
                inventory=bool(row.get("inventory")) or (inventory is not None and name == inventory),
                winner=winner is not None and name == winner)


def tune_panels(doc: dict, metric: str) -> list[Panel]:
    """One panel per workload for `metric` ("tok_s" or "accept_length"), in the tune's order.
    Pure: the plots are drawn from these, and the tests read them without parsing SVG. A config
    measured twice for one workload (it should not be) counts once: its first ok row."""
    rows = _dicts(doc.get("rows"))
    budgets = _grid_values(doc, "budgets", rows, "budget")
    inventory = _inventory_config(doc)
    winners = _winners(doc)
    panels = []
    for w in _workloads(doc, rows):
        label = workload_label(w)
        win = winners.get(label)
        winner = config_name({"kind": "ddtree", **win}) if win and (win.get("config") or win.get("budget")) else None
        if win and _clean(win.get("config")).lower() == "dflash":
            winner = DFLASH
        chosen: dict[str, dict] = {}
        for r in (r for r in rows if workload_label(r) == label):
            name = config_name(r)
            if name not in chosen or (_clean(chosen[name].get("status")) != "ok" and _clean(r.get("status")) == "ok"):
                chosen[name] = r
        marks = [_mark(r, metric, inventory, winner) for r in chosen.values()]
        lines: dict[int, list[Mark]] = {}
        for m in marks:
            if m.config != DFLASH and m.value is not None and m.budget is not None and m.topk_cap is not None:
                lines.setdefault(m.topk_cap, []).append(m)
        failed = [m for m in marks if m.config != DFLASH and m.failed and m.budget is not None]
        panels.append(Panel(
            workload=label, concurrency=_int(w.get("concurrency")), temperature=_num(w.get("temperature")),
            metric=metric, budgets=budgets,
            lines={cap: tuple(sorted(ms, key=lambda m: m.budget or 0)) for cap, ms in sorted(lines.items())},
            failed=tuple(sorted(failed, key=lambda m: (m.budget or 0, m.topk_cap or 0))),
            dflash=next((m for m in marks if m.config == DFLASH), None), winner=winner))
    return panels


def cap_colours(doc: dict) -> dict[int, str]:
    """Each topk cap's colour, the same in every panel and the legend."""
    caps = _grid_values(doc, "topk_caps", _dicts(doc.get("rows")), "topk_cap")
    return {cap: CAP_COLOURS[i % len(CAP_COLOURS)] for i, cap in enumerate(caps)}


# -- one panel ---------------------------------------------------------------------------------

# Geometry in SVG user units (the SVG scales to its card's width).
P_WIDTH, P_LEFT, P_RIGHT, P_TOP, P_PLOT_H = 560, 62, 74, 30, 220  # DFlash is labelled right of the plot
P_AXIS_H = 44  # tick labels and the x axis's title under the plot
P_LEGEND_ROW = 18


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "—"
    digits = 0 if abs(v) >= 100 else 1 if abs(v) >= 10 else 2
    return f"{v:,.{digits}f} {unit}".rstrip()


def _tip(m: Mark, metric: str) -> str:
    """What a point's tooltip says: the config, its figure and what the figure rests on."""
    unit = METRIC_LABELS.get(metric, (metric, ""))[1]
    parts = [f"{m.config}: {_fmt(m.value, unit)}"]
    if m.spread is not None:
        parts.append(f"±{m.spread * 100:.1f}%")
    if m.repeats is not None:
        parts.append(f"over {m.repeats} repeat{'s' if m.repeats != 1 else ''}")
    if m.host:
        parts.append(f"on {m.host}")
    tags = [t for t, on in (("inventory config", m.inventory), ("winner", m.winner)) if on]
    return " ".join(parts) + (f" ({', '.join(tags)})" if tags else "")


def _legend_items(panel: Panel, colours: dict[int, str]) -> list[tuple[str, str]]:
    """(svg of the key, text) for what this panel draws, in a fixed order."""
    items = [(f'<line x1="0" y1="0" x2="18" y2="0" stroke="{c}" stroke-width="2"/>'
              f'<circle cx="9" cy="0" r="3" fill="{c}"/>', f"topk cap {cap}") for cap, c in colours.items()]
    items.append((f'<line x1="0" y1="0" x2="18" y2="0" stroke="{DFLASH_COLOUR}" stroke-width="2" '
                  f'stroke-dasharray="5 3"/>', DFLASH))
    items.append(('<circle cx="9" cy="0" r="6" fill="none" stroke="#1d2329" stroke-width="1.5"/>', "inventory config"))
    items.append((_star(9, 0, 6), "winner"))
    items.append((_cross(9, 0, 4), "failed"))
    return items


def _star(cx: float, cy: float, r: float) -> str:
    pts = []
    for i in range(10):
        a = -math.pi / 2 + i * math.pi / 5
        rr = r if i % 2 == 0 else r * 0.45
        pts.append(f"{cx + rr * math.cos(a):.2f},{cy + rr * math.sin(a):.2f}")
    return f'<polygon points="{" ".join(pts)}" fill="{WINNER_COLOUR}" stroke="#7a5c00" stroke-width="0.8"/>'


def _cross(cx: float, cy: float, r: float) -> str:
    return (f'<path d="M{cx - r:.2f},{cy - r:.2f} L{cx + r:.2f},{cy + r:.2f} M{cx - r:.2f},{cy + r:.2f} '
            f'L{cx + r:.2f},{cy - r:.2f}" stroke="{FAIL_COLOUR}" stroke-width="2.2" stroke-linecap="round"/>')


def _legend(panel: Panel, colours: dict[int, str], y0: float) -> tuple[str, float]:
    """The key under the axis, wrapped to the panel's width; returns (svg, its height)."""
    out, x, y = ['<g class="legend">'], float(P_LEFT), y0 + P_LEGEND_ROW / 2
    for key, text in _legend_items(panel, colours):
        width = 26 + len(text) * 6.2 + 14
        if x + width > P_WIDTH - 4 and x > P_LEFT:
            x, y = float(P_LEFT), y + P_LEGEND_ROW
        out.append(f'<g transform="translate({x:.1f},{y:.1f})">{key}'
                   f'<text x="24" y="4" font-size="11" fill="#3b444d">{_t(text)}</text></g>')
        x += width
    out.append("</g>")
    return "".join(out), y - y0 + P_LEGEND_ROW / 2


def _x_scale(budgets: tuple[int, ...]):
    """Budget → x, log2-spaced, with half a doubling of room at each end so no point sits on the
    frame; one budget (or none) sits in the middle."""
    plot_w = P_WIDTH - P_LEFT - P_RIGHT
    if not budgets:
        return lambda b: P_LEFT + plot_w / 2
    lo, hi = math.log2(min(budgets)), math.log2(max(budgets))
    lo, hi = (lo - 1, hi + 1) if hi == lo else (lo - 0.4, hi + 0.4)
    return lambda b: P_LEFT + (math.log2(b) - lo) / (hi - lo) * plot_w


def _y_top(panel: Panel) -> float:
    values = [m.value * (1 + (m.spread or 0)) for m in panel.marks if m.value is not None]
    if panel.dflash is not None and panel.dflash.value is not None:
        values.append(panel.dflash.value)
    top = max(values or [0.0])
    if top <= 0:
        return 1.0
    step = _nice_step(top * 1.08, 5)
    return math.ceil(top * 1.08 / step) * step


def panel_svg(panel: Panel, colours: dict[int, str]) -> str:
    """One panel as SVG: axes with ticks and labels, a line per topk cap, DFlash dashed, the
    inventory's config ringed, the winner starred, failures as an "x" on the axis."""
    name, unit = METRIC_LABELS.get(panel.metric, (panel.metric, ""))
    x_of = _x_scale(panel.budgets)
    top = _y_top(panel)
    base_y = P_TOP + P_PLOT_H

    def y_of(v: float) -> float:
        return base_y - max(0.0, v) / top * P_PLOT_H

    legend, legend_h = _legend(panel, colours, base_y + P_AXIS_H)
    height = base_y + P_AXIS_H + legend_h + 6
    right = P_WIDTH - P_RIGHT
    out = [f'<svg class="tune-panel" data-metric="{_t(panel.metric)}" data-workload="{_t(panel.workload)}" '
           f'viewBox="0 0 {P_WIDTH} {height:.0f}" width="{P_WIDTH}" height="{height:.0f}" role="img" '
           f'aria-label="{_t(f"{name} against budget, {panel.workload}")}">',
           f'<text x="{P_LEFT}" y="18" font-size="13" font-weight="600" fill="#1d2329">'
           f'{_t(_shorten(f"{name} · {panel.workload}", 70))}</text>']
    # y axis: grid lines and labels first, so the data draws over them
    step = _nice_step(top, 5)
    k = 0
    while k * step <= top + 1e-9:
        v = k * step
        y = y_of(v)
        out.append(f'<line class="y-tick" x1="{P_LEFT}" y1="{y:.2f}" x2="{right}" y2="{y:.2f}" '
                   f'stroke="{"#9aa5b1" if k == 0 else "#e3e7eb"}" stroke-width="1"/>'
                   f'<text x="{P_LEFT - 6}" y="{y + 4:.2f}" font-size="11" fill="#55606b" text-anchor="end">'
                   f'{_t(f"{v:,.{0 if step >= 1 else 2}f}")}</text>')
        k += 1
    out.append(f'<line x1="{P_LEFT}" y1="{P_TOP}" x2="{P_LEFT}" y2="{base_y}" stroke="#9aa5b1" stroke-width="1"/>')
    out.append(f'<text transform="translate(14,{P_TOP + P_PLOT_H / 2:.1f}) rotate(-90)" font-size="11.5" '
               f'fill="#3b444d" text-anchor="middle">{_t(f"{name} ({unit})" if unit else name)}</text>')
    # x axis: a tick at every budget of the grid; a label unless it would overlap the last one
    last_label = -1e9
    for b in panel.budgets:
        x = x_of(b)
        out.append(f'<line class="x-tick" data-budget="{b}" x1="{x:.2f}" y1="{base_y}" x2="{x:.2f}" '
                   f'y2="{base_y + 5}" stroke="#9aa5b1" stroke-width="1"/>')
        if x - last_label >= 20:
            out.append(f'<text x="{x:.2f}" y="{base_y + 18}" font-size="11" fill="#55606b" '
                       f'text-anchor="middle">{b}</text>')
            last_label = x
    out.append(f'<text x="{P_LEFT + (right - P_LEFT) / 2:.1f}" y="{base_y + 36}" font-size="11.5" fill="#3b444d" '
               f'text-anchor="middle">tree budget (log2 scale)</text>')
    if not panel.marks and panel.dflash is None:
        out.append(f'<text x="{P_LEFT + (right - P_LEFT) / 2:.1f}" y="{P_TOP + P_PLOT_H / 2:.1f}" font-size="12.5" '
                   f'fill="#6b7580" font-style="italic" text-anchor="middle">not measured</text>')
    out.append(_dflash_line(panel, y_of, right))
    for cap, line in panel.lines.items():
        colour = colours.get(cap, CAP_COLOURS[0])
        pts = " ".join(f"{x_of(m.budget or 1):.2f},{y_of(m.value or 0):.2f}" for m in line)
        out.append(f'<g class="cap" data-topk-cap="{cap}"><polyline class="cap-line" data-topk-cap="{cap}" '
                   f'points="{pts}" fill="none" stroke="{colour}" stroke-width="2" stroke-linejoin="round"/>')
        for m in line:
            out.append(_point(m, panel.metric, x_of(m.budget or 1), y_of, colour))
        out.append("</g>")
    out.append(_failures(panel, x_of, base_y))
    out.append(legend)
    out.append("</svg>")
    return "".join(out)


def _dflash_line(panel: Panel, y_of, right: float) -> str:
    d = panel.dflash
    if d is None:
        return ""
    if d.value is None:  # the control failed: said at the axis, with its reason
        return (f'<g class="dflash-failed"><title>{_t(f"{DFLASH} failed: {d.reason}", secret=True)}</title>'
                f'{_cross(P_LEFT + 10, P_TOP + 10, 4)}<text x="{P_LEFT + 20}" y="{P_TOP + 14}" font-size="11" '
                f'fill="{FAIL_COLOUR}">{DFLASH} failed</text></g>')
    y = y_of(d.value)
    star = _star(right - 8, y, 7) if d.winner else ""
    ring = f'<circle cx="{right - 8}" cy="{y:.2f}" r="7" fill="none" stroke="#1d2329" stroke-width="1.5"/>' \
        if d.inventory else ""
    return (f'<g class="dflash" data-value="{d.value:.6g}"><title>{_t(_tip(d, panel.metric))}</title>'
            f'<line class="dflash-line" x1="{P_LEFT}" y1="{y:.2f}" x2="{right}" y2="{y:.2f}" '
            f'stroke="{DFLASH_COLOUR}" stroke-width="2" stroke-dasharray="6 4"/>'
            f'<text x="{right + 4}" y="{y + 4:.2f}" font-size="10.5" fill="{DFLASH_COLOUR}">'
            f'{DFLASH} {_t(_fmt(d.value))}</text>{ring}{star}</g>')


def _point(m: Mark, metric: str, x: float, y_of, colour: str) -> str:
    value = m.value or 0.0
    y = y_of(value)
    parts = [f'<g class="point" data-config="{_t(m.config)}" data-value="{value:.6g}"><title>{_t(_tip(m, metric))}'
             f'</title>']
    if m.spread:  # the spread over repeats, as an error bar
        y_lo, y_hi = y_of(value * (1 - m.spread)), y_of(value * (1 + m.spread))
        parts.append(f'<line class="spread" x1="{x:.2f}" y1="{y_lo:.2f}" x2="{x:.2f}" y2="{y_hi:.2f}" '
                     f'stroke="{colour}" stroke-width="1.2"/>')
    parts.append(f'<circle cx="{x:.2f}" cy="{y:.2f}" r="3.5" fill="{colour}"/>')
    if m.inventory:
        parts.append(f'<circle class="inventory-mark" cx="{x:.2f}" cy="{y:.2f}" r="8" fill="none" '
                     f'stroke="#1d2329" stroke-width="1.5"/>')
    if m.winner:
        above = y - 14 >= P_TOP  # above the point, unless that would leave the plot
        parts.append(f'<g class="winner-mark">{_star(x, y - 14 if above else y + 14, 7)}</g>')
    parts.append("</g>")
    return "".join(parts)


def _failures(panel: Panel, x_of, base_y: float) -> str:
    """Each failed config as an "x" on the x axis at its budget (stacked when several failed at
    one budget), its reason in the tooltip."""
    out, stacked = [], {}
    for m in panel.failed:
        n = stacked.get(m.budget, 0)
        stacked[m.budget] = n + 1
        x, y = x_of(m.budget or 1), base_y - 6 - n * 11
        tags = " (inventory config)" if m.inventory else ""
        out.append(f'<g class="failed-config" data-config="{_t(m.config)}">'
                   f'<title>{_t(f"{m.config}{tags} failed: {m.reason}", secret=True)}</title>{_cross(x, y, 4)}'
                   + (f'<circle cx="{x:.2f}" cy="{y:.2f}" r="8" fill="none" stroke="#1d2329" stroke-width="1.5"/>'
                      if m.inventory else "") + "</g>")
    return "".join(out)


# -- sections ----------------------------------------------------------------------------------

EXTRA_CSS = """
.panels { display: grid; grid-template-columns: repeat(auto-fill, minmax(420px, 1fr)); gap: 12px; }
td.gain { white-space: nowrap; font-variant-numeric: tabular-nums; }
.interrupted { background: #fff4e0; border-left: 4px solid #b26b00; padding: 8px 12px; margin: 10px 0; }
tr.failed td { background: #fdf3f4; }
"""


def _objective(doc: dict) -> str:
    obj = doc.get("objective") if isinstance(doc.get("objective"), dict) else {}
    kind = _clean(obj.get("kind")) or "throughput"
    bounds = [f"p99 {name} ≤ {v * 1000:,.0f} ms" for key, name in (("ttft_p99_max_s", "TTFT"),
                                                                     ("itl_p99_max_s", "inter-token latency"))
              if (v := _num(obj.get(key))) is not None]
    return kind + (f" subject to {' and '.join(bounds)}" if bounds else "")


def _restored(doc: dict) -> str:
    items = _dicts(doc.get("restored"))
    if not items:
        return '<span class="muted">no host recorded as restored</span>'
    parts = []
    for r in items:
        ok = r.get("ok") is True
        msg = _clean(r.get("message"))
        parts.append(f'<span class="{"good" if ok else "bad"} restored" data-host="{_t(r.get("host"))}">'
                     f'<b>{_t(r.get("host"))}</b> → {_t(r.get("release") or "—")}'
                     f' ({"ok" if ok else "NOT restored"})</span>'
                     + (f' <span class="muted">{_t(msg, secret=True)}</span>' if msg else ""))
    return "<br>".join(parts)


def _header(doc: dict, generated_at: float | None) -> str:
    tune_id = _clean(doc.get("tune_id")) or "unnamed tune"
    started, finished = _num(doc.get("started_at")), _num(doc.get("finished_at"))
    hosts = [_clean(h) for h in doc.get("hosts") or []] if isinstance(doc.get("hosts"), list) else []
    rows = _dicts(doc.get("rows"))
    interrupted = bool(doc.get("interrupted"))
    status = ('<span class="badge warn">INTERRUPTED</span> the rows below are those measured before it stopped'
              if interrupted else '<span class="badge good">COMPLETE</span>')
    meta = [("tune", _t(tune_id)), ("status", status), ("hosts", _t(", ".join(hosts) or "—")),
            ("inventory", _t(doc.get("inventory") or "—")),
            ("started", _t(_utc(started))), ("finished", _t(_utc(finished)))]
    if started is not None and finished is not None:
        meta.append(("duration", _t(_seconds(finished - started))))
    meta.append(("objective", _t(_objective(doc))))
    budgets = _grid_values(doc, "budgets", rows, "budget")
    caps = _grid_values(doc, "topk_caps", rows, "topk_cap")
    meta.append(("grid", _t(f"budgets {', '.join(map(str, budgets)) or '—'} × topk caps "
                            f"{', '.join(map(str, caps)) or '—'}, and {DFLASH} as the control")))
    meta.append(("inventory config", _t(_inventory_config(doc) or "—")))
    workloads = _workloads(doc, [])
    if workloads:
        meta.append(("workloads", "<br>".join(_t(_workload_text(w)) for w in workloads)))
    meta.append(("hosts restored to", _restored(doc)))
    if generated_at is not None:
        meta.append(("report written", _t(_utc(generated_at))))
    table = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in meta)
    banner = (f'<div class="interrupted"><b>Tune interrupted.</b> {len(rows)} row{"s" if len(rows) != 1 else ""} '
              f'measured before it stopped; the winners below rank only those.</div>' if interrupted else "")
    return f'<header><h1>ddtree-ops tune report</h1>{banner}<table class="meta">{table}</table></header>'


def _workload_text(w: dict) -> str:
    parts = [workload_label(w), f"concurrency {_int(w.get('concurrency')) or '?'}",
             f"temperature {_temp(w.get('temperature'))}"]
    if _int(w.get("max_new_tokens")) is not None:
        parts.append(f"{_int(w.get('max_new_tokens'))} new tokens")
    if _num(w.get("duration_s")) is not None:
        parts.append(f"{_num(w.get('duration_s')):g} s a measurement")
    return " · ".join(parts)


def _winners_section(doc: dict) -> str:
    winners = _dicts(doc.get("winners"))
    inventory = _inventory_config(doc)
    if not winners:
        body = '<p class="muted">No winner: no workload has a ranked measurement.</p>'
    else:
        head = ("<tr><th>workload</th><th>concurrency</th><th>temperature</th><th>winner</th><th>tok/s</th>"
                f"<th>vs {DFLASH}</th><th>vs inventory config ({_t(inventory or '—')})</th><th>note</th></tr>")
        trs = []
        for w in winners:
            name = config_name({"kind": "ddtree", **w}) if (w.get("config") or w.get("budget")) else "—"
            if _clean(w.get("config")).lower() == "dflash":
                name = DFLASH
            ranked = w.get("ranked") is not False
            note = _clean(w.get("note"))
            note_html = ("" if ranked else '<span class="badge warn">not ranked</span> ') + _t(note, secret=True)
            tag = ' <span class="muted">(inventory config)</span>' if inventory and name == inventory else ""
            trs.append(f'<tr class="winner-row" data-workload="{_t(workload_label(w))}">'
                       f'<td><b>{_t(workload_label(w))}</b></td>'
                       f'<td class="num">{_t(_int(w.get("concurrency")) or "—")}</td>'
                       f'<td class="num">{_t(_temp(w.get("temperature")))}</td><td><b>{_t(name)}</b>{tag}</td>'
                       f'<td class="num">{_t(_fmt(_num(w.get("tok_s"))))}</td>'
                       f'<td class="gain">{_t(gain_text(w.get("vs_dflash")))}</td>'
                       f'<td class="gain">{_t(gain_text(w.get("vs_inventory")))}</td>'
                       f'<td class="msg">{note_html}</td></tr>')
        body = (f'<table class="winners">{head}{"".join(trs)}</table>'
                '<p class="muted">Gains are ratios of tok/s with their interval over the repeats; an interval '
                'that contains 1.00x is no evidence of a difference.</p>')
    pick = doc.get("pick") if isinstance(doc.get("pick"), dict) else None
    if pick:
        name = config_name({"kind": "ddtree", **pick})
        why = f" — {_t(pick['why'], secret=True)}" if pick.get("why") else ""
        body += f'<p class="pick"><b>Pick:</b> {_t(name)}{why}</p>'
    return f"<h2>Winners</h2>{body}"


def _panels_section(doc: dict, metric: str, title: str, colours: dict[int, str]) -> str:
    panels = tune_panels(doc, metric)
    if not panels:
        return f'<h2>{_t(title)}</h2><p class="muted">No workload was measured: no plot.</p>'
    cards = "".join(f'<div class="card">{panel_svg(p, colours)}</div>' for p in panels)
    return f'<h2>{_t(title)}</h2><div class="panels">{cards}</div>'


_ROW_COLUMNS = (("tok_s", "tok/s", "{:,.1f}"), ("accept_length", "accept length", "{:.2f}"),
                ("ttft_p50_s", "TTFT p50 (ms)", "ms"), ("ttft_p99_s", "TTFT p99 (ms)", "ms"),
                ("itl_p50_s", "ITL p50 (ms)", "ms"), ("itl_p99_s", "ITL p99 (ms)", "ms"),
                ("error_rate", "errors", "%"))


def _cell(row: dict, key: str, fmt: str) -> str:
    v = _num(row.get(key))
    if v is None:
        return "—"
    if fmt == "ms":
        return f"{v * 1000:,.1f}"
    if fmt == "%":
        return f"{v * 100:.1f}%"
    return fmt.format(v)


def _row_order(doc: dict):
    order = {workload_label(w): i for i, w in enumerate(_workloads(doc, _dicts(doc.get("rows"))))}

    def key(r: dict) -> tuple:
        dflash = config_name(r) == DFLASH
        return (order.get(workload_label(r), len(order)), not dflash, _int(r.get("budget")) or 0,
                _int(r.get("topk_cap")) or 0, _clean(r.get("config")))
    return key


def _rows_section(doc: dict) -> str:
    rows = sorted(_dicts(doc.get("rows")), key=_row_order(doc))
    if not rows:
        return '<h2>Measurements</h2><p class="muted">No configuration was measured.</p>'
    inventory = _inventory_config(doc)
    head = ("<tr><th>workload</th><th>config</th><th>host</th><th>status</th>"
            + "".join(f"<th>{label}</th>" for _, label, _ in _ROW_COLUMNS) + "<th>spread</th><th>repeats</th>"
            "<th>reason</th></tr>")
    trs = []
    for r in rows:
        name = config_name(r)
        ok = _clean(r.get("status")) == "ok"
        spread = _num(r.get("tok_s_spread"))
        inv = bool(r.get("inventory")) or (inventory is not None and name == inventory)
        trs.append(f'<tr class="tune-row{"" if ok else " failed"}" data-config="{_t(name)}" '
                   f'data-workload="{_t(workload_label(r))}" data-status="{"ok" if ok else "failed"}">'
                   f'<td class="nowrap">{_t(workload_label(r))}</td><td class="nowrap"><b>{_t(name)}</b>'
                   f'{" <span class=muted>(inventory)</span>" if inv else ""}</td>'
                   f'<td class="nowrap">{_t(r.get("host") or "—")}</td>'
                   f'<td class="{"good" if ok else "bad"}">{_t(r.get("status") or "failed")}</td>'
                   + "".join(f'<td class="num">{_t(_cell(r, k, f))}</td>' for k, _, f in _ROW_COLUMNS)
                   + f'<td class="num">{_t("—" if spread is None else f"±{spread * 100:.1f}%")}</td>'
                   f'<td class="num">{_t(_int(r.get("repeats")) or "—")}</td>'
                   f'<td class="msg">{_t(r.get("reason") or "", secret=True)}</td></tr>')
    return f'<h2>Measurements</h2><table class="rows">{head}{"".join(trs)}</table>'


# -- the page ----------------------------------------------------------------------------------

def render_tune_report(doc: dict, generated_at: float | None = None) -> str:
    """The tune document as one HTML page. Pure: the same document (and `generated_at`, left off
    the page when None) gives the same bytes."""
    doc = doc if isinstance(doc, dict) else {}
    colours = cap_colours(doc)
    body = [_header(doc, generated_at), _winners_section(doc),
            _panels_section(doc, "tok_s", "Throughput against budget", colours),
            _panels_section(doc, "accept_length", "Accept length against budget", colours),
            _rows_section(doc),
            "<footer>Written by ddtree-ops tune. Self-contained: no scripts, nothing fetched.</footer>"]
    title = f"ddtree-ops tune report {_clean(doc.get('tune_id'))}".rstrip()
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_t(title)}</title><style>{CSS}{EXTRA_CSS}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def write_tune_report(path: str | os.PathLike, doc: dict) -> None:
    """Write the page atomically (cf. config/atomic_file.py): a reader or a crash never sees half
    a report, and the previous one stays whole until it is replaced."""
    write_atomically(path, render_tune_report(doc, generated_at=time.time()))


__all__ = ["render_tune_report", "write_tune_report", "tune_panels", "panel_svg", "gain_text", "config_name",
           "workload_label", "cap_colours", "Panel", "Mark"]
