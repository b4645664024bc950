"""Rollouts as the hosts record them: every release a deploy writes names its rollout (`rollout`),
and every release a rollback undoes names the rollback's (`rollback_rollout`). Read back from the
selected hosts' histories, those records give the listing (`rollouts`), the hosts a
`rollback --rollout ID` acts on, and what a `promote` must repeat to continue a rollout that
stopped after its canary. Reading changes nothing on a host; an unreachable host is a row."""

from __future__ import annotations

import enum
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from ..config.inventory import Host
from ..errors import DdtreeOpsError, InputError, shown
from ..host.session import HostSession
from ..runbook.rollback import current_chain
from .rollout import Target
from .rollout_id import is_rollout_id


class Kind(str, enum.Enum):
    DEPLOY = "deploy"
    ROLLBACK = "rollback"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class HostRecords:
    """One host's release history (`history` None: it could not be read, `error` says why)."""

    host: str
    history: dict[str, Any] | None
    error: str | None = None

    def releases(self) -> list[dict[str, Any]]:
        return list((self.history or {}).get("releases") or [])


@dataclass(frozen=True)
class HostPart:
    """What one rollout did to one host: the release it made (deploy) or undid (rollback)."""

    host: str
    releases: tuple[str, ...]
    outcome: str
    at: float
    budget: int | None = None
    topk_cap: int | None = None
    on_chain: bool = False  # a deploy's release is the host's current one, or one it builds on

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "releases": list(self.releases), "outcome": self.outcome, "at": self.at,
                "budget": self.budget, "topk_cap": self.topk_cap, "on_chain": self.on_chain}


@dataclass
class RolloutInfo:
    id: str
    kind: Kind
    parts: list[HostPart] = field(default_factory=list)
    patchset: str | None = None
    patchset_digest: str | None = None
    bundle: str | None = None
    by: str | None = None
    command: str | None = None
    args: dict[str, Any] = field(default_factory=dict)  # deploy: what `promote` repeats (options.py)

    @property
    def started(self) -> float:
        return min((p.at for p in self.parts), default=0.0)

    @property
    def hosts(self) -> list[str]:
        return [p.host for p in self.parts]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": str(self.kind), "started": self.started,
                "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
                "patchset": self.patchset, "patchset_digest": self.patchset_digest, "bundle": self.bundle,
                "by": self.by, "command": self.command, "hosts": [p.to_dict() for p in self.parts]}


# ---------------------------------------------------------------------------------------------
# reading the hosts


def read_records(hosts: list[Host], connect: Callable[[Host], HostSession], forks: int = 10) -> list[HostRecords]:
    """Every host's history, read in parallel, in the order given."""
    def one(h: Host) -> HostRecords:
        try:
            session = connect(h)
            try:
                return HostRecords(h.name, session.store.history())
            finally:
                session.close()
        except DdtreeOpsError as e:
            return HostRecords(h.name, None, str(e) or type(e).__name__)
    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(forks, len(hosts))), thread_name_prefix="ddtree-records") as pool:
        return list(pool.map(one, hosts))


# ---------------------------------------------------------------------------------------------
# the listing (pure)


def _num(v: Any) -> float:
    """A time from a record; 0 for anything else (a record edited by hand must not stop the listing)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def _deploy_part(host: str, rel: dict[str, Any], chain: list[str]) -> HostPart:
    return HostPart(host, (str(rel.get("id")),), str(rel.get("outcome")), _num(rel.get("created")),
                    rel.get("budget"), rel.get("topk_cap"), rel.get("id") in chain)


def _rollback_parts(host: str, undone: list[dict[str, Any]]) -> HostPart:
    newest_first = sorted(undone, key=lambda r: (_num(r.get("created")), str(r.get("id"))), reverse=True)
    return HostPart(host, tuple(str(r.get("id")) for r in newest_first), str(newest_first[0].get("outcome")),
                    min(_num(r.get("rolled_back_at")) for r in undone))


def _new_deploy(rid: str, rel: dict[str, Any]) -> RolloutInfo:
    args = rel.get("rollout_args")
    return RolloutInfo(rid, Kind.DEPLOY, patchset=rel.get("patchset"), patchset_digest=rel.get("patchset_digest"),
                       bundle=rel.get("bundle"), by=rel.get("by"), command=rel.get("command"),
                       args=args if isinstance(args, dict) else {})


def list_rollouts(records: list[HostRecords]) -> list[RolloutInfo]:
    """Every rollout the hosts record, newest first. A deploy's abort that rolled its own hosts
    back is part of that deploy, not a rollout of its own. Releases recorded before rollout ids
    existed belong to none."""
    found: dict[tuple[str, Kind], RolloutInfo] = {}
    for rec in records:
        chain = current_chain(rec.history) if rec.history else []
        undone: dict[str, list[dict[str, Any]]] = {}
        for rel in rec.releases():
            rid = rel.get("rollout")
            if isinstance(rid, str) and rid:
                info = found.setdefault((rid, Kind.DEPLOY), _new_deploy(rid, rel))
                info.parts.append(_deploy_part(rec.host, rel, chain))
            back = rel.get("rollback_rollout")
            if isinstance(back, str) and back and back != rid:
                undone.setdefault(back, []).append(rel)
        for back, rels in undone.items():
            first = min(rels, key=lambda r: _num(r.get("rolled_back_at")))
            info = found.setdefault((back, Kind.ROLLBACK),
                                    RolloutInfo(back, Kind.ROLLBACK, by=first.get("rollback_by")))
            info.parts.append(_rollback_parts(rec.host, rels))
    return sorted(found.values(), key=lambda r: (r.started, r.id), reverse=True)


def find_rollout(records: list[HostRecords], rollout_id: str, kind: Kind = Kind.DEPLOY) -> RolloutInfo:
    """The rollout named `rollout_id` on the selected hosts; InputError (exit 2) naming it otherwise."""
    if not is_rollout_id(rollout_id):
        raise InputError(f"--rollout {shown(rollout_id)}: not a rollout id (such as 20261202T015500Z-1a2b3c; "
                         f"`ddtree-ops rollouts` lists them)")
    hits = [r for r in list_rollouts(records) if r.id == rollout_id]
    wanted = [r for r in hits if r.kind == kind]
    if wanted:
        return wanted[0]
    if hits:
        raise InputError(f"rollout {rollout_id} is a {hits[0].kind}, not a {kind}")
    unread = [r.host for r in records if r.history is None]
    also = f" (not read: {', '.join(unread)})" if unread else ""
    raise InputError(f"rollout {rollout_id}: no selected host records it{also}; `ddtree-ops rollouts` lists them")


# ---------------------------------------------------------------------------------------------
# rollback --rollout and promote: which targets (pure)


def touched(records: list[HostRecords], info: RolloutInfo) -> set[str]:
    """Hosts whose release of the rollout is still on their current chain (so there is something
    to undo); hosts whose history could not be read are counted in: the rollback reads them
    again under their lock, and says what it finds."""
    return {p.host for p in info.parts if p.on_chain} | {r.host for r in records if r.history is None}


def undo_selection(targets: list[Target], records: list[HostRecords],
                   info: RolloutInfo) -> tuple[list[Target], list[str]]:
    """The targets `rollback --rollout` acts on (any node touched: the whole server) and a note
    for each one it leaves alone."""
    hit = touched(records, info)
    parts = {p.host: p for p in info.parts}
    chosen, notes = [], []
    for t in targets:
        if any(h.name in hit for h in t.hosts):
            chosen.append(t)
            continue
        why = [f"{h.name}: its release {parts[h.name].releases[0]} is no longer current ({parts[h.name].outcome})"
               for h in t.hosts if h.name in parts]
        notes.append(f"{t.name}: left alone: " + ("; ".join(why) if why else f"rollout {info.id} never changed it"))
    return chosen, notes


def promote_selection(targets: list[Target], info: RolloutInfo) -> tuple[list[Target], list[str]]:
    """The targets `promote` continues the rollout on: those it has not reached yet. Refused
    (exit 2) when a host it reached is not on its release any more (its canary failed, or the
    rollout was rolled back): promoting that would spread what was taken back."""
    bad = [p for p in info.parts if p.outcome != "deployed" or not p.on_chain]
    if bad:
        p = bad[0]
        raise InputError(f"rollout {info.id}: {p.host}'s release {p.releases[0]} is {p.outcome}, not deployed; "
                         f"nothing to promote (deploy again)")
    reached = set(info.hosts)
    rest = [t for t in targets if not any(h.name in reached for h in t.hosts)]
    notes = [f"{t.name}: already on rollout {info.id}" for t in targets if t not in rest]
    return rest, notes


@dataclass(frozen=True)
class SourceGiven:
    """What the operator passed to `promote`: a verified bundle's id, or a patch set's digest."""

    bundle_id: str | None
    patchset_digest: str
    label: str


def check_same_source(info: RolloutInfo, given: SourceGiven) -> None:
    """`promote` ships exactly what the canary got: the same bundle (by id), or the same patch set
    (by digest) when the rollout used no bundle. InputError naming both otherwise."""
    if info.bundle:
        if given.bundle_id != info.bundle:
            got = f"bundle {given.bundle_id}" if given.bundle_id else f"--patchset {given.label}"
            raise InputError(f"rollout {info.id} deployed bundle {info.bundle}; {got} is not it: give --bundle with "
                             f"that bundle")
        return
    if given.bundle_id:
        raise InputError(f"rollout {info.id} deployed patch set {info.patchset} without a bundle; give --patchset, "
                         f"not --bundle")
    if given.patchset_digest != info.patchset_digest:
        raise InputError(f"rollout {info.id} deployed patch set {info.patchset} (digest "
                         f"{str(info.patchset_digest)[:16]}…); --patchset {given.label} differs (digest "
                         f"{given.patchset_digest[:16]}…)")
