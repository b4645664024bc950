#!/usr/bin/python
# Copyright: ddtree-ops developers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0)
# The documentation of the ddtree.ops.rollout action plugin (plugins/action/rollout.py), which does the work.

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rollout
short_description: A ddtree-ops rollout's id, batch checks and webhook milestones, once for the play
version_added: "0.1.0"
description:
  - C(event=start) makes a new rollout id, tells the C(notify) webhooks of the play's hosts, sets the fact
    C(ddtree_rollout_id) (C(ddtree_rollback_id) for C(kind=rollback)) and shares it through set_stats (an AWX
    workflow passes it to the next job).
  - C(event=batch), at the start of each C(serial) batch, checks the batch as the CLI does before it leaves service
    - at most C(max_unavailable) of the play's hosts, and each router in front of it keeps its pool less
    C(max_unavailable) ready - and fails (so the play stops) when refused.
  - C(event=finish) tells the webhooks how each host ended.
  - Run it with C(run_once=true).
options:
  event:
    description: Which milestone.
    type: str
    choices: [start, batch, finish]
    default: start
  kind:
    description: What the rollout does.
    type: str
    choices: [deploy, rollback]
    default: deploy
  rollout_id:
    description: The rollout (C(event=finish)).
    type: str
  results:
    description: The hosts' results (C(host), C(outcome), C(exit_code), C(release), C(message)) for C(event=finish);
      default each play host's registered O(results_var).
    type: list
    elements: dict
  results_var:
    description: The variable each host registered its M(ddtree.ops.deploy) or M(ddtree.ops.rollback) result in.
    type: str
    default: ddtree_deploy
  patchset:
    description: The patch set, for the webhooks' messages.
    type: str
  bundle:
    description: The bundle id, for the webhooks' messages.
    type: str
  aborted:
    description: The rollout stopped early (C(event=finish)).
    type: bool
    default: false
  reason:
    description: Why it stopped (C(event=finish)).
    type: str
  max_unavailable:
    description: Targets out of service at once (N or P%); default the hosts' C(max_unavailable), else 1.
    type: str
extends_documentation_fragment:
  - ddtree.ops.tool
  - ddtree.ops.tool.read_only
"""

EXAMPLES = r"""
- name: Start the rollout
  ddtree.ops.rollout:
    event: start
  run_once: true
"""

RETURN = r"""
rollout_id:
  description: The rollout's id.
  returned: always
  type: str
  sample: 20261204T010032Z-dc5591
exit_code:
  description: The rollout's exit code from its hosts' (C(event=finish)).
  returned: event finish
  type: int
"""
