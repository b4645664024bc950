"""The `ddtree-ops` command: parse, call the library, print. Nothing else lives here.

Exit codes (also in the README):
  0 ok · 2 bad input, preflight refusal or a declined prompt (nothing changed) · 3 deploy failed, host rolled back
  and healthy · 4 deploy and rollback failed: a person must look · 5 deploy lock held
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Optional

import typer

from ..config.terminal import terminal_safe
from ..errors import EXIT_ERROR, DdtreeOpsError, InputError
from ..host.hooks import NO_HOOKS, Hooks
from .cmd_meta import COMPLETE_VAR
from .cmd_meta import register as register_meta
from .common import INVENTORY_OPT, LIMIT_OPT, hooks_of, output_file
from .common import confirm as _confirm
from .common import emit_json as _emit_json
from .common import guard as _guard
from .common import interrupted as _interrupted
from .common import log as _log

EXIT_CODES_HELP = (
    "Exit codes: 0 ok; 2 bad input, preflight refusal or a declined prompt (nothing changed); 3 deploy failed and "
    "the host is back on its previous release, healthy; 4 deploy failed and the rollback failed "
    "too (a person must look); 5 deploy lock held by someone else."
)

app = typer.Typer(help="Deploy the temperature-aware DDTree modules to SGLang hosts. " + EXIT_CODES_HELP,
                  no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False)


# ---------------------------------------------------------------------------------------------
# plugins: command groups mounted through the `ddtree_ops.cli_plugins` entry point. The test rig's
# `sandbox` group arrives this way (pyproject.toml), so the product never imports the test rig.

PLUGIN_GROUP = "ddtree_ops.cli_plugins"


def _mount_plugins() -> None:
    from importlib import metadata

    for ep in sorted(metadata.entry_points(group=PLUGIN_GROUP), key=lambda ep: ep.name):
        try:
            group = ep.load()()
        except Exception as e:  # a broken plugin costs its own commands, not the tool
            _log(f"warning: command group {ep.name!r} ({ep.value}) could not be loaded: {type(e).__name__}: {e}")
            continue
        app.add_typer(group, name=ep.name)


def _own_command_names() -> set[str]:
    # typer's own naming: the function's name, lower case, "_" as "-", unless the command names itself
    names = {c.name or c.callback.__name__.lower().replace("_", "-")
             for c in app.registered_commands if c.callback is not None or c.name}
    return names | {g.name for g in app.registered_groups if g.name}


def mount_plugins_for(args: list[str]) -> None:
    """The plugins' groups, unless `args` name one of the tool's own commands (a plugin cannot
    replace those): finding and loading them (importlib.metadata, every installed distribution's
    entry points, then the plugin's modules) was about 0.1 CPU-s of every start. The list of
    commands (no command, an option first, an unknown word) and shell completion get them all."""
    word = args[0] if args else ""
    if word and not word.startswith("-") and word in _own_command_names() and COMPLETE_VAR not in os.environ:
        return
    _mount_plugins()


# ---------------------------------------------------------------------------------------------
# render / plan / deploy / rollback / history

DEFAULT_PATCHSET = "ddtree-temp"
PATCHSET_OPT = typer.Option(None, "--patchset", "-p",
                            help=f"A name under patches/ or a patch-set folder (default {DEFAULT_PATCHSET}).")
BREAK_LOCK_OPT = typer.Option(
    [], "--break-lock", metavar="TOKEN",
    help="End the hold of a run that is still connected: the token its lock message shows (repeatable). A run "
         "that was killed or lost its connection needs nothing: its lock is already free.")
BUNDLE_OPT = typer.Option(None, "--bundle", help="A release bundle (ddtree-ops bundle); verified before use, and "
                                                   "its signature <bundle>.sig when the inventory sets bundle_signers.")
EXPECT_ID_OPT = typer.Option(None, "--expect-id", metavar="ID",
                             help="With --bundle: refuse it (exit 2) unless its id, or the sha256 of the file "
                                  "(64 hex digits), is ID.")


def _hosts(inventory: str, limit: Optional[str], budget: Optional[int] = None, topk_cap: Optional[int] = None):
    from ..config.inventory import load_inventory, with_overrides

    inv = load_inventory(inventory)
    return [with_overrides(h, budget=budget, topk_cap=topk_cap) for h in inv.select(limit)]


@app.command()
def render(
    host: str = typer.Option(..., "--host", help="Host name in the inventory."),
    inventory: str = INVENTORY_OPT,
    budget: Optional[int] = typer.Option(None, "--budget", help="Draft nodes per step, root excluded (1..1024)."),
    topk_cap: Optional[int] = typer.Option(None, "--topk-cap", help="Candidates per depth (1..budget)."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Check with systemd-analyze verify (locally)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
):
    """Print the systemd unit ddtree-ops would write for HOST. Connects to nothing."""
    from ..artifacts.units import render_unit, verify_unit
    from ..config.inventory import load_inventory, with_overrides

    def body():
        h = with_overrides(load_inventory(inventory).host(host), budget=budget, topk_cap=topk_cap)
        text = render_unit(h)
        if verify:
            verify_unit(text, h.unit, check_executables=False)
        if as_json:
            _emit_json({"ok": True, "host": h.name, "unit": h.unit, "path": h.unit_path, "verified": verify,
                        "text": text})
        else:
            sys.stdout.write(terminal_safe(text, keep_newlines=True))  # the templates are files from outside
    _guard(body, as_json=as_json)


def _load_ps(patchset: str | None):
    from ..artifacts.patchset import load_patchset

    return load_patchset(patchset or DEFAULT_PATCHSET)


@contextlib.contextmanager
def _source(patchset: str | None, bundle: str | None, hosts, *, expect_id: str | None = None,
            unsigned_patchset: bool = True, allow_unsigned: bool = False):
    """(patch set, opened bundle or None) for the selected `hosts`, everything checked before any
    connection: a bundle is verified completely (caps, names, hashes, id, `--expect-id`, and its
    signature against the hosts' `bundle_signers`) and every host's unit renders from its
    templates; a refusal is exit 2. The bundle's temp folder is removed when the block ends,
    however it ends (Ctrl-C included). `unsigned_patchset`: whether a --patchset may be used
    where the inventory requires signed bundles (deploy: only with --allow-unsigned)."""
    from ..errors import BundleError, InputError

    if bundle and patchset:
        raise InputError("give either --bundle or --patchset, not both")
    if expect_id is not None and not bundle:
        raise InputError("--expect-id checks a bundle: give --bundle too")
    from ..artifacts.signature_policy import Source, decide

    signatures = decide({h.name: h.bundle_signers for h in hosts}, Source.BUNDLE if bundle else Source.PATCHSET,
                        patchset=patchset or DEFAULT_PATCHSET, unsigned_patchset_ok=unsigned_patchset,
                        allow_unsigned=allow_unsigned)
    if signatures.warning:
        _log(f"warning: {signatures.warning}")
    if not bundle:
        yield _load_ps(patchset), None
        return
    from ..artifacts.bundle import open_bundle
    from ..artifacts.units import render_unit

    with open_bundle(bundle, expect_id=expect_id, signers=signatures.signers) as b:
        _log(f"bundle {b.id} verified ({len(b.manifest['files'])} files, sha256 {b.sha256[:16]}…"
             f"{signatures.note(b.signed_by)})")
        for h in hosts:  # a template from someone else's bundle is refused here, not on a host
            try:
                render_unit(h, b.templates_dir)
            except InputError as e:
                msg = str(e).replace(str(b.templates_dir), "templates")
                raise BundleError(" ".join(f"bundle {b.path}: host {h.name}: {msg}".split())) from None
        yield b.patchset, b


@app.command()
def plan(
    inventory: str = INVENTORY_OPT,
    limit: Optional[str] = LIMIT_OPT,
    patchset: Optional[str] = PATCHSET_OPT,
    bundle: Optional[str] = BUNDLE_OPT,
    expect_id: Optional[str] = EXPECT_ID_OPT,
    budget: Optional[int] = typer.Option(None, "--budget"),
    topk_cap: Optional[int] = typer.Option(None, "--topk-cap"),
    force: bool = typer.Option(False, "--force", help="Treat drifted files as replaceable."),
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Per host, what deploy would change (files, unit diff, units to stop/restart), and every check deploy
    makes before changing anything: exit 2 with deploy's refusal, 5 when another run holds the lock. Changes
    nothing."""
    from ..fleet.routing import router_for
    from ..host.session import session_to
    from ..runbook.dry_run import dry_run_host, plan_exit_code
    from ..runbook.options import DeployOptions
    from .tables import print_plan

    def body():
        hosts = _hosts(inventory, limit, budget, topk_cap)
        with _source(patchset, bundle, hosts, expect_id=expect_id) as (ps, b):
            return plan_body(ps, b, hosts)

    def plan_body(ps, b, hosts):
        tdir = str(b.templates_dir) if b else None
        plans, errors = [], []
        for h in hosts:
            try:
                opts = DeployOptions(force=force, templates_dir=tdir, command="ddtree-ops plan")
                with session_to(h, accept_new_host_keys=accept_new_host_keys) as session, router_for(h) as router:
                    plans.append(dry_run_host(session, ps, opts, router))
            except DdtreeOpsError as e:
                errors.append({"host": h.name, "error": type(e).__name__, "message": str(e), "exit_code": e.exit_code})
        code = plan_exit_code(plans, [e["exit_code"] for e in errors])
        if as_json:
            _emit_json({"ok": code == 0, "exit_code": code, "patchset": ps.label, "bundle": b.id if b else None,
                        "bundle_sha256": b.sha256 if b else None,
                        "plans": [p.to_dict() for p in plans], "errors": errors})
        else:
            for p in plans:
                print_plan(p)
            for e in errors:
                _log(f"error: {e['message']}")
            for p in plans:
                if p.locked:
                    _log(f"error: {p.locked}")
        return code
    _guard(body, as_json=as_json)


def _print_rollout(res, as_json: bool, extra: dict | None = None, report: str | None = None,
                   context: dict | None = None) -> int:
    """The summary: one JSON document, or a table on stdout (log excerpts after it); and the
    HTML report when asked for (written whatever the outcome: a failed rollout needs it most),
    with `context` (report_context.py: who ran it, from → to, the canary size) at its top."""
    doc = {**res.to_dict(), **(extra or {})}
    if report:
        from .report import write_report

        write_report(report, {**doc, **(context or {})})
        _log(f"report written to {report}")
    if as_json:
        _emit_json(doc)
    else:
        from .tables import print_rollout

        print_rollout(res)
    return res.exit_code


def _report_path(report: Optional[str]) -> Optional[str]:
    """--report FILE.html, checked before anything connects."""
    return None if report is None else output_file("--report", report, "rollout.html")


ROLLOUT_ID_OPT = typer.Option(None, "--rollout-id", metavar="ID",
                              help="Record this rollout id (as `ddtree-ops rollouts` shows them) instead of a new "
                                   "one: for an orchestrator that runs a rollout host by host (the ddtree.ops "
                                   "Ansible collection).")
NOTIFY_OPT = typer.Option(True, "--notify/--no-notify",
                          help="Tell the inventory's notify webhooks of this run's milestones (default); "
                               "--no-notify when the caller reports the rollout itself.")


def _rollout_id(given: str | None) -> str:
    """The run's rollout id: `--rollout-id` checked, or a new one."""
    from ..fleet.rollout_id import is_rollout_id, new_rollout_id

    if given is not None and not is_rollout_id(given):
        raise InputError(f"--rollout-id {given!r} is not a rollout id (like {new_rollout_id()})")
    return given or new_rollout_id()


REPORT_OPT = typer.Option(None, "--report", metavar="FILE.html",
                          help="Also write a self-contained HTML report: per-host phase timeline, the performance "
                               "gate's figures, the summary.")


def _asker(progress):
    """A yes/no question to the operator from a worker thread (a marginal performance verdict):
    one at a time, with the live view paused while it waits."""
    import threading

    lock = threading.Lock()

    def ask(question: str) -> bool:
        with lock:
            progress.pause()
            try:
                return typer.confirm(terminal_safe(question), default=False, err=True)
            except (typer.Abort, EOFError):
                return False
            finally:
                progress.resume()
    return ask




def _targets(inventory: str, limit: Optional[str], budget: Optional[int] = None, topk_cap: Optional[int] = None):
    from ..config.inventory import load_inventory, with_overrides
    from ..fleet.rollout import Target, make_targets
    from ..host.transport import check_identity_file

    inv = load_inventory(inventory)
    selected = [with_overrides(h, budget=budget, topk_cap=topk_cap) for h in inv.select(limit)]
    targets, notes = make_targets(inv, selected)
    for t in targets:  # a key file missing on this machine refuses the rollout before any host is touched
        for h in t.hosts:
            check_identity_file(h)
    if budget is not None or topk_cap is not None:  # nodes added to a partly selected server get them too
        targets = [Target(t.name, tuple(with_overrides(h, budget=budget, topk_cap=topk_cap) for h in t.hosts))
                   for t in targets]
    return targets, notes


MAX_UNAVAILABLE_OPT = typer.Option(
    None, "--max-unavailable", metavar="N|P%",
    help="Targets out of service at once, at most (default: the inventory's max_unavailable, else 1): no batch is "
         "larger, and behind a router no batch leaves fewer ready workers than its pool less this, nor none "
         "(unless 100%).")
ROLLOUT_HELP = ("Targets (hosts; a multi-node server counts as one) run as: --canary N first, then batches of "
                "--batch N|P% in parallel (at most --forks at once); the rollout stops when the failed targets "
                "exceed --max-fail P% of those attempted, and an aborted rollout rolls back what it updated "
                "(--keep-updated to keep it).")


@app.command(help="Ship the patch set: preflight, backup, atomic install, unit, restart, wait, health gate, "
                  "commit. Any failure after the first change rolls the host back by itself. " + ROLLOUT_HELP)
def deploy(
    ctx: typer.Context,
    inventory: str = INVENTORY_OPT,
    limit: Optional[str] = LIMIT_OPT,
    patchset: Optional[str] = PATCHSET_OPT,
    bundle: Optional[str] = BUNDLE_OPT,
    expect_id: Optional[str] = EXPECT_ID_OPT,
    allow_unsigned: bool = typer.Option(False, "--allow-unsigned",
                                        help="With --patchset: deploy it although the inventory's bundle_signers "
                                             "require signed bundles."),
    budget: Optional[int] = typer.Option(None, "--budget", help="Draft nodes per step, root excluded (1..1024)."),
    topk_cap: Optional[int] = typer.Option(None, "--topk-cap", help="Candidates per depth (1..budget)."),
    canary: int = typer.Option(1, "--canary", help="Targets deployed first; any failure there aborts the rollout."),
    batch: Optional[str] = typer.Option(None, "--batch", help="Targets per batch after the canary: N or P% "
                                                                "(default: --max-unavailable)."),
    max_unavailable: Optional[str] = MAX_UNAVAILABLE_OPT,
    max_fail: str = typer.Option("0%", "--max-fail", help="Abort when failed targets EXCEED this share of those "
                                                          "attempted (Ansible's max_fail_percentage)."),
    forks: int = typer.Option(10, "--forks", help="Parallel workers (SSH connections) at most."),
    keep_updated: bool = typer.Option(False, "--keep-updated",
                                      help="On abort, leave updated hosts on the new release."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout; logs on stderr."),
    no_rollback: bool = typer.Option(False, "--no-rollback", help="On failure leave the host as is (exit 4)."),
    force: bool = typer.Option(False, "--force", help="Replace files that drifted from what we expect."),
    break_lock: list[str] = BREAK_LOCK_OPT,
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys",
                                              help="Record unknown host keys (never changed ones)."),
    deadline: Optional[float] = typer.Option(None, "--deadline",
                                             help="Seconds to wait for weight loading (default: inventory)."),
    perf_gate: Optional[bool] = typer.Option(None, "--perf-gate/--no-perf-gate",
                                             help="Gate each host on speed: the inventory's perf_gate workload "
                                                  "before the change (baseline) and after (canary), and against a "
                                                  "host not yet updated (default: the inventory's perf_gate.enabled)."),
    accept_marginal: bool = typer.Option(False, "--accept-marginal",
                                         help="A marginal performance verdict passes (otherwise it asks on a "
                                              "terminal and fails without one)."),
    report: Optional[str] = REPORT_OPT,
    stop_after_canary: bool = typer.Option(False, "--stop-after-canary",
                                           help="Deploy the canary batch only and leave it on the new release; the "
                                                "summary prints the rollout id and the `promote` command that "
                                                "continues it."),
    rollout_id: Optional[str] = ROLLOUT_ID_OPT,
    notify: bool = NOTIFY_OPT,
):
    from ..fleet.actions import rolling_deploy
    from ..fleet.notify import rollout_notifier
    from ..fleet.pool_summary import pool_reader
    from ..runbook.phases import DeployOptions
    from .cmd_rollouts import promote_command, say_promote, stopped_after_canary
    from .flag_ranges import check_rollout_flags, rollout_policy_for
    from .liveview import make_progress
    from .report_context import deploy_context

    def body():
        _report_path(report)
        targets, notes = _targets(inventory, limit, budget, topk_cap)
        # A bad number: exit 2 before connecting.
        check_rollout_flags(len(targets), forks=forks, canary=canary, batch=batch, max_fail=max_fail,
                            deadline_s=deadline, max_unavailable=max_unavailable)
        policy, bounded = rollout_policy_for(targets, max_unavailable, canary=canary, batch=batch)
        notes = [*notes, *bounded]
        if stop_after_canary and canary < 1:
            raise InputError("--stop-after-canary needs a canary: --canary 1 or more")
        rid = _rollout_id(rollout_id)
        hosts = [h for t in targets for h in t.hosts]
        with _source(patchset, bundle, hosts, expect_id=expect_id, unsigned_patchset=False,
                     allow_unsigned=allow_unsigned) as (ps, b):
            return deploy_body(ps, b, targets, notes, policy, rid)

    def deploy_body(ps, b, targets, notes, policy, rid):
        _confirm(yes, f"Deploy {ps.label}{' (bundle ' + b.id + ')' if b else ''} to "
                      f"{', '.join(t.name for t in targets)}?")
        opts = DeployOptions(force=force, break_tokens=tuple(break_lock), no_rollback=no_rollback,
                             command=" ".join(["ddtree-ops", *sys.argv[1:]])[:500], deadline_s=deadline,
                             bundle_id=b.id if b else None, templates_dir=str(b.templates_dir) if b else None,
                             perf_gate=perf_gate, marginal="accept" if accept_marginal else "fail",
                             rollout_id=rid, stop_after_canary=stop_after_canary,
                             overrides={k: v for k, v in (("budget", budget), ("topk_cap", topk_cap)) if v is not None})
        progress = make_progress(pool_reader(targets))
        if not accept_marginal and sys.stdin.isatty():
            opts.marginal, opts.ask = "ask", _asker(progress)
        res = rolling_deploy(targets, ps, opts, canary=canary, batch=batch, max_fail=max_fail, forks=forks,
                             keep_updated=keep_updated, accept_new_host_keys=accept_new_host_keys,
                             progress=progress, notes=notes, hooks=hooks_of(ctx), policy=policy,
                             milestones=rollout_notifier(targets, "deploy", opts, _warn, patchset=ps.label,
                                                         bundle=b.id if b else None) if notify else None)
        promote = stopped_after_canary(res, promote_command(res.rollout_id, inventory, limit,
                                                            patchset=patchset or DEFAULT_PATCHSET,
                                                            bundle=bundle, allow_unsigned=allow_unsigned))
        code = _print_rollout(res, as_json, {"patchset": ps.label, "bundle": b.id if b else None,
                                             "bundle_sha256": b.sha256 if b else None, **promote}, report,
                              context=deploy_context(targets, ps.label, b.id if b else None, canary))
        say_promote(promote, res.rollout_id, as_json)
        return code
    _guard(body, as_json=as_json)


@app.command()
def rollback(
    ctx: typer.Context,
    inventory: str = INVENTORY_OPT,
    limit: Optional[str] = LIMIT_OPT,
    to: Optional[str] = typer.Option(None, "--to", help="A release id, or 'original' for the upstream files."),
    rollout: Optional[str] = typer.Option(None, "--rollout", metavar="ID",
                                          help="Undo a whole rollout: each selected host it changed goes back to the "
                                               "release it ran before it; the others are left alone."),
    batch: Optional[str] = typer.Option(None, "--batch", help="Targets per batch: N or P% "
                                                                "(default: --max-unavailable)."),
    max_unavailable: Optional[str] = MAX_UNAVAILABLE_OPT,
    forks: int = typer.Option(10, "--forks", help="Parallel workers (SSH connections) at most."),
    yes: bool = typer.Option(False, "--yes", "-y"),
    as_json: bool = typer.Option(False, "--json"),
    break_lock: list[str] = BREAK_LOCK_OPT,
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys"),
    report: Optional[str] = REPORT_OPT,
    force: bool = typer.Option(False, "--force", help="Restore the backups even where the host changed under the "
                                                      "release (files rewritten since, another SGLang version): "
                                                      "without it such a host is refused, exit 2."),
    rollout_id: Optional[str] = ROLLOUT_ID_OPT,
    notify: bool = NOTIFY_OPT,
):
    """Back to the previous release (or --to RELEASE|original, or what each host ran before --rollout ID), with
    the same restart and health gate, over the same selection as deploy (multi-node servers as a whole). A host
    whose files or SGLang version changed since the release being undone installed them is refused (exit 2,
    nothing changed) unless --force."""
    from ..fleet.actions import rolling_rollback
    from ..fleet.notify import rollout_notifier
    from ..fleet.pool_summary import pool_reader
    from ..runbook.phases import DeployOptions
    from ..runbook.rollback import UndoRollout
    from .cmd_rollouts import undo_targets
    from .flag_ranges import check_rollout_flags, rollout_policy_for
    from .liveview import make_progress
    from .report_context import rollback_context

    def body():
        _report_path(report)
        targets, notes = _targets(inventory, limit)
        check_rollout_flags(len(targets), forks=forks, batch=batch, max_unavailable=max_unavailable)
        if rollout and to:
            raise InputError("give either --to or --rollout, not both")
        rid = _rollout_id(rollout_id)
        target_release = to or "the previous release"
        if rollout:
            targets, left = undo_targets(targets, rollout, accept_new_host_keys=accept_new_host_keys,
                                         hooks=hooks_of(ctx), forks=forks)
            notes, target_release = [*notes, *left], f"what they ran before rollout {rollout}"
            if not targets:
                _log("\n".join([*left, f"rollout {rollout}: no selected host is on it any more; nothing to roll back"]))
                return 0
        policy, bounded = rollout_policy_for(targets, max_unavailable, batch=batch)
        notes = [*notes, *bounded]
        _confirm(yes, f"Roll back {', '.join(t.name for t in targets)} to {target_release}?")
        opts = DeployOptions(force=force, break_tokens=tuple(break_lock),
                             command=" ".join(["ddtree-ops", *sys.argv[1:]])[:500],
                             rollout_id=rid)
        res = rolling_rollback(targets, UndoRollout(rollout) if rollout else to, opts, batch=batch, forks=forks,
                               accept_new_host_keys=accept_new_host_keys,
                               progress=make_progress(pool_reader(targets)), notes=notes, hooks=hooks_of(ctx),
                               policy=policy,
                               milestones=rollout_notifier(targets, "rollback", opts, _warn) if notify else None)
        return _print_rollout(res, as_json, report=report,
                              context=rollback_context(targets, f"{target_release} ({opts.rollout_id})"))
    _guard(body, as_json=as_json)


@app.command()
def status(
    ctx: typer.Context,
    inventory: str = INVENTORY_OPT,
    limit: Optional[str] = LIMIT_OPT,
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    forks: int = typer.Option(10, "--forks", help="Hosts read in parallel at most."),
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys"),
    watch: bool = typer.Option(False, "--watch", help="Again every --interval seconds until Ctrl-C (a terminal "
                                                      "is redrawn; otherwise one block per round)."),
    interval: float = typer.Option(5.0, "--interval", metavar="S", help="Seconds between --watch rounds."),
    patchset: Optional[str] = typer.Option(None, "--patchset", "-p",
                                           help="Also compare each host's patch set with this one (by digest)."),
    bundle: Optional[str] = typer.Option(None, "--bundle", help="Also compare each host's bundle with this one, and "
                                                                "its launch flags with the bundle's templates."),
):
    """Per host, read in parallel: reachable (or why not), release, rollout and patch set, budget/topk of the
    active unit, drift (files changed since the release installed them, and each field where a host on a release
    differs from the inventory: budget, topk, unit, launch flags; patch set or bundle when given), unit states,
    /health, avg accept length. Exit 0 when every host is reachable, without drift and healthy; 1 otherwise
    (with --watch: as the last round found them)."""
    from ..fleet.config_drift import Expected
    from ..fleet.status import collect_status
    from .flag_ranges import check_forks
    from .watch import Watch, check_interval

    def body():
        check_forks(forks)
        hosts = _hosts(inventory, limit)
        if patchset is None and bundle is None:
            return rounds(hosts, None)
        with _source(patchset, bundle, hosts) as (ps, b):
            return rounds(hosts, Expected(ps.label, ps.digest(), b.id if b else None,
                                          str(b.templates_dir) if b else None))

    def rounds(hosts, expected):
        if watch:
            return Watch(check_interval(interval), tty=sys.stdout.isatty() and not as_json,
                         headed=not as_json).run(lambda: one(hosts, expected))
        return one(hosts, expected)

    def one(hosts, expected=None):
        rows = collect_status(hosts, accept_new_host_keys=accept_new_host_keys, forks=forks, expected=expected,
                              hooks=hooks_of(ctx))
        code = 0 if all(r["ok"] for r in rows) else EXIT_ERROR
        if as_json:
            _emit_json({"ok": code == 0, "exit_code": code, "hosts": rows})
            return code
        from .tables import print_status

        print_status(rows)
        return code
    _guard(body, as_json=as_json)


@app.command("bundle")
def bundle_cmd(
    patchset: str = typer.Option(DEFAULT_PATCHSET, "--patchset", "-p",
                                 help="A packaged patch set's name (patches/ in a checkout) or a patch-set folder."),
    out: str = typer.Option("dist", "--out", help="Folder for <id>.tar.gz."),
    templates: Optional[str] = typer.Option(None, "--templates", help="Unit templates folder (default: templates/)."),
    sign_key: Optional[str] = typer.Option(None, "--sign-key", metavar="KEY",
                                           help="Also write <bundle>.sig: ssh-keygen -Y sign -f KEY -n "
                                                "ddtree-ops-bundle (a private key, or a public key whose private "
                                                "half is in ssh-agent)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
):
    """Build an immutable release bundle (patch set + templates + manifest with every sha256 and a
    content-derived id). The same inputs give a byte-identical file."""
    from ..artifacts.bundle import build_bundle

    def body():
        b = build_bundle(patchset, out, templates, sign_key=sign_key)
        sig = str(b.signature) if b.signature else None
        if as_json:
            _emit_json({"ok": True, "id": b.id, "path": str(b.path), "sha256": b.sha256, "signature": sig,
                        "files": b.manifest["files"], "patchset": b.manifest["patchset"]})
        else:
            print(terminal_safe(b.path))
            _log(f"bundle {b.id}: {len(b.manifest['files'])} files, sha256 {b.sha256}"
                 f"{', signature ' + sig if sig else ''}")
    _guard(body, as_json=as_json)


@app.command()
def history(
    host: str = typer.Option(..., "--host"),
    inventory: str = INVENTORY_OPT,
    as_json: bool = typer.Option(False, "--json"),
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys"),
):
    """Releases on HOST: id, time, patch set, budget, topk, outcome."""
    from ..config.inventory import load_inventory
    from ..host.session import session_to

    def body():
        h = load_inventory(inventory).host(host)
        with session_to(h, accept_new_host_keys=accept_new_host_keys) as session:
            hist = session.store.history()
        if as_json:
            _emit_json({"ok": True, "host": h.name, **hist})
            return
        from .tables import print_history

        print_history(hist)
    _guard(body, as_json=as_json)


def _warn(msg: str) -> None:
    _log(f"warning: {msg}")


def _register_commands() -> None:
    from . import cmd_diff, cmd_gate, cmd_logs, cmd_metrics, cmd_rollouts, cmd_tune

    for module in (cmd_logs, cmd_metrics, cmd_diff, cmd_gate):
        module.register(app)
    cmd_rollouts.register(app, cmd_rollouts.CommandKit(_hosts, _targets, _source, _report_path, _print_rollout, _warn))
    cmd_tune.register(app, cmd_tune.TuneKit(_targets, _source, _print_rollout))


_register_commands()




register_meta(app)  # --version, `completion`, the defaults file (cmd_meta.py); listed last


def keep_library_logs_off_stderr() -> None:
    """Paramiko logs its transport thread's errors, tracebacks included (a banner read cut short
    when Ctrl-C or SIGTERM closes the socket under it), and configures no handler, so Python's
    last-resort handler printed them on the operator's stderr beside the tool's own message. The
    tool says every failure itself, in its own words; a NullHandler keeps the library's logs in."""
    import logging

    logging.getLogger("paramiko").addHandler(logging.NullHandler())


def main(hooks: Hooks = NO_HOOKS) -> None:
    """The `ddtree-ops` command. `hooks`: only the test rig passes any (ddtree_ops.testing.hooked_cli).
    SIGTERM and SIGHUP end it the way Ctrl-C does (signals.py)."""
    from .signals import signals_as_interrupts, typer_swallowed

    keep_library_logs_off_stderr()
    mount_plugins_for(sys.argv[1:])
    with signals_as_interrupts():
        try:
            app(obj=hooks)
        except SystemExit as e:
            interrupt = typer_swallowed(e)
            if interrupt is None:
                raise
            raise SystemExit(_interrupted(interrupt)) from None  # said as inside a command


if __name__ == "__main__":
    main()
