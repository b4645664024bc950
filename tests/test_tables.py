"""The CLI's tables (fast tier): piped or in CI (no TTY) every value is printed whole."""

from __future__ import annotations

from ddtree_ops.results import HostResult, Outcome
from ddtree_ops.rollout import RolloutResult
from ddtree_ops.tables import fit, print_history, print_rollout, print_status

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
    monkeypatch.setattr("ddtree_ops.tables.interactive", lambda: True)
    assert fit("x" * 100, 10) == "x" * 9 + "…" and fit("short", 10) == "short"
