"""`ddtree-ops logs`: the deployed unit's journal across hosts, read through each host's agent.

The agent runs `journalctl` as an argv (no shell, so no value is ever parsed by one); `--since`
is checked here against a small safe subset of what journalctl accepts and passed in a canonical
spelling as `--since=VALUE`, so it can never be read as another option. Secrets are scrubbed twice:
on the host (the values in the host's secrets_config and environment_file never leave it) and
here (the API key from the operator's environment, secret flags and fields). Output is bounded:
at most MAX_LINES lines per read, each cut at MAX_LINE_CHARS.

Following (`-f`) polls each host with `--after-cursor` in its own thread: a host lost while
following ends its own thread with one line, the others go on, and a stop event ends them all.
"""

from __future__ import annotations

import datetime
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Protocol

from ..config.inventory import Host
from ..config.redaction import SECRET_NAME_WORDS, scrub
from ..config.secrets import known_secrets
from ..errors import DdtreeOpsError, InputError, RemoteCommandError
from ..host.agent.protocol import Run, RunResult
from ..host.channel import ask_reply
from ..host.session import HostSession

DEFAULT_LINES = 100
MAX_LINES = 2000
MAX_LINE_CHARS = 2000
MAX_CURSOR_CHARS = 512
CURSOR_PREFIX = "-- cursor: "
JOURNAL_TIMEOUT_S = 60.0
FOLLOW_INTERVAL_S = 1.0

Opener = Callable[[Host], HostSession]


# -- what the operator asks for (checked before any connection) ---------------------------------

_ABSOLUTE = re.compile(r"^(\d{4}-\d{2}-\d{2})(?:[ T](\d{2}:\d{2})(:\d{2})?)?$")
_RELATIVE = re.compile(r"^(?:-\s*(?P<n1>\d{1,6})\s*(?P<u1>[a-z]+)|(?P<n2>\d{1,6})\s*(?P<u2>[a-z]+)\s+ago)$")
_SPAN_UNITS = {"s": "s", "sec": "s", "secs": "s", "second": "s", "seconds": "s",
               "m": "min", "min": "min", "mins": "min", "minute": "min", "minutes": "min",
               "h": "h", "hour": "h", "hours": "h", "d": "d", "day": "d", "days": "d",
               "w": "w", "week": "w", "weeks": "w"}
_WORDS = ("now", "today", "yesterday")
SINCE_FORMS = "'YYYY-MM-DD [HH:MM[:SS]]', '-1h', '-30min', '10 min ago', 'today', 'yesterday'"
_UNIT_NAME = re.compile(r"^[A-Za-z0-9:_.\\@][A-Za-z0-9:_.\\@-]{0,240}\."
                        r"(service|socket|target|timer|mount|path|scope|slice)$")


def parse_since(text: str) -> str:
    """The canonical journalctl spelling of a `--since` value from the safe subset; InputError
    (exit 2) for anything else. Pure."""
    value = " ".join(text.strip().split())
    if value in _WORDS:
        return value
    m = _ABSOLUTE.match(value)
    if m:
        date, hm, sec = m.group(1), m.group(2) or "00:00", (m.group(3) or ":00")[1:]
        try:
            stamp = datetime.datetime.strptime(f"{date} {hm}:{sec}", "%Y-%m-%d %H:%M:%S")
        except ValueError:
            raise InputError(f"--since {text!r}: not a real date and time") from None
        return stamp.strftime("%Y-%m-%d %H:%M:%S")
    m = _RELATIVE.match(value)
    if m:
        n, unit = (m.group("n1"), m.group("u1")) if m.group("n1") else (m.group("n2"), m.group("u2"))
        if unit in _SPAN_UNITS:
            return f"-{int(n)}{_SPAN_UNITS[unit]}"
    raise InputError(f"--since {text!r}: not a time ddtree-ops passes to journalctl; use one of {SINCE_FORMS}")


def check_unit_name(unit: str) -> str:
    """A systemd unit name (`sglang-k26-ddtree.service`, `x@1.service`); InputError otherwise."""
    if not _UNIT_NAME.match(unit):
        raise InputError(f"--unit {unit!r}: not a systemd unit name (such as sglang-k26-ddtree.service)")
    return unit


def check_lines(lines: int) -> int:
    if not 1 <= lines <= MAX_LINES:
        raise InputError(f"--lines {lines}: give 1..{MAX_LINES}")
    return lines


@dataclass(frozen=True)
class LogQuery:
    """What `logs` reads on every host: `unit` None is each host's own deployed unit."""

    lines: int = DEFAULT_LINES
    since: Optional[str] = None  # canonical (parse_since)
    unit: Optional[str] = None

    def unit_of(self, host: Host) -> str:
        return self.unit or host.unit


def make_query(lines: int = DEFAULT_LINES, since: Optional[str] = None, unit: Optional[str] = None) -> LogQuery:
    """The query from the operator's flags, every value checked (InputError: exit 2)."""
    return LogQuery(check_lines(lines), parse_since(since) if since is not None else None,
                    check_unit_name(unit) if unit is not None else None)


# -- one read of one host's journal ------------------------------------------------------------

def journal_argv(unit: str, lines: int, since: Optional[str] = None, after_cursor: Optional[str] = None,
                 newest_first: bool = False) -> list[str]:
    """journalctl's argv: every value joined to its option with `=`, so none can pose as an option.
    journalctl's --lines counts from where it starts: from --since that is the oldest entries, so a
    read of the newest N since T goes backwards (`newest_first`, --reverse)."""
    argv = ["journalctl", f"--unit={unit}", "--output=short-iso", "--no-pager", "--quiet", "--show-cursor",
            f"--lines={lines}"]
    if after_cursor is not None:
        argv.append(f"--after-cursor={after_cursor}")
    elif since is not None:
        argv.append(f"--since={since}")
    if newest_first:
        argv.append("--reverse")
    return argv


@dataclass
class JournalChunk:
    lines: list[str]  # oldest first
    cursor: Optional[str]  # the cursor journalctl printed: its last entry's (None: it gave none)
    entries: int = 0  # journal entries shown (a multi-line message is one entry of several lines)


def journal_entries(raw_lines: list[str]) -> list[list[str]]:
    """short-iso lines grouped by entry: a message's continuation lines are indented."""
    entries: list[list[str]] = []
    for line in raw_lines:
        if entries and line[:1] in (" ", "\t"):
            entries[-1].append(line)
        else:
            entries.append([line])
    return entries


def parse_journal(stdout: str, secrets: tuple[str, ...] = (), newest_first: bool = False) -> JournalChunk:
    """journalctl's output → its lines oldest first (scrubbed, each cut to MAX_LINE_CHARS, the
    newest MAX_LINES at most) and the cursor it printed last. Pure."""
    raw, cursor = [], None
    for line in stdout.splitlines():
        if line.startswith(CURSOR_PREFIX):
            value = line[len(CURSOR_PREFIX):].strip()
            cursor = value if 0 < len(value) <= MAX_CURSOR_CHARS and value.isprintable() else cursor
        elif line.strip():
            raw.append(line)
    entries = journal_entries(raw)
    if newest_first:
        entries.reverse()
    lines = [_bounded(scrub(line, secrets)) for entry in entries for line in entry]
    return JournalChunk(lines[-MAX_LINES:], cursor, len(entries))


def _bounded(line: str) -> str:
    return line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS] + f" …(+{len(line) - MAX_LINE_CHARS} chars)"


def nothing_matched(r: RunResult) -> bool:
    """journalctl (systemd 252) with --show-cursor exits 1 without a word when no entry matched
    (there is no cursor to show): an empty read, not a failure. Any other failure says something."""
    return r.rc == 1 and not r.stdout.strip() and not r.stderr.strip()


def read_journal(session: HostSession, query: LogQuery, after_cursor: Optional[str] = None) -> JournalChunk:
    """One journalctl run on the host, through its agent: the newest `query.lines` entries (since
    `query.since`), or the first ones after `after_cursor`. After a read since T the cursor is the
    OLDEST line's (journalctl read backwards): `newest_cursor` finds where to go on from.
    RemoteCommandError naming the host when journalctl fails."""
    host = session.host
    newest_first = after_cursor is None and query.since is not None
    request = Run(argv=journal_argv(query.unit_of(host), query.lines, query.since, after_cursor, newest_first),
                  timeout=JOURNAL_TIMEOUT_S, scrub_files=list(host.secret_files),
                  secret_words=list(SECRET_NAME_WORDS))
    r = ask_reply(session.link, request, RunResult, JOURNAL_TIMEOUT_S + 30, host.name)
    if nothing_matched(r):
        return JournalChunk([], after_cursor)
    if r.rc != 0:
        why = scrub((r.stderr or r.stdout).strip(), known_secrets(host))[-300:] or "no message"
        raise RemoteCommandError(f"{host.name}: journalctl exited {r.rc}: {why}")
    return parse_journal(r.stdout, known_secrets(host), newest_first)


def newest_cursor(session: HostSession, query: LogQuery, first: JournalChunk) -> Optional[str]:
    """The cursor of the newest entry of `first` (a read of `query`): where following goes on
    from. A read since T ends at its oldest entry; the entries after that one which it showed are
    read again, forwards, for the cursor of the last of them (they are already in the journal:
    no entry is skipped or shown twice, however many arrived meanwhile)."""
    if query.since is None or first.cursor is None or first.entries <= 1:
        return first.cursor
    again = read_journal(session, replace(query, lines=first.entries - 1), after_cursor=first.cursor)
    return again.cursor or first.cursor


# -- across hosts -----------------------------------------------------------------------------

@dataclass
class HostLog:
    host: str
    lines: list[str] = field(default_factory=list)
    error: Optional[str] = None  # why this host could not be read (one line)


def _reason(host: str, e: BaseException) -> str:
    """One line naming the host and the cause (the tool's errors mostly name the host already)."""
    text = " ".join((str(e) if isinstance(e, DdtreeOpsError) else f"{type(e).__name__}: {e}").split())
    return text if text.startswith(f"{host}: ") else f"{host}: {text or type(e).__name__}"


def read_host(host: Host, query: LogQuery, opener: Opener) -> HostLog:
    try:
        session = opener(host)
    except Exception as e:  # a host that cannot be reached is a line, never a crash
        return HostLog(host.name, error=_reason(host.name, e))
    try:
        return HostLog(host.name, read_journal(session, query).lines)
    except Exception as e:
        return HostLog(host.name, error=_reason(host.name, e))
    finally:
        session.close()


def read_logs(hosts: list[Host], query: LogQuery, opener: Opener, *, forks: int = 10) -> list[HostLog]:
    """Each host's lines (or why not), read in parallel, in the order of `hosts`."""
    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(forks, len(hosts))), thread_name_prefix="ddtree-logs") as pool:
        return list(pool.map(lambda h: read_host(h, query, opener), hosts))


class LogSink(Protocol):
    """Where followed lines go (the CLI prints them); called from the hosts' threads."""

    def line(self, host: str, text: str) -> None: ...

    def lost(self, host: str, reason: str) -> None:
        """`reason`: one line that starts with the host's name."""


def follow_host(host: Host, query: LogQuery, opener: Opener, sink: LogSink, stop: threading.Event,
                interval_s: Optional[float] = None) -> None:
    """The last lines, then every new one, until `stop`; a lost host is one `sink.lost` call."""
    session = None
    try:
        session = opener(host)
        cursor = None  # until a read shows an entry: read as without -f
        while not stop.is_set():
            if cursor is None:
                chunk = read_journal(session, query)
                cursor = newest_cursor(session, query, chunk)
            else:
                chunk = read_journal(session, query, after_cursor=cursor)
                cursor = chunk.cursor or cursor
            for text in chunk.lines:
                if stop.is_set():
                    return
                sink.line(host.name, text)
            stop.wait(FOLLOW_INTERVAL_S if interval_s is None else interval_s)
    except Exception as e:
        if not stop.is_set():
            sink.lost(host.name, _reason(host.name, e))
    finally:
        if session is not None:
            session.close()


def follow_logs(hosts: list[Host], query: LogQuery, opener: Opener, sink: LogSink, stop: threading.Event,
                interval_s: Optional[float] = None) -> list[threading.Thread]:
    """One daemon thread per host (started, returned): the caller waits on them or sets `stop`."""
    threads = [threading.Thread(target=follow_host, args=(h, query, opener, sink, stop, interval_s),
                                name=f"ddtree-logs-{h.name}", daemon=True) for h in hosts]
    for t in threads:
        t.start()
    return threads
