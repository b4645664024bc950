"""The rollout policy deploy and rollback share: how many targets may be out of service at once.

`max_unavailable` (the inventory's all/group vars, or `--max-unavailable`; the flag wins) is a
number of targets or a share of the selected ones ("25%": rounded down, at least 1); default 1.
It bounds every batch (a larger `--batch` is cut to it, the notes say so), so the default deploy
and the default rollback are rolling, one target at a time.

With a router in front of the targets, before each batch the router's workers are read (`Pool`)
and `admit` decides which of the batch may leave now: taking a batch out must not leave fewer
ready workers than the pool minus max_unavailable, nor none (unless max_unavailable is 100%: the
operator accepts an empty router). A worker already out of service (not ready, or not
registered) costs nothing to take out. When the pool is already short (a worker that is not
ours is down) the batch shrinks and the rest waits for the next one; when nothing may go, the
rollout stops with the reason (errors.RouterPoolShort).

Pure: the pools are read by the caller (fleet/routing.py), everything here is tested from data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Protocol, Sequence

from ..config.inventory import Host
from ..config.router_settings import normalize_url
from ..config.schema import CountOrShare
from ..errors import InputError

if TYPE_CHECKING:
    from ..gates.router import WorkerEntry


class Target(Protocol):
    """What the policy reads of a rollout's target (rollout.Target), named here so that this
    module, which rollout.py imports, does not import rollout.py back."""

    name: str
    hosts: tuple[Host, ...]

DEFAULT_MAX_UNAVAILABLE = CountOrShare(count=1)


@dataclass(frozen=True)
class RolloutPolicy:
    """How many of the selected targets may be out of service at once."""

    max_unavailable: int  # resolved against the selection, >= 1
    empty_ok: bool = False  # 100%: the operator accepts a router left with no ready worker
    said: str = "max_unavailable 1 (the default)"  # where it came from, for messages

    def bound(self, size: int) -> int:
        return min(size, self.max_unavailable)


def _inventory_value(targets: Sequence[Target]) -> tuple[CountOrShare | None, str]:
    """The inventory's max_unavailable for the selection: the strictest one its targets carry
    (a multi-node server's is its node 0's), and where it came from."""
    values = {t.name: t.hosts[0].max_unavailable for t in targets if t.hosts[0].max_unavailable is not None}
    if not values:
        return None, "the default"
    total = len(targets)
    name, value = min(values.items(), key=lambda kv: kv[1].of(total))
    if len({str(v) for v in values.values()}) > 1:
        return value, f"the inventory; the strictest of the selection's, {name}'s"
    return value, "the inventory"


def rollout_policy(targets: Sequence[Target], flag: CountOrShare | None = None, *, canary: int = 0,
                   batch_size: int | None = None, batch_flag: str | None = None) -> tuple[RolloutPolicy, list[str]]:
    """The policy for this selection and the notes the operator sees. `batch_size`: the batch the
    operator asked for (--batch, resolved); a larger one than max_unavailable is cut, with a note.
    InputError when the canary alone would take more targets out at once than allowed."""
    total = len(targets)
    if flag is not None:
        value, where = flag, "--max-unavailable"
    else:
        found, where = _inventory_value(targets)
        value = found or DEFAULT_MAX_UNAVAILABLE
    n = max(1, value.of(total))
    name = "--max-unavailable" if flag is not None else "max_unavailable"
    share = f", {n} of {total} targets" if value.percent is not None else ""
    policy = RolloutPolicy(n, value.everything, f"{name} {value}{share}" +
                           ("" if flag is not None else f" ({where})"))
    c = min(canary, total)
    if c > n:
        raise InputError(f"--canary {canary} would take {c} targets out of service at once, more than "
                         f"{policy.said}: give --max-unavailable {c} or a smaller --canary")
    notes = []
    if batch_size is not None and batch_flag is not None and batch_size > n:
        notes.append(f"--batch {batch_flag} is cut to batches of {n}: {policy.said}")
    return policy, notes


# ---------------------------------------------------------------------------------------------
# the router's pool, before each batch


@dataclass(frozen=True)
class Pool:
    """One router's workers as read before a batch (normalised URLs)."""

    router: str
    workers: frozenset[str]  # in the pool: listed and not draining
    ready: frozenset[str]  # routed to now: ready and healthy

    @property
    def short(self) -> frozenset[str]:
        return self.workers - self.ready


def pool_of(router: str, entries: Iterable[WorkerEntry]) -> Pool:
    """The pool from the router's listing. A draining entry is on its way out and counts for
    neither; a worker the router does not list is not in its pool (taking it out costs nothing)."""
    entries = list(entries)
    listed = {normalize_url(w.url) for w in entries if not w.draining}
    ready = {normalize_url(w.url) for w in entries if w.routable}
    return Pool(normalize_url(router), frozenset(listed), frozenset(ready))


def routes(t: Target) -> tuple[tuple[str, str], ...]:
    """(router URL, worker URL) of a target, normalised: the node the router sends requests to."""
    r = t.hosts[0].router
    return ((normalize_url(r.url), normalize_url(r.worker)),) if r is not None else ()


@dataclass(frozen=True)
class Admission:
    """Which targets of a batch may leave service now."""

    go: tuple[str, ...]
    wait: tuple[str, ...] = ()  # for the next batch
    why: str | None = None  # why the first of `wait` waits

    @property
    def refused(self) -> bool:
        return not self.go and bool(self.wait)


def admit(batch: Sequence[Target], pools: Mapping[str, Pool], policy: RolloutPolicy,
          names: Mapping[str, str] | None = None) -> Admission:
    """Targets of `batch`, in order, that may go together: each one's router must keep at least
    (pool - max_unavailable) ready workers, and one (unless the policy accepts none), after the
    ones admitted before it. `names`: worker URL → target name, for the messages."""
    taken: dict[str, frozenset[str]] = {r: frozenset() for r in pools}
    go: list[str] = []
    wait: list[str] = []
    why: str | None = None
    for t in batch:
        trial = {r: taken[r] | {w} for r, w in routes(t) if r in pools}
        block = next((b for r, took in trial.items() if (b := _blocked(pools[r], took, t.name, policy, names))), None)
        if block is None:
            go.append(t.name)
            taken.update(trial)
        else:
            wait.append(t.name)
            why = why or block
    return Admission(tuple(go), tuple(wait), why)


def _blocked(pool: Pool, took: frozenset[str], name: str, policy: RolloutPolicy,
             names: Mapping[str, str] | None) -> str | None:
    """Why taking the workers `took` out of `pool` is not allowed, or None."""
    leaving = took & pool.ready
    if not leaving:
        return None
    left = len(pool.ready - leaving)
    floor = len(pool.workers) - policy.max_unavailable
    if left >= max(floor, 0 if policy.empty_ok else 1):
        return None
    down = sorted((names or {}).get(u, u) for u in pool.short)
    shown_down = ", ".join(down[:3]) + (f" and {len(down) - 3} more" if len(down) > 3 else "")
    state = f"{len(pool.ready)} of {len(pool.workers)} workers ready" + (f" (not: {shown_down})" if down else "")
    rule = (f"fewer than {floor} (its pool of {len(pool.workers)} less {policy.said})" if floor >= 1 else
            "none, and the router is never emptied unless max_unavailable is 100%")
    return f"router {pool.router} has {state}: taking {name} out would leave {left}, {rule}"
