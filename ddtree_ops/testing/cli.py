"""`ddtree-ops sandbox up|status|down`: local test hosts from the command line.

Mounted by `ddtree_ops.cli.commands` through the `ddtree_ops.cli_plugins` entry point
(pyproject.toml): `plugin()` is the group. What the machine lacks to run hosts (root, systemd-nspawn,
sshd, ...) is named by `up`, exit 2.
"""

from __future__ import annotations

import typer

from ddtree_ops.cli.common import emit_json, guard
from ddtree_ops.errors import EXIT_ERROR

sandbox_app = typer.Typer(help="Local test hosts (containers with real systemd, sshd and the SGLang files).",
                          no_args_is_help=True)


@sandbox_app.command("up")
def sandbox_up(
    hosts: int = typer.Option(2, "--hosts", "-n", help="How many test hosts."),
    dir: str = typer.Option("sandbox", "--dir", help="Folder for keys, inventory and host state."),
    load_seconds: float = typer.Option(0.5, "--load-seconds", help="Stand-in weight-loading time."),
    multinode: int = typer.Option(0, "--multinode",
                                  help="The last N hosts form one multi-node server (group server1)."),
    router: bool = typer.Option(False, "--router",
                                help="Also start a real smg router (SGLang Model Gateway) in front of the hosts' "
                                     "servers; the inventory gets its router: section."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
):
    """Create N local test hosts and write DIR/inventory.yaml."""
    from .sandbox import Sandbox

    def body():
        sb = Sandbox(dir)
        rows = sb.up(hosts, load_seconds=load_seconds, multinode=multinode, router=router)
        if as_json:
            emit_json({"ok": True, "inventory": str(sb.inventory_path), "hosts": rows, **_router_fields(sb)})
        else:
            _print_sandbox(rows)
            print(f"inventory: {sb.inventory_path}")
            _print_router(sb)
    guard(body, as_json=as_json)


@sandbox_app.command("status")
def sandbox_status(
    dir: str = typer.Option("sandbox", "--dir"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Per host: address, SSH facts, unit and /health state (checked over verified SSH)."""
    from .sandbox import Sandbox

    def body():
        sb = Sandbox(dir)
        rows = sb.status()
        router = sb.router_status()
        if as_json:
            emit_json({"ok": True, "hosts": rows, **_router_fields(sb, router)})
        else:
            _print_sandbox(rows)
            _print_router(sb, router)
        ok = all(r["ssh_ok"] and r["health_up"] for r in rows) and (router is None or router["up"])
        return 0 if ok else EXIT_ERROR
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


def _router_fields(sb, router: dict | None = None) -> dict:
    """`router_url` and the router's row for the JSON documents; nothing without a router."""
    info = router or sb.router_status()
    return {"router_url": info["url"], "router": info} if info else {}


def _print_router(sb, router: dict | None = None) -> None:
    info = router or sb.router_status()
    if not info:
        return
    workers = ", ".join(f"{w['url']} {w['status']}" for w in info["workers"]) or "none listed"
    print(f"router: {info['url']} (smg, pid {info['pid']}, {'up' if info['up'] else 'DOWN'}; workers: {workers})")
    print(f"router key: export {info['key_env']}=\"$(cat {info['key_file']})\"")


def _print_sandbox(rows: list[dict]) -> None:
    from rich.table import Table

    from ..cli.tables import console, fit

    t = Table("host", "address", "sshd", "ssh", "active unit", "/health", "site-packages")
    for r in rows:
        t.add_row(r["name"], r["address"], "up" if r["sshd_up"] else "DOWN",
                  "ok" if r["ssh_ok"] else fit(r.get("ssh_error", "error"), 40),
                  str(r["active_unit"]), str(r["health"]), r["site_packages"])
    console().print(t)


def plugin() -> typer.Typer:
    """The `sandbox` command group (entry point `ddtree_ops.cli_plugins`)."""
    return sandbox_app
