"""The HTML rollout report (ddtree_ops/report.py).

Fast tier: the page as text (every host, bars proportional to durations, gate rows, escaping,
nothing fetched, atomic write). Sandbox tier: one real headless Chromium renders a 4-host report
with a perf gate; the dumped DOM must hold every host's rows and the screenshot must be a real
picture in the legend's colours.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import struct
import subprocess
import time
import zlib
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable

import pytest

from ddtree_ops.cli import report
from ddtree_ops.cli.report import SOURCE_COLOURS, render_report, step_colour, write_report
from kit import STRICT

T0 = 1_780_000_000.0  # the run's start; every step time below is an offset from it

DEPLOY_STEPS = [("preflight", 2.0), ("backup", 3.5), ("install", 1.5), ("daemon-reload", 0.5),
                ("launch check", 4.0), ("drain", 6.0), ("deregister", 1.0), ("stop", 3.0), ("gpus free", 2.0),
                ("restart", 1.0), ("weights", 40.0), ("cuda graphs", 12.0), ("warm-up", 5.0), ("serving", 2.0),
                ("health gate", 6.0), ("perf gate", 30.0), ("soak", 20.0), ("register", 1.0), ("committed", 0.5)]


def steps(start: float, plan: list[tuple[str, float]]) -> list[dict]:
    """Steps as the runbook records them: t at the END of each step. The first step's interval
    starts at its own t (zero width), so `start` is where the first step ends."""
    out, t = [], start
    for i, (name, secs) in enumerate(plan):
        t += 0.0 if i == 0 else secs
        out.append({"step": name, "t": T0 + t, "detail": f"{name} done"})
    return out


def metrics(tps: float, ttft: float, itl: float, err: float, acc: float) -> dict:
    return {"requests": 200, "errors": round(err * 200), "error_rate": err, "output_tokens": 51200,
            "wall_s": 51200 / tps, "output_tps": tps, "ttft_p50_s": ttft, "ttft_p99_s": ttft * 2.4,
            "itl_p50_s": itl, "itl_p99_s": itl * 1.9, "accept_length": acc}


def gate(verdict: str, base: dict, canary: dict, peers: dict | None) -> dict:
    rows = []
    for key in ("output_tps", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "error_rate", "accept_length"):
        b, c = base[key], canary[key]
        rows.append({"metric": key, "baseline": b, "canary": c, "peers": None if peers is None else peers[key],
                     "change": (c / b - 1) if b else None, "verdict": verdict if key == "itl_p99_s" else "pass",
                     "limit": "no more than 10% worse than baseline"})
    return {"verdict": verdict, "baseline": base, "canary": canary, "peers": peers, "rows": rows,
            "reasons": [f"itl_p99_s {verdict}: canary vs baseline within limits"]}


def sample_doc() -> dict:
    """Four hosts: a canary that passed its perf gate, two deployed (one with a marginal gate), one
    that failed its health gate and rolled back, with hostile text in its message and log."""
    base = metrics(1850.0, 0.210, 0.0125, 0.0, 3.1)
    good = metrics(2230.0, 0.195, 0.0104, 0.0, 3.9)
    marginal = metrics(1990.0, 0.231, 0.0141, 0.005, 3.6)
    failed_plan = DEPLOY_STEPS[:14] + [("rollback", 2.0), ("restore", 3.0), ("rollback: restarted", 1.0),
                                       ("rollback: healthy", 35.0), ("rolled back", 0.5)]
    hosts = [
        {"host": "gpu-node-01", "outcome": "deployed", "exit_code": 0, "release": "20261201T101500Z-4f2a9c",
         "failed_step": None, "message": "", "log": [], "steps": steps(0.0, DEPLOY_STEPS),
         "seconds": 141.5, "repaired": None, "perf_gate": gate("pass", base, good, None)},
        {"host": "gpu-node-02", "outcome": "deployed", "exit_code": 0, "release": "20261201T101500Z-4f2a9c",
         "failed_step": None, "message": "", "log": [], "steps": steps(145.0, DEPLOY_STEPS),
         "seconds": 140.0, "repaired": None, "perf_gate": None},
        {"host": "gpu-node-03<b>", "outcome": "rolled_back", "exit_code": 3, "release": "20261130T000000Z-abcdef",
         "failed_step": "health gate",
         "message": "deploy failed at health gate: <script>alert('x')</script> /generate returned 500",
         "log": ["Traceback (most recent call last):", "  File \"ddtree.py\", line 12, in <module>",
                 "RuntimeError: <script>alert(1)</script> & CUDA error: out of memory",
                 "--api-key sk-supersecretvalue"],
         "steps": steps(146.0, failed_plan), "seconds": 160.0, "repaired": None},
        {"host": "gpu-node-04", "outcome": "deployed", "exit_code": 0, "release": "20261201T101500Z-4f2a9c",
         "failed_step": None, "message": "", "log": [], "steps": steps(144.0, DEPLOY_STEPS),
         "seconds": 139.0, "repaired": None,
         "perf_gate": gate("marginal", base, marginal, good)},
    ]
    return {"action": "deploy", "ok": False, "exit_code": 3, "aborted": True,
            "abort_reason": "failure budget exceeded: 1 of 3 hosts failed (max 0%)", "reverted": [],
            "batches": [["gpu-node-01"], ["gpu-node-02", "gpu-node-03<b>", "gpu-node-04"]],
            "notes": ["canary gpu-node-01 passed its perf gate"], "seconds": 310.2,
            "hosts": hosts, "patchset": "ddtree-temp 2.0.0", "bundle": {"name": "ddtree-temp", "sha256": "9f3c…"}}


class Tags(HTMLParser):
    """The page's start tags with their attributes, and its text, as a browser's parser sees them."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data):
        self.text.append(data)


def parse(page: str) -> Tags:
    p = Tags()
    p.feed(page)
    p.close()
    return p


# --------------------------------------------------------------------------- fast tier

def test_every_host_is_in_the_summary_timeline_and_failures():
    doc = sample_doc()
    p = parse(render_report(doc))
    rows = [a["data-host"] for t, a in p.tags if t == "tr" and a.get("class") == "host-row"]
    lanes = [a["data-host"] for t, a in p.tags if t == "g" and a.get("class") == "tl-row"]
    names = [h["host"] for h in doc["hosts"]]
    assert rows == names and lanes == names
    failures = [a["data-host"] for t, a in p.tags if t == "section" and "failure" in a.get("class", "")]
    assert failures == ["gpu-node-03<b>"]  # only the host that failed shows its log
    text = "".join(p.text)
    assert "failure budget exceeded" in text and "ddtree-temp 2.0.0" in text and "exit code 3" in text


def test_phases_are_bars_proportional_to_their_durations():
    doc = sample_doc()
    p = parse(render_report(doc))
    bars = [a for t, a in p.tags if t == "rect" and "phase" in a.get("class", "").split()]
    assert len(bars) == sum(len(h["steps"]) for h in doc["hosts"])
    ratios = [float(b["width"]) / float(b["data-seconds"]) for b in bars if float(b["data-seconds"]) >= 0.5]
    assert ratios and max(ratios) - min(ratios) < 1e-2 * max(ratios)
    # the canary's weights phase is 40 s and its install 1.5 s, on one scale
    canary = [b for b in bars if b["data-step"] in ("weights", "install")][:2]
    widths = {b["data-step"]: float(b["width"]) for b in canary}
    assert widths["weights"] / widths["install"] == pytest.approx(40 / 1.5, rel=1e-3)
    # the first step has no interval of its own; later batches start later on the axis
    assert float(bars[0]["data-seconds"]) == 0.0
    xs = [float(a["x"]) for a in bars if a["data-step"] == "preflight"]
    assert xs[0] < xs[1]
    # colours follow the legend; the failed host's rollback is in the rollback colour
    assert {b["fill"] for b in bars if b["data-step"] == "weights"} == {step_colour("weights")}
    assert {b["fill"] for b in bars if b["data-step"].startswith("rollback")} == {step_colour("rolled back")}


def test_failed_step_is_marked_on_the_timeline():
    doc = sample_doc()
    page = render_report(doc)
    assert page.count('class="fail-mark"') == 1 and "failed at health gate" in page
    # recorded failed step: its bar is outlined
    doc["hosts"][2]["failed_step"] = "weights"
    bars = [a for t, a in parse(render_report(doc)).tags if t == "rect" and "failed" in a.get("class", "").split()]
    assert [b["data-step"] for b in bars] == ["weights"]


def test_perf_gate_rows_verdicts_and_limits_appear():
    doc = sample_doc()
    p = parse(render_report(doc))
    cards = [a["data-metric"] for t, a in p.tags if t == "div" and "gate-row" in a.get("class", "")]
    assert cards.count("itl_p99_s") == 2 and len(cards) == 14  # 7 metrics x 2 gated hosts
    bars = [a for t, a in p.tags if t == "rect" and a.get("class") == "bar"]
    assert {b["data-source"] for b in bars} == {"baseline", "canary", "peers"}
    assert {b["fill"] for b in bars} == set(SOURCE_COLOURS.values())
    text = "".join(p.text)
    assert "no more than 10% worse than baseline" in text and "marginal" in text
    assert "2,230 tok/s" in text and "+20.5% vs baseline" in text  # 2230 / 1850 - 1
    gated = [a["data-host"] for t, a in p.tags if t == "section" and "gate" in a.get("class", "").split()]
    assert gated == ["gpu-node-01", "gpu-node-04"]


def test_bar_lengths_in_a_metric_chart_follow_the_values():
    svg = report.metric_svg({"metric": "output_tps", "baseline": 1000.0, "canary": 1500.0, "peers": None})
    widths = {a["data-source"]: float(a["width"]) for t, a in parse(svg).tags if t == "rect"}
    assert widths["canary"] / widths["baseline"] == pytest.approx(1.5, rel=1e-3) and widths["peers"] == 0


def test_every_document_value_is_escaped():
    doc = sample_doc()
    evil = "<script>alert('owned')</script>"
    doc["hosts"][0]["message"] = evil
    doc["hosts"][0]["host"] = 'x"><img src=x onerror=alert(1)>'
    doc["hosts"][0]["steps"][3]["step"] = "<svg onload=alert(2)>"
    doc["hosts"][0]["perf_gate"]["rows"][0]["limit"] = "</div><script>alert(3)</script>"
    doc["abort_reason"] = "<iframe src=javascript:alert(4)>"
    doc["patchset"] = "<b>bold</b>"
    doc["hosts"][2]["log"].append("\x1b[31mred\x1b[0m \x00")
    page = render_report(doc, title="<i>title</i>")
    assert "<script" not in page.lower() and "<img" not in page and "<iframe" not in page
    assert "<svg onload" not in page and "<b>bold" not in page and "<i>title" not in page
    assert "\x1b" not in page and "\x00" not in page
    p = parse(page)
    assert not [a for _, a in p.tags if any(k.startswith("on") for k in a)]  # no event handler attributes
    text = "".join(p.text)
    assert evil in text  # shown as text, as written
    assert "<script>alert(1)</script> & CUDA error" in text  # the failed host's log line, literal
    assert "\\x1b[31mred" in text
    assert "sk-supersecretvalue" not in page  # secrets masked again, whatever built the document


def test_no_external_urls_or_scripts():
    doc = sample_doc()
    doc["hosts"][2]["log"].append("GET https://10.0.0.3:30000/generate -> 500")  # text may mention a URL
    page = render_report(doc)
    assert not re.search(r"""(?:src|href|action|xlink:href)\s*=\s*["']?\s*(?:https?:)?//""", page, re.I)
    assert "@import" not in page and "url(" not in page and "<link" not in page.lower()
    assert "<script" not in page.lower()
    assert "default-src 'none'" in page  # the browser is told too: nothing fetched, no script run


def test_render_is_pure_and_survives_partial_documents():
    doc = sample_doc()
    assert render_report(doc, generated_at=T0) == render_report(doc, generated_at=T0)
    assert "report written" not in render_report(doc)  # no clock read unless asked
    odd = {"action": "rollback", "ok": True, "exit_code": 0, "hosts": [
        {"host": "a", "outcome": "skipped", "steps": []},
        {"host": "b", "outcome": "rolled_back", "exit_code": 0,
         "steps": [{"step": "mystery", "t": "soon"}, {"step": "new-step", "t": T0}, {"step": "x", "t": float("nan")}],
         "perf_gate": {"verdict": "weird", "rows": [{"metric": "new_metric", "canary": 2.0}]}},
    ]}
    page = render_report(odd)
    assert 'data-host="a"' in page and 'data-step="new-step"' in page and "no steps recorded" in page
    assert render_report({}).startswith("<!DOCTYPE html>")


class Notes:
    """A rollout's progress view that keeps its notes: the CLI's own batch names."""

    def __init__(self):
        self.said: list[str] = []

    def __getattr__(self, name):
        return lambda *a: None

    def note(self, msg: str) -> None:
        self.said.append(msg)


@pytest.mark.parametrize(("canary", "batch", "kind"), [(1, "1", "deploy"), (1, None, "deploy"), (2, "1", "deploy"),
                                                       (0, "2", "rollback")])
def test_batches_are_numbered_as_the_cli_numbers_them(canary, batch, kind):
    from ddtree_ops.config.inventory import parse_inventory
    from ddtree_ops.fleet.rollout import Rollout, Target
    from ddtree_ops.runbook.results import HostResult, Outcome
    from ddtree_ops.testing.fake_host import fake_inventory

    inv = parse_inventory(fake_inventory(4), "inv.yaml")
    targets = [Target(h.name, (h,)) for h in inv.hosts.values()]
    ok = Outcome.DEPLOYED if kind == "deploy" else Outcome.ROLLED_BACK
    view = Notes()
    res = Rollout(targets, lambda t, report: [HostResult(t.name, ok, 0)], kind=kind, canary=canary, batch=batch,
                  progress=view).run()
    said = [n for n in view.said if n.startswith(("canary:", "batch "))]
    doc = {**res.to_dict(), "canary": canary}
    labels = report.batch_labels(doc["batches"], report._canary_count(doc))
    assert [f"{label}: {', '.join(b)}" for label, b in zip(labels, doc["batches"], strict=True)] == said
    page = parse(render_report(doc))
    assert all(f"{label}: " in "".join(page.text) for label in labels)
    if canary == 1 and batch == "1":  # the control: the old numbering skipped "batch 1"
        assert labels == ["canary", "batch 1", "batch 2", "batch 3"]
    if kind == "rollback":
        assert "canary" not in labels and report._canary_count({"action": "rollback"}) == 0


def rollback_doc(action: str) -> dict:
    plan = [("rollback", 1.0), ("restore", 2.0), ("rollback: restarted", 1.0), ("rollback: healthy", 20.0),
            ("rolled back", 0.5)]
    return {"action": action, "ok": action == "rollback", "exit_code": 0 if action == "rollback" else 3,
            "batches": [["gpu-node-01"]], "hosts": [
                {"host": "gpu-node-01", "outcome": "rolled_back", "exit_code": 0 if action == "rollback" else 3,
                 "steps": steps(0.0, plan), "seconds": 24.5}]}


def test_a_successful_rollback_is_drawn_in_the_colours_of_what_it_did_not_in_red():
    red = step_colour("rolled back")
    fills = {a["data-step"]: a["fill"] for t, a in parse(render_report(rollback_doc("rollback"))).tags
             if t == "rect" and "phase" in a.get("class", "")}
    assert red not in fills.values(), fills
    assert fills["rollback: healthy"] == step_colour("health gate") and fills["rolled back"] == step_colour("commit")
    page = render_report(rollback_doc("rollback"))
    assert '<span class="badge good">OK</span>' in page
    control = {a["fill"] for t, a in parse(render_report(rollback_doc("deploy"))).tags  # a deploy that failed
               if t == "rect" and "phase" in a.get("class", "")}
    assert control == {red}
    assert '<span class="badge warn">ROLLED BACK: healthy</span>' in render_report(rollback_doc("deploy"))


def exit_cells(page: str) -> dict[str, str]:
    """host → the exit cell of its summary row."""
    return dict(re.findall(r'class="host-row" data-host="([^"]+)">.*?<td class="num">([^<]*)</td>', page))


def test_a_host_that_never_started_shows_no_exit_code_of_its_own():
    doc = sample_doc()
    doc["hosts"].append({"host": "gpu-node-05", "outcome": "skipped", "exit_code": 0,
                         "message": "not started: canary failed (1 of 1)", "steps": []})
    exits = exit_cells(render_report(doc))
    assert exits["gpu-node-05"] == "not run" and exits["gpu-node-01"] == "0"  # the control: a real exit 0
    doc["hosts"][-1]["exit_code"] = 1  # skipped because of an interrupt: it counts as exit 1
    assert exit_cells(render_report(doc))["gpu-node-05"] == "not run (1)"


def test_what_an_operator_wants_first_is_at_the_top():
    doc = {**sample_doc(), "ran_by": "ops@console", "change": {
        "from": "sglang-k26-dflash-cg.service or the release each host ran before",
        "to": "sglang-k26-ddtree.service: ddtree-temp 2.0.0, budget 16, topk 4, bundle b-9f3c"}}
    doc["hosts"][1]["serving"] = {"before": {"accept_length": 1.0, "output_tps": 0.0},
                                  "after": {"accept_length": 3.42, "output_tps": 812.0}, "source": "server"}
    page = render_report(doc)
    head = page[:page.index("<h2>Hosts</h2>")]
    text = "".join(parse(head).text)
    assert "sglang-k26-dflash-cg.service or the release each host ran before → sglang-k26-ddtree.service: " \
           "ddtree-temp 2.0.0, budget 16, topk 4, bundle b-9f3c" in text
    assert "ops@console" in text
    assert "client errors" in text and "not measured" in text
    serving = page[page.index("<h2>Serving before → after</h2>"):page.index("<h2>Timeline</h2>")]
    rows = dict(re.findall(r'<b>([^<]+)</b></td>(.*?)</tr>', serving))
    assert "3.10 → 3.90" in rows["gpu-node-01"] and "1,850 → 2,230" in rows["gpu-node-01"]  # the perf gate's
    assert "1.00 → 3.42" in rows["gpu-node-02"] and "0 → 812" in rows["gpu-node-02"]  # the server's reads
    assert "not measured" in rows["gpu-node-04"] or "→" in rows["gpu-node-04"]
    assert "not measured" in rows["gpu-node-03&lt;b&gt;"]  # neither a gate nor a read: said, not left blank
    sampled = render_report({**doc, "client_errors": {"requests": 370, "failed": 15, "router": "http://r:1"}})
    assert "15 of 370 requests failed</span> through http://r:1" in sampled  # the control: a sample is shown


def assert_written_atomically(monkeypatch, out: Path, write: Callable[[], None], marker: str) -> None:
    """`write()` puts a page at `out` through a temp file in the same folder renamed over it (the old
    page stays whole until the rename), with `marker` and its time in it, and leaves nothing else."""
    out.write_text("old report")
    seen = []
    real_replace = os.replace

    def replace(src, dst):
        seen.append((Path(src).parent, Path(src).read_text(encoding="utf-8")[:15]))
        assert out.read_text() == "old report"
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)  # what config/atomic_file.py renames with
    write()
    monkeypatch.setattr(os, "replace", real_replace)
    assert seen == [(out.parent, "<!DOCTYPE html>")]
    text = out.read_text(encoding="utf-8")
    assert marker in text and "report written" in text
    assert list(out.parent.iterdir()) == [out]


def test_write_report_is_atomic(tmp_path, monkeypatch):
    out = tmp_path / "r.html"
    assert_written_atomically(monkeypatch, out, lambda: write_report(out, sample_doc()), "gpu-node-04")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(report.os, "replace", boom)
    with pytest.raises(OSError):
        write_report(out, sample_doc())
    assert list(tmp_path.iterdir()) == [out]  # no temp file left behind
    assert "gpu-node-04" in out.read_text(encoding="utf-8")


# --------------------------------------------------------------------------- real browser (sandbox tier)

def chromium() -> str:
    exe = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    if exe:
        return exe
    msg = "chromium not installed (apt-get install -y chromium; scripts/setup does)"
    if STRICT:
        pytest.fail(msg)
    pytest.skip(msg)


def run_browser(exe: str, args: list[str], tmp: Path, timeout: float = 60.0) -> bytes:
    """One headless Chromium run, with its own profile and HOME under tmp and nothing reaching the
    network. Its own process group, so on a timeout the browser and its helpers (zygote, renderer,
    GPU process) are killed together by the group of the PID we started."""
    env = dict(os.environ, HOME=str(tmp), XDG_CONFIG_HOME=str(tmp / "cfg"), XDG_CACHE_HOME=str(tmp / "cache"))
    argv = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
            "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-sync",
            "--disable-background-networking", "--disable-component-update", "--disable-breakpad",
            "--disable-features=Translate,MediaRouter,OptimizationHints", "--force-device-scale-factor=1",
            "--force-color-profile=srgb", f"--user-data-dir={tmp / 'profile'}", *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"chromium did not finish in {timeout:.0f} s: {' '.join(argv)}")
    finally:
        try:  # helpers that outlived the browser (its group is still ours)
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB/RGBA PNG (what Chromium writes) with zlib and struct: (width, height,
    rows of RGB(A) bytes), each row's filter undone byte by byte (a 1400x2200 shot: about 2 s)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, head = 8, [], None
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            head = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    width, height, depth, ctype, _, _, interlace = head
    assert depth == 8 and ctype in (2, 6) and interlace == 0, head
    bpp = 3 if ctype == 2 else 4
    raw, stride = zlib.decompress(b"".join(idat)), width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if f == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 255
        elif f == 2:
            line = bytearray((a + b) & 255 for a, b in zip(line, prev, strict=True))
        elif f == 3:
            for i in range(stride):
                line[i] = (line[i] + ((line[i - bpp] if i >= bpp else 0) + prev[i]) // 2) & 255
        elif f == 4:
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, rows


def colours(width: int, rows: list[bytes]) -> dict[tuple[int, int, int], int]:
    bpp = len(rows[0]) // width
    counts: dict[tuple[int, int, int], int] = {}
    for row in rows:
        for x in range(0, len(row), bpp):
            rgb = (row[x], row[x + 1], row[x + 2])
            counts[rgb] = counts.get(rgb, 0) + 1
    return counts


def hex_rgb(h: str) -> tuple[int, int, int]:
    return int(h[1:3], 16), int(h[3:5], 16), int(h[5:7], 16)


@pytest.mark.sandbox
def test_headless_chromium_renders_every_host(tmp_path):
    exe = chromium()
    doc = sample_doc()
    page = write_report(tmp_path / "report.html", doc, generated_at=T0)
    url = page.resolve().as_uri()
    started = time.monotonic()

    # What the browser parsed: every host's summary row, timeline lane and bars, no script node.
    dom = run_browser(exe, ["--dump-dom", url], tmp_path / "dom").decode("utf-8")
    p = parse(dom)
    names = [h["host"] for h in doc["hosts"]]
    assert [a["data-host"] for t, a in p.tags if t == "tr" and a.get("class") == "host-row"] == names
    assert [a["data-host"] for t, a in p.tags if t == "g" and a.get("class") == "tl-row"] == names
    assert len([a for t, a in p.tags if t == "rect" and "phase" in a.get("class", "")]) == 4 * 19
    assert not [t for t, _ in p.tags if t == "script"]
    assert "<script>alert(1)</script> & CUDA error" in "".join(p.text)

    # What it drew: a real picture (many colours), with the phase and gate colours of the legend.
    shot = tmp_path / "shot.png"
    run_browser(exe, [f"--screenshot={shot}", "--window-size=1400,2200", url], tmp_path / "shot")
    width, height, rows = png_pixels(shot.read_bytes())
    assert (width, height) == (1400, 2200)
    counts = colours(width, rows)
    assert len(counts) > 200, f"{len(counts)} colours: a blank or broken page"
    want = {step_colour(s) for s in ("preflight", "weights", "health gate", "committed", "rolled back", "drain")}
    want |= set(SOURCE_COLOURS.values())
    missing = [c for c in sorted(want) if counts.get(hex_rgb(c), 0) < 40]
    assert not missing, f"colours not drawn (or not visible in the window): {missing}"
    if os.environ.get("DDTREE_OPS_REPORT_SAMPLE"):  # keep a copy to look at (tmp_path is cleaned up)
        shutil.copyfile(shot, os.environ["DDTREE_OPS_REPORT_SAMPLE"])
    print(f"chromium: DOM and screenshot in {time.monotonic() - started:.1f} s")


def test_a_deploy_reads_the_servers_accept_length_and_throughput_before_and_after(tmp_path, patchset):
    from ddtree_ops.fleet.actions import rolling_deploy
    from ddtree_ops.fleet.rollout import Target
    from ddtree_ops.fleet.serving_sample import throughput
    from ddtree_ops.runbook.phases import DeployOptions
    from ddtree_ops.testing.fake_host import DDTREE_UNIT, DFLASH_UNIT, fake_hosts

    fake = fake_hosts(tmp_path / "h")[0]
    fake.accept_lengths = {DFLASH_UNIT: 1.0, DDTREE_UNIT: 3.4}
    res = rolling_deploy([Target("fh1", (fake.host,))], patchset, DeployOptions(reconnect_s=5),
                         connect=lambda host: fake.session())
    serving = res.to_dict()["hosts"][0]["serving"]
    assert serving["before"]["accept_length"] == 1.0 and serving["after"]["accept_length"] == 3.4, serving
    assert serving["before"]["output_tps"] is None  # the fake server has no /metrics: not a made-up 0
    assert "1.00 → 3.40" in render_report(res.to_dict())
    metrics = ('# TYPE sglang:gen_throughput gauge\nsglang:gen_throughput{model_name="m",tp_rank="0"} 812.5\n'
               'sglang:gen_throughput{model_name="m",tp_rank="1"} 10\nsglang:gen_throughput_other 99\n')
    assert throughput(metrics) == 822.5 and throughput("# nothing here\n") is None
