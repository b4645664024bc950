"""A host that answers as no agent would cannot flood, crash or hang the controller.

The real `AgentChannel` reads a hostile program over pipes (ddtree_ops.testing.hostile_agent):
an answer without a line end stops at the reply cap with a one-line error naming the host and the
cap, read in time linear in what came; a deeply nested answer is a one-line RemoteCommandError,
never a RecursionError. After either, the channel is broken and the program ended.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddtree_ops.errors import RemoteCommandError, UnreachableError
from ddtree_ops.host.agent.protocol import Journal
from ddtree_ops.host.channel import MAX_REPLY_DEPTH, REPLY_CAP_ENV, AgentChannel, ask, nesting_depth
from ddtree_ops.testing.hostile_agent import HostileConnection, place

CAP = 4 << 20
ROOT = Path(__file__).resolve().parent.parent  # the checkout, for the probe's interpreter


def channel(script) -> AgentChannel:
    host = SimpleNamespace(name="evil", python="/opt/venv/bin/python", agent_python="/usr/bin/python3",
                           connect_timeout_s=10.0, become=False, lock_lease_s=30.0, lock_renew_s=10.0)
    return AgentChannel(HostileConnection(script), host)  # type: ignore[arg-type]


def journal_request() -> Journal:
    return Journal("/var/lib/ddtree-ops")


class CountingBuffer(bytearray):
    """A reply buffer that counts the bytes each search for a line end looks at."""

    looked_at = 0

    def find(self, sub, start=0, *args):  # type: ignore[override]
        CountingBuffer.looked_at += len(self) - start
        return super().find(sub, start, *args)


@pytest.fixture
def hostile(tmp_path):
    chans: list[AgentChannel] = []

    def make(mode: str) -> AgentChannel:
        chans.append(channel(place(tmp_path / mode, mode)))
        return chans[-1]
    yield make
    for ch in chans:
        ch.close()


def flooded(ch: AgentChannel) -> tuple[RemoteCommandError, float]:
    with ch._io:
        ch._start()  # the hello exchange and the heartbeat, answered as an agent would
    ch._buf = CountingBuffer()
    CountingBuffer.looked_at = 0
    t0 = time.monotonic()
    with pytest.raises(RemoteCommandError) as e:
        ask(ch, journal_request(), 60)
    return e.value, time.monotonic() - t0


def test_a_reply_without_a_line_end_stops_at_the_cap_with_one_line_naming_host_and_cap(hostile, monkeypatch):
    monkeypatch.setenv(REPLY_CAP_ENV, str(CAP))
    ch = hostile("flood")
    err, took = flooded(ch)
    assert str(err) == (f"evil: the answer to 'journal' is longer than {CAP} bytes (the reply cap); "
                        f"the agent was stopped")
    assert took < 10
    assert len(ch._buf) == 0 and ch._chan is None
    proc = ch.conn.channels[-1].proc  # type: ignore[attr-defined]
    assert proc.wait(timeout=10) is not None  # the flooding program was ended with its channel
    with pytest.raises(UnreachableError, match="^evil: the answer to 'journal' is longer"):
        ask(ch, journal_request(), 5)  # broken, as after a timeout: nothing more is read from it


def test_the_search_for_a_line_end_looks_at_each_byte_once(hostile, monkeypatch):
    """Incremental: the bytes looked at stay within what arrived. A scan from the start of the
    buffer at every chunk (the control below) looks at hundreds of times more."""
    monkeypatch.setenv(REPLY_CAP_ENV, str(CAP))
    flooded(hostile("flood"))
    linear = CountingBuffer.looked_at
    assert CAP <= linear <= CAP + (2 << 20), linear

    rescanning = hostile("flood")
    rescanning._line_end = lambda op, cap, ch=rescanning: (  # type: ignore[method-assign]
        setattr(ch, "_scanned", 0), AgentChannel._line_end(ch, op, cap))[1]
    flooded(rescanning)
    assert CountingBuffer.looked_at > 20 * linear, (CountingBuffer.looked_at, linear)


def test_memory_follows_the_cap_not_the_flood(tmp_path):
    """In a fresh controller process: the peak memory grows with the cap (the control: a cap 12
    times larger costs clearly more), and with a 4 MiB cap stays within a few MiB of the start."""
    script = place(tmp_path / "flood", "flood")
    probe = textwrap.dedent(f"""
        import json, sys
        from types import SimpleNamespace
        from ddtree_ops.errors import RemoteCommandError
        from ddtree_ops.host.agent.protocol import Journal
        from ddtree_ops.host.channel import AgentChannel, ask
        from ddtree_ops.testing.hostile_agent import HostileConnection
        host = SimpleNamespace(name="evil", python="p", agent_python="p", connect_timeout_s=10.0, become=False,
                               lock_lease_s=30.0, lock_renew_s=10.0)
        ch = AgentChannel(HostileConnection({str(script)!r}), host)
        with ch._io:
            ch._start()
        def kib(field):
            return int(next(x for x in open("/proc/self/status") if x.startswith(field)).split()[1])
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) starts again from what is resident now
        before = kib("VmRSS:")
        try:
            ask(ch, Journal("/var/lib/ddtree-ops"), 60)
        except RemoteCommandError as e:
            print(json.dumps({{"grew_kib": kib("VmHWM:") - before, "error": str(e)}}))
        ch.close()
    """)

    def grew(cap: int) -> int:
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                           env={"PATH": "/usr/bin:/bin", REPLY_CAP_ENV: str(cap), "PYTHONPATH": str(ROOT)})
        assert r.returncode == 0, r.stderr[-2000:]
        doc = json.loads(r.stdout)
        assert f"longer than {cap} bytes" in doc["error"]
        return doc["grew_kib"]
    small, large = grew(4 << 20), grew(48 << 20)
    assert small < 16 * 1024, small
    assert large > small + 32 * 1024, (small, large)


@pytest.mark.parametrize("mode,why", [
    ("deep", f"nested deeper than {MAX_REPLY_DEPTH} levels"),
    ("nested", f"nested deeper than {MAX_REPLY_DEPTH} levels"),
    ("list", "not a JSON object"),
])
def test_an_unusable_answer_is_one_line_naming_the_host_and_breaks_the_channel(hostile, mode, why):
    ch = hostile(mode)
    with pytest.raises(RemoteCommandError) as e:
        ask(ch, journal_request(), 30)
    msg = str(e.value)
    assert msg.startswith("evil: remote step 'journal': unusable answer from /usr/bin/python3 (")
    assert msg.endswith(f"bytes, {why}); the agent was stopped") and "\n" not in msg
    assert e.value.__context__ is None or e.value.__suppress_context__  # no RecursionError chained
    with pytest.raises(UnreachableError):
        ask(ch, journal_request(), 5)


def test_a_hello_that_is_not_an_agents_is_one_line_not_a_protocol_traceback(hostile):
    ch = hostile("badhello")
    with pytest.raises(RemoteCommandError, match=r"^evil: remote step 'hello': not an agent's answer: "
                                                 r"HelloReply: .*; the agent was stopped$"):
        ask(ch, journal_request(), 30)
    with pytest.raises(UnreachableError):
        ask(ch, journal_request(), 5)


def test_nesting_depth_counts_without_recursion_and_stops_past_the_limit():
    deep: list = []
    for _ in range(100_000):  # far past the interpreter's recursion limit
        deep = [deep]
    assert nesting_depth(deep, 64) == 65
    assert nesting_depth({"a": [{"b": 1}], "c": 2}, 64) == 3
    assert nesting_depth("text", 64) == 0



# --------------------------------------------------------------- through the CLI, on a real host

EVIL_DIR = "/var/tmp/ddtree-evil-agent"
DFLASH = "sglang-k26-dflash-cg.service"  # what a fresh sandbox host serves


@pytest.fixture
def evil_host(fresh_host, tmp_path):
    """sbx1 with the hostile program as its inventory's `agent_python:` (the real one stays in place);
    `set_mode(mode)` picks how it answers."""
    from ddtree_ops.testing.hostile_agent import SCRIPT

    python = fresh_host.host.python
    script = f"#!{python}\n" + SCRIPT.split("\n", 1)[1]
    path = f"{EVIL_DIR}/python"
    fresh_host.ssh(["sh", "-c", 'mkdir -p "$1" && cat > "$1/python" && chmod 755 "$1/python"', "sh", EVIL_DIR],
                   stdin=script)

    def set_mode(mode: str) -> None:
        fresh_host.ssh(["sh", "-c", 'printf "%s\\n" "$2" > "$1.mode"', "sh", path, mode])
    th = fresh_host.with_vars(tmp_path, agent_python=path)
    th.set_mode = set_mode  # type: ignore[attr-defined]
    yield th
    fresh_host.ssh(["rm", "-rf", EVIL_DIR], check=False)


def one_line_error(r, host: str) -> str:
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in r.stderr and "RecursionError" not in r.stderr, r.stderr[-3000:]
    assert len(errors) == 1 and host in errors[0], r.stderr[-3000:]
    return errors[0]


def test_plan_against_a_host_answering_deep_json_is_one_line_and_exit_1(evil_host, good_patchset, cli):
    evil_host.set_mode("deep")
    r = cli("plan", "-i", str(evil_host.inventory), "-l", evil_host.name, "-p", str(good_patchset))
    line = one_line_error(r, evil_host.name)
    assert r.code == 1, (r.code, r.stderr[-2000:])
    assert f"nested deeper than {MAX_REPLY_DEPTH} levels" in line and "the agent was stopped" in line


def test_plan_against_a_flooding_host_ends_quickly_at_the_cap(evil_host, good_patchset, cli):
    """Through SSH and systemd-run: the controller stops at the (lowered) cap, says so, exit 1."""
    evil_host.set_mode("flood")
    t0 = time.monotonic()
    r = cli("plan", "-i", str(evil_host.inventory), "-l", evil_host.name, "-p", str(good_patchset),
            env={REPLY_CAP_ENV: str(CAP)})
    took = time.monotonic() - t0
    line = one_line_error(r, evil_host.name)
    assert r.code == 1 and f"longer than {CAP} bytes (the reply cap)" in line, r.stderr[-2000:]
    assert took < 60, took


@pytest.mark.parametrize("command", ["status", "history", "deploy"])
def test_every_command_that_reads_replies_survives_deep_json(evil_host, good_patchset, cli, command):
    evil_host.set_mode("deep")
    inv = str(evil_host.inventory)
    args = {"status": ("status", "-i", inv, "-l", evil_host.name),
            "history": ("history", "--host", evil_host.name, "-i", inv),
            "deploy": ("deploy", "-i", inv, "-l", evil_host.name, "-p", str(good_patchset), "--yes")}[command]
    r = cli(*args)
    assert "Traceback" not in r.stderr and "RecursionError" not in r.stderr, r.stderr[-3000:]
    assert r.code != 0 or command == "status", (r.code, r.stdout[-1000:], r.stderr[-1000:])
    assert f"nested deeper than {MAX_REPLY_DEPTH} levels" in r.stdout + r.stderr, (r.stdout[-2000:], r.stderr[-2000:])
    assert evil_host.unit_state(DFLASH) == "active"  # the serving unit was never touched


class AnswersWith:
    """An agent transport that answers every request with `doc` (a host gone wrong)."""

    def __init__(self, doc):
        self.doc = doc

    def call(self, request, timeout):
        return self.doc

    def close(self):
        pass


@pytest.mark.parametrize("doc", [[1, 2], {"acquired": True, "surprise": 1}, {}, "text"])
def test_an_answer_of_the_wrong_shape_is_one_line_naming_the_host(doc):
    from ddtree_ops.host.agent.protocol import Lock, LockReply
    from ddtree_ops.host.channel import ask_reply

    with pytest.raises(RemoteCommandError, match=r"^h1: remote step 'lock': not the answer the tool expects: "):
        ask_reply(AnswersWith(doc), Lock("/var/lib/ddtree-ops", {"user": "op"}), LockReply, 5, "h1")


def test_an_answer_of_the_right_shape_is_read():
    # The control: the same call with a lock reply the agent really sends.
    from ddtree_ops.host.agent.protocol import Lock, LockReply
    from ddtree_ops.host.channel import ask_reply

    agent = AnswersWith({"acquired": True, "holder": None})
    reply = ask_reply(agent, Lock("/var/lib/ddtree-ops", {"user": "op"}), LockReply, 5, "h1")
    assert reply.acquired is True
