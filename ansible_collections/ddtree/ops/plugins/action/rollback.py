# Copyright: ddtree-ops developers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0)
"""ddtree.ops.rollback: one host back to its previous release, a named one, the pristine upstream
files, or what it ran before a rollout, through the ddtree-ops runbook (restart, health gate).
No check mode: a rollback's checks are made on the host as it runs (the tool has no dry run of
one), so in check mode Ansible skips the task."""

from __future__ import annotations

from ansible_collections.ddtree.ops.plugins.plugin_utils.action import ToolAction, exit_message, one_host
from ansible_collections.ddtree.ops.plugins.plugin_utils.tool import phase_seconds

ARGUMENT_SPEC = {
    "to": {"type": "str", "default": "previous"},
    "rollout": {"type": "str"},
    "force": {"type": "bool", "default": False},
    "rollout_id": {"type": "str"},
}


def rollback_args(args):
    argv = ["rollback", "--yes", "--no-notify"]
    if args.get("rollout"):
        if args.get("to") not in (None, "previous"):
            raise ValueError("give either to or rollout, not both")
        argv += ["--rollout", args["rollout"]]
    elif args.get("to") not in (None, "previous"):
        argv += ["--to", args["to"]]
    if args.get("force"):
        argv.append("--force")
    if args.get("rollout_id"):
        argv += ["--rollout-id", args["rollout_id"]]
    return argv


class ActionModule(ToolAction):
    ARGUMENT_SPEC = ARGUMENT_SPEC
    _supports_check_mode = False

    def recorded(self, rollout, host, doc):
        """Whether the host records deploy rollout `rollout` (its records read with `rollouts`)."""
        from ddtree_ops.fleet.rollout_id import is_rollout_id

        if not is_rollout_id(rollout):
            raise ValueError("rollout %r is not a rollout id (such as 20261202T015500Z-1a2b3c)" % (rollout,))
        run = self.run_command(["rollouts"], host, doc)
        listed = (run.doc or {}).get("rollouts")
        if run.rc != 0 or listed is None or (run.doc or {}).get("unreadable"):
            raise ValueError(exit_message(run))  # the records could not be read: nothing is assumed
        return any(r.get("id") == rollout and r.get("kind") == "deploy" for r in listed)

    def act(self, result, args, host, doc, task_vars):
        argv = rollback_args(args)
        if args.get("rollout") and not self.recorded(args["rollout"], host, doc):
            # One task is one host: a host the rollout never reached has nothing to undo, where the
            # CLI over a whole selection refuses an id no selected host records (exit 2).
            result.update(changed=False, outcome="unchanged", exit_code=0,
                          msg="rollout %s never changed %s: left alone" % (args["rollout"], host))
            return result
        run = self.run_command(argv, host, doc)
        row = one_host(run)
        result["exit_code"] = run.rc
        if row is None:
            if run.rc == 0:  # the host is no longer on that rollout (a later run replaced it): nothing to undo
                result.update(changed=False, outcome="unchanged", msg=run.last_lines(1))
                return result
            return self.fail(result, exit_message(run), changed=False)
        result.update(outcome=row.get("outcome"), release=row.get("release"), failed_step=row.get("failed_step"),
                      phases=phase_seconds(row.get("steps")), rollout_id=(run.doc or {}).get("rollout_id"),
                      changed=row.get("outcome") not in ("unchanged", None))
        if run.rc != 0:
            return self.fail(result, exit_message(run, row))
        result["msg"] = "%s: %s" % (row.get("outcome"), row.get("release"))
        return result
