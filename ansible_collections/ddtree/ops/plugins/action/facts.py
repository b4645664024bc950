# Copyright: ddtree-ops developers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0)
"""ddtree.ops.facts: what the host runs, read only (the tool's `status` for the one host), as
`ansible_facts.ddtree`. Drift and an unhealthy server are facts, not failures; a host the tool
cannot reach is unreachable, as Ansible marks one."""

from __future__ import annotations

from ansible_collections.ddtree.ops.plugins.plugin_utils.action import ToolAction, exit_message, one_host
from ansible_collections.ddtree.ops.plugins.plugin_utils.deploy_args import source_args

ARGUMENT_SPEC = {
    "patchset": {"type": "str"},
    "bundle": {"type": "path"},
}


class ActionModule(ToolAction):
    ARGUMENT_SPEC = ARGUMENT_SPEC

    def act(self, result, args, host, doc, task_vars):
        src = source_args(args)
        run = self.run_command(["status"] + src, host, doc)
        row = one_host(run)
        if row is None:
            return self.fail(result, exit_message(run), exit_code=run.rc)
        result["changed"] = False
        if not row.get("reachable", True):
            result.update(unreachable=True, msg="%s: not reachable: %s" % (host, row.get("reason")))
            return result
        row = dict((k, v) for k, v in row.items() if k not in ("connect_tries", "seconds"))
        result["ansible_facts"] = {"ddtree": row}
        result["msg"] = "release %s, %s" % (row.get("release"), "ok" if row.get("ok") else "drift or unhealthy")
        return result
