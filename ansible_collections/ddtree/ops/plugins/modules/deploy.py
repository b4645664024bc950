#!/usr/bin/python
# Copyright: ddtree-ops developers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0)
# The documentation of the ddtree.ops.deploy action plugin (plugins/action/deploy.py), which does the work.

from __future__ import annotations

DOCUMENTATION = r"""
---
module: deploy
short_description: Deploy the DDTree patch set to one SGLang host through the ddtree-ops runbook
version_added: "0.1.0"
description:
  - Runs the ddtree-ops deploy for the task's host on the controller, over the tool's own SSH session built from
    the host's variables (C(ansible_host), C(ansible_port), C(ansible_user), C(ansible_ssh_private_key_file),
    C(ansible_python_interpreter), and the tool's inventory keys such as C(model_path), C(budget), C(router)).
  - The same runbook and engine as the CLI, in the same order - lock and lease with a heartbeat, preflight,
    backup, journal, atomic install, unit, launch check, restart, weight wait, health gate, optional
    performance gate, commit - and an automatic rollback of the host when a step fails.
  - Each phase is printed as it happens (ansible-runner C(verbose) events, which AWX shows live).
  - Check mode is the tool's C(plan) - every check a deploy makes, nothing changed; a refusal fails the task.
  - Diff mode shows the unit's diff and the file table.
options:
  patchset:
    description: A patch set name under the tool's C(patches/) or a patch-set folder. Default C(ddtree-temp).
    type: str
  bundle:
    description: A release bundle made by C(ddtree-ops bundle), verified before any host is touched.
    type: path
  expect_id:
    description: With O(bundle), refuse it unless its id (or its file's sha256) is this.
    type: str
  budget:
    description: Draft nodes per step, root excluded (1..1024); overrides the host's C(budget).
    type: int
  topk_cap:
    description: Candidates per depth (1..budget); overrides the host's C(topk_cap).
    type: int
  perf_gate:
    description: Gate the host on speed (baseline before, canary after); default the host's C(perf_gate.enabled).
    type: bool
  accept_marginal:
    description: A marginal performance verdict passes (otherwise it fails the deploy, rolled back).
    type: bool
    default: false
  deadline:
    description: Seconds to wait for weight loading (default the host's C(health.load_deadline_s)).
    type: float
  rollout_id:
    description: The rollout id the host records (from M(ddtree.ops.rollout)); default a new one.
    type: str
  no_rollback:
    description: On failure leave the host as it failed (exit code 4) instead of rolling it back.
    type: bool
    default: false
  force:
    description: Replace files that drifted from what the tool expects.
    type: bool
    default: false
attributes:
  check_mode:
    support: full
    description: Check mode is the tool's plan, every check a deploy makes with nothing changed.
  diff_mode:
    support: full
    description: Shows the unit's diff and the file table.
notes:
  - One task is one host; a multi-node server (C(multinode) group) is refused, deploy it with the CLI.
  - A cancelled job (AWX sends SIGKILL to the job) stops the tool's command, which rolls the host back by itself.
extends_documentation_fragment:
  - ddtree.ops.tool
"""

EXAMPLES = r"""
- name: Deploy DDTree budget 16 / topk cap 4
  ddtree.ops.deploy:
    patchset: ddtree-temp
    budget: 16
    topk_cap: 4
    rollout_id: "{{ ddtree_rollout_id }}"
"""

RETURN = r"""
exit_code:
  description: The CLI's exit code - 0 ok, 2 refused (nothing changed), 3 failed and rolled back, 4 a person must
    look, 5 lock held.
  returned: always
  type: int
  sample: 0
outcome:
  description: What happened to the host (deployed, unchanged, rolled back, refused, ...; C(planned) in check mode).
  returned: always
  type: str
  sample: deployed
release:
  description: The host's release id after the task.
  returned: always
  type: str
  sample: 20261204T010033Z-8014e3
rollout_id:
  description: The rollout id the host recorded.
  returned: always
  type: str
  sample: 20261204T010032Z-dc5591
phases:
  description: Each step of the runbook with its duration in seconds.
  returned: success and failure
  type: list
  elements: dict
failed_step:
  description: The step that failed, when one did.
  returned: failure
  type: str
perf_gate:
  description: The performance gate's verdict and figures, when it ran.
  returned: when the gate ran
  type: dict
plan:
  description: The tool's plan of the host (check mode).
  returned: check mode
  type: dict
"""
