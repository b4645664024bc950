"""The tune's HTML report (ddtree_ops/cli/tune_report.py).

Fast tier only: the page as text and its SVG parsed as XML. A tune of two workloads over seven
configs (DFlash, budgets 4/8/16 × topk caps 1/2), one of which crashed at start-up: a tok/s and an
accept-length panel per workload, a line per topk cap in each, the failure as an "x" with its
reason, the winners' gains with their intervals; hostile text escaped; a partial or empty
document still a page.
"""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET

import pytest
from test_report import (  # the deploy report's parser: the same tags and text a browser sees
    assert_written_atomically,
    parse,
)

from ddtree_ops.cli.tune_report import gain_text, render_tune_report, tune_panels, write_tune_report

T0 = 1_780_000_000.0
EVIL_REASON = "deploy failed at cuda graphs: <script>alert('x')</script> & budget 16 > 8 on sm_103"

# (budget, topk cap) -> tok/s at c1 and c8, accept length; None for DFlash
CONFIGS = {None: (100.0, 400.0, 2.6), (4, 1): (110.0, 430.0, 2.9), (8, 1): (118.0, 440.0, 3.2),
           (16, 1): (121.0, 420.0, 3.4), (4, 2): (115.0, 470.0, 3.1), (8, 2): (126.0, 450.0, 3.6),
           (16, 2): (131.0, 390.0, 3.9)}


def row(cfg: tuple[int, int] | None, workload: str, concurrency: int, temperature: float, tok_s: float | None,
        accept: float | None, *, status: str = "ok", reason: str | None = None, host: str = "gpu-a") -> dict:
    budget, cap = cfg if cfg else (None, None)
    return {"config": f"{budget}/{cap}" if cfg else "DFlash", "kind": "ddtree" if cfg else "dflash",
            "budget": budget, "topk_cap": cap, "inventory": cfg == (8, 2), "host": host,
            "concurrency": concurrency, "temperature": temperature, "workload": workload, "status": status,
            "reason": reason, "tok_s": tok_s, "tok_s_spread": None if tok_s is None else 0.03,
            "repeats": 3 if tok_s is not None else 0, "samples_tok_s": [] if tok_s is None else [tok_s] * 3,
            "accept_length": accept, **({"ttft_p50_s": 0.08, "ttft_p99_s": 0.21, "itl_p50_s": 0.011,
                                         "itl_p99_s": 0.024, "error_rate": 0.0} if tok_s is not None else
                                        dict.fromkeys(("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                                                       "error_rate")))}


def sample_doc() -> dict:
    """Two workloads, seven configs each; 16/2 crashed capturing CUDA graphs at c1 (a failed row
    with null numbers and a hostile reason) and won at no workload."""
    rows = []
    for (label, conc, temp, col) in (("c1 T0", 1, 0.0, 0), ("c8 T0.7", 8, 0.7, 1)):
        for cfg, figures in CONFIGS.items():
            if cfg == (16, 2) and conc == 1:
                rows.append(row(cfg, label, conc, temp, None, None, status="failed", reason=EVIL_REASON,
                                host="gpu-b"))
            else:
                rows.append(row(cfg, label, conc, temp, figures[col], figures[2], host="gpu-a" if cfg else "gpu-b"))
    return {
        "tune_id": "t-20261204-0912", "started_at": T0, "finished_at": T0 + 1830.0, "inventory": "inventory/x.yaml",
        "hosts": ["gpu-a", "gpu-b"], "objective": {"kind": "throughput", "ttft_p99_max_s": 0.5, "itl_p99_max_s": None},
        "grid": {"budgets": [4, 8, 16], "topk_caps": [1, 2], "inventory_config": {"budget": 8, "topk_cap": 2}},
        "workloads": [{"label": "c1 T0", "concurrency": 1, "temperature": 0.0, "max_new_tokens": 64, "duration_s": 5},
                      {"label": "c8 T0.7", "concurrency": 8, "temperature": 0.7, "max_new_tokens": 64,
                       "duration_s": 5}],
        "rows": rows,
        "winners": [
            {"workload": "c1 T0", "concurrency": 1, "temperature": 0.0, "config": "8/2", "budget": 8, "topk_cap": 2,
             "tok_s": 126.0, "vs_dflash": {"ratio": 1.26, "low": 1.19, "high": 1.33},
             "vs_inventory": {"ratio": 1.0, "low": 1.0, "high": 1.0}, "ranked": True, "note": ""},
            {"workload": "c8 T0.7", "concurrency": 8, "temperature": 0.7, "config": "4/2", "budget": 4,
             "topk_cap": 2, "tok_s": 470.0, "vs_dflash": {"ratio": 1.42, "low": 1.35, "high": 1.49},
             "vs_inventory": {"ratio": 1.04, "low": 0.98, "high": 1.1}, "ranked": False,
             "note": "spread 6% after 5 repeats: 4/2 and 8/2 overlap"}],
        "pick": {"config": "4/2", "budget": 4, "topk_cap": 2, "why": "wins at c8, the fleet's traffic"},
        "interrupted": False,
        "restored": [{"host": "gpu-a", "release": "r-20261201-aa", "ok": True, "message": "routed again"},
                     {"host": "gpu-b", "release": "r-20261201-aa", "ok": True, "message": ""}]}




def svgs(page: str) -> list[ET.Element]:
    """Every panel, parsed as XML: a panel that is not well-formed fails here."""
    return [ET.fromstring(s) for s in re.findall(r"<svg\b.*?</svg>", page, flags=re.S)]


def panels_of(page: str, metric: str) -> dict[str, ET.Element]:
    return {s.get("data-workload"): s for s in svgs(page) if s.get("data-metric") == metric}


def by_class(el: ET.Element, tag: str, cls: str) -> list[ET.Element]:
    return [e for e in el.iter(tag) if cls in (e.get("class") or "").split()]


def points(polyline: ET.Element) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in (p.split(",") for p in polyline.get("points", "").split())]


def test_one_throughput_and_one_accept_panel_per_workload():
    page = render_tune_report(sample_doc())
    for metric in ("tok_s", "accept_length"):
        assert list(panels_of(page, metric)) == ["c1 T0", "c8 T0.7"]


def test_each_throughput_panel_has_one_line_per_topk_cap_through_its_measured_budgets():
    page = render_tune_report(sample_doc())
    for workload, svg in panels_of(page, "tok_s").items():
        lines = {pl.get("data-topk-cap"): pl for pl in by_class(svg, "polyline", "cap-line")}
        assert sorted(lines) == ["1", "2"], workload
        want = {"1": 3, "2": 2 if workload == "c1 T0" else 3}  # 16/2 failed at c1: no point for it
        assert {cap: len(points(pl)) for cap, pl in lines.items()} == want
        for pl in lines.values():
            xs = [x for x, _ in points(pl)]
            assert xs == sorted(xs)  # drawn left to right by budget


def test_budgets_are_log2_spaced_and_higher_throughput_is_drawn_higher():
    page = render_tune_report(sample_doc())
    svg = panels_of(page, "tok_s")["c8 T0.7"]
    ticks = {int(t.get("data-budget")): float(t.get("x1")) for t in by_class(svg, "line", "x-tick")}
    assert sorted(ticks) == [4, 8, 16]
    assert math.isclose(ticks[8] - ticks[4], ticks[16] - ticks[8], rel_tol=1e-6)  # one doubling, one step
    cap1 = points(next(pl for pl in by_class(svg, "polyline", "cap-line") if pl.get("data-topk-cap") == "1"))
    ys = [y for _, y in cap1]  # 430, 440, 420 tok/s: the middle one highest, i.e. smallest y
    assert ys[1] < ys[0] < ys[2]


def test_dflash_is_a_dashed_horizontal_line_at_its_throughput():
    page = render_tune_report(sample_doc())
    for workload, svg in panels_of(page, "tok_s").items():
        (line,) = by_class(svg, "line", "dflash-line")
        assert line.get("stroke-dasharray") and line.get("y1") == line.get("y2")
        (group,) = by_class(svg, "g", "dflash")
        assert float(group.get("data-value")) == (100.0 if workload == "c1 T0" else 400.0)


def test_the_failed_config_is_an_x_on_the_axis_with_its_escaped_reason():
    page = render_tune_report(sample_doc())
    for metric in ("tok_s", "accept_length"):
        panels = panels_of(page, metric)
        (failed,) = by_class(panels["c1 T0"], "g", "failed-config")
        assert failed.get("data-config") == "16/2"
        assert failed.find("title").text == f"16/2 failed: {EVIL_REASON}"  # the reason, as the host wrote it
        assert failed.find("path") is not None  # the x
        assert not by_class(panels["c8 T0.7"], "g", "failed-config")  # it ran at c8
    assert "<script>alert" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    failed_rows = [a for t, a in parse(page).tags if t == "tr" and a.get("data-status") == "failed"]
    assert [(a["data-config"], a["data-workload"]) for a in failed_rows] == [("16/2", "c1 T0")]


def test_inventory_config_and_winner_are_marked_in_their_panels():
    page = render_tune_report(sample_doc())
    for metric in ("tok_s", "accept_length"):
        panels = panels_of(page, metric)
        for workload, winner in (("c1 T0", "8/2"), ("c8 T0.7", "4/2")):
            svg = panels[workload]
            marked = {g.get("data-config") for g in by_class(svg, "g", "point") if by_class(g, "g", "winner-mark")}
            ringed = {g.get("data-config") for g in by_class(svg, "g", "point")
                      if by_class(g, "circle", "inventory-mark")}
            assert marked == {winner} and ringed == {"8/2"}, (metric, workload)


def test_each_panel_has_axis_labels_ticks_and_a_legend_of_what_it_draws():
    page = render_tune_report(sample_doc())
    svg = panels_of(page, "tok_s")["c1 T0"]
    text = " ".join(t.text or "" for t in svg.iter("text"))
    assert "output throughput (tok/s)" in text and "tree budget (log2 scale)" in text
    assert len(by_class(svg, "line", "y-tick")) >= 3
    legend = " ".join(t.text or "" for g in by_class(svg, "g", "legend") for t in g.iter("text"))
    for item in ("topk cap 1", "topk cap 2", "DFlash", "inventory config", "winner", "failed"):
        assert item in legend


def test_winners_table_shows_gains_with_intervals_and_says_when_not_ranked():
    p = parse(render_tune_report(sample_doc()))
    text = "".join(p.text)
    assert "1.26x (1.19–1.33)" in text and "1.42x (1.35–1.49)" in text and "1.04x (0.98–1.10)" in text
    assert [a["data-workload"] for t, a in p.tags if t == "tr" and a.get("class") == "winner-row"] == \
        ["c1 T0", "c8 T0.7"]
    assert text.count("not ranked") == 1 and "4/2 and 8/2 overlap" in text
    assert "Pick: 4/2 — wins at c8, the fleet's traffic" in text
    assert "throughput subject to p99 TTFT ≤ 500 ms" in text


@pytest.mark.parametrize("gain, shown", [({"ratio": 1.42, "low": 1.35, "high": 1.49}, "1.42x (1.35–1.49)"),
                                         ({"ratio": 0.9}, "0.90x"), (None, "—"), ({"ratio": None}, "—"),
                                         ({"ratio": float("nan")}, "—"), ("1.4", "—")])
def test_gain_text(gain, shown):
    assert gain_text(gain) == shown


def test_hostile_host_names_and_text_are_escaped_everywhere():
    doc = sample_doc()
    evil_host = 'gpu-c"><script>alert(1)</script>'
    doc["hosts"].append(evil_host)
    doc["rows"][0]["host"] = evil_host
    doc["restored"].append({"host": evil_host, "release": "<img src=x onerror=alert(2)>", "ok": False,
                            "message": "<iframe src=javascript:alert(3)>"})
    doc["winners"][1]["note"] = "<svg onload=alert(4)>"
    doc["tune_id"] = "</title><script>alert(5)</script>"
    doc["workloads"][0]["label"] = "<b>c1</b>"
    for r in doc["rows"]:
        if r["workload"] == "c1 T0":
            r["workload"] = "<b>c1</b>"
    doc["winners"][0]["workload"] = "<b>c1</b>"
    doc["rows"][1]["reason"] = "\x1b[31mred\x1b[0m --api-key sk-supersecretvalue"
    page = render_tune_report(doc)
    assert "<script" not in page.lower() and "<img" not in page and "<iframe" not in page
    assert "<svg onload" not in page and "<b>c1" not in page and "\x1b" not in page
    assert "sk-supersecretvalue" not in page  # secrets masked again, whatever built the document
    p = parse(page)
    assert not [a for _, a in p.tags if any(k.startswith("on") for k in a)]  # no event handler attributes
    assert not [t for t, _ in p.tags if t in ("script", "img", "iframe")]
    text = "".join(p.text)
    assert evil_host in text and "\\x1b[31mred" in text
    assert list(panels_of(page, "tok_s")) == ["<b>c1</b>", "c8 T0.7"]  # well-formed SVG, names intact


def test_page_is_self_contained():
    page = render_tune_report(sample_doc())
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", page)
    assert "<link" not in page and "@import" not in page and "url(" not in page


def test_an_interrupted_tune_with_few_rows_renders_and_says_so():
    doc = sample_doc()
    doc["interrupted"] = True
    doc["rows"] = doc["rows"][:2]  # DFlash and 4/1 at c1, then Ctrl-C
    doc["winners"] = []
    doc["pick"] = None
    p = parse(render_tune_report(doc))
    text = "".join(p.text)
    assert "INTERRUPTED" in text and "Tune interrupted." in text and "2 rows measured" in text
    assert "No winner" in text
    page = render_tune_report(doc)
    c8 = panels_of(page, "tok_s")["c8 T0.7"]  # a workload never reached still has its panel, empty
    assert "not measured" in " ".join(t.text or "" for t in c8.iter("text"))
    assert not by_class(c8, "polyline", "cap-line")


@pytest.mark.parametrize("doc", [{}, {"interrupted": True}, {"rows": None, "winners": None, "grid": None},
                                 {"rows": [{}], "workloads": [{}], "winners": [{}], "restored": [{}]},
                                 {"rows": [{"status": "failed", "budget": "x", "topk_cap": -1, "tok_s": "nan"}],
                                  "grid": {"budgets": 8, "topk_caps": None, "inventory_config": {"budget": 0}}},
                                 {"rows": [{"status": "ok", "budget": 8, "topk_cap": 2, "tok_s": float("inf"),
                                            "accept_length": None, "workload": "w"}]}])
def test_partial_or_malformed_documents_render_without_error(doc):
    page = render_tune_report(doc)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    svgs(page)  # whatever panels there are, well-formed
    if doc.get("interrupted"):
        assert "INTERRUPTED" in page
    else:
        assert "COMPLETE" in page


def test_an_interrupted_empty_tune_says_nothing_was_measured():
    text = "".join(parse(render_tune_report({"tune_id": "t-1", "interrupted": True})).text)
    assert "Tune interrupted." in text and "0 rows measured" in text and "No configuration was measured" in text


def test_panels_from_data_hold_the_failed_config_dflash_and_winner():
    (c1, c8) = tune_panels(sample_doc(), "tok_s")
    assert (c1.workload, c1.concurrency, c1.temperature, c1.budgets) == ("c1 T0", 1, 0.0, (4, 8, 16))
    assert [m.config for m in c1.failed] == ["16/2"] and c1.failed[0].value is None
    assert c1.dflash is not None and c1.dflash.value == 100.0 and c1.winner == "8/2"
    assert [m.value for m in c8.lines[2]] == [470.0, 450.0, 390.0] and c8.winner == "4/2"
    assert [m.config for m in c8.marks if m.inventory] == ["8/2"]


def test_a_dflash_winner_and_a_failed_control_are_drawn():
    doc = sample_doc()
    doc["winners"][0].update(config="DFlash", budget=None, topk_cap=None)
    dflash_c8 = next(r for r in doc["rows"] if r["workload"] == "c8 T0.7" and r["kind"] == "dflash")
    dflash_c8.update(status="failed", reason="out of memory <b>", tok_s=None, accept_length=None)
    panels = panels_of(render_tune_report(doc), "tok_s")
    (c1_dflash,) = by_class(panels["c1 T0"], "g", "dflash")
    assert c1_dflash.find("polygon") is not None  # the star on the control's line
    (failed,) = by_class(panels["c8 T0.7"], "g", "dflash-failed")
    assert failed.find("title").text == "DFlash failed: out of memory <b>"
    assert not by_class(panels["c8 T0.7"], "line", "dflash-line")


def test_render_is_deterministic():
    doc = sample_doc()
    assert render_tune_report(doc, generated_at=T0) == render_tune_report(doc, generated_at=T0)
    assert "report written" not in render_tune_report(doc)


def test_write_tune_report_is_atomic(tmp_path, monkeypatch):
    out = tmp_path / "tune.html"
    assert_written_atomically(monkeypatch, out, lambda: write_tune_report(str(out), sample_doc()), "t-20261204-0912")
