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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
