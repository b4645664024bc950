"""A rollout over the selected targets: canary first, then batches, with a failure budget.

What runs on each target is an action passed in (fleet.py supplies deploy and rollback), so the
rollout's logic (batches, canary, failure budget, abort and revert) is tested with plain
functions, without hosts.

Vocabulary:

* a *target* is what is deployed as one: a single host, or a multi-node server (every host of a
  `multinode: true` group; see multinode.py). Canary and batch sizes and the failure budget count
  targets. Selecting one node of a multi-node server selects the whole server.
* the *canary* is the first `--canary N` targets (default 1), run before anything else; any
  failure there aborts the rollout.
* then the remaining targets in *batches* of `--batch N` or `--batch P%` (P% of all selected
  targets, rounded down, at least 1, as Ansible's `serial`), never larger than the policy's
  max_unavailable (policy.py: default 1 target, so a default rollout is rolling); behind a router
  a batch that would leave too few workers ready is shortened or the rollout stops before it.
  A batch's targets run in parallel on a bounded pool of `--forks` worker threads, each target
  over its own SSH connection(s).
* the *failure budget* `--max-fail P%` (default 0): after each batch, when the failed targets
  exceed P% of the targets attempted so far (strictly greater, as Ansible's
  max_fail_percentage: 2 of 4 failed with 50% is still within), no new batch starts.
* an *aborted* rollout (canary failure, budget exceeded, Ctrl-C) rolls back, by default, every
  target this run updated, so the fleet ends on one release; `keep_updated=True` opts out.
* an *interrupt* (Ctrl-C, SIGTERM, SIGHUP: cli/signals.py hands it to the rollouts under way,
  `deliver_interrupt`; a KeyboardInterrupt in the main thread counts the same) asks every target
  in flight to stop at its next event, where its runbook rolls it back, and no new batch starts.
  A target that is already rolling back (its run failed) is not interrupted, and a second
  interrupt is only noted: nothing cuts a rollback short.

Each host's result is a row; an unreachable host is a row, never a crash. The overall exit code
is the most serious one of the rows.
"""

from __future__ import annotations

import dataclasses
import math
import re
import signal
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Callable

from ..config.inventory import Host, Inventory
from ..errors import (
    EXIT_BAD_INPUT,
    EXIT_ERROR,
    EXIT_NEEDS_PERSON,
    EXIT_OK,
    EXIT_ROLLED_BACK,
    InputError,
    RouterPoolShort,
    reason,
)
from ..runbook.describe import Interrupt, interrupt_label, interrupted_by
from ..runbook.events import Event, EventSink, Failed
from ..runbook.results import SUCCESS, HostResult, Outcome, failed_result, overall_exit_code
from .canary_verdict import canary_abort_reason

if TYPE_CHECKING:
    from .policy import Admission

# ---------------------------------------------------------------------------------------------
# targets, batches and the failure budget (pure)


@dataclass(frozen=True)
class Target:
    """What is deployed as one: a host, or every node of a multi-node server (rank 0 first)."""

    name: str
    hosts: tuple[Host, ...]

    @property
    def multinode(self) -> bool:
        return len(self.hosts) > 1 or self.hosts[0].multinode


def make_targets(inv: Inventory, selected: list[Host]) -> tuple[list[Target], list[str]]:
    """Group the selection into targets, in inventory order. A partly selected multi-node server
    is taken whole (its nodes must run the same code); the notes say so."""
    notes: list[str] = []
    servers = inv.servers()
    chosen = {h.name: h for h in selected}
    targets: list[Target] = []
    seen: set[str] = set()
    for h in selected:
        if h.name in seen:
            continue
        if h.server:
            names = servers[h.server]
            missing = [n for n in names if n not in chosen]
            if missing:
                notes.append(f"{', '.join(missing)} added: node(s) of the multi-node server {h.server}, "
                             f"which is deployed as a whole")
            nodes = tuple(chosen.get(n) or inv.hosts[n] for n in names)
            targets.append(Target(h.server, nodes))
            seen.update(names)
        else:
            targets.append(Target(h.name, (h,)))
            seen.add(h.name)
    return targets, notes


_PCT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%?\s*$")


def parse_percent(spec: str | float | int, what: str = "--max-fail") -> Fraction:
    """'25%', '25' or 25 → Fraction(25). 0..100."""
    m = _PCT_RE.match(str(spec))
    if not m:
        raise InputError(f"{what} must be a percentage such as 25% (0..100), got {spec!r}")
    p = Fraction(m.group(1))
    if not 0 <= p <= 100:
        raise InputError(f"{what} must be 0..100%, got {spec!r}")
    return p


def batch_size(spec: str | int | None, total: int) -> int:
    """`--batch N` or `--batch P%` → hosts per batch. P% is of all selected targets, rounded down,
    at least 1 (Ansible's `serial`). None → everything at once."""
    if total <= 0:
        return 0
    if spec is None or str(spec).strip() == "":
        return total
    s = str(spec).strip()
    if s.endswith("%"):
        p = parse_percent(s, "--batch")
        if p <= 0:
            raise InputError(f"--batch must be > 0%, got {spec!r}")
        return max(1, min(total, math.floor(p * total / 100)))
    if not s.isdigit() or int(s) < 1:
        raise InputError(f"--batch must be a positive number of hosts or a percentage such as 25%, got {spec!r}")
    return min(total, int(s))


def plan_batches(total: int, *, canary: int = 1, batch: str | int | None = None,
                 max_unavailable: int | None = None) -> list[list[int]]:
    """Indices of the targets in each batch: the canary batch first (if canary > 0), then the rest,
    in batches never larger than `max_unavailable` (policy.py; None: no bound)."""
    if canary < 0:
        raise InputError(f"--canary must be >= 0, got {canary}")
    idx = list(range(total))
    out: list[list[int]] = []
    c = min(canary, total)
    if c:
        out.append(idx[:c])
    rest = idx[c:]
    size = batch_size(batch, total)
    if max_unavailable is not None:
        size = max(1, min(size, max_unavailable))
    for i in range(0, len(rest), max(size, 1)):
        out.append(rest[i:i + size])
    return out


def budget_exceeded(failed: int, attempted: int, max_fail_pct: Fraction | int | float) -> bool:
    """Ansible's rule: the failure percentage must EXCEED the maximum (exact arithmetic)."""
    if attempted <= 0:
        return False
    return Fraction(failed) * 100 > Fraction(max_fail_pct) * attempted


# ---------------------------------------------------------------------------------------------
# progress: what a view (live table, plain lines, nothing) is told


class Progress:
    """Callbacks from the rollout; every method may be called from worker threads."""

    def start(self, hosts: list[str], batches: list[list[str]]) -> None: ...

    def state(self, host: str, state: str) -> None: ...

    def event(self, event: Event) -> None: ...  # what a host's run did (runbook/events.py)

    def note(self, msg: str) -> None: ...

    def pause(self) -> None: ...  # while the operator answers a question (nothing to redraw over it)

    def resume(self) -> None: ...

    def stop(self) -> None: ...


class _Guarded(Progress):
    """A view that can no longer write (its terminal closed, SIGHUP's usual cause: writes fail
    with EIO) must not break the run it shows, least of all a rollback: its OSError is dropped."""

    def __init__(self, view: Progress):
        self.view = view

    def _tell(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except OSError:
            pass

    def start(self, hosts: list[str], batches: list[list[str]]) -> None:
        self._tell(self.view.start, hosts, batches)

    def state(self, host: str, state: str) -> None:
        self._tell(self.view.state, host, state)

    def event(self, event: Event) -> None:
        self._tell(self.view.event, event)

    def note(self, msg: str) -> None:
        self._tell(self.view.note, msg)

    def pause(self) -> None:
        self._tell(self.view.pause)

    def resume(self) -> None:
        self._tell(self.view.resume)

    def stop(self) -> None:
        self._tell(self.view.stop)


class Milestones:
    """A rollout's milestones, for those who follow it from outside (fleet/notify.py's webhooks):
    told from the rollout's own thread, in this order; `finished` comes after the view stopped."""

    def started(self, hosts: list[str], batches: list[list[str]]) -> None: ...

    def canary(self, passed: bool, results: list[HostResult]) -> None: ...

    def aborted(self, reason: str) -> None: ...

    def finished(self, result: RolloutResult) -> None: ...


# ---------------------------------------------------------------------------------------------
# the rollout


@dataclass
class RolloutResult:
    action: str
    results: list[HostResult]  # one per host, inventory order
    batches: list[list[str]]  # target names per batch
    aborted: bool = False
    abort_reason: str | None = None
    reverted: list[str] = field(default_factory=list)  # targets rolled back because of the abort
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    rollout_id: str | None = None  # shared by every host this run touched (fleet/rollout_id.py)
    stopped_after_canary: bool = False  # --stop-after-canary: the rest waits for `promote`

    @property
    def exit_code(self) -> int:
        return overall_exit_code(self.results)

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "rollout_id": self.rollout_id, "ok": self.exit_code == 0,
                "exit_code": self.exit_code, "stopped_after_canary": self.stopped_after_canary,
                "aborted": self.aborted, "abort_reason": self.abort_reason, "reverted": self.reverted,
                "batches": self.batches, "notes": self.notes, "seconds": round(self.seconds, 3),
                "hosts": [r.to_dict() for r in self.results]}


TargetAction = Callable[[Target, EventSink], list[HostResult]]
STOPPED_AFTER_CANARY = "--stop-after-canary: waiting for `promote`"


# What runs in this process and takes interrupts in its own time (`interrupt(e)`): the rollouts under
# way (the CLI runs one at a time) and a tune (fleet/tune.py).
_RUNNING: list[Any] = []


def deliver_interrupt(e: KeyboardInterrupt) -> bool:
    """Hand an interrupt to every rollout under way, which acts on it in its own time; False when
    none is (the caller raises it then). It runs inside a signal handler, between any two
    statements of the main thread: it only appends to a list (no lock, no output)."""
    running = list(_RUNNING)
    for r in running:
        r.interrupt(e)
    return bool(running)


class _Interrupt(Interrupt):
    """Raised inside a worker (through its reporter) when the main thread was interrupted (Ctrl-C,
    SIGTERM, SIGHUP): the same signal, for the messages."""


class Rollout:
    """Run `action` over targets: canary, batches, failure budget, abort → revert."""

    def __init__(self, targets: list[Target], action: TargetAction, *, kind: str = "deploy",
                 canary: int = 1, batch: str | int | None = None, max_fail: str | float | int = 0,
                 forks: int = 10, keep_updated: bool = False, revert: TargetAction | None = None,
                 progress: Progress | None = None, notes: list[str] | None = None,
                 rollout_id: str | None = None, stop_after_canary: bool = False,
                 milestones: Milestones | None = None, max_unavailable: int | None = None,
                 admit: Callable[[list[Target]], Admission] | None = None):
        if forks < 1:
            raise InputError(f"--forks must be >= 1, got {forks}")
        self.targets, self.action, self.kind = targets, action, kind
        self.canary, self.max_fail = canary, parse_percent(max_fail)
        self.batches = plan_batches(len(targets), canary=canary, batch=batch, max_unavailable=max_unavailable)
        # policy.py: targets out of service at once at most, and which of a batch may leave now.
        self.max_unavailable, self.admit = max_unavailable, admit
        self._held: RouterPoolShort | None = None  # the router refused the next batch
        self.forks, self.keep_updated, self.revert = forks, keep_updated, revert
        self.progress: Progress = _Guarded(progress or Progress())
        self.notes = list(notes or [])
        self.rollout_id, self.stop_after_canary = rollout_id, stop_after_canary
        self.milestones = milestones or Milestones()
        self._interrupts: list[KeyboardInterrupt] = []  # in arrival order; appended by `interrupt`
        self._told = 0  # how many of them the progress view was told about

    # -- helpers ---------------------------------------------------------------------------------
    def _reporter(self, interruptible: bool) -> EventSink:
        """The sink of one target's run. Once the rollout is interrupted, the target's next event
        raises `_Interrupt` (once per host), unless the target is rolling back already: a failed
        run reports `Failed` before its rollback, whose events must go through untouched."""
        raised: set[str] = set()
        lock = threading.Lock()
        rolling_back = threading.Event()

        def report(event: Event) -> None:
            if isinstance(event, Failed):
                rolling_back.set()
            self.progress.event(event)
            if interruptible and self._interrupts and not rolling_back.is_set():
                with lock:
                    if event.host in raised:
                        return
                    raised.add(event.host)
                raise _Interrupt(getattr(self._interrupts[0], "signum", signal.SIGINT))  # the runbook rolls back
        return report

    def _run_target(self, t: Target, action: TargetAction, interruptible: bool) -> list[HostResult]:
        if action is self.action and self._interrupts:  # queued when the interrupt came: never started
            return [self._not_started(h.name, interrupted_by(self._interrupts[0])) for h in t.hosts]
        for h in t.hosts:
            self.progress.state(h.name, "running")
        t0 = time.monotonic()
        try:
            results = action(t, self._reporter(interruptible))
        except KeyboardInterrupt as e:  # interrupted before the first change
            results = [failed_result(h.name, e, time.monotonic() - t0, exit_code=EXIT_ERROR,
                                     message=f"interrupted ({interrupt_label(e)}) before any change")
                       for h in t.hosts]
        except Exception as e:  # a bug must be a row too, not a crash of the whole rollout
            results = [failed_result(h.name, e, time.monotonic() - t0, outcome=Outcome.FAILED, exit_code=EXIT_ERROR,
                                     message=reason(e)) for h in t.hosts]
        if action is self.action and self.kind == "rollback" and self._interrupts:
            results = [_ran_to_its_end(r, self._interrupts[0]) for r in results]
        for r in results:
            self.progress.state(r.host, r.outcome)
        return results

    def _run_batch(self, pool: ThreadPoolExecutor, batch: list[Target], action: TargetAction,
                   interruptible: bool) -> dict[str, list[HostResult]]:
        futures: dict[Future, Target] = {pool.submit(self._run_target, t, action, interruptible): t for t in batch}
        done: dict[str, list[HostResult]] = {}
        pending = set(futures)
        while pending:
            try:
                finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            except KeyboardInterrupt as e:  # one no signal handler handed over (a library caller's)
                self.interrupt(e)
                continue
            finally:
                self._tell_interrupts()
            for f in finished:
                done[futures[f].name] = f.result()
        return done

    def interrupt(self, e: KeyboardInterrupt) -> None:
        """Record an interrupt (any thread, a signal handler included: one atomic append). The
        first one stops every target in flight (which rolls back) and the rollout; later ones are
        only noted, so a rollback under way runs to its end."""
        self._interrupts.append(e)

    def _tell_interrupts(self) -> None:
        """Tell the view about the interrupts recorded since the last time (main thread)."""
        while self._told < len(self._interrupts):
            label = interrupt_label(self._interrupts[self._told])
            doing = "finish their rollback" if self.kind == "rollback" else "are rolled back"
            self.progress.note(f"interrupted ({label}): stopping; hosts in flight {doing}" if self._told == 0
                               else f"interrupted again ({label}): ignored; hosts in flight finish rolling back")
            self._told += 1

    def _not_started(self, host: str, reason: str) -> HostResult:
        """A host the rollout never started on. Not a success when an interrupt stopped the
        rollout (exit 1, as "interrupted before any change"): an interrupted rollout never exits 0
        unless every host was done when it came. Nor when the router held it back (RouterPoolShort:
        refused, exit 2, when nothing had changed; exit 1 after earlier batches)."""
        if self._held is not None:
            return HostResult(host, Outcome.REFUSED if self._held.exit_code == EXIT_BAD_INPUT else Outcome.SKIPPED,
                              self._held.exit_code, message=f"not started: {reason}")
        return HostResult(host, Outcome.SKIPPED, EXIT_ERROR if self._interrupts else EXIT_OK,
                          message=f"not started: {reason}")

    def _admitted(self, queue: list[list[int]], bi: int, *, changed: bool) -> list[Target] | None:
        """The targets of batch `bi` that may leave service now (`admit`, policy.py); those that
        must wait get a batch of their own, next in `queue`. None when none may go: `_held` says why."""
        batch = [self.targets[i] for i in queue[bi]]
        if self.admit is None or self._interrupts:
            return batch
        names = ", ".join(t.name for t in batch)
        after = f"before {names}" + ("" if changed else "; nothing was changed")
        try:
            adm = self.admit(batch)
        except Exception as e:  # an unreadable router: nothing is taken out of it on a guess
            self._held = RouterPoolShort(f"the router's workers could not be read: {reason(e)}; stopped {after}",
                                         changed=changed)
            return None
        if adm.refused:
            self._held = RouterPoolShort(f"{adm.why}; stopped {after}", changed=changed)
            return None
        if adm.wait:
            index = {t.name: i for i, t in enumerate(self.targets)}
            queue[bi] = [index[n] for n in adm.go]
            queue.insert(bi + 1, [index[n] for n in adm.wait])
            self.progress.note(f"{', '.join(adm.wait)} wait for the next batch: {adm.why}")
        return [self.targets[i] for i in queue[bi]]

    def _names(self, queue: list[list[int]]) -> list[list[str]]:
        return [[self.targets[i].name for i in b] for b in queue]

    def _failed(self, results: list[HostResult]) -> bool:
        return any(r.outcome not in SUCCESS[self.kind] for r in results)

    # -- run -------------------------------------------------------------------------------------
    def run(self) -> RolloutResult:
        t_start = time.monotonic()
        names = [[self.targets[i].name for i in b] for b in self.batches]
        all_hosts = [h.name for t in self.targets for h in t.hosts]
        self.progress.start(all_hosts, names)
        self.milestones.started(all_hosts, names)
        for n in self.notes:
            self.progress.note(n)
        by_target: dict[str, list[HostResult]] = {}
        canary_rows: list[HostResult] = []
        aborted, reason = False, None
        attempted = failed = 0
        queue = [list(b) for b in self.batches]  # a batch the router shortens leaves the rest to a next one
        _RUNNING.append(self)  # from here on an interrupt is recorded, never raised in this thread
        try:
            with ThreadPoolExecutor(max_workers=self.forks, thread_name_prefix="ddtree-ops") as pool:
                bi = -1
                while bi + 1 < len(queue):
                    bi += 1
                    batch = self._admitted(queue, bi, changed=bool(by_target))
                    if batch is None:
                        aborted, reason = True, str(self._held)
                        self.progress.note(f"rollout stopped: {reason}")
                        self.milestones.aborted(reason)
                        break
                    is_canary = queue[bi][0] < self.canary
                    label = "canary" if is_canary else f"batch {bi + 1 - sum(b[0] < self.canary for b in queue[:bi])}"
                    self.progress.note(f"{label}: {', '.join(t.name for t in batch)}")
                    # A rollback is never cut short (half done, it would need a person): in flight, it
                    # runs to its end; an interrupt only stops what has not started.
                    done = self._run_batch(pool, batch, self.action, self.kind != "rollback")
                    by_target.update(done)
                    batch_failed = sum(1 for t in batch if self._failed(done[t.name]))
                    attempted += len(batch)
                    failed += batch_failed
                    if self._interrupts:
                        aborted, reason = True, interrupted_by(self._interrupts[0])
                    elif is_canary and batch_failed:
                        aborted, reason = True, canary_abort_reason([r for t in batch for r in done[t.name]],
                                                                    batch_failed, len(batch))
                    elif budget_exceeded(failed, attempted, self.max_fail):
                        aborted = True
                        reason = (f"failure budget exceeded: {failed} of {attempted} failed "
                                  f"({float(Fraction(failed * 100, attempted)):.0f}% > "
                                  f"max-fail {float(self.max_fail):g}%)")
                    if is_canary:  # the verdict once the whole canary ran (it may span batches), or failed
                        canary_rows += [r for t in batch for r in done[t.name]]
                        if aborted or not any(i < self.canary for b in queue[bi + 1:] for i in b):
                            self.milestones.canary(not self._failed(canary_rows), canary_rows)
                    if aborted:
                        self.progress.note(f"rollout aborted: {reason}")
                        self.milestones.aborted(reason)
                        break
                    if is_canary and self.stop_after_canary and not any(i < self.canary for b in queue[bi + 1:]
                                                                         for i in b):
                        reason = STOPPED_AFTER_CANARY  # the whole canary is done (it may span batches)
                        break
                reverted: list[str] = []
                if aborted and self._held is not None:
                    self.progress.note("hosts this run changed stay as they are: rolling them back would take "
                                       "more workers out of the router")
                elif aborted and self.revert is not None and not self.keep_updated:
                    updated = [t for t in self.targets if t.name in by_target
                               and any(r.outcome == Outcome.DEPLOYED for r in by_target[t.name])]
                    if updated:
                        self.progress.note(f"rolling back what this run updated: {', '.join(t.name for t in updated)}")
                        back: dict[str, list[HostResult]] = {}
                        step = self.max_unavailable or len(updated)  # never more out at once than a batch
                        for i in range(0, len(updated), step):
                            back.update(self._run_batch(pool, updated[i:i + step], self.revert, False))
                        for t in updated:
                            by_target[t.name] = _merge_revert(by_target[t.name], back[t.name])
                            if any(r.outcome == Outcome.REVERT_REFUSED for r in by_target[t.name]):
                                self.progress.note(f"{t.name}: not rolled back (its rollback refused, nothing "
                                                   f"changed): it stays on the new release")
                            else:
                                reverted.append(t.name)
                elif aborted and self.keep_updated:
                    self.progress.note("--keep-updated: hosts this run updated stay on the new release")
        finally:
            _RUNNING.remove(self)
            self._tell_interrupts()
            self.progress.stop()
        results: list[HostResult] = []
        for t in self.targets:
            if t.name in by_target:
                results.extend(by_target[t.name])
            else:
                results.extend(self._not_started(h.name, reason or "aborted") for h in t.hosts)
        result = RolloutResult(self.kind, results, self._names(queue), aborted, reason if aborted else None,
                               reverted, self.notes,
                               time.monotonic() - t_start, self.rollout_id,
                               reason == STOPPED_AFTER_CANARY and not aborted)
        self.milestones.finished(result)
        return result


def _ran_to_its_end(row: HostResult, e: KeyboardInterrupt) -> HostResult:
    """A `rollback` interrupted while it ran on this host, and finished: the host is on its
    previous release, healthy, and the run was interrupted: exit 3, as an interrupted deploy."""
    if row.outcome != Outcome.ROLLED_BACK:
        return row
    return dataclasses.replace(row, outcome=Outcome.INTERRUPTED, exit_code=EXIT_ROLLED_BACK,
                               message=f"{interrupted_by(e)} during the rollback, which ran to its end: {row.message}")


def _merge_revert(deployed: list[HostResult], back: list[HostResult]) -> list[HostResult]:
    """A host this run updated and then rolled back because the rollout was aborted."""
    by_host = {r.host: r for r in back}
    out = []
    for d in deployed:
        b = by_host.get(d.host)
        if b is None or d.outcome != Outcome.DEPLOYED:
            out.append(d)
            continue
        if b.outcome == Outcome.ROLLED_BACK:
            out.append(HostResult(d.host, Outcome.REVERTED, EXIT_ROLLED_BACK, release=d.release,
                                  message=f"deployed {d.release}, then rolled back because the rollout was aborted; "
                                          + (b.message or ""),
                                  steps=d.steps + b.steps, seconds=d.seconds + b.seconds))
        elif b.outcome == Outcome.REFUSED:
            # The rollback refused before it changed anything (exit 2: drift under the release, a
            # pruned backup): the host is as this run deployed it, healthy at its gate. Not 4,
            # nothing is broken; not 2 or 3, the deploy did change it: 1, as a rollout stopped
            # with its done hosts on the new release.
            out.append(HostResult(d.host, Outcome.REVERT_REFUSED, EXIT_ERROR, release=d.release,
                                  failed_step="abort rollback",
                                  message=f"deployed {d.release}; NOT rolled back after the abort, the rollback "
                                          f"refused and changed nothing: {b.message}. The host stays on "
                                          f"{d.release}, which passed its health gate",
                                  steps=d.steps + b.steps, seconds=d.seconds + b.seconds))
        else:
            out.append(HostResult(d.host, Outcome.REVERT_FAILED, EXIT_NEEDS_PERSON, release=d.release,
                                  failed_step="abort rollback",
                                  message=f"deployed {d.release}; rolling it back after the abort failed: {b.message}",
                                  log=b.log, steps=d.steps + b.steps, seconds=d.seconds + b.seconds))
    return out
