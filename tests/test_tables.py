"""The CLI's tables (fast tier): piped or in CI (no TTY) every value is printed whole."""

from __future__ import annotations

from ddtree_ops.cli.tables import fit, print_history, print_rollout, print_status
from ddtree_ops.fleet.rollout import RolloutResult
from ddtree_ops.runbook.results import HostResult, Outcome

LONG_HOST = "sglang-k26-ddtree-node-with-a-long-name-number-0001.cluster.example"
LONG_MSG = ("deploy failed at wait for weights: sglang-k26-ddtree.service is failed after 41.2 s "
            "(the server exited while starting); rolled back to 20261130T000000Z-abcdef, healthy")


def test_rollout_summary_prints_whole_values_when_piped(capsys):
    res = RolloutResult("deploy", [HostResult(LONG_HOST, Outcome.ROLLED_BACK, 3, release="20261130T000000Z-abcdef",
                                              failed_step="wait for weights", message=LONG_MSG)], [[LONG_HOST]])
    print_rollout(res)
    out = capsys.readouterr().out
    assert LONG_HOST in out and LONG_MSG in out and "…" not in out
    assert "exit code 3" in out


def test_status_and_history_print_whole_values_when_piped(capsys):
    reason = "cannot reach 10.200.9.2:22: Connection refused by /opt/venv_sglang/lib/python3.11/site-packages"
    print_status([{"host": LONG_HOST, "reachable": False, "reason": reason, "release": None, "patchset": None,
                   "budget": None, "topk_cap": None, "drift": [], "active_unit": None, "health": None,
                   "avg_accept_length": None}])
    print_history({"current": "r1", "releases": [{"id": "r1", "created": 0, "patchset": "ddtree-temp-2.0.0-long-label",
                                                  "budget": 16, "topk_cap": 4, "outcome": "deployed"}]})
    out = capsys.readouterr().out
    assert LONG_HOST in out and reason in out and "ddtree-temp-2.0.0-long-label" in out and "…" not in out


def test_fit_cuts_only_on_a_terminal(monkeypatch):
    assert fit("x" * 100, 10) == "x" * 100
    monkeypatch.setattr("ddtree_ops.cli.tables.interactive", lambda: True)
    assert fit("x" * 100, 10) == "x" * 9 + "…" and fit("short", 10) == "short"


# --------------------------------------------------------------------------- remote text is literal

# What a host may send: Rich markup, a hyperlink, an emoji code and a terminal escape sequence.
EVIL = "[red]x[/red] [link=http://evil]y[/link] :warning: [bold]"
ESC = "\x1b[2J\x1b]8;;http://evil\x07"


def _printed_literally(text: str) -> None:
    assert EVIL in text, text  # markup interpreted would have printed "x y ⚠" without the tags
    assert "\x1b" not in text and "\\x1b[2J" in text  # control characters shown, never sent to the terminal
    assert "⚠" not in text


def test_every_table_prints_what_hosts_send_literally(capsys):
    from ddtree_ops.runbook.plan import FileChange, HostPlan

    remote = EVIL + ESC
    res = RolloutResult("deploy", [HostResult("h1", Outcome.ROLLED_BACK, 3, release=remote, failed_step=remote,
                                              message=remote, log=[remote])], [["h1"]],
                        aborted=True, abort_reason=remote)
    print_rollout(res)
    _printed_literally(capsys.readouterr().out)
    print_status([{"host": "h1", "reachable": False, "reason": remote, "release": remote, "patchset": remote,
                   "budget": None, "topk_cap": None, "drift": [{"path": "/x/" + remote}], "active_unit": remote,
                   "health": remote, "avg_accept_length": None},
                  {"host": "h2", "reachable": True, "reason": remote, "release": None, "patchset": None,
                   "budget": None, "topk_cap": None, "drift": [], "active_unit": None, "health": None,
                   "avg_accept_length": None}])
    _printed_literally(capsys.readouterr().out)
    print_history({"current": remote, "releases": [{"id": remote, "created": 0, "patchset": remote, "budget": 16,
                                                    "topk_cap": 4, "outcome": remote}]})
    _printed_literally(capsys.readouterr().out)
    from ddtree_ops.cli.tables import print_plan

    plan = HostPlan(host="h1", patchset=remote, patchset_digest="d", budget=16, topk_cap=4, sglang_version=remote,
                    current_release=remote, files=(FileChange("/p", remote, remote, None, "ab" * 32, remote, remote),),
                    unit_path="/etc/systemd/system/u.service", unit_old=None, unit_new="", unit_diff=remote,
                    stop_units=(remote,), restart_unit="u.service", refusals=(remote,),
                    interrupted={"release": remote, "step": remote}, lock={"user": remote, "machine": remote,
                                                                           "since_utc": remote})
    print_plan(plan)
    out = capsys.readouterr().out
    _printed_literally(out)
    assert out.count(EVIL) >= 10 and "refused: " + EVIL in out


def test_the_live_progress_table_prints_what_hosts_send_literally():
    from rich.console import Console

    from ddtree_ops.cli.liveview import LiveProgress, _Row

    p = LiveProgress()
    p.rows["h1"] = _Row(state=EVIL, msg=EVIL + ESC)
    con = Console(record=True, width=400, force_terminal=True, color_system="truecolor")
    con.print(p._table())
    _printed_literally(con.export_text(clear=False))
    assert "\x1b]8;" not in con.export_text(styles=True)  # no hyperlink escape: [link=...] was not markup
    p.console = con
    p._live = type("FakeLive", (), {"console": con})()
    p.note(EVIL)
    assert EVIL in con.export_text()


def test_the_live_view_shows_each_running_hosts_phase_with_its_own_elapsed_time(monkeypatch):
    from rich.console import Console

    from ddtree_ops.cli import liveview as fleetview
    from ddtree_ops.runbook.events import Note, PhaseStarted

    now = [100.0]
    monkeypatch.setattr(fleetview.time, "monotonic", lambda: now[0])
    p = fleetview.LiveProgress()
    p.state("h1", "running")
    p.state("h2", "running")
    p.event(PhaseStarted("h1", "cuda graphs"))
    p.event(Note("h1", "waiting  3.0 s: cuda graphs 0 s; /health refused"))
    now[0] = 142.0
    p.event(PhaseStarted("h2", "drain"))
    now[0] = 150.0
    con = Console(record=True, width=200)
    con.print(p._table())
    lines = {ln.split()[1]: ln for ln in con.export_text().splitlines() if ln.strip().startswith(("│ h", "┃ h"))
             or " h1 " in ln or " h2 " in ln}
    assert "cuda graphs 50 s" in lines["h1"] and "waiting" in lines["h1"]
    assert "drain 8 s" in lines["h2"]
    p.state("h2", "deployed")
    con = Console(record=True, width=200)
    con.print(p._table())
    assert "drain" not in con.export_text()  # a finished host has no phase


def test_the_performance_gate_shows_in_the_rollout_table_with_its_rows_and_in_status_and_history(capsys):
    from ddtree_ops.gates.perfgate import compare
    from ddtree_ops.gates.workload import Measurement

    def m(tps: float) -> Measurement:
        return Measurement(requests=20, errors=0, output_tokens=int(tps * 10), wall_s=10.0, ttft_p50_s=0.05,
                           ttft_p99_s=0.08, itl_p50_s=0.01, itl_p99_s=0.02, accept_length=3.1)
    gate = compare(m(212.0), m(150.3)).as_dict()
    res = RolloutResult("deploy", [HostResult("h1", Outcome.ROLLED_BACK, 3, failed_step="perf gate", perf_gate=gate)],
                        [["h1"]])
    print_rollout(res)
    out = capsys.readouterr().out
    assert "fail (212 → 150 tok/s)" in out  # the summary row
    assert "h1: performance gate fail" in out and "212.0" in out and "150.3" in out and "-29.1 %" in out
    print_status([{"host": "h1", "reachable": True, "reason": None, "release": "r1", "patchset": "p", "budget": 16,
                   "topk_cap": 4, "drift": [], "active_unit": "u", "health": 200, "avg_accept_length": 3.1,
                   "perf_gate": gate}])
    print_history({"current": "r1", "releases": [{"id": "r1", "created": 0, "patchset": "p", "budget": 16,
                                                  "topk_cap": 4, "outcome": "rolled back", "perf_gate": gate}]})
    assert capsys.readouterr().out.count("fail (212 → 150 tok/s)") == 2
