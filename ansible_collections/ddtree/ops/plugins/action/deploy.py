# Copyright: ddtree-ops developers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0)
"""ddtree.ops.deploy: one host's deploy through the ddtree-ops runbook (see the module's docs).

Check mode is the tool's `plan` (every check a deploy makes, nothing changed); diff mode adds the
unit's diff and the file table, from the same plan, before the deploy runs."""

from __future__ import annotations

from ansible_collections.ddtree.ops.plugins.plugin_utils.action import ToolAction, exit_message, one_host
from ansible_collections.ddtree.ops.plugins.plugin_utils.deploy_args import (
    DEPLOY_SPEC,
    config_args,
    deploy_args,
    plan_changes,
    plan_diff,
    source_args,
)
from ansible_collections.ddtree.ops.plugins.plugin_utils.tool import phase_seconds


class ActionModule(ToolAction):
    ARGUMENT_SPEC = DEPLOY_SPEC

    def act(self, result, args, host, doc, task_vars):
        src = source_args(args)
        plan = None
        if self._task.check_mode or self._task.diff:
            run = self.run_command(["plan"] + src + config_args(args) + (["--force"] if args["force"] else []),
                                   host, doc)
            plans = (run.doc or {}).get("plans") or []
            plan = plans[0] if plans else None
            if plan is None or run.rc != 0:
                refusals = "; ".join(plan.get("refusals") or []) if plan else ""
                return self.fail(result, refusals or exit_message(run), exit_code=run.rc, plan=plan)
            if self._task.diff:
                result["diff"] = plan_diff(plan)
            if self._task.check_mode:
                result.update(changed=plan_changes(plan), plan=plan, exit_code=0,
                              release=plan.get("current_release"), outcome="planned",
                              msg="would change the host" if plan_changes(plan) else "already as asked")
                return result
        run = self.run_command(deploy_args(args), host, doc)
        row = one_host(run)
        doc_ = run.doc or {}
        result.update(exit_code=run.rc, rollout_id=doc_.get("rollout_id") or args.get("rollout_id"))
        if row is None:
            return self.fail(result, exit_message(run), outcome=None, release=None, changed=False)
        result.update(outcome=row.get("outcome"), release=row.get("release"), failed_step=row.get("failed_step"),
                      phases=phase_seconds(row.get("steps")), seconds=row.get("seconds"),
                      perf_gate=row.get("perf_gate"), serving=row.get("serving"),
                      changed=row.get("outcome") != "unchanged")
        if run.rc != 0:
            return self.fail(result, exit_message(run, row))
        result["msg"] = "%s: %s" % (row.get("outcome"), row.get("release"))
        return result
