#!/usr/bin/python
# Copyright: ddtree-ops developers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0)
# The documentation of the ddtree.ops.facts action plugin (plugins/action/facts.py), which does the work.

from __future__ import annotations

DOCUMENTATION = r"""
---
module: facts
short_description: What an SGLang host runs, as ddtree-ops sees it, read only
version_added: "0.1.0"
description:
  - The tool's C(status) for the task's host as C(ansible_facts.ddtree) - release and rollout id, patch set,
    budget and topk cap of the active unit, unit states, drift of files, of the SGLang version and from the
    inventory, C(/health), average accept length, the current release's performance gate, a host heal.
  - Drift and an unhealthy server are facts, not failures. A host the tool cannot reach is marked unreachable.
options:
  patchset:
    description: Also report drift from this patch set.
    type: str
  bundle:
    description: Also report drift from this bundle.
    type: path
attributes:
  facts:
    support: full
    description: Sets C(ansible_facts.ddtree).
extends_documentation_fragment:
  - ddtree.ops.tool
  - ddtree.ops.tool.read_only
"""

EXAMPLES = r"""
- name: Read what the hosts run
  ddtree.ops.facts:

- name: Every host on one release
  ansible.builtin.assert:
    that: ansible_facts.ddtree.release == hostvars[ansible_play_hosts[0]].ansible_facts.ddtree.release
"""

RETURN = r"""
ansible_facts:
  description: The facts.
  returned: when the host was reached
  type: complex
  contains:
    ddtree:
      description: The tool's status row of the host (release, rollout, budget, topk_cap, units, drift, health,
        avg_accept_length, perf_gate, host_heal, ...).
      type: dict
      returned: always
"""
