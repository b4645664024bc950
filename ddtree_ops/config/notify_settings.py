"""`notify:` in the inventory: webhooks told, as a JSON POST, when a rollout starts, when its
canary's verdict is in, when it aborts and when it ends (fleet/notify.py sends them).

    all:
      vars:
        notify:
          - url: https://chat.example.com/hooks/deploys
            events: [canary, abort, finish]     # default: all four
            timeout_s: 5                        # the whole request, connect to last byte
            headers_env: {Authorization: DEPLOY_HOOK_AUTH}   # value read from $DEPLOY_HOOK_AUTH

A header's value comes from the operator's environment, never from the file: an inventory is
committed and copied, a secret in it leaks. For the same reason a URL with a user name or a
password in it is refused. Like any var, `notify` in a group or host replaces the one above it;
a rollout tells every webhook of the hosts it selects, each once.
"""

from __future__ import annotations

import enum
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import shown
from .schema import Check, Field, Invalid, env_name, mapping, number_range


class NotifyEvent(str, enum.Enum):
    START = "start"
    CANARY = "canary"
    ABORT = "abort"
    FINISH = "finish"

    def __str__(self) -> str:
        return self.value


ALL_EVENTS = tuple(NotifyEvent)
TIMEOUT_S = 5.0
TIMEOUT_MAX_S = 60.0  # each event waits on its webhooks at most this long: the rollout waits too
WEBHOOKS_MAX = 20
# RFC 9110 token characters; no header a client sets itself (Host, Content-Length, ...).
_HEADER_RE = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$")
_RESERVED_HEADERS = {"host", "content-length", "content-type", "transfer-encoding", "connection"}


@dataclass(frozen=True)
class Webhook:
    url: str
    events: tuple[NotifyEvent, ...] = ALL_EVENTS
    timeout_s: float = TIMEOUT_S
    headers_env: tuple[tuple[str, str], ...] = ()  # (header, environment variable holding its value)

    @property
    def origin(self) -> str:
        """scheme://host[:port]: how messages name the webhook (a chat hook's path is its secret)."""
        parts = urllib.parse.urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}"


def webhook_url(value: Any, done: Mapping[str, Any]) -> str:
    """An absolute http(s) URL with a host, without credentials, spaces or control characters."""
    if not isinstance(value, str) or not value:
        raise Invalid(f"must be an http(s) URL such as https://hooks.example.com/deploys, got {shown(value)}")
    if any(ord(c) <= 32 or ord(c) == 127 for c in value):
        raise Invalid(f"must not contain spaces or control characters: {shown(value)}")
    try:
        parts = urllib.parse.urlsplit(value)
        parts.port  # noqa: B018 (a port out of range raises here)
    except ValueError as e:
        raise Invalid(f"is not a valid URL ({e}): {shown(value)}") from None
    if parts.scheme not in ("http", "https"):
        raise Invalid(f"must use http or https, got {shown(parts.scheme or value)}")
    if parts.username is not None or parts.password is not None:
        raise Invalid("must not carry a user name or password (they would sit in the inventory and in logs): "
                      "send credentials as a header with headers_env")
    if not parts.hostname:
        raise Invalid(f"has no host: {shown(value)}")
    return value


def _events(value: Any, done: Mapping[str, Any]) -> tuple[NotifyEvent, ...]:
    values = [e.value for e in ALL_EVENTS]
    allowed = ", ".join(values)
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names:
        raise Invalid(f"must be a non-empty list of {allowed}, got {shown(value)}")
    out: list[NotifyEvent] = []
    for n in names:
        if not isinstance(n, str) or n not in values:
            raise Invalid(f"unknown event {shown(n)}; allowed: {allowed}")
        if NotifyEvent(n) not in out:
            out.append(NotifyEvent(n))
    return tuple(e for e in ALL_EVENTS if e in out)


def _headers_env(value: Any, done: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise Invalid(f"must be a mapping Header-Name: ENVIRONMENT_VARIABLE, got {shown(value)}")
    var = env_name("the environment variable holding the header's value")
    out = []
    for header, env in value.items():
        if not isinstance(header, str) or not _HEADER_RE.match(header):
            raise Invalid(f"header name {shown(header)} is not a valid HTTP header name")
        if header.lower() in _RESERVED_HEADERS:
            raise Invalid(f"header {header} is set by the tool itself")
        try:
            out.append((header, var(env, done)))
        except Invalid as e:
            raise Invalid(f"{header}: {e.problem}") from None
    return tuple(out)


WEBHOOK_FIELDS: tuple[Field, ...] = (
    Field("url", webhook_url, required="an http(s) URL"),
    Field("events", _events, ALL_EVENTS),
    Field("timeout_s", number_range(0.1, TIMEOUT_MAX_S), TIMEOUT_S),
    Field("headers_env", _headers_env, {}),
)


def notify_field() -> Check:
    """The inventory's `notify`: a list of webhooks (null or [] for none)."""

    def check(value: Any, done: Mapping[str, Any]) -> tuple[Webhook, ...]:
        hooks = [] if value is None else value
        if not isinstance(hooks, (list, tuple)):
            raise Invalid(f"must be a list of webhooks ({{url: ..., events: [...]}}), got {shown(value)}")
        if len(hooks) > WEBHOOKS_MAX:
            raise Invalid(f"at most {WEBHOOKS_MAX} webhooks, got {len(hooks)}")
        out = []
        for i, raw in enumerate(hooks):
            try:
                out.append(Webhook(**mapping(WEBHOOK_FIELDS, raw)))
            except Invalid as e:
                e.field = f"[{i}]" + (f".{e.field}" if e.field else "")
                raise
        return tuple(out)
    return check
