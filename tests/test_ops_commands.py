"""The operators' everyday commands in the fast tier: `logs` (--since subset, argv, scrubbing,
bounds, following with a lost host), `status --watch`, `metrics` (read back with
prometheus_client's own parser, atomic --out) and `diff` between two releases of a fake host."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from ddtree_ops.cli.commands import app
from ddtree_ops.cli.watch import CLEAR_SCREEN, Watch, check_interval
from ddtree_ops.config.atomic_file import write_atomically
from ddtree_ops.config.inventory import with_overrides
from ddtree_ops.errors import EXIT_BAD_INPUT, DeployFailed, InputError, UnreachableError
from ddtree_ops.fleet import logs as fleet_logs
from ddtree_ops.fleet import metrics as fleet_metrics
from ddtree_ops.fleet.diff import diff_releases
from ddtree_ops.fleet.logs import (
    MAX_LINE_CHARS,
    LogQuery,
    follow_logs,
    journal_argv,
    make_query,
    parse_journal,
    parse_since,
    read_logs,
)
from ddtree_ops.fleet.metrics import status_exposition
from ddtree_ops.host.session import HostSession
from ddtree_ops.runbook.deploy import deploy_host
from ddtree_ops.runbook.phases import DeployOptions
from ddtree_ops.testing.fake_host import FAKE_CRASH, fake_hosts, fake_inventory
from fast_kit import PROBE_REL, load, write_patchset

# -- logs: what reaches journalctl -------------------------------------------------------------

SAFE_SINCE = [
    ("2026-12-01 10:00", "2026-12-01 10:00:00"),
    ("2026-12-01T10:00:05", "2026-12-01 10:00:05"),
    ("2026-12-01", "2026-12-01 00:00:00"),
    ("-1h", "-1h"),
    ("-30min", "-30min"),
    ("10 min ago", "-10min"),
    ("2 days ago", "-2d"),
    ("today", "today"),
    ("yesterday", "yesterday"),
]
HOSTILE_SINCE = ["-1h; rm -rf /", "$(id)", "`id`", "--output=json", "1h", "+1h", "2026-13-01", "2026-02-30 10:00",
                 "10 parsecs ago", "-1h --unit=sshd.service", "today\n--merge", "", "-9999999h", "now'"]


@pytest.mark.parametrize(("given", "canonical"), SAFE_SINCE)
def test_since_accepts_the_safe_subset_in_a_canonical_spelling(given, canonical):
    assert parse_since(given) == canonical


@pytest.mark.parametrize("given", HOSTILE_SINCE)
def test_since_refuses_everything_else_with_exit_2_naming_the_value(given):
    with pytest.raises(InputError) as e:
        parse_since(given)
    assert e.value.exit_code == EXIT_BAD_INPUT and "--since" in str(e.value) and "\n" not in str(e.value)


def test_journal_argv_binds_every_value_to_its_option_so_none_poses_as_one():
    argv = journal_argv("x.service", 50, since="-1h")
    assert argv[0] == "journalctl" and "--output=short-iso" in argv and "--since=-1h" in argv
    hostile = journal_argv("x.service", 5, after_cursor="--merge")
    assert "--after-cursor=--merge" in hostile and "--merge" not in hostile
    assert all(a.startswith("--") for a in hostile[1:])
    # The control: a value passed as an argument of its own would be taken for an option.
    assert "--merge" in ["journalctl", "--after-cursor", "--merge"]


def test_unit_and_lines_are_checked_before_anything_connects():
    assert make_query(10, "-1h", "x@1.service") == LogQuery(10, "-1h", "x@1.service")
    for bad in ("-x.service", "sshd", "a b.service", "../x.service", "x.service;id"):
        with pytest.raises(InputError, match="--unit"):
            make_query(unit=bad)
    for bad in (0, -1, 2001):
        with pytest.raises(InputError, match="--lines"):
            make_query(lines=bad)


def test_journal_lines_are_scrubbed_bounded_and_the_cursor_is_kept(monkeypatch):
    out = ("2026-12-01T10:00:00+0000 h sglang[1]: server_args api_key='s3cret-value' port=30000\n"
           "2026-12-01T10:00:01+0000 h sglang[1]: key from env KNOWN-KEY-123 used\n"
           "2026-12-01T10:00:02+0000 h sglang[1]: " + "x" * (MAX_LINE_CHARS + 50) + "\n"
           "-- cursor: s=abc;i=2\n")
    chunk = parse_journal(out, ("KNOWN-KEY-123",))
    assert chunk.cursor == "s=abc;i=2"
    text = "\n".join(chunk.lines)
    assert "s3cret-value" not in text and "KNOWN-KEY-123" not in text and text.count("***") == 2
    assert len(chunk.lines[2]) < MAX_LINE_CHARS + 40 and "more" not in chunk.lines[0]
    # The control: without the known secret the environment's key would have gone through.
    assert "KNOWN-KEY-123" in "\n".join(parse_journal(out).lines)
    monkeypatch.setattr(fleet_logs, "MAX_LINES", 2)
    assert len(parse_journal(out).lines) == 2


class JournalLink:
    """A host's agent answering only journalctl, from an in-memory journal (cursor = index) as
    journalctl reads it: --lines counts from where it starts, --reverse reads backwards and then
    shows the cursor of the oldest entry shown. `lose_at`: the call that finds the connection
    gone. Records every argv it was sent."""

    def __init__(self, name: str, entries: list[str], lose_at: int | None = None):
        self.name, self.entries, self.lose_at = name, entries, lose_at
        self.argvs: list[list[str]] = []
        self.requests: list[dict[str, Any]] = []
        self.closed = False

    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.requests.append(request)
        argv = request["argv"]
        self.argvs.append(argv)
        if self.lose_at is not None and len(self.argvs) >= self.lose_at:
            raise UnreachableError(f"{self.name}: connection lost (test)")
        opts = dict(a[2:].split("=", 1) for a in argv[1:] if "=" in a)
        n = int(opts["lines"])
        if "after-cursor" in opts:
            first = int(opts["after-cursor"]) + 1
            idx = list(range(first, min(first + n, len(self.entries))))
        else:
            idx = list(range(max(0, len(self.entries) - n), len(self.entries)))
            idx = idx[::-1] if "--reverse" in argv else idx
        if not idx:
            return {"rc": 1, "stdout": "", "stderr": ""}  # as systemd 252 with --show-cursor
        shown = "".join(f"{self.entries[i]}\n" for i in idx)
        return {"rc": 0, "stdout": shown + f"-- cursor: {idx[-1]}\n", "stderr": ""}

    def close(self) -> None:
        self.closed = True


def _hosts(tmp_path: Path, n: int, **host_vars: Any):
    return [f.host for f in fake_hosts(tmp_path / "hosts", n, **host_vars)]


def test_logs_read_every_host_in_parallel_and_a_lost_one_is_one_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVER_KEY_T", "env-secret-999")
    hosts = _hosts(tmp_path, 3, api_key_env="SERVER_KEY_T", secrets_config="/etc/ddtree/secrets.yaml",
                   environment_file="/etc/ddtree/env")
    links = {"fh1": JournalLink("fh1", ["a1 uses env-secret-999", "a2"]), "fh2": JournalLink("fh2", ["b1"], lose_at=1),
             "fh3": JournalLink("fh3", [f"c{i}" for i in range(10)])}
    got = read_logs(hosts, make_query(lines=3), lambda h: HostSession(h, links[h.name]))
    assert [g.host for g in got] == ["fh1", "fh2", "fh3"]
    assert got[0].lines == ["a1 uses ***", "a2"] and got[2].lines == ["c7", "c8", "c9"]
    assert got[1].lines == [] and got[1].error.startswith("fh2: connection lost") and "\n" not in got[1].error
    # The host's own secret files go with the request: the agent blanks their values on the host.
    assert links["fh1"].requests[0]["scrub_files"] == ["/etc/ddtree/secrets.yaml", "/etc/ddtree/env"]
    assert all(link.closed for link in links.values())


class Collect:
    def __init__(self):
        self.lines: list[tuple[str, str]] = []
        self.lost_hosts: list[tuple[str, str]] = []
        self.more = threading.Event()

    def line(self, host: str, text: str) -> None:
        self.lines.append((host, text))
        if sum(1 for h, _ in self.lines if h == "fh1") >= 6:
            self.more.set()

    def lost(self, host: str, reason: str) -> None:
        self.lost_hosts.append((host, reason))


def test_follow_goes_on_for_the_others_when_a_host_is_lost_and_repeats_no_line(tmp_path):
    hosts = _hosts(tmp_path, 2)
    a, b = JournalLink("fh1", ["a0", "a1"]), JournalLink("fh2", ["b0"], lose_at=3)
    links = {"fh1": a, "fh2": b}
    sink, stop = Collect(), threading.Event()
    threads = follow_logs(hosts, make_query(lines=10), lambda h: HostSession(h, links[h.name]), sink, stop,
                          interval_s=0.01)
    for i in range(2, 6):  # new lines arrive on fh1 while fh2 is already gone
        while not b.closed:
            threading.Event().wait(0.01)
        a.entries.append(f"a{i}")
    assert sink.more.wait(10), sink.lines
    stop.set()
    for t in threads:
        t.join(5)
    assert [t for h, t in sink.lines if h == "fh1"] == [f"a{i}" for i in range(6)]
    assert [t for h, t in sink.lines if h == "fh2"] == ["b0"]
    assert len(sink.lost_hosts) == 1 and sink.lost_hosts[0][0] == "fh2" and "connection lost" in sink.lost_hosts[0][1]
    assert any("--after-cursor=1" in argv for argv in a.argvs)
    assert a.closed and not any(t.is_alive() for t in threads)


def test_follow_since_shows_the_newest_lines_then_goes_on_from_the_newest(tmp_path):
    hosts = _hosts(tmp_path, 1)
    link = JournalLink("fh1", [f"e{i}" for i in range(10)])
    got: list[str] = []
    stop = threading.Event()

    class Sink:
        def line(self, host, text):
            got.append(text)
            if text == "e11":
                stop.set()

        def lost(self, host, reason):
            raise AssertionError(reason)
    follow = threading.Thread(target=fleet_logs.follow_host,
                              args=(hosts[0], make_query(3, "-1h"), lambda h: HostSession(h, link), Sink(), stop, 0.01))
    follow.start()
    while len(got) < 3:
        threading.Event().wait(0.01)
    link.entries += ["e10", "e11"]
    follow.join(10)
    assert got == ["e7", "e8", "e9", "e10", "e11"]
    assert "--reverse" in link.argvs[0] and "--after-cursor=7" in link.argvs[1]
    # The control: going on from the cursor the backwards read printed shows two lines again.
    assert JournalLink("x", [f"e{i}" for i in range(12)]).call(
        {"argv": journal_argv("u", 10, after_cursor="7")}, 1)["stdout"].startswith("e8\ne9\n")


def test_a_multi_line_entry_stays_whole_when_read_backwards():
    out = "t3 c: last\nt2 b: first line\n    second line\nt1 a: one\n-- cursor: c1\n"
    chunk = parse_journal(out, newest_first=True)
    assert chunk.lines == ["t1 a: one", "t2 b: first line", "    second line", "t3 c: last"]
    assert chunk.entries == 3 and chunk.cursor == "c1"
    assert parse_journal(out).lines[0] == "t3 c: last"  # the control: read forwards, kept as printed


# -- the CLI over fake hosts -------------------------------------------------------------------

@pytest.fixture
def inv(tmp_path) -> Path:
    p = tmp_path / "inv.yaml"
    p.write_text(yaml.safe_dump(fake_inventory(2)))
    return p


def test_logs_cli_refuses_a_hostile_since_with_exit_2_before_connecting(inv, monkeypatch):
    opened: list[str] = []
    monkeypatch.setattr("ddtree_ops.host.session.open_session", lambda h, **kw: opened.append(h.name))
    r = CliRunner().invoke(app, ["logs", "-i", str(inv), "--since", "-1h; reboot"], catch_exceptions=False)
    assert r.exit_code == 2 and "--since" in r.stderr and "Traceback" not in r.stdout + r.stderr
    assert opened == []


def test_logs_cli_prefixes_each_line_with_its_host_and_shows_no_escape(inv, monkeypatch):
    links = {"fh1": JournalLink("fh1", ["\x1b]0;owned\x07hello"]), "fh2": JournalLink("fh2", ["there"])}
    monkeypatch.setattr("ddtree_ops.host.session.open_session", lambda h, **kw: HostSession(h, links[h.name]))
    r = CliRunner().invoke(app, ["logs", "-i", str(inv), "--since", "10 min ago", "-n", "5"], catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == ["fh1 | \\x1b]0;owned\\x07hello", "fh2 | there"]
    assert "--since=-10min" in links["fh1"].argvs[0]


def test_logs_follow_cli_exits_1_once_every_host_is_lost(inv, monkeypatch):
    links = {"fh1": JournalLink("fh1", ["a"], lose_at=2), "fh2": JournalLink("fh2", [], lose_at=1)}
    monkeypatch.setattr("ddtree_ops.host.session.open_session", lambda h, **kw: HostSession(h, links[h.name]))
    monkeypatch.setattr(fleet_logs, "FOLLOW_INTERVAL_S", 0.01)
    r = CliRunner().invoke(app, ["logs", "-i", str(inv), "-f"], catch_exceptions=False)
    assert r.exit_code == 1 and r.stdout == "fh1 | a\n"
    lines = r.stderr.splitlines()
    assert sorted(ln.split(": ")[1] for ln in lines) == ["fh1", "fh2"], r.stderr
    assert all(ln.startswith("lost while following: ") for ln in lines), r.stderr


# -- status --watch ----------------------------------------------------------------------------

def test_watch_runs_rounds_and_exits_with_the_last_rounds_code():
    out: list[str] = []
    codes = iter([0, 1, 0])
    w = Watch(2.0, tty=False, write=out.append, wait=lambda s: None, now=lambda: 0.0, rounds=3)
    assert w.run(lambda: next(codes)) == 0
    assert out == ["== status at 1970-01-01 00:00:00 UTC ==\n"] * 3
    codes = iter([0, 1])
    assert Watch(2.0, tty=False, write=out.append, wait=lambda s: None, rounds=2).run(lambda: next(codes)) == 1


def test_watch_redraws_a_terminal_and_ctrl_c_keeps_the_last_code():
    out: list[str] = []

    def wait(_s):
        raise KeyboardInterrupt
    assert Watch(5.0, tty=True, write=out.append, wait=wait).run(lambda: 1) == 1
    assert out[0].startswith(CLEAR_SCREEN) and "every 5 s" in out[0]

    def first_round():
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):  # nothing seen yet: the command ends as interrupted
        Watch(5.0, tty=False, write=out.append, wait=wait).run(first_round)


def test_watch_interval_is_range_checked():
    assert check_interval(0.5) == 0.5
    for bad in (0, -1, 0.1, 1e9):
        with pytest.raises(InputError, match="--interval"):
            check_interval(bad)


def test_status_watch_cli_prints_one_block_per_round_off_a_terminal(inv, monkeypatch):
    rounds = []

    def collect(hosts, **kw):
        rounds.append(1)
        if len(rounds) == 3:
            raise KeyboardInterrupt
        return [{"host": h.name, "ok": len(rounds) == 1, "reachable": False, "reason": "down", "release": None,
                 "patchset": None, "budget": None, "topk_cap": None, "drift": [], "active_unit": None,
                 "health": None, "avg_accept_length": None, "server": None} for h in hosts]
    monkeypatch.setattr("ddtree_ops.fleet.status.collect_status", collect)
    r = CliRunner().invoke(app, ["status", "-i", str(inv), "--watch", "--interval", "0.5"], catch_exceptions=False)
    assert r.stdout.count("== status at") == 3 and r.stdout.count("fh2") == 2, r.stdout
    assert r.exit_code == 1  # the second (last finished) round found the hosts not ok; the first was ok


# -- metrics -----------------------------------------------------------------------------------

def _row(host: str, **kw: Any) -> dict[str, Any]:
    row = {"host": host, "reachable": True, "reason": None, "release": "20261201T100000Z-abcdef",
           "rollout": "20261201T095959Z-123456", "patchset": "ddtree-temp 1.2.0", "bundle": None,
           "budget": 16, "topk_cap": 4, "algorithm": "DDTREE", "drift": [], "active_unit": "u.service",
           "health": 200, "avg_accept_length": 3.25, "node_rank": None, "seconds": 0.4, "ok": True,
           "perf_gate": {"verdict": "pass", "canary": {"accept_length": 3.1, "output_tps": 212.5}}}
    row.update(kw)
    return row


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_read_back_by_prometheus_parser_with_every_value_and_label():
    hostile = 'rel"with\\odd\nchars\x1b[2J'
    rows = [_row("g1"), _row("g2", release=hostile, rollout=None, perf_gate=None, drift=[{"path": "/x"}], ok=False,
                             config_drift=[{"field": "budget"}, {"field": "topk_cap"}]),
            _row("g3", reachable=False, reason="cannot reach", release=None, budget=None, topk_cap=None, health=None,
                 avg_accept_length=None, perf_gate=None, ok=False)]
    text = status_exposition(rows)
    got = _samples(text)
    assert got[("ddtree_ops_host_budget", (("host", "g1"),))] == 16
    assert got[("ddtree_ops_perf_gate_output_tokens_per_second", (("host", "g1"),))] == 212.5
    assert got[("ddtree_ops_perf_gate_verdict", (("host", "g1"), ("verdict", "pass")))] == 1
    assert got[("ddtree_ops_perf_gate_verdict", (("host", "g1"), ("verdict", "fail")))] == 0
    assert got[("ddtree_ops_host_accept_length", (("host", "g1"),))] == 3.25
    assert got[("ddtree_ops_host_drift_files", (("host", "g2"),))] == 1
    assert got[("ddtree_ops_host_config_drift", (("host", "g2"),))] == 2
    assert got[("ddtree_ops_host_config_drift", (("host", "g1"),))] == 0
    assert got[("ddtree_ops_host_reachable", (("host", "g3"),))] == 0
    info = [k for k in got if k[0] == "ddtree_ops_host_release_info" and ("host", "g2") in k[1]]
    assert dict(info[0][1])["release"] == 'rel"with\\odd\\nchars\\x1b[2J' and dict(info[0][1])["rollout"] == ""
    assert dict([k for k in got if k[0] == "ddtree_ops_host_release_info" and ("host", "g1") in k[1]][0][1])[
        "rollout"] == "20261201T095959Z-123456"
    # What nobody could read is left out, not written as 0.
    assert not [k for k in got if ("host", "g3") in k[1] and k[0] in ("ddtree_ops_host_budget",
                                                                     "ddtree_ops_host_release_info")]
    assert "\x1b" not in text and text.count("# TYPE ") == text.count("# HELP ")


def test_metrics_label_escaping_is_what_keeps_the_parser_whole(monkeypatch):
    # The control: the same rows with label values written raw are not a valid exposition.
    monkeypatch.setattr(fleet_metrics, "escape_label", lambda v: str(v))
    text = status_exposition([_row("g1", release='a"b\nc')])
    with pytest.raises(ValueError):
        list(text_string_to_metric_families(text))


def test_metrics_out_is_replaced_atomically_and_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    out = tmp_path / "ddtree_ops.prom"
    write_atomically(str(out), "old 1\n")
    write_atomically(str(out), "new 2\n")
    assert out.read_text() == "new 2\n" and oct(out.stat().st_mode & 0o777) == "0o644"

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        write_atomically(str(out), "half")
    assert out.read_text() == "new 2\n" and sorted(p.name for p in tmp_path.iterdir()) == ["ddtree_ops.prom"]


def test_metrics_cli_writes_the_file_and_refuses_a_missing_folder(inv, tmp_path, monkeypatch):
    monkeypatch.setattr("ddtree_ops.fleet.status.collect_status", lambda hosts, **kw: [_row(h.name) for h in hosts])
    out = tmp_path / "prom" / "ddtree_ops.prom"
    r = CliRunner().invoke(app, ["metrics", "-i", str(inv), "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 2 and "--out" in r.stderr
    out.parent.mkdir()
    r = CliRunner().invoke(app, ["metrics", "-i", str(inv), "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    assert {k[1] for k in _samples(out.read_text()) if k[0] == "ddtree_ops_host_ok"} == {(("host", "fh1"),),
                                                                                        (("host", "fh2"),)}


# -- diff --------------------------------------------------------------------------------------

OPTS = DeployOptions(reconnect_s=5)


def _two_releases(tmp_path: Path):
    fake = fake_hosts(tmp_path / "hosts")[0]
    ps1 = load(write_patchset(tmp_path / "ps1", {PROBE_REL: b"PROBE = 1\nSAME = 0\n"}, name="p", version="1.0.0"))
    ps2 = load(write_patchset(tmp_path / "ps2", {PROBE_REL: b"PROBE = 2\nSAME = 0\n"}, name="p", version="2.0.0"))
    r1 = deploy_host(fake.session(), ps1, OPTS)
    fake.host = with_overrides(fake.host, budget=10)
    r2 = deploy_host(fake.session(), ps2, OPTS)
    assert r1.exit_code == 0 and r2.exit_code == 0
    return fake, r1.release, r2.release


@pytest.fixture(scope="module")
def shared_releases(tmp_path_factory):
    """A fake host with release 1 (PROBE = 1, budget 16) then release 2 (PROBE = 2, budget 10);
    for tests that only read it."""
    return _two_releases(tmp_path_factory.mktemp("diff"))


@pytest.fixture
def two_releases(tmp_path):
    """The same, for a test that changes the host."""
    return _two_releases(tmp_path)


def test_diff_shows_record_fields_file_and_unit_changes_between_two_releases(shared_releases):
    fake, rel1, rel2 = shared_releases
    d = diff_releases(fake.session(), rel1, rel2)
    fields = {c.name: (c.old, c.new) for c in d.fields}
    assert fields["budget"] == (16, 10) and fields["patchset"] == ("p-1.0.0", "p-2.0.0")
    by_path = {f.path: f for f in d.files}
    probe = by_path[f"{fake.host.site_packages}/{PROBE_REL}"]
    assert probe.change == "changed" and "-PROBE = 1" in probe.diff and "+PROBE = 2" in probe.diff
    assert " SAME = 0" in probe.diff and probe.note is None
    unit = by_path[fake.host.unit_path]
    assert unit.unit and any(ln.startswith("-") and "16" in ln for ln in unit.diff)
    assert any(ln.startswith("+") and "10" in ln for ln in unit.diff)
    # The control: a release compared with itself has nothing to show.
    same = diff_releases(fake.session(), rel2, rel2)
    assert same.fields == [] and same.files == [] and same.unchanged_files == len(d.files)


def test_diff_of_a_rolled_back_release_compares_its_record_and_says_why_not_its_files(two_releases, tmp_path):
    fake, _, rel2 = two_releases
    bad = load(write_patchset(tmp_path / "ps3", {PROBE_REL: b"PROBE = 3\n" + FAKE_CRASH}, name="p", version="3.0.0"))
    with pytest.raises(DeployFailed):
        deploy_host(fake.session(), bad, OPTS)
    rel3 = fake.session().store.history()["releases"][-1]["id"]
    d = diff_releases(fake.session(), rel2, rel3)
    assert {c.name: c.new for c in d.fields}["outcome"].startswith("rolled back") and d.files == []
    assert len(d.notes) == 1 and rel3 in d.notes[0] and "not compared" in d.notes[0]


def test_diff_never_passes_off_a_changed_backup_copy_as_the_release_file(two_releases):
    fake, rel1, rel2 = two_releases
    # Release 1's module lives only in release 2's backup: tamper with that copy.
    bdir = fake.path(f"{fake.host.state_dir}/releases/{rel2}/backup")
    manifest = json.loads((bdir / "manifest.json").read_text())
    entry = next(e for e in manifest["entries"] if e["path"].endswith(PROBE_REL))
    (bdir / entry["stored"]).write_bytes(b"PROBE = 666\n")
    d = diff_releases(fake.session(), rel1, rel2)
    probe = next(f for f in d.files if f.path.endswith(PROBE_REL))
    assert probe.diff == [] and "no copy" in probe.note
    # A manifest pointing outside its backup is not followed either, even to the right bytes.
    (bdir.parent / "outside").write_bytes(b"PROBE = 1\nSAME = 0\n")
    entry["stored"] = "files/../../outside"
    (bdir / "manifest.json").write_text(json.dumps(manifest))
    assert "no copy" in next(f for f in diff_releases(fake.session(), rel1, rel2).files
                             if f.path.endswith(PROBE_REL)).note


def test_diff_cli_prints_the_changes_and_exits_2_for_an_unknown_release(shared_releases, tmp_path, monkeypatch):
    fake, rel1, rel2 = shared_releases
    inv = tmp_path / "inv1.yaml"
    inv.write_text(yaml.safe_dump(fake_inventory(1)))
    monkeypatch.setattr("ddtree_ops.host.session.open_session", lambda h, **kw: fake.session())
    r = CliRunner().invoke(app, ["diff", "-i", str(inv), "--host", "fh1", rel1, rel2], catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    assert f"fh1: {rel1} → {rel2}" in r.stdout and "budget: 16 → 10" in r.stdout and "+PROBE = 2" in r.stdout
    r = CliRunner().invoke(app, ["diff", "-i", str(inv), "--host", "fh1", rel1, "20990101T000000Z-ffffff"],
                           catch_exceptions=False)
    assert r.exit_code == 2 and "Traceback" not in r.stdout + r.stderr
    assert r.stderr.startswith("error: fh1: release '20990101T000000Z-ffffff' is not on the host")
    assert len(r.stderr.splitlines()) == 1 and r.stdout == ""
