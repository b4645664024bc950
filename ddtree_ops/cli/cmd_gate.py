"""`ddtree-ops gate`: the canary performance gate between servers named by URL (gates/url_gate.py),
once (`--baseline URL --canary URL`: the verdict, exit 0/1/2) or as the HTTP service Argo
Rollouts' web metric provider calls (`--serve ADDR`: gates/gate_service.py)."""

from __future__ import annotations

import enum
import os
import sys
from typing import Optional

import typer

from ..config.terminal import terminal_safe
from ..errors import EXIT_ERROR, EXIT_OK, InputError
from .common import emit_json, guard, log


class Marginal(str, enum.Enum):
    """What a marginal verdict exits with."""

    PASS = "pass"
    FAIL = "fail"


def exit_code(verdict: str, marginal: Marginal) -> int:
    """0 pass; 1 fail; marginal: 0, or 1 with `--marginal fail`."""
    if verdict == "fail" or (verdict == "marginal" and marginal is Marginal.FAIL):
        return EXIT_ERROR
    return EXIT_OK


def _perf_gate(inventory: str | None, host: str | None):
    """(the perf_gate settings, where they came from): the inventory's (the host's, or the one
    every host shares: all its workloads, as the deploy measures them), else the built-in ones:
    one workload, today's case (a service started without an inventory keeps the bound its
    orchestrator's timeout was sized for; examples/argo)."""
    from ..config.inventory import load_inventory
    from ..config.perfgate_settings import PerfGateSettings
    from ..config.workload_settings import Workload

    if inventory is None:
        if host is not None:
            raise InputError("--host picks a host's perf_gate settings from an inventory: give -i INVENTORY too")
        return PerfGateSettings(workloads=(Workload(),)), "the built-in defaults"
    inv = load_inventory(inventory)
    if host is not None:
        return inv.host(host).perf_gate, f"{inventory} (host {host})"
    distinct = {(h.perf_gate.workloads, h.perf_gate.thresholds) for h in inv.hosts.values()}
    if len(distinct) > 1:
        raise InputError(f"{inventory}: the hosts' perf_gate settings differ; name the host whose settings to "
                         f"use with --host")
    first = next(iter(inv.hosts.values()), None)
    return (first.perf_gate if first else PerfGateSettings(workloads=(Workload(),))), inventory


def _api_key(var: str | None) -> str | None:
    if var is None:
        return None
    key = os.environ.get(var)
    if not key:
        raise InputError(f"--api-key-env {var}: the variable is not set in this environment")
    return key


BASELINE_OPT = typer.Option([], "--baseline", metavar="URL",
                            help="A server on the release serving now (repeatable: several are one reference, their "
                                 "mean per server).")
CANARY_OPT = typer.Option([], "--canary", metavar="URL",
                          help="A server on the new release (repeatable: each is judged, the worst counts).")
MARGINAL_OPT = typer.Option(None, "--marginal", case_sensitive=False,
                            help="Exit code of a marginal verdict: pass (0, the default) or fail (1).")
ALLOW_HOST_OPT = typer.Option([], "--allow-host", metavar="HOST[:PORT]",
                              help="With --serve: a host requests may name besides the --baseline/--canary URLs "
                                   "(repeatable; *.DOMAIN for a domain's hosts).")


def gate(
    baseline: list[str] = BASELINE_OPT,
    canary: list[str] = CANARY_OPT,
    inventory: Optional[str] = typer.Option(None, "--inventory", "-i", envvar="DDTREE_OPS_INVENTORY",
                                            help="Take the workload and thresholds from this inventory's perf_gate "
                                                 "(what deploy --perf-gate uses); default: the built-in ones."),
    host: Optional[str] = typer.Option(None, "--host", help="With -i: this host's perf_gate (needed when the "
                                                            "hosts' settings differ)."),
    duration: Optional[float] = typer.Option(None, "--duration", metavar="S", help="Seconds of load per server."),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", metavar="N", help="Streams per server."),
    min_requests: Optional[int] = typer.Option(None, "--min-requests", metavar="N"),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", metavar="N"),
    request_timeout: Optional[float] = typer.Option(None, "--request-timeout", metavar="S",
                                                    help="Per request, and for the /health probe (10 s at most)."),
    api_key_env: Optional[str] = typer.Option(None, "--api-key-env", metavar="VAR",
                                              help="The environment variable holding the servers' API key."),
    marginal: Optional[Marginal] = MARGINAL_OPT,
    as_json: bool = typer.Option(False, "--json", help="The verdict as one JSON document on stdout."),
    serve: Optional[str] = typer.Option(None, "--serve", metavar="ADDR",
                                        help="Run as the HTTP service for Argo Rollouts' web metric provider on "
                                             "HOST:PORT (GET /gate?baseline=URL&canary=URL, GET /healthz) until "
                                             "SIGTERM or Ctrl-C; --baseline/--canary are then its defaults."),
    allow_host: list[str] = ALLOW_HOST_OPT,
):
    """Compare a baseline server and a canary with the deploy's performance gate: both measured side by side with
    the same workload, each of perf_gate's workloads in turn (the workload flags apply to each), the verdict (pass,
    marginal, fail; the worst workload's) and its table. Exit 0 pass (and marginal, unless
    --marginal fail); 1 fail; 2 no verdict: a bad flag or URL, a server that does not answer GET /health with 200
    within the probe's bound, or a baseline without a successful request. The run ends within the bound it
    states (probe + duration + request timeout + a few seconds)."""
    from ..config.workload_settings import Workload
    from ..gates.url_gate import GateSettings
    from .flag_ranges import check_workload_flags

    def body():
        pg, source = _perf_gate(inventory, host)
        flags = {"duration_s": ("--duration", duration), "concurrency": ("--concurrency", concurrency),
                 "min_requests": ("--min-requests", min_requests),
                 "max_new_tokens": ("--max-new-tokens", max_new_tokens),
                 "request_timeout_s": ("--request-timeout", request_timeout)}
        # The flags apply to every workload; two that they make the same case are measured once.
        workloads: dict[tuple, Workload] = {}
        for w in pg.workloads:
            w = check_workload_flags(w, flags)
            workloads.setdefault(w.case, w)
        cases = tuple(workloads.values())
        settings = GateSettings(cases[0], pg.thresholds, _api_key(api_key_env), source, workloads=cases)
        if serve is not None:
            if as_json or marginal is not None:
                raise InputError("--json and --marginal are for one run; the service answers JSON, a marginal "
                                 "verdict as \"inconclusive\"")
            return _serve(serve, settings)
        if allow_host:
            raise InputError("--allow-host is for --serve")
        return _once(settings)

    def _once(settings) -> int:
        from ..gates.url_gate import GateRequest, run_gate

        request = GateRequest.of(baseline, canary)
        log(f"gate: workload and thresholds from {settings.source}")
        outcome = run_gate(request, settings, progress=log)
        policy = marginal or Marginal.PASS
        code = exit_code(outcome.verdict.value, policy)
        if as_json:
            emit_json({"ok": code == 0, "exit_code": code, "marginal": policy.value, **outcome.as_dict()})
        else:
            sys.stdout.write(terminal_safe(outcome.report(), keep_newlines=True) + "\n")
        return code

    def _serve(addr: str, settings) -> int:
        from ..gates import gate_service as gs
        from ..gates.url_gate import parse_url
        from ..runbook.describe import interrupt_label

        baselines = tuple(parse_url(u, "baseline") for u in baseline)
        canaries = tuple(parse_url(u, "canary") for u in canary)
        allow = gs.AllowList.of(baselines + canaries, allow_host)
        service = gs.GateService(settings, allow, baselines, canaries, log=log)
        server = gs.listen(service, addr)
        log(f"gate service on {gs.url_of(server)}: GET /gate?baseline=URL&canary=URL, GET /healthz; one measurement "
            f"at a time, at most {service.bound_s:g} s each; workload and thresholds from {settings.source}; "
            f"allowed: {allow.describe()}")
        try:
            gs.serve(server)
        except KeyboardInterrupt as e:  # SIGTERM or Ctrl-C: how a service is stopped, not a failure
            log(f"gate service stopped ({interrupt_label(e)})")
        return EXIT_OK
    guard(body, as_json=as_json)


def register(app: typer.Typer) -> None:
    app.command()(gate)
