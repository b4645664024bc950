#!/usr/bin/python
# Copyright: ddtree-ops developers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0)
# The documentation of the ddtree.ops.rollback action plugin (plugins/action/rollback.py), which does the work.

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rollback
short_description: Roll one SGLang host back through the ddtree-ops runbook
version_added: "0.1.0"
description:
  - Takes the task's host back to its previous release, a named release, the pristine upstream files, or what it
    ran before a rollout, with the same restart and health gate as a deploy, over the tool's own SSH session.
  - A host whose files or SGLang version changed since the release being undone is refused (exit code 2) unless
    O(force).
  - No check mode (the tool makes a rollback's checks on the host as it runs); Ansible skips the task in check mode.
options:
  to:
    description: C(previous), a release id, or C(original) (the pristine upstream files).
    type: str
    default: previous
  rollout:
    description: Undo this rollout on the host - back to what it ran before it; a host the rollout never changed
      is left alone.
    type: str
  force:
    description: Restore the backups even where the host changed under the release.
    type: bool
    default: false
  rollout_id:
    description: The id the rollback's own rollout records; default a new one.
    type: str
attributes:
  check_mode:
    support: none
    description: Cannot run in check mode, Ansible skips the task.
  diff_mode:
    support: none
    description: Returns no diff.
extends_documentation_fragment:
  - ddtree.ops.tool
"""

EXAMPLES = r"""
- name: Undo the rollout the AWX workflow started
  ddtree.ops.rollback:
    rollout: "{{ ddtree_rollout_id }}"
"""

RETURN = r"""
exit_code:
  description: The CLI's exit code (0 ok, 2 refused, 3 failed and back where it was, 4 a person must look).
  returned: always
  type: int
outcome:
  description: What happened to the host (rolled back, unchanged, ...).
  returned: always
  type: str
release:
  description: The host's release id after the task.
  returned: when the host was reached
  type: str
phases:
  description: Each step with its duration in seconds.
  returned: when the host was reached
  type: list
  elements: dict
"""
