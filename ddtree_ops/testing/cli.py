"""`ddtree-ops sandbox up|status|down`: local test hosts from the command line.

Mounted by `ddtree_ops.cli` when the `sandbox` extra is installed.
"""

from __future__ import annotations

import typer

from ddtree_ops.cli_common import emit_json, guard
from ddtree_ops.errors import EXIT_ERROR

sandbox_app = typer.Typer(help="Local test hosts (network namespaces with sshd, systemctl and SGLang files).",
                          no_args_is_help=True)


@sandbox_app.command("up")
def sandbox_up(
    hosts: int = typer.Option(2, "--hosts", "-n", help="How many test hosts."),
    dir: str = typer.Option("sandbox", "--dir", help="Folder for keys, inventory and host state."),
    load_seconds: float = typer.Option(0.5, "--load-seconds", help="Stand-in weight-loading time."),
    multinode: int = typer.Option(0, "--multinode",
                                  help="The last N hosts form one multi-node server (group server1)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
):
    """Create N local test hosts and write DIR/inventory.yaml."""
    from .sandbox import Sandbox

    def body():
        sb = Sandbox(dir)
        rows = sb.up(hosts, load_seconds=load_seconds, multinode=multinode)
        if as_json:
            emit_json({"ok": True, "inventory": str(sb.inventory_path), "hosts": rows})
        else:
            _print_sandbox(rows)
            print(f"inventory: {sb.inventory_path}")
    guard(body, as_json=as_json)


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
            emit_json({"ok": True, "hosts": rows})
        else:
            _print_sandbox(rows)
        return 0 if all(r["ssh_ok"] and r["health_up"] for r in rows) else EXIT_ERROR
    guard(body, as_json=as_json)


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
            emit_json({"ok": True, **res})
        else:
            print(f"sandbox down: {res['hosts']} host(s), {res['killed']} process(es) stopped")
    guard(body, as_json=as_json)


def _print_sandbox(rows: list[dict]) -> None:
    from rich.table import Table

    from ..tables import console, fit

    t = Table("host", "address", "sshd", "ssh", "active unit", "/health", "site-packages")
    for r in rows:
        t.add_row(r["name"], r["address"], "up" if r["sshd_up"] else "DOWN",
                  "ok" if r["ssh_ok"] else fit(r.get("ssh_error", "error"), 40),
                  str(r["active_unit"]), str(r["health"]), r["site_packages"])
    console().print(t)
