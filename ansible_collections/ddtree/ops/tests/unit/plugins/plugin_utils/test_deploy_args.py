# Copyright: ddtree-ops developers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0)
"""The command lines the actions build from their options, and what the tool's plan and steps
mean as a task result (run by `ansible-test units`)."""

from __future__ import annotations

import pytest

from ansible_collections.ddtree.ops.plugins.plugin_utils.deploy_args import (
    config_args,
    deploy_args,
    plan_changes,
    plan_diff,
    source_args,
)
from ansible_collections.ddtree.ops.plugins.plugin_utils.tool import phase_seconds

SAME = {"status": "same", "action": "replace", "rel": "sglang/a.py", "old_sha256": "a" * 64, "new_sha256": "a" * 64}
NEW = {"status": "new", "action": "add", "rel": "sglang/b.py", "old_sha256": None, "new_sha256": "b" * 64}


def test_a_deploy_never_asks_never_notifies_and_passes_each_option_once():
    argv = deploy_args({"patchset": "ddtree-temp", "budget": 16, "topk_cap": 4, "perf_gate": False,
                        "deadline": 90, "rollout_id": "20261204T010032Z-dc5591", "no_rollback": True,
                        "accept_marginal": True, "force": False})
    assert argv[:3] == ["deploy", "--yes", "--no-notify"]
    assert argv[3:] == ["--patchset", "ddtree-temp", "--budget", "16", "--topk-cap", "4", "--no-perf-gate",
                        "--accept-marginal", "--deadline", "90.0", "--rollout-id", "20261204T010032Z-dc5591",
                        "--no-rollback"]


def test_unset_options_leave_the_inventorys_values():
    assert deploy_args({}) == ["deploy", "--yes", "--no-notify"]
    assert config_args({"budget": None, "topk_cap": None}) == []


@pytest.mark.parametrize("args, problem", [
    ({"patchset": "p", "bundle": "/b.tar"}, "either patchset or bundle"),
    ({"expect_id": "x"}, "give bundle too"),
])
def test_contradicting_sources_are_refused(args, problem):
    with pytest.raises(ValueError, match=problem):
        source_args(args)


def test_a_bundle_goes_with_its_expected_id():
    assert source_args({"bundle": "/b.tar", "expect_id": "abc"}) == ["--bundle", "/b.tar", "--expect-id", "abc"]


def test_a_plan_with_every_file_the_same_and_the_unit_unchanged_changes_nothing():
    assert not plan_changes({"files": [SAME], "unit_diff": "", "stop_units": []})
    assert plan_changes({"files": [SAME, NEW], "unit_diff": "", "stop_units": []})
    assert plan_changes({"files": [SAME], "unit_diff": "--- a\n+++ b\n", "stop_units": []})
    assert plan_changes({"files": [SAME], "unit_diff": "", "stop_units": ["dflash.service"]})


def test_the_diff_shows_the_unit_diff_then_every_file():
    d = plan_diff({"files": [SAME, NEW], "unit_diff": "--- a/u\n+++ b/u\n", "unit_path": "/etc/u"})
    text = d["prepared"]
    assert text.startswith("--- a/u\n+++ b/u\n")
    assert "same     replace sglang/a.py  aaaaaaaaaaaa -> aaaaaaaaaaaa" in text
    assert "new      add     sglang/b.py  - -> bbbbbbbbbbbb" in text
    assert "unit /etc/u: unchanged" in plan_diff({"files": [], "unit_diff": "", "unit_path": "/etc/u"})["prepared"]


def test_each_step_lasts_until_the_next_begins():
    steps = [{"step": "preflight", "t": 10.0}, {"step": "backup", "t": 10.25, "detail": "x"},
             {"step": "committed", "t": 12.0}]
    assert phase_seconds(steps) == [{"step": "preflight", "seconds": 0.25, "detail": ""},
                                    {"step": "backup", "seconds": 1.75, "detail": "x"},
                                    {"step": "committed", "seconds": 0.0, "detail": ""}]
    assert phase_seconds(None) == []
