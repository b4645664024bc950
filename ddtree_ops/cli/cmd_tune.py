"""`ddtree-ops tune`: measure a grid of DDTree configs (and DFlash, the control) on the selected hosts,
under the perf gate's workload at several concurrencies and temperatures, and say which config wins
each, by how much. Parse, call fleet/tune.py, print; `--write` (config/inventory_edit.py) and
`--keep best` (an ordinary rolling deploy of the pick) after it."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import typer

from ..config.inventory import BUDGET_MAX
from ..config.workload_settings import CONCURRENCY_MAX
from ..errors import EXIT_ERROR, EXIT_NEEDS_PERSON, EXIT_OK, EXIT_ROLLED_BACK, InputError
from ..fleet.tune_plan import (
    DEFAULT_BUDGETS,
    DEFAULT_CONCURRENCIES,
    DEFAULT_DURATION_S,
    DEFAULT_TEMPERATURES,
    DEFAULT_TOPK_CAPS,
    as_flag,
)
from ..gates.tune_ranking import DEFAULT_MAX_REPEATS, DEFAULT_MAX_SPREAD, DEFAULT_MIN_REPEATS
from .common import INVENTORY_OPT, LIMIT_OPT, confirm, emit_json, guard, hooks_of, log, output_file


@dataclass(frozen=True)
class TuneKit:
    """What tune shares with deploy, handed over by commands.py (which imports this module)."""

    targets: Callable[..., tuple]  # (inventory, limit) → (targets, notes)
    source: Callable[..., Any]  # the verified patch set or bundle, as a context manager
    print_rollout: Callable[..., int]


def exit_code(doc: dict[str, Any]) -> int:
    """0: done, every host back as it was and routed; 3: interrupted, every host back (rows kept);
    1: a host is back but not in its router; 4: a host could not be put back (a person must look)."""
    restored = doc.get("restored") or []
    if any(not r.get("ok") for r in restored):
        return EXIT_NEEDS_PERSON
    if any(r.get("routed") is False for r in restored):
        return EXIT_ERROR
    return EXIT_ROLLED_BACK if doc.get("interrupted") else EXIT_OK


def _fmt_gain(g: dict[str, float] | None) -> str:
    return "-" if not g else f"{g['ratio']:.2f}x ({g['low']:.2f}-{g['high']:.2f})"


def print_summary(doc: dict[str, Any]) -> None:
    from ..config.terminal import terminal_safe

    rows = doc["rows"]
    failed = [r for r in rows if r["status"] != "ok"]
    out = [f"tune {doc['tune_id']}: {len(rows) - len(failed)} of {len(rows)} measurements ok"
           + (f", interrupted ({doc['interrupted_by']})" if doc.get("interrupted") else "")]
    out.append(f"{'workload':<10} {'winner':<8} {'tok/s':>9} {'accept':>6}  {'vs DFlash':<20} "
               f"{'vs inventory':<20} note")
    for w in doc["winners"]:
        tps = f"{w['tok_s']:.1f}" if w.get("tok_s") is not None else "-"
        acc = f"{w['accept_length']:.2f}" if w.get("accept_length") is not None else "-"
        out.append(f"{w['workload']:<10} {w.get('config') or '-':<8} {tps:>9} {acc:>6}  "
                   f"{_fmt_gain(w.get('vs_dflash')):<20} {_fmt_gain(w.get('vs_inventory')):<20} "
                   f"{w.get('note') or ''}".rstrip())
    seen: set[tuple[str, str]] = set()
    for r in failed:
        key = (r["config"], r.get("reason") or "")
        if key not in seen:
            seen.add(key)
            out.append(f"failed: {r['config']} on {r['host']}: {r.get('reason')}")
    p = doc.get("pick")
    out.append(f"pick for every workload: {p['config']} ({p['why']})" if p else "pick: none (no DDTree config "
               "was measured ok in every workload)")
    for r in doc.get("restored") or []:
        out.append(f"{r['host']}: {r['message']}" + ("" if r.get("routed") in (None, True) else " (NOT routed)"))
    print(terminal_safe("\n".join(out), keep_newlines=True))


def register(app: typer.Typer, kit: TuneKit) -> None:
    @app.command(help="Find the DDTree config that wins on these hosts: every --budgets x --topk-caps config (and "
                      "the inventory's, and DFlash as the control) deployed through the deploy runbook, measured at "
                      "each --concurrency x --temperatures as the perf gate measures, repeated until steady; each "
                      "host out of the router while tuned and back on its release at the end (or on the pick with "
                      "--keep best). Exit 0 done, 3 interrupted (hosts back), 1 a host not re-routed, 4 a host not "
                      "back.")
    def tune(
        ctx: typer.Context,
        inventory: str = INVENTORY_OPT,
        limit: Optional[str] = LIMIT_OPT,
        patchset: Optional[str] = typer.Option(None, "--patchset", "-p", help="The patch set to tune (default "
                                                                              "ddtree-temp)."),
        bundle: Optional[str] = typer.Option(None, "--bundle", help="Or a verified release bundle."),
        expect_id: Optional[str] = typer.Option(None, "--expect-id", metavar="ID"),
        budgets: str = typer.Option(as_flag(DEFAULT_BUDGETS), "--budgets", help="Budgets to try, comma-separated."),
        topk_caps: str = typer.Option(as_flag(DEFAULT_TOPK_CAPS), "--topk-caps",
                                      help="Top-k caps to try (each ≤ the budget)."),
        concurrency: str = typer.Option(as_flag(DEFAULT_CONCURRENCIES), "--concurrency",
                                        help="Concurrent streams per workload."),
        temperatures: str = typer.Option(as_flag(DEFAULT_TEMPERATURES), "--temperatures",
                                         help="Sampling temperatures per workload."),
        prompts_file: Optional[str] = typer.Option(None, "--prompts-file",
                                                   help="Prompts (one per line, or .jsonl with \"text\"); default: "
                                                        "the perf gate's."),
        duration: float = typer.Option(DEFAULT_DURATION_S, "--duration", help="Seconds per measurement."),
        min_repeats: int = typer.Option(DEFAULT_MIN_REPEATS, "--min-repeats",
                                        help="Measurements per config and workload, at least."),
        max_repeats: int = typer.Option(DEFAULT_MAX_REPEATS, "--max-repeats",
                                        help="... and at most, when tok/s stays unsteady."),
        max_spread: float = typer.Option(DEFAULT_MAX_SPREAD, "--max-spread",
                                         help="Steady: tok/s half-range over the repeats within this share."),
        objective: str = typer.Option("throughput", "--objective", help="throughput (the only one; bound it with "
                                                                        "--ttft-p99-max / --itl-p99-max)."),
        ttft_p99_max: Optional[float] = typer.Option(None, "--ttft-p99-max", metavar="S",
                                                     help="Only configs whose TTFT p99 stays within S seconds."),
        itl_p99_max: Optional[float] = typer.Option(None, "--itl-p99-max", metavar="S",
                                                    help="Only configs whose inter-token p99 stays within S s."),
        keep: str = typer.Option("original", "--keep", help="original: every host back on its release; best: then "
                                                            "deploy the pick to them (a rolling deploy)."),
        write: bool = typer.Option(False, "--write", help="Put the pick's budget and topk_cap into the inventory file "
                                                          "they came from (diff shown first)."),
        max_unavailable: Optional[str] = typer.Option(None, "--max-unavailable", metavar="N|P%",
                                                      help="Hosts tuned (out of service) at once, at most."),
        deadline: Optional[float] = typer.Option(None, "--deadline", help="Seconds to wait for weight loading."),
        yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
        as_json: bool = typer.Option(False, "--json", help="The tune's record as one JSON document on stdout."),
        report: Optional[str] = typer.Option(None, "--report", metavar="FILE.html",
                                             help="Also write an HTML report with the plots."),
        accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys"),
    ):
        def body() -> int:
            from ..config.workload_settings import load_prompts
            from ..fleet.actions import ssh_connector
            from ..fleet.rollout_id import new_rollout_id
            from ..fleet.tune import Tune, TuneOptions, check_one_kind, keep_record, survey, tune_document
            from ..fleet.tune_plan import assign, grid, parse_float_list, parse_int_list, workloads
            from ..gates.tune_ranking import Objective, RepeatRule
            from .flag_ranges import check_workload_flags, rollout_policy_for

            if objective != "throughput":
                raise InputError(f"--objective {objective!r}: the one objective is 'throughput' (bound it with "
                                 f"--ttft-p99-max / --itl-p99-max)")
            if keep not in ("original", "best"):
                raise InputError(f"--keep {keep!r}: give 'original' or 'best'")
            if not 1 <= min_repeats <= max_repeats <= 50:
                raise InputError("--min-repeats and --max-repeats: 1 ≤ min ≤ max ≤ 50")
            if not 0 < max_spread < 1:
                raise InputError(f"--max-spread {max_spread:g}: give a share between 0 and 1, like 0.03")
            for flag, v in (("--ttft-p99-max", ttft_p99_max), ("--itl-p99-max", itl_p99_max)):
                if v is not None and not v > 0:
                    raise InputError(f"{flag} {v:g}: give seconds > 0")
            if report:
                output_file("--report", report, "tune.html")
            bs = parse_int_list(budgets, "--budgets", 1, BUDGET_MAX)
            ks = parse_int_list(topk_caps, "--topk-caps", 1, BUDGET_MAX)
            cs = parse_int_list(concurrency, "--concurrency", 1, CONCURRENCY_MAX)
            ts = parse_float_list(temperatures, "--temperatures", 0.0, 2.0)
            targets, notes = kit.targets(inventory, limit)
            hosts = [h for t in targets for h in t.hosts]
            check_one_kind(hosts)
            base = check_workload_flags(hosts[0].perf_gate.workload, {"duration_s": ("--duration", duration)})
            if prompts_file:
                import dataclasses

                base = dataclasses.replace(base, prompts=load_prompts(prompts_file), prompts_file=prompts_file)
            wls = workloads(base, cs, ts, base.duration_s)
            configs = grid(bs, ks, (hosts[0].budget, hosts[0].topk_cap))
            policy, bounded = rollout_policy_for(targets, max_unavailable)
            notes = [*notes, *bounded]
            if write:  # a --write that would be refused is refused now, before an hour of tuning
                _check_writable(inventory, [h.name for h in hosts], configs)
            with kit.source(patchset, bundle, hosts, expect_id=expect_id) as (ps, b):
                connect = ssh_connector(accept_new_host_keys, hooks_of(ctx))
                current = survey(hosts, connect)
                on_original = [n for n, rid in current.items() if rid is None]
                plans = assign(configs, [h.name for h in hosts], on_original)
                if not on_original:
                    notes.append("DFlash (the control) is not measured: every selected host runs a DDTree "
                                 "release, and going to the original files cannot be undone by a rollback; "
                                 "include a host that runs DFlash (`rollback --to original` it first)")
                parallel = policy.bound(len(plans))
                admit = _router_admission(targets, policy)
                if admit is not None:  # the first hosts must be able to leave their routers now
                    for t in targets[:parallel]:
                        why = admit(t.name)
                        if why is not None:
                            raise InputError(f"tune: {why}; nothing was changed (lower --max-unavailable, or "
                                             f"put more workers behind the router)")
                per = max(p.deploys for p in plans)
                log(f"tune: {len(configs)} configs x {len(wls)} workloads on {len(hosts)} host(s), "
                    f"{parallel} at a time; at most {per} deploy(s) per host; "
                    f"{duration:g} s per measurement, {min_repeats}-{max_repeats} repeats")
                for p in plans:
                    log(f"  {p.host} (now on {current[p.host] or 'original'}): "
                        + (", ".join(c.label for c in p.configs) or "nothing"))
                for n in notes:
                    log(f"note: {n}")
                confirm(yes, f"Tune {', '.join(h.name for h in hosts)}: each restarted up to {per} time(s) and "
                             f"out of its router meanwhile?")
                rid = new_rollout_id()
                tune_id = "tune-" + rid.lower()
                opts = TuneOptions(patchset=ps, workloads=wls,
                                   rule=RepeatRule(min_repeats, max_repeats, max_spread), deadline_s=deadline,
                                   command=" ".join(["ddtree-ops", *sys.argv[1:]])[:400], tune_id=tune_id,
                                   rollout_id=rid)
                started = time.time()
                run = Tune(plans, {h.name: h for h in hosts}, opts, connect=connect,
                           report=lambda e: log(f"{e.host} | {e.text}"), max_parallel=parallel, admit=admit)
                results = run.run()
                obj = Objective(ttft_p99_max, itl_p99_max)
                doc = tune_document(tune_id=tune_id, started_at=started, hosts=hosts, configs=configs,
                                    budgets=bs, topk_caps=ks, workloads_=wls, results=results, objective=obj,
                                    notes=notes, interrupted=run.interrupted_by, inventory=inventory)
                doc["not_kept"] = keep_record(hosts, doc, connect, lambda e: log(f"{e.host} | {e.text}"))
                code = exit_code(doc)
                if report:
                    from .tune_report import write_tune_report

                    write_tune_report(report, doc)
                    log(f"report written to {report}")
                if as_json:
                    emit_json(doc)
                else:
                    print_summary(doc)
                if code != EXIT_OK:
                    return code
                if write:
                    code = _write(doc, inventory, [h.name for h in hosts], yes)
                if keep == "best" and code == EXIT_OK:
                    code = _keep_best(kit, doc, inventory, limit, ps, connect, policy, as_json)
                return code
        guard(body, as_json=as_json)

    def _router_admission(targets: list, policy) -> Callable[[str], str | None] | None:
        """`admit(host)` for the tune from the deploy's router rule (fleet/policy.py): None when the
        host may leave its router now, else why not. None without a router."""
        from ..fleet.routing import router_gate

        gate = router_gate(targets, policy)
        if gate is None:
            return None
        by_name = {t.name: t for t in targets}

        def admit(host: str) -> str | None:
            adm = gate([by_name[host]])
            return None if adm.go else (adm.why or "the router's pool would be too small")
        return admit

    def _check_writable(inventory: str, names: list[str], configs: list) -> None:
        """InputError now when --write could not write a pick: the hosts take budget or topk_cap from
        different places, or those places cannot be edited (inventory_edit.py's refusals). Tried with
        the grid's largest budget (no other host's top-k cap can end above it) and a cap that differs
        from the inventory's where the grid has one, so both keys' sources are checked."""
        from ..config.inventory_edit import plan_write

        inv = next((c for c in configs if c.inventory), None)
        trees = sorted((c for c in configs if not c.dflash and not c.inventory),
                       key=lambda c: (-c.budget, inv is not None and c.topk_cap == inv.topk_cap))
        other = trees[0] if trees else None
        if other is not None:
            try:
                plan_write(inventory, names, {"budget": other.budget, "topk_cap": other.topk_cap})
            except InputError as e:
                raise InputError(f"--write would be refused after the tune, so nothing was started: {e}") from None

    def _write(doc: dict[str, Any], inventory: str, names: list[str], yes: bool) -> int:
        from ..config.inventory_edit import apply_plan, plan_write

        p = doc.get("pick")
        if not p:
            log("--write: nothing written: no DDTree config was measured ok in every workload")
            return EXIT_OK
        plan = plan_write(inventory, names, {"budget": p["budget"], "topk_cap": p["topk_cap"]})
        if not plan.edits:
            log(f"--write: the inventory already says budget {p['budget']} / topk_cap {p['topk_cap']}")
            return EXIT_OK
        log(plan.diff().rstrip("\n"))
        for line in plan.summary():
            log(f"--write: {line}")
        confirm(yes, f"Write budget {p['budget']} / topk_cap {p['topk_cap']} into the inventory?")
        apply_plan(plan)
        log(f"--write: written ({', '.join(e.path for e in plan.edits)})")
        return EXIT_OK

    def _keep_best(kit: TuneKit, doc: dict[str, Any], inventory: str, limit: Optional[str], ps, connect,
                   policy, as_json: bool) -> int:
        from ..fleet.actions import rolling_deploy
        from ..runbook.options import DeployOptions

        p = doc.get("pick")
        if not p:
            log("--keep best: every host stays on its release: no DDTree config was measured ok in every workload")
            return EXIT_OK
        targets, notes = kit.targets(inventory, limit, p["budget"], p["topk_cap"])
        log(f"--keep best: deploying {p['config']} to {', '.join(t.name for t in targets)}")
        opts = DeployOptions(command=f"ddtree-ops tune --keep best ({doc['tune_id']})", perf_gate=False,
                             overrides={"budget": p["budget"], "topk_cap": p["topk_cap"]})
        res = rolling_deploy(targets, ps, opts, connect=connect, policy=policy, notes=notes)
        if as_json:  # stdout holds the tune's document already: the deploy's outcome goes to stderr
            for r in res.results:
                log(f"{r.host} | --keep best: {r.outcome}" + (f": {r.message}" if r.message else ""))
            return res.exit_code
        return kit.print_rollout(res, False)
