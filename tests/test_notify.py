"""`notify:` webhooks (fast tier): what a local HTTP server on 127.0.0.1 receives from a rollout,
in which order and in which shape; a webhook that fails, hangs or is not there costs the rollout
no more than its timeout and never its exit code; the inventory refuses what it must not hold."""

from __future__ import annotations

import datetime
import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ddtree_ops.cli.commands import app
from ddtree_ops.config.inventory import parse_inventory
from ddtree_ops.config.notify_settings import NotifyEvent, Webhook
from ddtree_ops.errors import EXIT_BAD_INPUT, EXIT_ROLLED_BACK, InventoryError
from ddtree_ops.fleet import actions
from ddtree_ops.fleet.notify import Notifier, RolloutInfo
from ddtree_ops.fleet.policy import Admission
from ddtree_ops.fleet.rollout import Rollout, Target
from ddtree_ops.runbook.results import HostResult, Outcome
from ddtree_ops.testing.fake_host import fake_hosts, fake_inventory

PAYLOAD_KEYS = {"event", "rollout", "kind", "patchset", "bundle", "by", "time", "hosts", "exit_code", "passed",
                "aborted", "reason", "batches", "seconds", "stopped_after_canary", "text"}
HOST_KEYS = {"host", "outcome", "exit_code", "release", "message"}
HANG_CAP_S = 10.0  # a hanging handler answers after this at the latest (the fixture's teardown)


class Receiver:
    """A webhook server on loopback: /ok answers 204, /fail 500, /hang does not answer (until the
    test ends); every POST is recorded as (path, JSON body, headers)."""

    def __init__(self):
        self.got: list[tuple[str, dict, dict]] = []
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.got.append((self.path, json.loads(body), dict(self.headers)))
                if self.path.startswith("/hang"):
                    receiver.release.wait(HANG_CAP_S)
                self.send_response(500 if self.path.startswith("/fail") else 204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def events(self, path: str) -> list[str]:
        return [doc["event"] for p, doc, _ in self.got if p == path]

    def docs(self, path: str) -> list[dict]:
        return [doc for p, doc, _ in self.got if p == path]


@pytest.fixture
def receiver():
    r = Receiver()
    r.thread.start()
    yield r
    r.release.set()
    r.server.shutdown()
    r.server.server_close()


def closed_port_url() -> str:
    """A loopback URL nothing listens on."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/gone"


def targets(n: int, hooks: list[dict] | None = None) -> list[Target]:
    inv = parse_inventory(fake_inventory(n, **({"notify": hooks} if hooks else {})), "inv.yaml")
    return [Target(h.name, (h,)) for h in inv.hosts.values()]


def scripted(outcomes: dict[str, Outcome]):
    """A rollout action whose outcome per host comes from `outcomes` (deployed otherwise)."""
    def act(t: Target, report) -> list[HostResult]:
        o = outcomes.get(t.name, Outcome.DEPLOYED)
        return [HostResult(h.name, o, EXIT_ROLLED_BACK if o == Outcome.ROLLED_BACK else 0, release="r-" + h.name)
                for h in t.hosts]
    return act


def rolled_back(t: Target, report) -> list[HostResult]:
    return [HostResult(h.name, Outcome.ROLLED_BACK, EXIT_ROLLED_BACK) for h in t.hosts]


def run_rollout(ts: list[Target], notifier: Notifier | None, failing: dict[str, Outcome] | None = None):
    """Canary fh1, then one target per batch; an abort reverts what was deployed."""
    return Rollout(ts, scripted(failing or {}), revert=rolled_back, batch="1", milestones=notifier,
                   rollout_id="20261202T020000Z-abc123").run()


def notifier(hooks: list[Webhook], warnings: list[str], **kw) -> Notifier:
    info = RolloutInfo("deploy", "20261202T020000Z-abc123", "payload 1.0.0", None, "ops@console")
    return Notifier(tuple(hooks), info, warnings.append,
                    clock=lambda: datetime.datetime(2026, 12, 2, 2, 0, tzinfo=datetime.timezone.utc), **kw)


# ---------------------------------------------------------------------------------------------
# order and shape


def test_a_good_rollout_tells_start_canary_finish_in_order_with_the_whole_payload(receiver):
    warnings: list[str] = []
    res = run_rollout(targets(3), notifier([Webhook(receiver.url + "/ok")], warnings))
    assert res.exit_code == 0 and warnings == []
    assert receiver.events("/ok") == ["start", "canary", "finish"]
    start, canary, finish = receiver.docs("/ok")
    for doc in (start, canary, finish):
        assert set(doc) == PAYLOAD_KEYS and all(set(h) == HOST_KEYS for h in doc["hosts"])
        assert (doc["rollout"], doc["kind"], doc["patchset"], doc["by"], doc["time"]) == (
            "20261202T020000Z-abc123", "deploy", "payload 1.0.0", "ops@console", "2026-12-02T02:00:00Z")
    assert [h["host"] for h in start["hosts"]] == ["fh1", "fh2", "fh3"] and start["batches"] == [
        ["fh1"], ["fh2"], ["fh3"]]
    assert canary["passed"] is True and [h["host"] for h in canary["hosts"]] == ["fh1"]
    assert finish["exit_code"] == 0 and finish["aborted"] is False and finish["stopped_after_canary"] is False
    assert [(h["host"], h["outcome"], h["release"]) for h in finish["hosts"]] == [
        ("fh1", "deployed", "r-fh1"), ("fh2", "deployed", "r-fh2"), ("fh3", "deployed", "r-fh3")]
    assert finish["text"].startswith("ddtree-ops deploy 20261202T020000Z-abc123 (payload 1.0.0) by ops@console: "
                                     "finished, exit 0")


def test_a_failed_canary_tells_its_verdict_then_the_abort_then_the_end(receiver):
    res = run_rollout(targets(3), notifier([Webhook(receiver.url + "/ok")], []), {"fh1": Outcome.ROLLED_BACK})
    assert res.aborted and res.exit_code == EXIT_ROLLED_BACK
    assert receiver.events("/ok") == ["start", "canary", "abort", "finish"]
    _, canary, abort, finish = receiver.docs("/ok")
    assert canary["passed"] is False and canary["hosts"][0]["outcome"] == "rolled_back"
    assert abort["reason"] == res.abort_reason and "canary failed" in abort["reason"]
    assert finish["exit_code"] == EXIT_ROLLED_BACK and finish["aborted"] is True


def test_a_canary_split_over_batches_gets_one_verdict_after_its_last_host(receiver):
    """A router that lets one target leave at a time splits a canary of 2: the verdict waits for both."""
    def one_at_a_time(batch: list[Target]) -> Admission:
        return Admission(go=(batch[0].name,), wait=tuple(t.name for t in batch[1:]), why="router pool")

    res = Rollout(targets(3), scripted({}), canary=2, admit=one_at_a_time,
                  milestones=notifier([Webhook(receiver.url + "/ok")], [])).run()
    assert res.batches[:2] == [["fh1"], ["fh2"]], "the canary did not span two batches: no test"
    assert receiver.events("/ok") == ["start", "canary", "finish"]
    assert [h["host"] for h in receiver.docs("/ok")[1]["hosts"]] == ["fh1", "fh2"]


def test_a_webhook_is_told_only_the_events_it_asked_for(receiver):
    hooks = [Webhook(receiver.url + "/ok", events=(NotifyEvent.ABORT, NotifyEvent.FINISH)),
             Webhook(receiver.url + "/all")]  # the control: the default, every event
    run_rollout(targets(2), notifier(hooks, []))
    assert receiver.events("/ok") == ["finish"]
    assert receiver.events("/all") == ["start", "canary", "finish"]


def test_secret_headers_come_from_the_environment_and_an_unset_one_skips_its_webhook(receiver):
    warnings: list[str] = []
    hooks = [Webhook(receiver.url + "/ok", headers_env=(("Authorization", "HOOK_TOKEN"),)),
             Webhook(receiver.url + "/unset", headers_env=(("X-Token", "HOOK_TOKEN_UNSET"),))]
    run_rollout(targets(1), notifier(hooks, warnings, environ={"HOOK_TOKEN": "Bearer s3cret"}))
    assert {headers.get("Authorization") for path, _, headers in receiver.got if path == "/ok"} == {"Bearer s3cret"}
    assert receiver.events("/unset") == []
    assert warnings == [f"webhook {receiver.url}: header X-Token: $HOOK_TOKEN_UNSET is not set; "
                        f"this webhook is not told"]


# ---------------------------------------------------------------------------------------------
# best effort, bounded


def test_failing_hanging_and_absent_webhooks_cost_at_most_their_timeout_never_the_exit_code(receiver):
    warnings: list[str] = []
    hooks = [Webhook(receiver.url + "/fail/secret-path"), Webhook(receiver.url + "/hang/secret-path", timeout_s=0.5),
             Webhook(closed_port_url(), timeout_s=0.5), Webhook(receiver.url + "/ok")]
    t0 = time.monotonic()
    res = run_rollout(targets(2), notifier(hooks, warnings), {"fh2": Outcome.ROLLED_BACK})
    took = time.monotonic() - t0
    quiet = run_rollout(targets(2), None, {"fh2": Outcome.ROLLED_BACK})  # the control: no webhook at all
    assert (res.exit_code, [str(r.outcome) for r in res.results]) == (
        quiet.exit_code, [str(r.outcome) for r in quiet.results])
    events = ["start", "canary", "abort", "finish"]
    assert receiver.events("/ok") == events  # the good webhook is told everything, in order, whatever the others do
    assert took < len(events) * (0.5 + 1.0) + 1.0, f"the webhooks held the rollout {took:.1f} s"
    assert len(warnings) == 3 * len(events), warnings
    assert all("secret-path" not in w for w in warnings), "a warning showed a webhook's path"
    assert any("HTTP 500" in w for w in warnings) and any("within 0.5 s" in w for w in warnings)
    assert any("ConnectError" in w for w in warnings)


@pytest.mark.interrupts
@pytest.mark.parametrize("event", ["finish", "start"])
def test_ctrl_c_during_a_webhook_wait_ends_the_wait_and_keeps_a_finished_result(receiver, event):
    """After the end, Ctrl-C only ends the wait on a hanging webhook: the summary and exit code
    stay. The control: the same Ctrl-C while the start event waits stops the rollout before it
    runs anything (no rollout under way to hand it to), as anywhere else before a change."""
    warnings: list[str] = []
    hook = Webhook(receiver.url + "/hang", events=(NotifyEvent(event),), timeout_s=5)
    ran: list[str] = []
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever the test run inherited
    timer = threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    t0 = time.monotonic()
    try:
        timer.start()
        try:
            res = Rollout(targets(2), lambda t, r: ran.append(t.name) or scripted({})(t, r),
                          milestones=notifier([hook], warnings)).run()
        except KeyboardInterrupt:
            res = None
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - t0 < 3, "the interrupt did not end the wait"
    assert warnings == [f"interrupted: no longer waiting for the webhooks' answer to the {event} event"]
    if event == "finish":
        assert res is not None and res.exit_code == 0 and ran == ["fh1", "fh2"]
    else:
        assert res is None and ran == []


# ---------------------------------------------------------------------------------------------
# the inventory's `notify`


@pytest.mark.parametrize("notify, field, says", [
    ([{"url": "ftp://hooks.example.com/x"}], "notify[0].url", "http or https"),
    ([{"url": "https://bot:pw@hooks.example.com/x"}], "notify[0].url", "user name or password"),
    ([{"url": "https://hooks.example.com/a b"}], "notify[0].url", "spaces"),
    ([{"url": "https:///nohost"}], "notify[0].url", "no host"),
    ([{"events": ["finish"]}], "notify[0].url", "required"),
    ([{"url": "https://h.example.com", "events": ["done"]}], "notify[0].events", "unknown event 'done'"),
    ([{"url": "https://h.example.com", "timeout_s": 0}], "notify[0].timeout_s", "0.1..60"),
    ([{"url": "https://h.example.com", "headers_env": {"Authorization": "x y"}}], "notify[0].headers_env",
     "environment variable"),
    ([{"url": "https://h.example.com", "headers_env": {"Host": "H"}}], "notify[0].headers_env", "set by the tool"),
    ([{"url": "https://h.example.com", "token": "s3cret"}], "notify[0].token", "unknown key"),
    ({"url": "https://h.example.com"}, "notify", "must be a list"),
])
def test_the_inventory_refuses_a_bad_webhook_naming_file_host_and_field(notify, field, says):
    with pytest.raises(InventoryError) as ei:
        parse_inventory(fake_inventory(1, notify=notify), "inv.yaml")
    assert ei.value.exit_code == EXIT_BAD_INPUT and ei.value.field == field and says in ei.value.problem
    msg = str(ei.value)
    assert msg.startswith("inv.yaml: host 'fh1': field ") and "\n" not in msg
    assert "pw@" not in msg


def test_a_good_webhook_parses_with_its_defaults():
    host = parse_inventory(fake_inventory(1, notify=[{"url": "https://h.example.com/hook"}]), "inv.yaml").hosts["fh1"]
    assert host.notify == (Webhook("https://h.example.com/hook"),)
    assert host.notify[0].events == tuple(NotifyEvent) and host.notify[0].timeout_s == 5.0


# ---------------------------------------------------------------------------------------------
# through the command line, on fake hosts


def test_deploy_on_the_command_line_tells_the_inventorys_webhooks(receiver, tmp_path, patchset, monkeypatch):
    hooks = [{"url": receiver.url + "/ok"}, {"url": receiver.url + "/fail", "timeout_s": 1}]
    doc = fake_inventory(2, notify=hooks)
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump(doc))
    fakes = {f.host.name: f for f in fake_hosts(tmp_path / "hosts", 2, notify=hooks)}
    monkeypatch.setattr(actions, "ssh_connector", lambda *a, **k: (lambda host: fakes[host.name].session()))
    monkeypatch.delenv("DDTREE_OPS_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(app, ["deploy", "-i", str(inv), "--patchset", str(Path(patchset.root)), "--yes",
                                   "--json"])
    result = json.loads(out.stdout)
    assert out.exit_code == 0 and result["exit_code"] == 0, out.output
    assert receiver.events("/ok") == ["start", "canary", "finish"]
    finish = receiver.docs("/ok")[-1]
    assert finish["patchset"] == result["patchset"] and finish["kind"] == "deploy"
    assert finish["rollout"] and finish["rollout"] in (result.get("rollout_id"), result.get("rollout"))
    assert [h["outcome"] for h in finish["hosts"]] == ["deployed"] * 2
    assert "warning: webhook " + receiver.url + ": the finish event got HTTP 500" in out.stderr
