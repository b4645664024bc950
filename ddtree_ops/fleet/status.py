"""`ddtree-ops status`: what each host runs, read in parallel, changing nothing.

Per host: reachable (or why not), current release and its patch set/bundle, budget/topk of the
active unit's ExecStart, drift (files whose sha256 differs from what the current release
recorded as installed, and `version_drift`: the SGLang in the venv is not the version the release
was installed onto; the restore check of host/agent/restore_check.py, the one `rollback` refuses
on), configuration drift (the inventory's budget, topk, unit and launch flags,
and the patch set or bundle when named, against what the host runs: config_drift.py), unit
states, /health and the average accept length from /server_info,
and the host's last heal of itself (rolled back on its own when its controller was lost).
An unreachable host is a row with `reachable: false` and the reason, never a crash.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from ..artifacts.units import parse_exec_flags
from ..config.inventory import Host
from ..errors import DdtreeOpsError
from ..gates.health import health_status
from ..host.first_contact import retry_until_reached
from ..host.hooks import NO_HOOKS, Hooks
from ..host.http import http_client
from ..host.release_store import ReleaseStore
from ..host.session import HostSession, open_session, reconnect_window_s
from .config_drift import Expected, Running, compare

UNIT_DIR = "/etc/systemd/system"  # where a conflicting unit is read from (the tool's own: host.unit_path)


def _http(host: Host, row: dict[str, Any]) -> None:
    if host.node_rank >= 1:
        row["health"] = f"n/a (rank {host.node_rank})"
        return
    try:
        with http_client(host) as c:
            row["health"] = health_status(c, timeout=min(5.0, host.health.request_timeout_s))
            if row["health"] == 200:
                try:
                    info = c.get("/server_info", timeout=5.0).json()
                    states = info.get("internal_states") or [{}]
                    v = states[0].get("avg_spec_accept_length")
                    row["avg_accept_length"] = float(v) if v is not None else None
                except (httpx.HTTPError, ValueError, AttributeError, TypeError, IndexError):
                    row["avg_accept_length"] = None
    except Exception as e:  # pragma: no cover - a broken URL must not crash the table
        row["health"] = type(e).__name__


def _active_unit_text(store: ReleaseStore, host: Host, active: str | None, facts: dict[str, Any]) -> str | None:
    """The unit file whose ExecStart the host runs: the tool's unit (read with the facts), or a
    conflicting unit that serves instead, read through the agent as well. No unit active: the
    tool's, as it would start."""
    if active and not (active == host.unit and facts.get("unit_text")):
        return store.unit_text(f"{UNIT_DIR}/{active}")
    return facts.get("unit_text")


class _NotReached(Exception):
    """The first contact failed for good (its own retries are over): not a read to try again."""

    def __init__(self, error: DdtreeOpsError):
        super().__init__(str(error))
        self.error = error


def _read_host(session: HostSession, host: Host, expected: Expected | None) -> dict[str, Any]:
    """What the host runs, read through its agent (the fields of a status row)."""
    row: dict[str, Any] = {"drift": [], "version_drift": []}
    store = session.store
    facts = store.facts([])
    rel = facts.get("current_release") or {}
    row["release"] = facts.get("current")
    row["patchset"] = rel.get("patchset")
    row["bundle"] = rel.get("bundle")
    row["rollout"] = rel.get("rollout")
    row["release_outcome"] = rel.get("outcome")
    row["perf_gate"] = rel.get("perf_gate")  # the current release's canary gate (perfgate)
    row["journal"] = facts.get("journal")
    row["lock"] = facts.get("lock")
    row["host_heal"] = facts.get("host_heal")  # the host's last heal of itself (host/heal_note.py)
    if row["release"]:  # the agent's restore check, as status asks it (host/agent/restore_check.py)
        check = store.installed_drift(row["release"])
        row["drift"] = [{"path": d.path, "recorded": d.expected_sha256, "now": d.found_sha256} for d in check.files]
        row["version_drift"] = [{"release": v.release, "recorded": v.recorded, "now": v.found} for v in check.versions]
    row["units"] = {u: st.active for u, st in session.services.states((host.unit, *host.conflicts)).items()}
    row["active_unit"] = next((u for u, s in row["units"].items() if s == "active"), None)
    unit_text = _active_unit_text(store, host, row["active_unit"], facts)
    flags = parse_exec_flags(unit_text or "")
    row["budget"], row["topk_cap"], row["algorithm"] = (flags.get("budget"), flags.get("topk_cap"),
                                                         flags.get("algorithm"))
    running = Running(row["release"], row["patchset"], rel.get("patchset_digest"), row["bundle"],
                      row["budget"], row["topk_cap"], row["active_unit"], unit_text)
    row["config_drift"] = [d.to_dict() for d in compare(host, running, expected)]
    return row


def host_status(host: Host, *, accept_new_host_keys: bool = False, expected: Expected | None = None,
                hooks: Hooks = NO_HOOKS) -> dict[str, Any]:
    t0 = time.monotonic()
    row: dict[str, Any] = {
        "host": host.name, "address": host.address, "server": host.server,
        "node_rank": host.node_rank if host.server else None,
        "reachable": False, "reason": None, "release": None, "patchset": None, "bundle": None,
        "release_outcome": None, "budget": None, "topk_cap": None, "algorithm": None, "drift": [], "version_drift": [],
        "units": {}, "active_unit": None, "health": None, "avg_accept_length": None, "journal": None, "lock": None,
        "perf_gate": None, "host_heal": None, "rollout": None, "config_drift": [], "connect_tries": 1,
    }
    window = reconnect_window_s(host)
    deadline = time.monotonic() + window
    tries = [0]

    def read_once() -> dict[str, Any]:
        # Read only: a connection lost while reading is a new first contact and a new read, all
        # within one window.
        try:
            session = open_session(host, accept_new_host_keys=accept_new_host_keys, hooks=hooks,
                                   window_s=max(deadline - time.monotonic(), 0.0))
        except DdtreeOpsError as e:
            raise _NotReached(e) from None
        tries[0] += session.connect_tries
        try:
            return _read_host(session, host, expected)
        finally:
            session.close()

    try:
        row.update(retry_until_reached(read_once, window_s=window, sleep=time.sleep, clock=time.monotonic).value,
                   reachable=True)
    except _NotReached as n:
        row["reason"] = str(n.error)
        tries[0] += getattr(n.error, "tries", 1)
    except Exception as e:
        row["reachable"] = True
        row["reason"] = f"reading the host failed: {e if isinstance(e, DdtreeOpsError) else f'{type(e).__name__}: {e}'}"
    row["connect_tries"] = max(tries[0], 1)
    _http(host, row)
    row["seconds"] = round(time.monotonic() - t0, 2)
    row["ok"] = bool(row["reachable"] and not row["reason"] and not row["drift"] and not row["version_drift"]
                     and not row["config_drift"]
                     and (host.node_rank >= 1 or row["health"] == 200))
    return row


def collect_status(hosts: list[Host], *, accept_new_host_keys: bool = False, forks: int = 10,
                   expected: Expected | None = None, hooks: Hooks = NO_HOOKS) -> list[dict[str, Any]]:
    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(forks, len(hosts))), thread_name_prefix="ddtree-status") as pool:
        return list(pool.map(lambda h: host_status(h, accept_new_host_keys=accept_new_host_keys, expected=expected,
                                                 hooks=hooks),
                             hosts))
