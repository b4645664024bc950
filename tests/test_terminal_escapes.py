"""Text from hosts, servers and files never reaches the operator's terminal or a CI log raw.

A host's error message, a release record, a server's log line (the log tail of a failed start,
the "waiting N s: LINE" progress notes while the weights load) may carry terminal escapes: a
clipboard write (ESC]52), a window title (ESC]0), a line erase, BEL, backspace, CR, C1 controls
and bidi overrides. Every output path shows them as visible escapes (`\\x1b`, `\\u202e`) instead.

Fast tier: `terminal_safe` itself, then the CLI in-process against fake hosts whose agent replies
and unit logs carry such text (plan, history, status, a failed deploy with its log tail and its
progress lines on a stderr that is not a TTY), the live view, `--json` and the HTML report. Each
CLI test runs once more with `terminal_safe` replaced by the identity (`raw`): the same output
then holds the raw escapes, so the hostile text really reached that path.

Sandbox: the real stand-in server, failing its start after printing escapes and bidi overrides,
through `ddtree-ops deploy` as a subprocess with stdout and stderr pipes.
"""

from __future__ import annotations

import dataclasses
import html
import json
import unicodedata

import pytest
from typer.testing import CliRunner

from ddtree_ops.cli.commands import app
from ddtree_ops.config.inventory import parse_inventory
from ddtree_ops.config.terminal import terminal_safe
from ddtree_ops.host.hooks import NO_HOOKS, Hooks
from ddtree_ops.testing import fake_systemd
from ddtree_ops.testing.fake_host import FAKE_CRASH, FakeHost, fake_inventory
from fast_kit import PROBE_REL, UPSTREAM_BYTES, UPSTREAM_REL, write_patchset

# What a hostile host or server may send, and how each must look once printed.
HOSTILE = {
    "clipboard write": ("\x1b]52;c;cHduZWQ=\x07", "\\x1b]52;c;cHduZWQ=\\x07"),
    "window title": ("\x1b]0;owned\x1b\\", "\\x1b]0;owned\\x1b\\"),
    "line erase and carriage return": ("\x1b[2K\rdeployed OK", "\\x1b[2K\\rdeployed OK"),
    "bell and backspace": ("\x07\x08\x08ok", "\\x07\\x08\\x08ok"),
    "C1 CSI and OSC": ("\x9b2J\x9d0;t\x9c", "\\x9b2J\\x9d0;t\\x9c"),
    "bidi overrides": ("\u202etxt.exe\u202c \u2066x\u2069", "\\u202etxt.exe\\u202c \\u2066x\\u2069"),
    "zero width and separators": ("a\u200bb\u2028c\ufeff", "a\\u200bb\\u2028c\\ufeff"),
    "lone surrogate": ("\ud800", "\\ud800"),
}
# What the CLI tests send: all of it but the lone surrogate (which no pipe could carry raw).
EVIL = " ".join(raw for kind, (raw, _) in HOSTILE.items() if kind != "lone surrogate")
EVIL_SHOWN = " ".join(shown for kind, (_, shown) in HOSTILE.items() if kind != "lone surrogate")
# A server's log line: EVIL without what ends a line (CR, U+2028), since the controller reads the
# journal line by line (str.splitlines) and such a character starts the next line of the tail.
EVIL_LINE = EVIL.replace("\r", "").replace("\u2028", "")
EVIL_LINE_SHOWN = EVIL_SHOWN.replace("\\r", "").replace("\\u2028", "")
# One marker per kind of attack: each must be visible wherever EVIL was printed.
MARKERS = ("\\x1b]52;c;", "\\x1b]0;owned", "\\x1b[2K", "\\x07\\x08", "\\x9b2J", "\\u202etxt.exe", "\\u200bb")


def raw_controls(text: str) -> list[str]:
    """Every character a terminal would act on rather than show, except newline and tab."""
    return [ch for ch in text if ch not in "\n\t" and unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp")]


def assert_terminal_safe(text: str, where: str) -> None:
    assert not raw_controls(text), f"{where}: raw {sorted(set(map(ascii, raw_controls(text))))} in {text!r}"


# --------------------------------------------------------------------------- the function itself

@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_terminal_safe_shows_each_hostile_sequence_as_a_visible_escape(kind):
    raw, shown = HOSTILE[kind]
    assert raw_controls(raw), "control: the input holds what a terminal would act on"
    assert terminal_safe(raw) == shown
    assert_terminal_safe(terminal_safe(raw), kind)


def test_terminal_safe_leaves_ordinary_text_alone_and_keeps_newlines_only_when_asked():
    plain = "fh1: /health 503; Load weight begin → 3.5 tok/s, 模型 ✓ é\tcol"
    assert terminal_safe(plain) == plain
    assert terminal_safe("a\nb") == "a\\nb"  # one line stays one line
    assert terminal_safe("a\nb\x1b", keep_newlines=True) == "a\nb\\x1b"
    assert terminal_safe(None) == "None" and terminal_safe(3) == "3"
    assert terminal_safe("\U000e0041") == "\\U000e0041"  # a tag character (format, outside the BMP)


# --------------------------------------------------------------------------- the CLI against fake hosts

def hostile_journal(fake, args):
    """The real fake journal plus two server lines carrying escapes, one a start-up milestone (so
    the health wait's progress note quotes it)."""
    answer = _REAL_JOURNALCTL(fake, args)
    hostile = f"Load weight begin {EVIL_LINE}\nTraceback: {EVIL_LINE}\n"
    return dataclasses.replace(answer, stdout=answer.stdout + hostile)


_REAL_JOURNALCTL = fake_systemd._journalctl


class HostileFake(FakeHost):
    """A fake host whose release history carries escapes in every text field."""

    def agent(self, request, proc):
        answer = super().agent(request, proc)
        if request["op"] == "history":
            answer = dict(answer, current=f"r1{EVIL}", releases=[
                {"id": f"r1{EVIL}", "created": 0, "patchset": EVIL, "budget": 16, "topk_cap": 4, "outcome": EVIL}])
        return answer


@pytest.fixture(params=["escaped", "raw"])
def cli(request, tmp_path, monkeypatch):
    """`ddtree-ops ARGS` in-process against one hostile fake host; stderr is not a TTY. With
    "raw", `terminal_safe` is the identity everywhere the CLI prints (the control)."""
    doc = fake_inventory(1)
    inv = tmp_path / "inventory.yaml"
    inv.write_text(json.dumps(doc))  # JSON is YAML
    host = parse_inventory(doc, str(inv)).hosts["fh1"]
    fake = HostileFake(host, tmp_path / "hosts" / "fh1")

    def connect(host, *, accept_new_host_keys: bool = False, hooks: Hooks = NO_HOOKS):
        return fake.session(hooks)
    for mod in ("ddtree_ops.host.session", "ddtree_ops.fleet.actions", "ddtree_ops.fleet.status"):
        monkeypatch.setattr(f"{mod}.open_session", connect)
    monkeypatch.setattr(fake_systemd, "_journalctl", hostile_journal)
    escaped = request.param == "escaped"
    if not escaped:
        for mod in ("tables", "common", "liveview", "commands"):
            monkeypatch.setattr(f"ddtree_ops.cli.{mod}.terminal_safe", lambda v, keep_newlines=False: str(v))

    def run(*args: str):
        r = CliRunner().invoke(app, [args[0], "-i", str(inv), *args[1:]], catch_exceptions=False)
        return r, r.stdout + r.stderr
    run.escaped, run.fake, run.tmp = escaped, fake, tmp_path
    return run


def check(cli, out: str, where: str) -> None:
    """Escaped: no raw control and every attack visible. Raw (the control): the attacks are there."""
    if cli.escaped:
        assert_terminal_safe(out, where)
        missing = [m for m in MARKERS if m not in out]
        assert not missing, f"{where}: {missing} not shown in {out!r}"
    else:
        assert "\x1b]52;c;" in out and "\u202e" in out, f"{where}: the hostile text never reached this path"


def test_plan_error_line_from_a_host_is_escaped(cli):
    cli.fake.fail_next["agent facts"] = EVIL
    r, out = cli("plan")
    assert r.exit_code != 0 and "error: fh1: agent facts failed" in r.stderr, out
    check(cli, r.stderr, "plan error line")


def test_history_table_and_error_line_are_escaped(cli):
    r, out = cli("history", "--host", "fh1")
    assert r.exit_code == 0, out
    check(cli, r.stdout, "history table")
    if cli.escaped:
        assert f"current: r1{EVIL_SHOWN}" in r.stdout
    cli.fake.fail_next["agent history"] = EVIL
    r, out = cli("history", "--host", "fh1")
    assert r.exit_code != 0 and "error: " in r.stderr, out
    check(cli, r.stderr, "history error line")


def test_status_reason_from_an_unreachable_host_is_escaped(cli, monkeypatch):
    from ddtree_ops.errors import UnreachableError

    def unreachable(host, **_):
        raise UnreachableError(f"{host.name}: {EVIL}")
    monkeypatch.setattr("ddtree_ops.fleet.status.open_session", unreachable)
    r, out = cli("status")
    assert r.exit_code == 1 and "NO: fh1: " in r.stdout, out
    check(cli, r.stdout, "status table")


def test_failed_deploy_log_tail_and_progress_lines_are_escaped(cli):
    ps = write_patchset(cli.tmp / "ps", {PROBE_REL: b"PROBE = 1\n" + FAKE_CRASH,
                                         UPSTREAM_REL: UPSTREAM_BYTES + b"# patched\n"}, name="crashing")
    r, out = cli("deploy", "-p", str(ps), "--yes")
    assert r.exit_code == 3, out
    assert "--- last log lines of fh1 ---" in r.stdout and "[fh1] waiting" in r.stderr, out
    check(cli, r.stdout, "deploy summary and log tail")
    check(cli, r.stderr, "progress lines (stderr not a TTY)")
    if cli.escaped:  # the log tail stays a block of lines; a progress note stays one line
        assert f"\nTraceback: {EVIL_LINE_SHOWN}\n" in r.stdout
        waiting = [ln for ln in r.stderr.splitlines() if ln.startswith("[fh1] waiting")]
        assert waiting and all(ln.endswith(f"Traceback: {EVIL_LINE_SHOWN}") for ln in waiting), waiting


def test_rendered_unit_from_a_hostile_template_is_escaped_and_keeps_its_lines(cli, monkeypatch):
    monkeypatch.setattr("ddtree_ops.artifacts.units.render_unit",
                        lambda host, templates_dir=None: f"[Service]\nDescription={EVIL}\nExecStart=/bin/true\n")
    r, out = cli("render", "--host", "fh1", "--no-verify")
    assert r.exit_code == 0, out
    check(cli, r.stdout, "render")
    if cli.escaped:
        assert r.stdout.splitlines()[0::2] == ["[Service]", "ExecStart=/bin/true"]


def test_json_output_carries_no_raw_control_either(cli):
    """`--json` needs no help from terminal_safe: json.dumps escapes every control character."""
    r, out = cli("history", "--host", "fh1", "--json")
    assert r.exit_code == 0, out
    assert_terminal_safe(r.stdout, "history --json")
    assert json.loads(r.stdout)["releases"][0]["patchset"] == EVIL  # whole, for a program to read


# --------------------------------------------------------------------------- progress views and the report

def test_plain_progress_prefixes_every_line_of_a_multi_line_message(capsys):
    from ddtree_ops.cli.liveview import PlainProgress
    from ddtree_ops.runbook.events import Failed

    p = PlainProgress()
    p.event(Failed("fh1", "restart", f"boom\n[fh2] deployed {EVIL}"))
    p.note(f"batch 1\n{EVIL}")
    err = capsys.readouterr().err
    assert_terminal_safe(err, "plain progress")
    lines = err.splitlines()
    assert lines[0] == "[fh1] FAILED at restart: boom"
    assert lines[1].startswith("[fh1] [fh2] deployed \\x1b]52;")  # never a bare "[fh2] ..." line
    assert lines[2:] == ["== batch 1", f"== {EVIL_SHOWN}"]


def test_live_view_shows_bidi_and_c1_escaped():
    from rich.console import Console

    from ddtree_ops.cli.liveview import LiveProgress
    from ddtree_ops.runbook.events import Note

    p = LiveProgress()
    p.state("fh1", "running")
    p.event(Note("fh1", EVIL))
    con = Console(record=True, width=2000, force_terminal=False)
    p.console = con
    p.note(EVIL)  # notes print above the table
    con.print(p._table())
    text = con.export_text()
    assert_terminal_safe(text, "live table")
    assert "\\u202etxt.exe" in text and "\\x9b2J" in text


@pytest.mark.parametrize("escaped", [True, False], ids=["escaped", "raw"])
def test_html_report_escapes_markup_and_shows_controls_of_host_strings(escaped, monkeypatch):
    from ddtree_ops.cli import report

    evil_html = "<script>alert(1)</script>"
    doc = {"action": "deploy", "exit_code": 3, "seconds": 1.0, "aborted": False, "batches": [["fh1"]],
           "hosts": [{"host": "fh1", "outcome": "rolled_back", "exit_code": 3, "release": EVIL,
                      "failed_step": EVIL, "message": evil_html + EVIL, "seconds": 1.0,
                      "log": [f"Traceback {EVIL}", evil_html],
                      "steps": [{"step": EVIL, "t": 1.0, "detail": EVIL}, {"step": "restart", "t": 2.0}]}]}
    if not escaped:
        monkeypatch.setattr(report, "terminal_safe", lambda v, keep_newlines=False: str(v))
    page = report.render_report(doc)
    assert "<script>alert" not in page and html.escape(evil_html) in page  # html.escape, either way
    if not escaped:  # the control: the host's escapes reach the page unless terminal_safe shows them
        assert "\x1b]52;c;" in page and "\u202e" in page
        return
    assert_terminal_safe(page, "HTML report")
    assert html.escape("\\x1b]52;c;") in page and "\\u202etxt.exe" in page and "\\x9b2J" in page


# --------------------------------------------------------------------------- a real server, a real CLI

# Printed by the server while it loads: a line with ESC (journald keeps it as a blob), a start-up
# milestone with bidi overrides (quoted by the health wait's progress note at 5 s), then the
# traceback's last line, with them too (in the log tail of the failure).
LOUD_PROBE = '''import time
print("Load weight begin " + {evil!r}, flush=True)
print("Error: a bidi override " + {bidi!r}, flush=True)
time.sleep(8)
raise RuntimeError("ddtree probe refused to load: " + {bidi!r})
'''


@pytest.mark.sandbox
def test_a_real_server_printing_escapes_before_failing_its_start_reaches_no_pipe_raw(clean_host, tmp_path):
    """The stand-in imports a patch-set module that prints escapes and bidi overrides to its log,
    then raises: the deploy rolls back (exit 3), and neither stdout (summary, log tail) nor stderr
    (progress lines; not a TTY) holds a raw control. journald stores a line with ESC as a blob, so
    what reaches the controller raw from a real journal is the bidi override: shown escaped."""
    from kit import make_patchset, run_cli

    bidi = "\u202eexe.txt\u202c \u2066x\u2069"
    ps = make_patchset(tmp_path, {PROBE_REL: LOUD_PROBE.format(evil=EVIL_LINE, bidi=bidi)
                                  .encode()}, name="loud")
    th = clean_host
    r = run_cli("deploy", "-i", str(th.inventory), "-l", th.name, "-p", str(ps), "--yes")
    assert r.code == 3, r.stdout + r.stderr
    journal = th.ssh(["journalctl", "-a", "-u", th.host.unit, "--no-pager"]).stdout
    assert "\u202eexe.txt" in journal and "\x1b]52;c;" in journal, "control: the server did print them"
    assert_terminal_safe(r.stdout, "deploy stdout")
    assert_terminal_safe(r.stderr, "deploy stderr")
    shown = "\\u202eexe.txt\\u202c \\u2066x\\u2069"
    assert f"RuntimeError: ddtree probe refused to load: {shown}" in r.stdout, r.stdout  # the log tail
    assert f"Error: a bidi override {shown}" in r.stderr, r.stderr  # the progress note
