# Copyright: ddtree-ops developers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0)
"""The ddtree-ops command lines of the collection's actions, from their validated options, and
what the tool's plans and results say in Ansible's terms."""

from __future__ import annotations

DEPLOY_SPEC = {
    "patchset": {"type": "str"},
    "bundle": {"type": "path"},
    "expect_id": {"type": "str"},
    "budget": {"type": "int"},
    "topk_cap": {"type": "int"},
    "perf_gate": {"type": "bool"},
    "accept_marginal": {"type": "bool", "default": False},
    "deadline": {"type": "float"},
    "rollout_id": {"type": "str"},
    "no_rollback": {"type": "bool", "default": False},
    "force": {"type": "bool", "default": False},
}


def source_args(args):
    argv = []
    if args.get("patchset") and args.get("bundle"):
        raise ValueError("give either patchset or bundle, not both")
    if args.get("expect_id") and not args.get("bundle"):
        raise ValueError("expect_id checks a bundle: give bundle too")
    for opt, flag in (("patchset", "--patchset"), ("bundle", "--bundle"), ("expect_id", "--expect-id")):
        if args.get(opt):
            argv += [flag, args[opt]]
    return argv


def config_args(args):
    argv = []
    for opt, flag in (("budget", "--budget"), ("topk_cap", "--topk-cap")):
        if args.get(opt) is not None:
            argv += [flag, str(args[opt])]
    return argv


def deploy_args(args):
    argv = ["deploy", "--yes", "--no-notify"] + source_args(args) + config_args(args)
    if args.get("perf_gate") is not None:
        argv.append("--perf-gate" if args["perf_gate"] else "--no-perf-gate")
    if args.get("accept_marginal"):
        argv.append("--accept-marginal")
    if args.get("deadline") is not None:
        argv += ["--deadline", repr(float(args["deadline"]))]
    if args.get("rollout_id"):
        argv += ["--rollout-id", args["rollout_id"]]
    for opt, flag in (("no_rollback", "--no-rollback"), ("force", "--force")):
        if args.get(opt):
            argv.append(flag)
    return argv


def plan_changes(plan):
    """Whether a deploy would change the host, from its plan."""
    return bool(plan.get("unit_diff") or plan.get("stop_units")
                or any(f.get("status") != "same" for f in plan.get("files", [])))


def plan_diff(plan):
    """The unit's diff and the file table, as Ansible's diff callback prints a prepared diff."""
    rows = []
    for f in plan.get("files", []):
        old, new = (f.get("old_sha256") or "-")[:12], (f.get("new_sha256") or "-")[:12]
        rows.append("%-8s %-7s %s  %s -> %s" % (f.get("status"), f.get("action"), f.get("rel"), old, new))
    unit = plan.get("unit_diff") or "unit %s: unchanged\n" % plan.get("unit_path")
    return {"prepared": unit + ("" if unit.endswith("\n") else "\n") + "files:\n" + "\n".join(rows) + "\n"}
