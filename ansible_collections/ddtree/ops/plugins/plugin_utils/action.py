# Copyright: ddtree-ops developers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0)
"""What the collection's action plugins share: the host's vars as the tool's inventory, one
command run with live progress, the tool's exit codes and JSON as a task result."""

from __future__ import annotations

from ansible.errors import AnsibleError
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

from ansible_collections.ddtree.ops.plugins.plugin_utils.tool import ToolMissing, host_inventory, run_tool, tool_python

display = Display()

# The CLI's exit codes (README "Exit codes").
EXIT_MEANING = {
    0: "ok",
    2: "bad input or a preflight refusal: nothing changed",
    3: "failed; the host is back on its previous release, healthy",
    4: "failed and the rollback failed too: a person must look",
    5: "the deploy lock is held by another run",
}


class ToolAction(ActionBase):
    """An action that runs one ddtree-ops command against the task's host over the tool's own SSH
    session (never Ansible's connection)."""

    _requires_connection = False
    TRANSFERS_FILES = False
    ARGUMENT_SPEC = {}

    def args(self):
        """The task's options, validated against ARGUMENT_SPEC (raises on a bad one)."""
        validation, new_args = self.validate_argument_spec(argument_spec=self.ARGUMENT_SPEC)
        return new_args

    def host_doc(self, task_vars):
        """(name, one-host inventory) of the task's host, from its vars."""
        host = str(task_vars["inventory_hostname"])
        return host, self.inventory_of(host, task_vars, task_vars.get("inventory_dir"))

    def inventory_of(self, host, hostvars, inventory_dir):
        """The one-host inventory of `host` from its vars (`hostvars`: the task's vars, or
        hostvars[host] for another host of the play), templates rendered as Ansible would."""
        from ddtree_ops.config.ansible_hostvars import host_var_names
        from ddtree_ops.errors import DdtreeOpsError

        wanted = host_var_names()
        picked = dict((k, self._templar.template(hostvars[k])) for k in list(hostvars.keys()) if k in wanted)
        try:
            return host_inventory(host, picked, inventory_dir)
        except DdtreeOpsError as e:  # the tool's InventoryError: its message names the host and the field
            raise AnsibleError(str(e)) from None

    def run_command(self, argv, host, doc):
        own = "[%s] " % host

        def show(line):
            if line.startswith("== "):  # the CLI's framing of its one-host rollout ("== canary: ...")
                return
            display.display("%s | %s" % (host, line[len(own):] if line.startswith(own) else line))
        return run_tool(argv, host, doc, show)

    def fail(self, result, msg, **fields):
        result.update(fields)
        result["failed"] = True
        result["msg"] = msg
        return result

    def run(self, tmp=None, task_vars=None):
        result = super(ToolAction, self).run(tmp, task_vars)
        del tmp
        try:
            args = self.args()
            tool_python()  # ddtree-ops is importable, or ToolMissing says where to install it
            host, doc = self.host_doc(task_vars or {})
            return self.act(result, args, host, doc, task_vars or {})
        except (ToolMissing, AnsibleError, ValueError) as e:  # ValueError: options that contradict each other
            return self.fail(result, str(e))

    def act(self, result, args, host, doc, task_vars):
        raise NotImplementedError


def one_host(run):
    """The JSON document's row for the one host, or None."""
    rows = (run.doc or {}).get("hosts") or []
    return rows[0] if rows else None


def exit_message(run, row=None):
    """A failed command as one message: the tool's own words first."""
    rc = run.rc
    parts = []
    if row and row.get("message"):
        parts.append(row["message"])
    elif run.doc and run.doc.get("message"):
        parts.append(run.doc["message"])
    elif run.lines:
        parts.append(run.lines[-1])
    parts.append("(exit %s: %s)" % (rc, EXIT_MEANING.get(rc, "the command was stopped" if rc and rc > 128
                                                             else "unexpected")))
    return " ".join(parts)
