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
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
):
    """Create N local test hosts and write DIR/inventory.yaml."""
    from .sandbox import Sandbox

    def body():
        sb = Sandbox(dir)
        rows = sb.up(hosts, load_seconds=load_seconds)
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

INVENTORY_OPT = typer.Option("inventory/ct200.yaml", "--inventory", "-i", help="Inventory file.")
LIMIT_OPT = typer.Option(None, "--limit", "-l", help="Host names, group names or globs, comma-separated.")
PATCHSET_OPT = typer.Option("ddtree-temp", "--patchset", "-p", help="A name under patches/ or a patch-set folder.")


class _Reporter:
    """Step lines on stderr; with --json nothing but the document goes to stdout."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet

    def __call__(self, host: str, msg: str) -> None:
        if not self.quiet:
            _log(f"[{host}] {msg}")


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
):
    """Print the systemd unit ddtree-ops would write for HOST. Connects to nothing."""
    from .inventory import load_inventory, with_overrides
    from .units import render_unit, verify_unit

    def body():
        h = with_overrides(load_inventory(inventory).host(host), budget=budget, topk_cap=topk_cap)
        text = render_unit(h)
        if verify:
            verify_unit(text, h.unit, check_executables=False)
        sys.stdout.write(text)
    _guard(body)


def _load_ps(patchset: str):
    from .patchset import load_patchset

    return load_patchset(patchset)


@app.command()
def plan(
    inventory: str = INVENTORY_OPT,
    limit: Optional[str] = LIMIT_OPT,
    patchset: str = PATCHSET_OPT,
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
        hosts = _hosts(inventory, limit, budget, topk_cap)
        ps = _load_ps(patchset)
        plans, errors = [], []
        for h in hosts:
            try:
                with connect(h, accept_new_host_keys=accept_new_host_keys) as conn:
                    plans.append(plan_host(conn, h, ps, force=force))
            except DdtreeOpsError as e:
                errors.append({"host": h.name, "error": type(e).__name__, "message": str(e), "exit_code": e.exit_code})
        if as_json:
            _emit_json({"ok": not errors, "patchset": ps.label, "plans": [p.to_dict() for p in plans], "errors": errors})
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


def _print_results(results, as_json: bool, extra: dict | None = None) -> int:
    from .fleet import overall_exit_code

    code = overall_exit_code(results)
    if as_json:
        _emit_json({"ok": code == 0, "exit_code": code, **(extra or {}), "hosts": [r.to_dict() for r in results]})
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table("host", "outcome", "release", "failed step", "seconds", "message")
        for r in results:
            t.add_row(r.host, r.outcome, r.release or "-", r.failed_step or "-", f"{r.seconds:.1f}",
                      (r.message or "").splitlines()[0][:80] if r.message else "")
        Console(stderr=False).print(t)
        for r in results:
            if r.log:
                print(f"--- last log lines of {r.host} ---")
                print("\n".join(r.log[-15:]))
    return code


@app.command()
def deploy(
    inventory: str = INVENTORY_OPT,
    limit: Optional[str] = LIMIT_OPT,
    patchset: str = PATCHSET_OPT,
    budget: Optional[int] = typer.Option(None, "--budget", help="Draft nodes per step, root excluded (1..1024)."),
    topk_cap: Optional[int] = typer.Option(None, "--topk-cap", help="Candidates per depth (1..budget)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout; logs on stderr."),
    no_rollback: bool = typer.Option(False, "--no-rollback", help="On failure leave the host as is (exit 4)."),
    force: bool = typer.Option(False, "--force", help="Replace files that drifted from what we expect."),
    break_lock: bool = typer.Option(False, "--break-lock", help="Clear a stale deploy lock first."),
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys", help="Record unknown host keys (never changed ones)."),
    deadline: Optional[float] = typer.Option(None, "--deadline", help="Seconds to wait for weight loading (default: inventory)."),
):
    """Ship the patch set: preflight, backup, atomic install, unit, restart, wait, health gate, commit.
    Any failure after the first change rolls the host back by itself."""
    from .fleet import run_sequential

    def body():
        hosts = _hosts(inventory, limit, budget, topk_cap)
        ps = _load_ps(patchset)
        if not yes and sys.stdin.isatty():
            names = ", ".join(h.name for h in hosts)
            if not typer.confirm(f"Deploy {ps.label} to {names}?"):
                raise typer.Exit(1)
        from .deploy import DeployOptions

        opts = DeployOptions(force=force, break_lock=break_lock, no_rollback=no_rollback,
                             command=" ".join(["ddtree-ops", *sys.argv[1:]])[:500], deadline_s=deadline)
        results = run_sequential(hosts, lambda d: d.deploy(ps, opts), accept_new_host_keys=accept_new_host_keys,
                                 report=_Reporter())
        return _print_results(results, as_json, {"patchset": ps.label})
    _guard(body, as_json=as_json)


@app.command()
def rollback(
    inventory: str = INVENTORY_OPT,
    limit: Optional[str] = LIMIT_OPT,
    to: Optional[str] = typer.Option(None, "--to", help="A release id, or 'original' for the upstream files."),
    yes: bool = typer.Option(False, "--yes", "-y"),
    as_json: bool = typer.Option(False, "--json"),
    break_lock: bool = typer.Option(False, "--break-lock"),
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys"),
):
    """Back to the previous release (or --to RELEASE|original), with the same restart and health gate."""
    from .deploy import DeployOptions
    from .fleet import run_sequential

    def body():
        hosts = _hosts(inventory, limit)
        if not yes and sys.stdin.isatty():
            if not typer.confirm(f"Roll back {', '.join(h.name for h in hosts)} to {to or 'the previous release'}?"):
                raise typer.Exit(1)
        opts = DeployOptions(break_lock=break_lock, command=" ".join(["ddtree-ops", *sys.argv[1:]])[:500])
        results = run_sequential(hosts, lambda d: d.rollback(to, opts), accept_new_host_keys=accept_new_host_keys,
                                 report=_Reporter())
        return _print_results(results, as_json)
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
