"""Run a GitHub Actions workflow's shell steps here, as a runner would, for the CI example's test.

What a runner does for a `run:` step and this does too: the script through
`bash --noprofile --norc -eo pipefail` (the workflow's `shell: bash`), the workflow's, job's and
step's `env:`, `$GITHUB_OUTPUT` (a step's `key=value` lines become `steps.ID.outputs.key`, and a
job's `outputs:` become `needs.JOB.outputs.key`), `$GITHUB_PATH` and `$RUNNER_TEMP`. Expressions
are evaluated only where they are plain property paths (`${{ inputs.limit }}`,
`${{ needs.bundle.outputs.id }}`, `${{ secrets.X }}`): anything else is refused, so the example
cannot quietly depend on an expression this runner would get wrong. `uses:` steps (checkout,
artifacts) and the steps the caller names are skipped: the caller provides what they would
(the checkout, the installed tool, the SSH key).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_EXPR = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")
_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z_][A-Za-z0-9_-]*)*$")


@dataclass
class StepRun:
    job: str
    name: str
    code: int
    stdout: str
    stderr: str


@dataclass
class WorkflowRun:
    workflow: dict[str, Any]
    workdir: Path
    inputs: dict[str, str]
    secrets: dict[str, str] = field(default_factory=dict)
    env_overrides: dict[str, str] = field(default_factory=dict)  # win over the workflow's env
    skip_steps: tuple[str, ...] = ()  # step names the caller stands in for
    base_path: str = os.environ.get("PATH", "")
    needs: dict[str, dict[str, str]] = field(default_factory=dict)
    steps: list[StepRun] = field(default_factory=list)

    def context(self, step_outputs: dict[str, dict[str, str]]) -> dict[str, Any]:
        inputs = {k: str(v.get("default", "")) for k, v in
                  (self.workflow.get("on", self.workflow.get(True, {})) or {})
                  .get("workflow_dispatch", {}).get("inputs", {}).items()}
        inputs.update(self.inputs)
        return {"inputs": inputs, "secrets": self.secrets,
                "needs": {j: {"outputs": o} for j, o in self.needs.items()},
                "steps": {s: {"outputs": o} for s, o in step_outputs.items()},
                "github": {"repository": "example/ddtree-ops"}}

    def expand(self, text: str, ctx: dict[str, Any]) -> str:
        def one(m: re.Match) -> str:
            expr = m.group(1)
            if not _PATH.match(expr):
                raise ValueError(f"expression {expr!r} is not a plain property path")
            value: Any = ctx
            for part in expr.split("."):
                value = value.get(part, "") if isinstance(value, dict) else ""
            return "" if value is None else str(value)
        return _EXPR.sub(one, str(text))

    def run_job(self, job: str, *, timeout: float = 600) -> list[StepRun]:
        spec = self.workflow["jobs"][job]
        step_outputs: dict[str, dict[str, str]] = {}
        extra_path: list[str] = []
        ran: list[StepRun] = []
        temp = self.workdir / ".runner-temp"
        temp.mkdir(exist_ok=True)
        for i, step in enumerate(spec.get("steps", [])):
            name = step.get("name", step.get("uses", f"step {i}"))
            if "uses" in step or name in self.skip_steps:
                continue
            ctx = self.context(step_outputs)
            env = {**{k: self.expand(v, ctx) for k, v in (self.workflow.get("env") or {}).items()},
                   **{k: self.expand(v, ctx) for k, v in (spec.get("env") or {}).items()},
                   **{k: self.expand(v, ctx) for k, v in (step.get("env") or {}).items()},
                   **self.env_overrides}
            out_file, path_file = temp / f"output-{job}-{i}", temp / f"path-{job}-{i}"
            out_file.write_text("")
            path_file.write_text("")
            env.update(GITHUB_OUTPUT=str(out_file), GITHUB_PATH=str(path_file), RUNNER_TEMP=str(temp),
                       PATH=os.pathsep.join([*extra_path, self.base_path]), HOME=os.environ.get("HOME", "/root"),
                       CI="true", GITHUB_ACTIONS="true")
            script = self.expand(step["run"], ctx)
            r = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script],
                               cwd=self.workdir, env=env, capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL)
            ran.append(StepRun(job, name, r.returncode, r.stdout, r.stderr))
            if "id" in step:
                step_outputs[step["id"]] = dict(line.split("=", 1) for line in out_file.read_text().splitlines()
                                                if "=" in line)
            extra_path = [p for p in path_file.read_text().splitlines() if p] + extra_path
            if r.returncode != 0 and not step.get("continue-on-error"):
                break
        self.steps.extend(ran)
        ctx = self.context(step_outputs)
        self.needs[job] = {k: self.expand(v, ctx) for k, v in (spec.get("outputs") or {}).items()}
        return ran


def load_workflow(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())
