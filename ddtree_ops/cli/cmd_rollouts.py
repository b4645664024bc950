"""`ddtree-ops rollouts` (the listing from the hosts' records) and `ddtree-ops promote` (continue
a rollout that stopped after its canary), plus what `deploy` and `rollback` take from here: the
`promote` command to print after `--stop-after-canary`, and the targets of `rollback --rollout`.

Thin: the records are read and interpreted in fleet/rollouts.py."""

from __future__ import annotations

import shlex
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import typer
from rich.table import Table

from ..config.terminal import terminal_safe
from ..host.hooks import Hooks
from .common import INVENTORY_OPT, LIMIT_OPT, emit_json, guard, hooks_of, log

ROLLOUT_OPT = typer.Option(..., "--rollout", metavar="ID", help="A rollout id (`ddtree-ops rollouts` lists them).")


@dataclass(frozen=True)
class CommandKit:
    """What `rollouts` and `promote` share with `deploy`, handed over by commands.py when it
    registers them (it imports this module, so this one cannot import it back)."""

    hosts: Callable[[str, Optional[str]], list]  # (inventory, limit) → selected hosts
    targets: Callable[..., tuple]  # (inventory, limit, budget, topk_cap) → (targets, notes)
    source: Callable[..., Any]  # the verified patch set or bundle, as a context manager
    report_path: Callable[[Optional[str]], Optional[str]]
    print_rollout: Callable[..., int]
    warn: Callable[[str], None]




def _records(hosts, accept_new_host_keys: bool, hooks: Hooks, forks: int):
    from ..fleet.actions import ssh_connector
    from ..fleet.rollouts import read_records

    records = read_records(hosts, ssh_connector(accept_new_host_keys, hooks), forks)
    for r in records:
        if r.history is None:
            log(f"warning: {r.host}: its records could not be read: {r.error}")
    return records


# ---------------------------------------------------------------------------------------------
# deploy --stop-after-canary and rollback --rollout


def promote_command(rollout_id: str, inventory: str, limit: Optional[str], *, patchset: str,
                    bundle: Optional[str], allow_unsigned: bool = False) -> str:
    """The command that continues `rollout_id` over the same selection with the same release."""
    argv = ["ddtree-ops", "promote", "-i", inventory, "--rollout", rollout_id]
    argv += ["--limit", limit] if limit else []
    argv += ["--bundle", bundle] if bundle else ["--patchset", patchset]
    argv += ["--allow-unsigned"] if allow_unsigned and not bundle else []
    return shlex.join(argv)


def stopped_after_canary(res, command: str) -> dict[str, Any]:
    """What a deploy that stopped after its canary adds to its summary ({}: it did not stop there)."""
    waiting = [r.host for r in res.results if str(r.outcome) == "skipped"]
    if not res.stopped_after_canary or res.exit_code != 0 or not waiting:
        return {}
    return {"promote": command, "waiting": waiting}


def say_promote(extra: dict[str, Any], rollout_id: str, as_json: bool) -> None:
    """After the summary: the rollout id and the command that continues it (stderr beside JSON)."""
    if not extra:
        return
    line = (f"rollout {rollout_id}: canary done; {len(extra['waiting'])} host(s) wait "
            f"({', '.join(extra['waiting'])}). Continue with:\n  {extra['promote']}")
    if as_json:
        log(line)
    else:
        print(terminal_safe(line, keep_newlines=True))


def undo_targets(targets, rollout_id: str, *, accept_new_host_keys: bool, hooks: Hooks, forks: int):
    """`rollback --rollout ID`: the targets that rollout changed, and a note for each one left alone."""
    from ..fleet.rollouts import find_rollout, undo_selection

    records = _records([h for t in targets for h in t.hosts], accept_new_host_keys, hooks, forks)
    return undo_selection(targets, records, find_rollout(records, rollout_id))


# ---------------------------------------------------------------------------------------------
# rollouts


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts or 0))


def _budgets(info) -> str:
    pairs = sorted({(p.budget, p.topk_cap) for p in info.parts if p.budget is not None}, key=str)
    return ", ".join(f"{b}/{k}" for b, k in pairs) or "-"


def print_rollouts(infos) -> None:
    from .tables import console, fit, literal

    t = Table("rollout", "kind", "started (UTC)", "patch set / bundle", "budget/topk", "hosts", "by")
    for info in infos:
        source = info.patchset or "-"
        source += f" (bundle {info.bundle})" if info.bundle else ""
        hosts = ", ".join(f"{p.host} {p.outcome}" for p in info.parts)
        t.add_row(*map(literal, (info.id, str(info.kind), _when(info.started), source, _budgets(info),
                                 fit(hosts, 100), info.by or "-")))
    console().print(t)


def rollouts_command(kit: CommandKit):
    def rollouts(
        ctx: typer.Context,
        inventory: str = INVENTORY_OPT,
        limit: Optional[str] = LIMIT_OPT,
        last: Optional[int] = typer.Option(None, "--last", min=1, help="Only the newest N rollouts."),
        forks: int = typer.Option(10, "--forks", help="Hosts read in parallel at most."),
        accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys"),
        as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    ):
        """The rollouts the selected hosts record, newest first: id, deploy or rollback, when, each host and how
        it ended, patch set and bundle, budget/topk. Reads the hosts' release records; changes nothing. Exit 1
        when a host's records could not be read."""
        from ..fleet.rollouts import list_rollouts
        from .flag_ranges import check_forks

        def body():
            check_forks(forks)
            records = _records(kit.hosts(inventory, limit), accept_new_host_keys, hooks_of(ctx), forks)
            infos = list_rollouts(records)[:last]
            unread = [{"host": r.host, "error": r.error} for r in records if r.history is None]
            code = 1 if unread else 0
            if as_json:
                emit_json({"ok": code == 0, "exit_code": code, "rollouts": [i.to_dict() for i in infos],
                           "unreadable": unread})
            else:
                print_rollouts(infos)
            return code
        guard(body, as_json=as_json)
    return rollouts


# ---------------------------------------------------------------------------------------------
# promote


def _promote_targets(kit: CommandKit, inventory: str, limit: Optional[str], rollout_id: str, *, forks: int,
                     accept_new_host_keys: bool, hooks: Hooks):
    """The rollout as recorded, and the targets it has not reached (with the budget/topk
    overrides its deploy was given)."""
    from ..fleet.rollouts import find_rollout, promote_selection

    first, notes = kit.targets(inventory, limit)
    records = _records([h for t in first for h in t.hosts], accept_new_host_keys, hooks, forks)
    info = find_rollout(records, rollout_id)
    overrides = info.args.get("overrides") or {}
    targets, _ = kit.targets(inventory, limit, overrides.get("budget"), overrides.get("topk_cap"))
    rest, more = promote_selection(targets, info)
    return info, rest, notes + more


def _promote_options(info, ps, b) -> Any:
    """The deploy options of the rollout's canary run, as its record keeps them (options.py)."""
    from ..runbook.options import DeployOptions

    args = info.args
    overrides = {k: v for k, v in (args.get("overrides") or {}).items() if k in ("budget", "topk_cap")}
    return DeployOptions(command=" ".join(["ddtree-ops", *sys.argv[1:]])[:500], rollout_id=info.id,
                         bundle_id=b.id if b else None, templates_dir=str(b.templates_dir) if b else None,
                         perf_gate=args.get("perf_gate"), deadline_s=args.get("deadline_s"),
                         marginal=args.get("marginal") if args.get("marginal") in ("accept", "fail") else "fail",
                         overrides=overrides)


def _nothing_to_promote(info, notes: list[str], as_json: bool) -> int:
    for n in notes:
        log(n)
    log(f"rollout {info.id}: every selected host has it already; nothing to promote")
    if as_json:
        emit_json({"ok": True, "exit_code": 0, "action": "deploy", "rollout_id": info.id, "hosts": [],
                   "notes": notes})
    return 0


def promote_command_for(kit: CommandKit):
    def promote(
        ctx: typer.Context,
        inventory: str = INVENTORY_OPT,
        limit: Optional[str] = LIMIT_OPT,
        rollout: str = ROLLOUT_OPT,
        patchset: Optional[str] = typer.Option(None, "--patchset", "-p",
                                               help="The patch set the rollout deployed (its digest must match)."),
        bundle: Optional[str] = typer.Option(None, "--bundle",
                                             help="The bundle the rollout deployed (its id must match)."),
        expect_id: Optional[str] = typer.Option(None, "--expect-id", metavar="ID",
                                                help="As for deploy: the bundle's id or the sha256 of its file."),
        allow_unsigned: bool = typer.Option(False, "--allow-unsigned", help="As for deploy."),
        batch: Optional[str] = typer.Option(None, "--batch", help="Targets per batch: N or P% (default: "
                                                                    "--max-unavailable)."),
        max_unavailable: Optional[str] = typer.Option(None, "--max-unavailable", metavar="N|P%",
                                                      help="As for deploy."),
        max_fail: str = typer.Option("0%", "--max-fail", help="As for deploy."),
        forks: int = typer.Option(10, "--forks", help="Parallel workers (SSH connections) at most."),
        keep_updated: bool = typer.Option(False, "--keep-updated", help="As for deploy."),
        yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
        as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout; logs on stderr."),
        accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys"),
        report: Optional[str] = typer.Option(None, "--report", metavar="FILE.html", help="As for deploy."),
    ):
        """Continue a rollout that stopped after its canary (deploy --stop-after-canary) on the selected hosts
        it has not reached: the same release (--bundle or --patchset, checked against the recorded bundle id or
        patch set digest; exit 2 when it differs), the same --budget/--topk-cap, performance gate and deadline,
        the same rollout id. Refused (exit 2) when a host of the rollout is no longer on its release."""
        from ..fleet.actions import rolling_deploy
        from ..fleet.notify import rollout_notifier
        from ..fleet.pool_summary import pool_reader
        from ..fleet.rollouts import SourceGiven, check_same_source
        from .common import confirm
        from .flag_ranges import check_rollout_flags, rollout_policy_for
        from .liveview import make_progress
        from .report_context import deploy_context

        def body():
            kit.report_path(report)
            info, rest, notes = _promote_targets(kit, inventory, limit, rollout, forks=forks,
                                                 accept_new_host_keys=accept_new_host_keys, hooks=hooks_of(ctx))
            check_rollout_flags(max(len(rest), 1), forks=forks, canary=0, batch=batch, max_fail=max_fail,
                                max_unavailable=max_unavailable)
            if not rest:
                return _nothing_to_promote(info, notes, as_json)
            hosts = [h for t in rest for h in t.hosts]
            with kit.source(patchset, bundle, hosts, expect_id=expect_id, unsigned_patchset=False,
                            allow_unsigned=allow_unsigned) as (ps, b):
                check_same_source(info, SourceGiven(b.id if b else None, ps.digest(), ps.label))
                policy, bounded = rollout_policy_for(rest, max_unavailable, batch=batch)
                return run(info, rest, [*notes, *bounded], ps, b, policy)

        def run(info, rest, notes, ps, b, policy):
            confirm(yes, f"Promote rollout {info.id} ({ps.label}) to {', '.join(t.name for t in rest)}?")
            opts = _promote_options(info, ps, b)
            res = rolling_deploy(rest, ps, opts, canary=0, batch=batch, max_fail=max_fail, forks=forks,
                                 keep_updated=keep_updated, accept_new_host_keys=accept_new_host_keys,
                                 progress=make_progress(pool_reader(rest)), notes=notes, hooks=hooks_of(ctx),
                                 policy=policy, milestones=rollout_notifier(rest, "deploy", opts, kit.warn,
                                                                            patchset=ps.label, bundle=opts.bundle_id))
            return kit.print_rollout(res, as_json, {"patchset": ps.label, "bundle": opts.bundle_id,
                                                    "bundle_sha256": b.sha256 if b else None}, report,
                                     context=deploy_context(rest, ps.label, opts.bundle_id, 0))
        guard(body, as_json=as_json)
    return promote


def register(app: typer.Typer, kit: CommandKit) -> None:
    app.command("rollouts")(rollouts_command(kit))
    app.command("promote")(promote_command_for(kit))
