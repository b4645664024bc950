"""Webhooks told of a rollout's milestones (the inventory's `notify:`, config/notify_settings.py):
a JSON POST when it starts, when its canary's verdict is in, when it aborts, when it ends.

Best effort, and bounded: a webhook that refuses, fails or hangs costs the rollout at most its
`timeout_s` per event (the request is bounded end to end by host/bounded_http.py, and the wait on
it by a join with the same limit), never its result or exit code; a warning line names it, by
scheme and host only (a chat hook's URL path is its secret). An event goes to all its webhooks
at once and is done (or given up) before the next one is sent, so each webhook sees the events
in order: start, canary, abort, finish.
"""

from __future__ import annotations

import datetime
import getpass
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import httpx

from ..config.notify_settings import NotifyEvent, Webhook
from ..host.bounded_http import BoundedTransport, network_transport
from ..host.tls import tls_context
from ..runbook.results import HostResult
from .rollout import Milestones, RolloutResult, Target, deliver_interrupt

MESSAGE_MAX = 300  # characters of a host's message in a payload
JOIN_SLACK_S = 1.0  # beyond a webhook's own timeout, for the thread to hand back what it got


def operator() -> str:
    """user@machine: who ran the rollout."""
    try:
        user = getpass.getuser()
    except Exception:  # no login name: a container's uid without a passwd entry
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()}"


@dataclass(frozen=True)
class RolloutInfo:
    """What every event says about the rollout."""

    kind: str  # deploy | rollback
    rollout_id: str | None
    patchset: str | None = None
    bundle: str | None = None
    by: str = ""


@dataclass(frozen=True)
class _Ready:
    """A webhook with its secret headers read from the environment."""

    hook: Webhook
    headers: dict[str, str]


def host_rows(results: list[HostResult]) -> list[dict[str, Any]]:
    return [{"host": r.host, "outcome": str(r.outcome), "exit_code": r.exit_code, "release": r.release,
             "message": (r.message or "")[:MESSAGE_MAX] or None} for r in results]


def summary(info: RolloutInfo, event: NotifyEvent, fields: Mapping[str, Any]) -> str:
    """One line for chat webhooks that show a `text` field."""
    what = f"ddtree-ops {info.kind} {info.rollout_id or ''}".rstrip()
    source = info.bundle and f"bundle {info.bundle}" or info.patchset
    head = f"{what} ({source}) by {info.by}" if source else f"{what} by {info.by}"
    if event is NotifyEvent.START:
        return f"{head}: started on {', '.join(h['host'] for h in fields['hosts'])}"
    if event is NotifyEvent.CANARY:
        return f"{head}: canary {'passed' if fields['passed'] else 'failed'}"
    if event is NotifyEvent.ABORT:
        return f"{head}: aborted: {fields['reason']}"
    counts: dict[str, int] = {}
    for h in fields["hosts"]:
        counts[h["outcome"]] = counts.get(h["outcome"], 0) + 1
    return f"{head}: finished, exit {fields['exit_code']} ({', '.join(f'{n} {o}' for o, n in counts.items())})"


class Notifier(Milestones):
    """Sends each milestone of one rollout to the webhooks that asked for it."""

    def __init__(self, hooks: tuple[Webhook, ...], info: RolloutInfo, warn: Callable[[str], None], *,
                 environ: Mapping[str, str] | None = None, transport: httpx.BaseTransport | None = None,
                 clock: Callable[[], datetime.datetime] | None = None):
        self.info, self.warn, self._transport = info, warn, transport
        self._clock = clock or (lambda: datetime.datetime.now(datetime.timezone.utc))
        env = os.environ if environ is None else environ
        self.ready = [r for r in (self._prepare(h, env) for h in hooks) if r is not None]

    def _prepare(self, hook: Webhook, env: Mapping[str, str]) -> _Ready | None:
        headers = {}
        for name, var in hook.headers_env:
            value = env.get(var)
            if not value:
                self.warn(f"webhook {hook.origin}: header {name}: ${var} is not set; this webhook is not told")
                return None
            if any(ord(c) < 32 or ord(c) == 127 for c in value):
                self.warn(f"webhook {hook.origin}: header {name}: ${var} holds a control character; "
                          f"this webhook is not told")
                return None
            headers[name] = value
        return _Ready(hook, headers)

    # -- the milestones ----------------------------------------------------------------------------
    def started(self, hosts: list[str], batches: list[list[str]]) -> None:
        self._send(NotifyEvent.START, hosts=[{"host": h, "outcome": None, "exit_code": None, "release": None,
                                              "message": None} for h in hosts], batches=batches)

    def canary(self, passed: bool, results: list[HostResult]) -> None:
        self._send(NotifyEvent.CANARY, passed=passed, hosts=host_rows(results))

    def aborted(self, reason: str) -> None:
        self._send(NotifyEvent.ABORT, reason=reason)

    def finished(self, result: RolloutResult) -> None:
        self._send(NotifyEvent.FINISH, hosts=host_rows(result.results), exit_code=result.exit_code,
                   aborted=result.aborted, reason=result.abort_reason, seconds=round(result.seconds, 3),
                   stopped_after_canary=getattr(result, "stopped_after_canary", False))

    def send(self, event: NotifyEvent, **fields: Any) -> None:
        """One milestone with fields of the caller's (a rollout run by an orchestrator)."""
        self._send(event, **fields)

    # -- sending -----------------------------------------------------------------------------------
    def payload(self, event: NotifyEvent, **fields: Any) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "event": event.value, "rollout": self.info.rollout_id, "kind": self.info.kind,
            "patchset": self.info.patchset, "bundle": self.info.bundle, "by": self.info.by,
            "time": self._clock().strftime("%Y-%m-%dT%H:%M:%SZ"), "hosts": [], "exit_code": None,
            "passed": None, "aborted": None, "reason": None, "batches": None, "seconds": None,
            "stopped_after_canary": None,
        }
        doc.update(fields)
        doc["text"] = summary(self.info, event, doc)
        return doc

    def _send(self, event: NotifyEvent, **fields: Any) -> None:
        """Post `event` to its webhooks in parallel; back when each answered or ran out of time."""
        targets = [r for r in self.ready if event in r.hook.events]
        if not targets:
            return
        try:
            doc = self.payload(event, **fields)
        except Exception as e:  # a payload bug must not cost the rollout anything
            self.warn(f"webhooks: the {event.value} event could not be built: {type(e).__name__}: {e}")
            return
        threads = []
        for r in targets:
            t = threading.Thread(target=self._post, args=(r, event, doc), daemon=True,
                                 name=f"ddtree-ops-notify {r.hook.origin}")
            t.start()
            threads.append((t, r))
        try:
            for t, r in threads:
                t.join(r.hook.timeout_s + JOIN_SLACK_S)
                if t.is_alive():  # e.g. a name lookup, which no socket timeout bounds: left behind
                    self.warn(f"webhook {r.hook.origin}: no answer to the {event.value} event within "
                              f"{r.hook.timeout_s:g} s; the rollout goes on")
        except KeyboardInterrupt as e:
            # Ctrl-C while waiting on a webhook ends the wait. During the rollout the interrupt is
            # the rollout's (it stops its hosts, as anywhere else); after its end it only ends the
            # wait: the finished rollout's summary and exit code must not be lost to a slow webhook.
            self.warn(f"interrupted: no longer waiting for the webhooks' answer to the {event.value} event")
            if event is not NotifyEvent.FINISH and not deliver_interrupt(e):
                raise

    def _post(self, r: _Ready, event: NotifyEvent, doc: dict[str, Any]) -> None:
        hook = r.hook
        try:
            inner = self._transport if self._transport is not None else network_transport(tls_context)
            with httpx.Client(transport=BoundedTransport(inner), timeout=hook.timeout_s, follow_redirects=False,
                              trust_env=False) as client:
                # The answer's status is all that counts: its body is never read (whatever its size).
                with client.stream("POST", hook.url, json=doc,
                                   headers={"User-Agent": _user_agent(), **r.headers}) as resp:
                    status = resp.status_code
            if status >= 300:
                self.warn(f"webhook {hook.origin}: the {event.value} event got HTTP {status}; "
                          f"the rollout goes on")
        except Exception as e:  # best effort: any failure is a warning line, never the rollout's
            self.warn(f"webhook {hook.origin}: the {event.value} event was not delivered "
                      f"({_cause(e, hook)}); the rollout goes on")


def _cause(e: Exception, hook: Webhook) -> str:
    """Why a POST failed, without the URL's path (a chat hook's secret)."""
    reason = getattr(e, "reason", "") or str(e) or type(e).__name__
    return f"{type(e).__name__}: {reason}".replace(hook.url, hook.origin)[:200]


def _user_agent() -> str:
    from importlib import metadata  # imported when a webhook is posted, not at every start

    try:
        return f"ddtree-ops/{metadata.version('ddtree-ops')}"
    except metadata.PackageNotFoundError:
        return "ddtree-ops"


def notifier_for(targets: list[Target], info: RolloutInfo, warn: Callable[[str], None], **kw: Any) -> Notifier | None:
    """The notifier of a rollout over `targets`: every distinct webhook of their hosts, each once;
    None when none has any."""
    hooks = tuple(dict.fromkeys(w for t in targets for h in t.hosts for w in h.notify))
    return Notifier(hooks, info, warn, **kw) if hooks else None


def rollout_notifier(targets: list[Target], kind: str, opts: Any, warn: Callable[[str], None], *,
                     patchset: str | None = None, bundle: str | None = None) -> Notifier | None:
    """The notifier of a `deploy` or `rollback` run with DeployOptions `opts` (its rollout id)."""
    info = RolloutInfo(kind, getattr(opts, "rollout_id", None), patchset, bundle, operator())
    return notifier_for(targets, info, warn)
