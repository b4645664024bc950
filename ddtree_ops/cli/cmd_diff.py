"""`ddtree-ops diff --host H REL1 REL2`: two releases of one host compared (fleet/diff.py), read only."""

from __future__ import annotations

import typer

from ..config.terminal import terminal_safe
from .common import INVENTORY_OPT, emit_json, guard


def _short(sha: str | None) -> str:
    return sha[:12] if sha else "absent"


def print_diff(d) -> None:
    """The release records' changes, then each changed file: its hashes and its unified diff."""
    out = [f"{d.host}: {d.old} → {d.new}"]
    out += [f"  {c.name}: {c.old} → {c.new}" for c in d.fields] or ["  release records: no change in "
                                                                     "patch set, bundle, budget, topk, rollout"]
    out += [f"  note: {n}" for n in d.notes]
    for f in d.files:
        what = "unit " if f.unit else ""
        out.append(f"{what}{f.path}: {f.change} ({_short(f.old_sha256)} → {_short(f.new_sha256)})")
        out += [f"  {f.note}"] if f.note else f.diff
    if not d.notes:
        out.append(f"{len(d.files)} file(s) differ, {d.unchanged_files} the same")
    print(terminal_safe("\n".join(out), keep_newlines=True))


def diff(
    old: str = typer.Argument(..., metavar="REL1", help="The older release id."),
    new: str = typer.Argument(..., metavar="REL2", help="The newer release id."),
    host: str = typer.Option(..., "--host", help="Host name in the inventory."),
    inventory: str = INVENTORY_OPT,
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys"),
):
    """What changed on HOST between releases REL1 and REL2: patch set, bundle, budget/topk, rollout, and each
    file by sha256 with a unified diff of text files and of the unit, from the host's release records and
    backups (read only). Exit 2 for a release the host does not have."""
    from ..config.inventory import load_inventory
    from ..fleet.diff import diff_releases
    from ..host.session import session_to

    def body():
        h = load_inventory(inventory).host(host)
        with session_to(h, accept_new_host_keys=accept_new_host_keys) as session:
            d = diff_releases(session, old, new)
        if as_json:
            emit_json({"ok": True, **d.to_dict()})
        else:
            print_diff(d)
    guard(body, as_json=as_json)


def register(app: typer.Typer) -> None:
    app.command()(diff)
