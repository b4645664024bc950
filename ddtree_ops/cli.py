"""The `ddtree-ops` command: parse, call the library, print. Nothing else lives here.

Exit codes (also in the README):
  0 ok · 2 bad input or preflight refusal (nothing changed) · 3 deploy failed, host rolled back
  and healthy · 4 deploy and rollback failed: a person must look · 5 deploy lock held
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Optional

import typer

from .errors import EXIT_ERROR, DdtreeOpsError

EXIT_CODES_HELP = (
    "Exit codes: 0 ok; 2 bad input or preflight refusal (nothing changed); 3 deploy failed and "
    "the host is back on its previous release, healthy; 4 deploy failed and the rollback failed "
    "too (a person must look); 5 deploy lock held by someone else."
)

app = typer.Typer(help="Deploy the temperature-aware DDTree modules to SGLang hosts. " + EXIT_CODES_HELP,
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
sandbox_app = typer.Typer(help="Local test hosts (network namespaces with sshd, systemctl and SGLang files).",
                          no_args_is_help=True)
app.add_typer(sandbox_app, name="sandbox")


def _emit_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")


def _log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def _guard(fn: Callable[[], int | None], *, as_json: bool = False) -> None:
    """Run a command body; turn our exceptions into a message and the documented exit code."""
    try:
        code = fn() or 0
    except DdtreeOpsError as e:
        if as_json:
            _emit_json({"ok": False, "error": type(e).__name__, "message": str(e), "exit_code": e.exit_code})
        _log(f"error: {e}")
        raise typer.Exit(e.exit_code)
    except KeyboardInterrupt:
        _log("interrupted")
        raise typer.Exit(130)
    raise typer.Exit(code)


# ---------------------------------------------------------------------------------------------
# sandbox


@sandbox_app.command("up")
def sandbox_up(
    hosts: int = typer.Option(2, "--hosts", "-n", help="How many test hosts."),
    dir: str = typer.Option("sandbox", "--dir", help="Folder for keys, inventory and host state."),
    load_seconds: float = typer.Option(0.5, "--load-seconds", help="Stand-in weight-loading time."),
    multinode: int = typer.Option(0, "--multinode", help="The last N hosts form one multi-node server (group server1)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
):
    """Create N local test hosts and write DIR/inventory.yaml."""
    from .sandbox import Sandbox

    def body():
        sb = Sandbox(dir)
        rows = sb.up(hosts, load_seconds=load_seconds, multinode=multinode)
        if as_json:
            _emit_json({"ok": True, "inventory": str(sb.inventory_path), "hosts": rows})
        else:
            _print_sandbox(rows)
            print(f"inventory: {sb.inventory_path}")
    _guard(body, as_json=as_json)


@sandbox_app.command("status")
def sandbox_status(
    dir: str = typer.Option("sandbox", "--dir"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Per host: address, SSH facts, unit and /health state (checked over verified SSH)."""
    from .sandbox import Sandbox

    def body():
        rows = Sandbox(dir).status()
        if as_json:
            _emit_json({"ok": True, "hosts": rows})
        else:
            _print_sandbox(rows)
        return 0 if all(r["ssh_ok"] and r["health_up"] for r in rows) else EXIT_ERROR
    _guard(body, as_json=as_json)


@sandbox_app.command("down")
def sandbox_down(
    dir: str = typer.Option("sandbox", "--dir"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Stop every process the sandbox started, delete its namespaces and files."""
    from .sandbox import Sandbox

    def body():
        res = Sandbox(dir).down()
        if as_json:
            _emit_json({"ok": True, **res})
        else:
            print(f"sandbox down: {res['hosts']} host(s), {res['killed']} process(es) stopped")
    _guard(body, as_json=as_json)


def _print_sandbox(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table("host", "address", "sshd", "ssh", "active unit", "/health", "site-packages")
    for r in rows:
        t.add_row(r["name"], r["address"], "up" if r["sshd_up"] else "DOWN",
                  "ok" if r["ssh_ok"] else r.get("ssh_error", "error")[:40],
                  str(r["active_unit"]), str(r["health"]), r["site_packages"])
    Console().print(t)


# ---------------------------------------------------------------------------------------------
# render / plan / deploy / rollback / history

INVENTORY_OPT = typer.Option(..., "--inventory", "-i", envvar="DDTREE_OPS_INVENTORY",
                              help="Inventory file (or $DDTREE_OPS_INVENTORY). No default: name production explicitly.")
LIMIT_OPT = typer.Option(None, "--limit", "-l", help="Host names, group names or globs, comma-separated.")
DEFAULT_PATCHSET = "ddtree-temp"
PATCHSET_OPT = typer.Option(None, "--patchset", "-p",
                            help=f"A name under patches/ or a patch-set folder (default {DEFAULT_PATCHSET}).")
BUNDLE_OPT = typer.Option(None, "--bundle", help="A release bundle (ddtree-ops bundle); verified before use.")


def _hosts(inventory: str, limit: Optional[str], budget: Optional[int] = None, topk_cap: Optional[int] = None):
    from .inventory import load_inventory, with_overrides

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
    from .inventory import load_inventory, with_overrides
    from .units import render_unit, verify_unit

    def body():
        h = with_overrides(load_inventory(inventory).host(host), budget=budget, topk_cap=topk_cap)
        text = render_unit(h)
        if verify:
            verify_unit(text, h.unit, check_executables=False)
        if as_json:
            _emit_json({"ok": True, "host": h.name, "unit": h.unit, "path": h.unit_path, "verified": verify, "text": text})
        else:
            sys.stdout.write(text)
    _guard(body, as_json=as_json)


def _load_ps(patchset: str | None):
    from .patchset import load_patchset

    return load_patchset(patchset or DEFAULT_PATCHSET)


def _load_source(patchset: str | None, bundle: str | None):
    """(patch set, opened bundle or None). A bundle is verified completely here, before any
    connection: tampered or truncated → BundleError (exit 2)."""
    from .errors import InputError

    if bundle:
        if patchset:
            raise InputError("give either --bundle or --patchset, not both")
        from .bundle import open_bundle

        b = open_bundle(bundle)
        _log(f"bundle {b.id} verified ({len(b.manifest['files'])} files, sha256 {b.sha256[:16]}…)")
        return b.patchset, b
    return _load_ps(patchset), None


@app.command()
def plan(
    inventory: str = INVENTORY_OPT,
    limit: Optional[str] = LIMIT_OPT,
    patchset: Optional[str] = PATCHSET_OPT,
    bundle: Optional[str] = BUNDLE_OPT,
    budget: Optional[int] = typer.Option(None, "--budget"),
    topk_cap: Optional[int] = typer.Option(None, "--topk-cap"),
    force: bool = typer.Option(False, "--force", help="Treat drifted files as replaceable."),
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Per host, what deploy would change (files, unit diff, units to stop/restart). Changes nothing."""
    from .deploy import plan_host
    from .transport import connect

    def body():
        ps, b = _load_source(patchset, bundle)
        hosts = _hosts(inventory, limit, budget, topk_cap)
        tdir = str(b.templates_dir) if b else None
        plans, errors = [], []
        for h in hosts:
            try:
                with connect(h, accept_new_host_keys=accept_new_host_keys) as conn:
                    plans.append(plan_host(conn, h, ps, force=force, templates_dir=tdir))
            except DdtreeOpsError as e:
                errors.append({"host": h.name, "error": type(e).__name__, "message": str(e), "exit_code": e.exit_code})
        if as_json:
            code = max([e["exit_code"] for e in errors] or [2 if any(p.refusals for p in plans) else 0])
            _emit_json({"ok": code == 0, "exit_code": code, "patchset": ps.label, "bundle": b.id if b else None,
                        "plans": [p.to_dict() for p in plans], "errors": errors})
        else:
            for p in plans:
                _print_plan(p)
            for e in errors:
                _log(f"error: {e['message']}")
        if errors:
            return max(e["exit_code"] for e in errors)
        return 2 if any(p.refusals for p in plans) else 0
    _guard(body, as_json=as_json)


def _print_plan(p) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"[bold]{p.host}[/bold]: {p.patchset} (budget {p.budget}, topk cap {p.topk_cap}); "
              f"SGLang {p.sglang_version}; current release {p.current_release or 'none'}")
    if p.interrupted:
        con.print(f"  interrupted deploy {p.interrupted.get('release')} at step {p.interrupted.get('step')!r}: "
                  f"will be rolled back first")
    if p.lock:
        con.print(f"  deploy lock held: {p.lock.get('user')}@{p.lock.get('machine')} since {p.lock.get('since_utc')}")
    t = Table("file", "action", "old sha256", "new sha256", "status")
    for f in p.files:
        t.add_row(f.rel, f.action, (f.old_sha256 or "-")[:12], f.new_sha256[:12], f.status + (f" ({f.note})" if f.note else ""))
    con.print(t)
    print(p.unit_diff or f"unit {p.unit_path}: unchanged")
    print(f"stop: {', '.join(p.stop_units) or 'nothing'}; restart: {p.restart_unit}")
    for r in p.refusals:
        con.print(f"  [red]refused[/red]: {r}")


def _print_rollout(res, as_json: bool, extra: dict | None = None) -> int:
    """The summary: one JSON document, or a table on stdout (log excerpts after it)."""
    code = res.exit_code
    if as_json:
        _emit_json({**res.to_dict(), **(extra or {})})
        return code
    from rich.console import Console
    from rich.table import Table

    from .fleet import summary_rows

    title = f"{res.action}: " + (f"ABORTED ({res.abort_reason})" if res.aborted else "done") + f" in {res.seconds:.1f} s"
    t = Table("host", "outcome", "release", "failed step", "seconds", "message", title=title, title_justify="left")
    for row in summary_rows(res):
        t.add_row(row["host"], row["outcome"], row["release"] or "-", row["failed_step"] or "-", f"{row['seconds']:.1f}",
                  row["message"][:80])
    Console(stderr=False).print(t)
    for r in res.results:
        if r.log:
            print(f"--- last log lines of {r.host} ---")
            print("\n".join(r.log[-15:]))
    print(f"exit code {code}")
    return code


def _confirm(yes: bool, question: str) -> None:
    """Ask only on an interactive terminal without --yes; CI (stdin not a TTY) is never asked."""
    if not yes and sys.stdin.isatty():
        if not typer.confirm(question):
            raise typer.Exit(1)


def _targets(inventory: str, limit: Optional[str], budget: Optional[int] = None, topk_cap: Optional[int] = None):
    from .fleet import make_targets
    from .inventory import load_inventory, with_overrides

    inv = load_inventory(inventory)
    selected = [with_overrides(h, budget=budget, topk_cap=topk_cap) for h in inv.select(limit)]
    targets, notes = make_targets(inv, selected)
    if budget is not None or topk_cap is not None:  # nodes added to a partly selected server get them too
        from .fleet import Target

        targets = [Target(t.name, tuple(with_overrides(h, budget=budget, topk_cap=topk_cap) for h in t.hosts))
                   for t in targets]
    return targets, notes


ROLLOUT_HELP = ("Targets (hosts; a multi-node server counts as one) run as: --canary N first, then batches of "
                "--batch N|P% in parallel (at most --forks at once); the rollout stops when the failed targets "
                "exceed --max-fail P% of those attempted, and an aborted rollout rolls back what it updated "
                "(--keep-updated to keep it).")


@app.command(help="Ship the patch set: preflight, backup, atomic install, unit, restart, wait, health gate, "
                  "commit. Any failure after the first change rolls the host back by itself. " + ROLLOUT_HELP)
def deploy(
    inventory: str = INVENTORY_OPT,
    limit: Optional[str] = LIMIT_OPT,
    patchset: Optional[str] = PATCHSET_OPT,
    bundle: Optional[str] = BUNDLE_OPT,
    budget: Optional[int] = typer.Option(None, "--budget", help="Draft nodes per step, root excluded (1..1024)."),
    topk_cap: Optional[int] = typer.Option(None, "--topk-cap", help="Candidates per depth (1..budget)."),
    canary: int = typer.Option(1, "--canary", help="Targets deployed first; any failure there aborts the rollout."),
    batch: Optional[str] = typer.Option(None, "--batch", help="Targets per batch after the canary: N or P% "
                                                                "(default: all the rest at once)."),
    max_fail: str = typer.Option("0%", "--max-fail", help="Abort when failed targets EXCEED this share of those "
                                                          "attempted (Ansible's max_fail_percentage)."),
    forks: int = typer.Option(10, "--forks", help="Parallel workers (SSH connections) at most."),
    keep_updated: bool = typer.Option(False, "--keep-updated", help="On abort, leave updated hosts on the new release."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout; logs on stderr."),
    no_rollback: bool = typer.Option(False, "--no-rollback", help="On failure leave the host as is (exit 4)."),
    force: bool = typer.Option(False, "--force", help="Replace files that drifted from what we expect."),
    break_lock: bool = typer.Option(False, "--break-lock", help="Clear a stale deploy lock first."),
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys", help="Record unknown host keys (never changed ones)."),
    deadline: Optional[float] = typer.Option(None, "--deadline", help="Seconds to wait for weight loading (default: inventory)."),
):
    from .deploy import DeployOptions
    from .fleet import plan_batches, parse_percent, rolling_deploy
    from .fleetview import make_progress

    def body():
        ps, b = _load_source(patchset, bundle)
        targets, notes = _targets(inventory, limit, budget, topk_cap)
        parse_percent(max_fail)
        plan_batches(len(targets), canary=canary, batch=batch)  # bad --batch/--canary: exit 2 before connecting
        _confirm(yes, f"Deploy {ps.label}{' (bundle ' + b.id + ')' if b else ''} to "
                      f"{', '.join(t.name for t in targets)}?")
        opts = DeployOptions(force=force, break_lock=break_lock, no_rollback=no_rollback,
                             command=" ".join(["ddtree-ops", *sys.argv[1:]])[:500], deadline_s=deadline,
                             bundle_id=b.id if b else None, templates_dir=str(b.templates_dir) if b else None)
        try:
            res = rolling_deploy(targets, ps, opts, canary=canary, batch=batch, max_fail=max_fail, forks=forks,
                                 keep_updated=keep_updated, accept_new_host_keys=accept_new_host_keys,
                                 progress=make_progress(), notes=notes)
        finally:
            if b:
                b.close()
        return _print_rollout(res, as_json, {"patchset": ps.label, "bundle": b.id if b else None})
    _guard(body, as_json=as_json)


@app.command()
def rollback(
    inventory: str = INVENTORY_OPT,
    limit: Optional[str] = LIMIT_OPT,
    to: Optional[str] = typer.Option(None, "--to", help="A release id, or 'original' for the upstream files."),
    batch: Optional[str] = typer.Option(None, "--batch", help="Targets per batch: N or P% (default: all at once)."),
    forks: int = typer.Option(10, "--forks", help="Parallel workers (SSH connections) at most."),
    yes: bool = typer.Option(False, "--yes", "-y"),
    as_json: bool = typer.Option(False, "--json"),
    break_lock: bool = typer.Option(False, "--break-lock"),
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys"),
):
    """Back to the previous release (or --to RELEASE|original), with the same restart and health gate,
    over the same selection as deploy (multi-node servers as a whole)."""
    from .deploy import DeployOptions
    from .fleet import plan_batches, rolling_rollback
    from .fleetview import make_progress

    def body():
        targets, notes = _targets(inventory, limit)
        plan_batches(len(targets), canary=0, batch=batch)
        _confirm(yes, f"Roll back {', '.join(t.name for t in targets)} to {to or 'the previous release'}?")
        opts = DeployOptions(break_lock=break_lock, command=" ".join(["ddtree-ops", *sys.argv[1:]])[:500])
        res = rolling_rollback(targets, to, opts, batch=batch, forks=forks, accept_new_host_keys=accept_new_host_keys,
                               progress=make_progress(), notes=notes)
        return _print_rollout(res, as_json)
    _guard(body, as_json=as_json)


@app.command()
def status(
    inventory: str = INVENTORY_OPT,
    limit: Optional[str] = LIMIT_OPT,
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    forks: int = typer.Option(10, "--forks", help="Hosts read in parallel at most."),
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys"),
):
    """Per host, read in parallel: reachable (or why not), release and patch set, budget/topk of the active
    unit, drift, unit states, /health, avg accept length. Exit 0 when every host is reachable, without drift
    and healthy; 1 otherwise."""
    from .status import collect_status

    def body():
        hosts = _hosts(inventory, limit)
        rows = collect_status(hosts, accept_new_host_keys=accept_new_host_keys, forks=forks)
        code = 0 if all(r["ok"] for r in rows) else EXIT_ERROR
        if as_json:
            _emit_json({"ok": code == 0, "exit_code": code, "hosts": rows})
            return code
        from rich.console import Console
        from rich.table import Table

        t = Table("host", "reachable", "release", "patch set", "budget", "topk", "drift", "active unit", "/health",
                  "accept len")
        for r in rows:
            acc = r.get("avg_accept_length")
            t.add_row(r["host"] + (f" ({r['server']} rank {r['node_rank']})" if r.get("server") else ""),
                      "yes" if r["reachable"] else f"NO: {(r['reason'] or '')[:60]}",
                      r["release"] or "-", r["patchset"] or "-", str(r["budget"] or "-"), str(r["topk_cap"] or "-"),
                      ", ".join(d["path"].rsplit("/", 1)[-1] for d in r["drift"]) or "none",
                      r["active_unit"] or "none", str(r["health"]), f"{acc:.2f}" if acc is not None else "-")
        Console().print(t)
        for r in rows:
            if r["reachable"] and r["reason"]:
                print(f"{r['host']}: {r['reason']}")
        return code
    _guard(body, as_json=as_json)


@app.command("bundle")
def bundle_cmd(
    patchset: str = typer.Option(DEFAULT_PATCHSET, "--patchset", "-p", help="A name under patches/ or a patch-set folder."),
    out: str = typer.Option("dist", "--out", help="Folder for <id>.tar.gz."),
    templates: Optional[str] = typer.Option(None, "--templates", help="Unit templates folder (default: templates/)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
):
    """Build an immutable release bundle (patch set + templates + manifest with every sha256 and a
    content-derived id). The same inputs give a byte-identical file."""
    from .bundle import build_bundle

    def body():
        b = build_bundle(patchset, out, templates)
        if as_json:
            _emit_json({"ok": True, "id": b.id, "path": str(b.path), "sha256": b.sha256,
                        "files": b.manifest["files"], "patchset": b.manifest["patchset"]})
        else:
            print(f"{b.path}")
            _log(f"bundle {b.id}: {len(b.manifest['files'])} files, sha256 {b.sha256}")
    _guard(body, as_json=as_json)


@app.command()
def history(
    host: str = typer.Option(..., "--host"),
    inventory: str = INVENTORY_OPT,
    as_json: bool = typer.Option(False, "--json"),
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys"),
):
    """Releases on HOST: id, time, patch set, budget, topk, outcome."""
    from .inventory import load_inventory
    from .release_store import ReleaseStore
    from .transport import connect

    def body():
        h = load_inventory(inventory).host(host)
        with connect(h, accept_new_host_keys=accept_new_host_keys) as conn:
            hist = ReleaseStore(conn, h).history()
        if as_json:
            _emit_json({"ok": True, "host": h.name, **hist})
            return
        from rich.console import Console
        from rich.table import Table
        import time as _t

        t = Table("", "release", "created (UTC)", "patch set", "budget", "topk", "outcome")
        for r in hist["releases"]:
            created = _t.strftime("%Y-%m-%d %H:%M:%S", _t.gmtime(r.get("created") or 0))
            t.add_row("*" if r["id"] == hist["current"] else "", r["id"], created, str(r.get("patchset")),
                      str(r.get("budget")), str(r.get("topk_cap")), str(r.get("outcome")))
        Console().print(t)
        print(f"current: {hist['current'] or 'original upstream files'}")
    _guard(body, as_json=as_json)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
