# Copyright: ddtree-ops developers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0)
"""ddtree.ops.rollout: a rollout's id and its milestones, once for the play (run it with
`run_once: true`): `event: start` makes a new rollout id, tells the webhooks of every host of the
play (their `notify:` vars) and shares the id as the fact `ddtree_rollout_id` and through
set_stats (an AWX workflow hands it to the next job, e.g. a rollback of the rollout);
`event: batch`, at the start of each `serial` batch, makes the CLI's checks before the batch
leaves service (max_unavailable over the play's hosts, the router's pool) and fails the batch, so
the play stops, when they refuse it; `event: finish` tells the webhooks how each host ended, from
the deploy results given."""

from __future__ import annotations

from ansible.errors import AnsibleError

from ansible_collections.ddtree.ops.plugins.plugin_utils.action import ToolAction, display

ARGUMENT_SPEC = {
    "event": {"type": "str", "choices": ["start", "batch", "finish"], "default": "start"},
    "max_unavailable": {"type": "str"},
    "kind": {"type": "str", "choices": ["deploy", "rollback"], "default": "deploy"},
    "rollout_id": {"type": "str"},
    "results": {"type": "list", "elements": "dict"},
    "results_var": {"type": "str", "default": "ddtree_deploy"},
    "patchset": {"type": "str"},
    "bundle": {"type": "str"},
    "aborted": {"type": "bool", "default": False},
    "reason": {"type": "str"},
}


class ActionModule(ToolAction):
    ARGUMENT_SPEC = ARGUMENT_SPEC

    def play_hosts(self, task_vars):
        """The Host of every host of the play, from its own vars."""
        from ddtree_ops.config.inventory import parse_inventory
        from ddtree_ops.errors import DdtreeOpsError

        out = []
        hostvars = task_vars.get("hostvars") or {}
        for name in [str(n) for n in task_vars.get("ansible_play_hosts_all") or [task_vars["inventory_hostname"]]]:
            hv = hostvars[name]
            doc = self.inventory_of(name, hv, hv.get("inventory_dir"))
            try:
                out.append(parse_inventory(doc, "ansible vars of %s" % name).hosts[name])
            except DdtreeOpsError as e:  # a bad var of a host: its message names the host and the field
                raise AnsibleError(str(e)) from None
        return out

    def act(self, result, args, host, doc, task_vars):
        from ddtree_ops.fleet.external_rollout import finish_rollout, start_rollout
        from ddtree_ops.fleet.rollout_id import is_rollout_id

        hosts = self.play_hosts(task_vars)
        warn = display.warning
        common = dict(patchset=args.get("patchset"), bundle=args.get("bundle"))
        result["changed"] = False
        if self._task.check_mode and args["event"] != "batch":
            hosts = []  # check mode tells no webhook: the id is only a preview
        if args["event"] == "start":
            rid = start_rollout(hosts, args["kind"], warn, **common)
            # A rollback's own id has a name of its own: in an AWX workflow the deploy's
            # ddtree_rollout_id reaches the rollback job as the rollout it must undo.
            name = "ddtree_rollout_id" if args["kind"] == "deploy" else "ddtree_rollback_id"
            result.update(rollout_id=rid, ansible_facts={name: rid},
                          ansible_stats={"data": {name: rid}, "per_host": False, "aggregate": False},
                          msg="rollout %s started on %s" % (rid, ", ".join(h.name for h in hosts)))
            return result
        if args["event"] == "batch":
            return self.batch(result, args, hosts, task_vars)
        rid = args.get("rollout_id")
        if not rid or not is_rollout_id(rid):
            return self.fail(result, "event finish needs the rollout_id that event start gave (got %r)" % (rid,))
        rows = args["results"] if args.get("results") is not None else self.registered(task_vars, args["results_var"])
        rows = [r for r in rows if r.get("host")]
        code = finish_rollout(hosts, args["kind"], rid, rows, warn, aborted=args["aborted"], reason=args.get("reason"),
                              **common)
        result.update(rollout_id=rid, exit_code=code, msg="rollout %s finished, exit %d" % (rid, code))
        return result

    def batch(self, result, args, hosts, task_vars):
        from ddtree_ops.config.schema import Invalid, count_or_share
        from ddtree_ops.errors import DdtreeOpsError
        from ddtree_ops.fleet.external_rollout import check_batch

        limit = None
        if args.get("max_unavailable"):
            try:
                limit = count_or_share()(args["max_unavailable"], {})
            except Invalid as e:
                return self.fail(result, "max_unavailable: %s" % e.problem)
        batch = list(task_vars.get("ansible_play_batch") or [])
        everyone = [h.name for h in hosts]
        earlier = bool(batch) and everyone.index(batch[0]) > 0 if batch and batch[0] in everyone else False
        try:
            result["msg"] = check_batch(hosts, batch, max_unavailable=limit, changed=earlier)
        except DdtreeOpsError as e:
            return self.fail(result, str(e), exit_code=e.exit_code)
        return result

    def registered(self, task_vars, name):
        """Each play host's registered result of the deploy (or rollback) task, as the webhooks'
        rows; a host the play never reached has none."""
        rows = []
        hostvars = task_vars.get("hostvars") or {}
        for host in task_vars.get("ansible_play_hosts_all") or []:
            hv = hostvars[host]
            if name not in hv:
                continue
            r = self._templar.template(hv[name])
            if not isinstance(r, dict) or r.get("skipped"):
                continue
            rows.append({"host": host, "outcome": r.get("outcome"), "exit_code": r.get("exit_code"),
                         "release": r.get("release"), "message": r.get("msg")})
        return rows
