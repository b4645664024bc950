"""The CLI's tables: plans, rollout summaries, status and history, printed on stdout.

On a terminal long values are shortened to fit the screen; piped or in CI (no TTY) every value
is printed whole, since that output is what a person reads afterwards in a log.

Every value goes to Rich as a `Text` (`literal`), never as a markup string: what a host sends
(error messages, log lines, unit states, release ids, the lock holder's description) is printed
as written, so `[red]`, `[link=...]` or `:emoji:` in it is not markup; and every value, in a cell
or on a line of its own, goes through `terminal_safe` first: control characters (ESC, CR, C1),
bidi overrides and other format characters are shown as their escapes (`\\x1b`, `\\u202e`) instead
of reaching the terminal. Only a multi-line block (a log tail, the unit diff) keeps its newlines.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..config.redaction import scrub_lines
from ..config.terminal import terminal_safe
from ..fleet.config_drift import FieldDrift
from ..fleet.rollout import RolloutResult
from ..host.heal_note import heal_note, healed_notes, unreported_heal
from ..runbook.plan import HostPlan
from .messages import one_line

# Wide enough that Rich never wraps or cuts a cell; a table is only as wide as its content.
_UNLIMITED = 100_000


def interactive() -> bool:
    return sys.stdout.isatty()


def console() -> Console:
    return Console() if interactive() else Console(width=_UNLIMITED, soft_wrap=True)


def clean(value: Any) -> str:
    """One line of text from outside, safe for the terminal (newlines shown as `\\n` too)."""
    return terminal_safe(value)


def block(value: Any) -> str:
    """A multi-line block from outside (a log tail, a diff): its newlines kept, the rest escaped."""
    return terminal_safe(value, keep_newlines=True)


def literal(value: Any, style: str = "") -> Text:
    """`value` as Rich prints it literally: no markup, no emoji codes, no control characters."""
    return Text(clean(value), style=style)


def fit(text: str, width: int) -> str:
    """`text` cut to `width` on a terminal (with an ellipsis); whole otherwise."""
    if not interactive() or len(text) <= width:
        return text
    return text[: max(width - 1, 0)] + "…"


def print_plan(p: HostPlan) -> None:
    con = console()
    con.print(Text.assemble(literal(p.host, "bold"), literal(
        f": {p.patchset} (budget {p.budget}, topk cap {p.topk_cap}); SGLang {p.sglang_version}; "
        f"current release {p.current_release or 'none'}")))
    if p.interrupted:
        con.print(literal(f"  interrupted deploy {p.interrupted.get('release')} at step "
                          f"{p.interrupted.get('step')!r}: will be rolled back first"))
    if p.lock:
        con.print(literal(f"  deploy lock held: {p.lock.get('user')}@{p.lock.get('machine')} "
                          f"since {p.lock.get('since_utc')}"))
    t = Table("file", "action", "old sha256", "new sha256", "status")
    for f in p.files:
        t.add_row(*map(literal, (f.rel, f.action, (f.old_sha256 or "-")[:12], f.new_sha256[:12],
                                 f.status + (f" ({f.note})" if f.note else ""))))
    con.print(t)
    print(block(p.unit_diff or f"unit {p.unit_path}: unchanged"))
    print(clean(f"stop: {', '.join(p.stop_units) or 'nothing'}; restart: {p.restart_unit}"))
    for c in p.checked:
        con.print(Text.assemble("  ", ("checked", "green"), ": ", literal(c)))
    for r in p.refusals:
        con.print(Text.assemble("  ", ("refused", "red"), ": ", literal(r)))


def summary_rows(res: RolloutResult) -> list[dict[str, Any]]:
    return [{"host": r.host, "outcome": str(r.outcome), "release": r.release, "failed_step": r.failed_step,
             "seconds": round(r.seconds, 1), "message": one_line(r.message),  # a refusal's reasons: after line 1
             "ssh": ssh_cell(r.connect_tries, r.reconnects)}
            for r in res.results]


def ssh_cell(tries: int, reconnects: int = 0) -> str:
    """What reaching the host took: "ok" at the first try, else the tries and reconnects."""
    parts = [f"{tries} tries"] if tries > 1 else []
    parts += [f"{reconnects} reconnect{'s' if reconnects > 1 else ''}"] if reconnects else []
    return ", ".join(parts) or "ok"


def _gate_value(metric: str, v: Any) -> str:
    if not isinstance(v, (int, float)):
        return "-"
    if metric.endswith("_s"):
        return f"{v * 1000:.1f} ms"
    if metric == "error_rate":
        return f"{v * 100:.1f} %"
    return f"{v:.2f}" if metric == "accept_length" else f"{v:.1f}"


def print_gate(host: str, gate: dict[str, Any]) -> None:
    """The performance gate of one host: baseline, canary and peers per metric, with the limits."""
    t = Table("metric", "baseline", "canary", "peers", "change", "verdict", "limit",
              title=literal(f"{host}: performance gate {gate.get('verdict')}"), title_justify="left")
    for r in gate.get("rows") or []:
        change = r.get("change")
        m = str(r.get("metric"))
        shown_change = "-" if not isinstance(change, (int, float)) else (
            f"{change * 100:+.1f} pp" if m == "error_rate" else f"{change * 100:+.1f} %")
        values = [_gate_value(m, r.get(k)) for k in ("baseline", "canary", "peers")]
        t.add_row(*map(literal, (r.get("label") or m, *values, shown_change, r.get("verdict"), r.get("limit"))))
    console().print(t)
    for reason in gate.get("reasons") or []:
        print(clean(f"  {reason}"))


_SHOWN_WHOLE = {"refused", "revert_refused"}


def print_rollout(res: RolloutResult) -> None:
    """The summary table, the performance gates, then the last log lines of each host that has some."""
    state = f"ABORTED ({res.abort_reason})" if res.aborted else "done"
    rollout = f" {res.rollout_id}" if res.rollout_id else ""
    title = f"{res.action}{rollout}: {state} in {res.seconds:.1f} s"
    t = Table("host", "outcome", "release", "failed step", "seconds", "ssh", "perf gate", "message",
              title=literal(title), title_justify="left")
    for r, row in zip(res.results, summary_rows(res), strict=True):
        t.add_row(*map(literal, (row["host"], row["outcome"], row["release"] or "-", row["failed_step"] or "-",
                                 f"{row['seconds']:.1f}", row["ssh"], gate_brief(r.perf_gate),
                                 fit(row["message"], 160))))
    console().print(t)
    for row in summary_rows(res):
        # A refusal names what to fix (a rollback's restore check: every drifted file and the
        # versions): whole, where the table's cell had to cut it.
        if row["outcome"] in _SHOWN_WHOLE and len(row["message"] or "") > 160:
            print(clean(f"{row['host']}: {row['message']}"))
    for r in res.results:
        if r.perf_gate:
            print_gate(r.host, r.perf_gate)
    for r in res.results:
        for note in healed_notes(r.steps):  # the host had rolled itself back since the last run
            print(clean(f"{r.host}: {note}"))
    for r in res.results:
        if r.log:
            print(f"--- last log lines of {clean(r.host)} ---")
            print(block("\n".join(scrub_lines(r.log[-15:]))))  # scrubbed when read; masked again here
    print(clean(f"rollout {res.rollout_id}: exit code {res.exit_code}" if res.rollout_id
                else f"exit code {res.exit_code}"))


def gate_brief(gate: dict[str, Any] | None) -> str:
    """A release's performance gate in a table cell: verdict and output tok/s against its reference."""
    if not gate:
        return "-"
    canary, ref = gate.get("canary") or {}, gate.get("baseline") or gate.get("peers") or {}
    tps = canary.get("output_tps")
    if tps is None:
        return str(gate.get("verdict"))
    if ref.get("output_tps"):
        return f"{gate.get('verdict')} ({ref['output_tps']:.0f} → {tps:.0f} tok/s)"
    return f"{gate.get('verdict')} ({tps:.0f} tok/s)"


def print_status(rows: list[dict[str, Any]]) -> None:
    t = Table("host", "reachable", "release", "rollout", "patch set", "budget", "topk", "drift", "active unit",
              "/health", "accept len", "perf gate")
    for r in rows:
        acc = r.get("avg_accept_length")
        t.add_row(*map(literal, (
            r["host"] + (f" ({r['server']} rank {r['node_rank']})" if r.get("server") else ""),
            ("yes" + (f" ({r['connect_tries']} tries)" if r.get("connect_tries", 1) > 1 else "")) if r["reachable"]
            else f"NO: {fit(r['reason'] or '', 60)}",
            r["release"] or "-", r.get("rollout") or "-", r["patchset"] or "-", str(r["budget"] or "-"),
            str(r["topk_cap"] or "-"),
            drift_cell(r),
            r["active_unit"] or "none", str(r["health"]), f"{acc:.2f}" if acc is not None else "-",
            gate_brief(r.get("perf_gate")))))
    console().print(t)
    for r in rows:
        if r["reachable"] and r["reason"]:
            print(clean(f"{r['host']}: {r['reason']}"))
        heal = unreported_heal(r.get("host_heal"))
        if heal:
            print(clean(f"{r['host']}: {heal_note(heal)}"))


def drift_cell(row: dict[str, Any]) -> str:
    """Files changed behind the tool's back, then each field that differs from the inventory."""
    files = [d["path"].rsplit("/", 1)[-1] for d in row["drift"]]
    versions = [f"SGLang {v.get('now') or 'missing'} (release: {v.get('recorded')})"
                for v in (row.get("version_drift") or [])[:1]]
    fields = [FieldDrift(d["field"], d["inventory"], d["host"]).brief() for d in row.get("config_drift") or []]
    return "; ".join([*files, *versions, *fields]) or "none"


def print_history(hist: dict[str, Any]) -> None:
    t = Table("", "release", "created (UTC)", "rollout", "patch set", "budget", "topk", "outcome", "perf gate")
    for r in hist["releases"]:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.get("created") or 0))
        t.add_row(*map(literal, ("*" if r["id"] == hist["current"] else "", r["id"], created, r.get("rollout") or "-",
                                 r.get("patchset"),
                                 r.get("budget"), r.get("topk_cap"), r.get("outcome"), gate_brief(r.get("perf_gate")))))
    console().print(t)
    print(clean(f"current: {hist['current'] or 'original upstream files'}"))
    tunes = hist.get("tunes") or []
    if tunes:
        print_tunes(tunes)


def print_tunes(tunes: list[dict[str, Any]]) -> None:
    """The tunes a host keeps (`ddtree-ops tune`): when, on which hosts, the winners and the pick."""
    t = Table("tune", "started (UTC)", "hosts", "rows", "winners", "pick")
    for d in tunes:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(d.get("started_at") or 0))
        winners = ", ".join(f"{w.get('workload')}: {w.get('config') or '-'}" for w in d.get("winners") or [])
        pick = d.get("pick") or {}
        t.add_row(*map(literal, (d.get("tune_id"), started + (" (interrupted)" if d.get("interrupted") else ""),
                                 ", ".join(d.get("hosts") or []), d.get("rows"), winners or "-",
                                 pick.get("config") or "-")))
    console().print(t)
