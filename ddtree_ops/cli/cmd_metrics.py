"""`ddtree-ops metrics`: status as Prometheus text (fleet/metrics.py), on stdout or into a file
for node exporter's textfile collector."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from .common import INVENTORY_OPT, LIMIT_OPT, guard, log, output_file


def check_out(out: str) -> str:
    """--out FILE, checked before anything connects."""
    return output_file("--out", out, "ddtree_ops.prom")


def metrics(
    inventory: str = INVENTORY_OPT,
    limit: Optional[str] = LIMIT_OPT,
    out: Optional[str] = typer.Option(None, "--out", metavar="FILE",
                                      help="Write to FILE atomically (temp file + rename), e.g. into node "
                                           "exporter's --collector.textfile.directory as ddtree_ops.prom."),
    forks: int = typer.Option(10, "--forks", help="Hosts read in parallel at most."),
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys"),
):
    """What `status` knows, per host, as Prometheus text exposition: reachable, healthy, drift, release and
    rollout (labels of ddtree_ops_host_release_info), budget/topk, accept length, and the current release's
    performance gate (verdict, accept length, tok/s). Exit 0 once written (an unhealthy host is a value, not
    an error); 1 when the file could not be written; 2 for a bad flag."""
    from ..config.atomic_file import write_atomically
    from ..config.inventory import load_inventory
    from ..fleet.metrics import status_exposition
    from ..fleet.status import collect_status
    from .flag_ranges import check_forks

    def body():
        check_forks(forks)
        if out is not None:
            check_out(out)
        hosts = load_inventory(inventory).select(limit)
        text = status_exposition(collect_status(hosts, accept_new_host_keys=accept_new_host_keys, forks=forks))
        if out is None:
            sys.stdout.write(text)
            return 0
        try:
            write_atomically(out, text)
        except OSError as e:
            log(f"error: --out {out}: {e.strerror or e}")
            return 1
        log(f"metrics of {len(hosts)} host(s) written to {out}")
        return 0
    guard(body)


def register(app: typer.Typer) -> None:
    app.command()(metrics)
