"""`ddtree-ops logs`: the deployed unit's journal across hosts, each line prefixed by its host.

Thin: the flags are checked and the lines read in fleet/logs.py; here they are printed, every
one through `terminal_safe` (a server's log line may carry escape sequences)."""

from __future__ import annotations

import sys
import threading
import time
from typing import Optional

import typer

from ..config.terminal import terminal_safe
from ..errors import EXIT_ERROR
from .common import INVENTORY_OPT, LIMIT_OPT, guard, interrupted, log


class PrefixedPrinter:
    """`host | line` on stdout, one whole line at a time from any thread; a lost host on stderr."""

    def __init__(self, names: list[str]):
        self.width = max((len(terminal_safe(n)) for n in names), default=0)
        self.lock = threading.Lock()
        self.lost_hosts: list[str] = []

    def line(self, host: str, text: str) -> None:
        with self.lock:
            sys.stdout.write(f"{terminal_safe(host):<{self.width}} | {terminal_safe(text)}\n")
            sys.stdout.flush()

    def lost(self, host: str, reason: str) -> None:
        with self.lock:
            self.lost_hosts.append(host)
            log(f"lost while following: {reason}")


def _print_once(hosts, query, opener, forks: int) -> int:
    from ..fleet.logs import read_logs

    printer = PrefixedPrinter([h.name for h in hosts])
    failed = 0
    for hl in read_logs(hosts, query, opener, forks=forks):
        if hl.error is not None:
            failed += 1
            log(f"error: {hl.error}")
        for text in hl.lines:
            printer.line(hl.host, text)
    return EXIT_ERROR if failed else 0


def _follow(hosts, query, opener) -> int:
    """Until Ctrl-C (exit 0) or until no host is left to follow (exit 1)."""
    from ..fleet.logs import follow_logs

    printer = PrefixedPrinter([h.name for h in hosts])
    stop = threading.Event()
    threads = follow_logs(hosts, query, opener, printer, stop)
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.2)  # short joins: the main thread must stay free to take the signal
    except KeyboardInterrupt as e:
        stop.set()
        deadline = time.monotonic() + 1.0  # a moment for each host's session to hang up cleanly
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return 0 if getattr(e, "exit_code", 130) == 130 else interrupted(e)
    return EXIT_ERROR


def logs(
    inventory: str = INVENTORY_OPT,
    limit: Optional[str] = LIMIT_OPT,
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines until Ctrl-C."),
    since: Optional[str] = typer.Option(None, "--since", metavar="T",
                                        help="From T: 'YYYY-MM-DD [HH:MM[:SS]]', '-1h', '-30min', '10 min ago', "
                                             "'today', 'yesterday'."),
    lines: int = typer.Option(100, "--lines", "-n", help="Lines per host at most (1..2000)."),
    unit: Optional[str] = typer.Option(None, "--unit", help="Another unit's journal (default: each host's "
                                                            "deployed unit)."),
    forks: int = typer.Option(10, "--forks", help="Hosts read in parallel at most."),
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys"),
):
    """The deployed unit's journal (journalctl -o short-iso) on every selected host, each line prefixed
    by its host, secrets scrubbed. Exit 0 when every host was read (with -f: at Ctrl-C); 1 when a host
    could not be; 2 for a bad flag."""
    from ..config.inventory import load_inventory
    from ..fleet.logs import make_query
    from ..host.session import open_session
    from .flag_ranges import check_forks

    def body():
        query = make_query(lines, since, unit)
        check_forks(forks)
        hosts = load_inventory(inventory).select(limit)

        def opener(h):
            return open_session(h, accept_new_host_keys=accept_new_host_keys)
        return _follow(hosts, query, opener) if follow else _print_once(hosts, query, opener, forks)
    guard(body)


def register(app: typer.Typer) -> None:
    app.command()(logs)
