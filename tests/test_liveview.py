"""The rollout's views (fast tier): the live table on a terminal and the plain lines of a CI log.
They show the start of a message and a refusal's reason, a phase's time stops when it ends, a
note is said once without a source tag, and a line tells how far the rollout is and how many
of the router's workers are ready."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from ddtree_ops.cli import liveview
from ddtree_ops.cli.liveview import STEP_WIDTH, LiveProgress, PlainProgress
from ddtree_ops.cli.messages import one_line
from ddtree_ops.config.inventory import parse_inventory
from ddtree_ops.fleet.pool_summary import pool_reader
from ddtree_ops.fleet.rollout import Target
from ddtree_ops.runbook.events import Failed, Note, PhaseStarted, StepDone
from ddtree_ops.testing.fake_host import fake_inventory
from ddtree_ops.testing.fake_router import FakeSmg

REFUSAL = ("refused: fh1: preflight refused; nothing was changed:\n"
           "  - site-packages /opt/venv_sglang/lib/python3.11/site-packages does not exist")


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(liveview.time, "monotonic", c)
    return c


def _live(hosts=("fh1", "fh2", "fh3"), pool=None) -> tuple[LiveProgress, io.StringIO]:
    """A live view writing to a buffer, its rows made as `start` makes them (no Live display)."""
    view = LiveProgress(pool)
    out = io.StringIO()
    view.console = Console(file=out, width=200, force_terminal=False)
    for h in hosts:
        view._row(h)
    return view, out


def test_the_step_column_shows_the_start_of_a_long_message(clock):
    view, _ = _live()
    text = "install: " + "x" * 200 + " ort in this venv"
    view.state("fh1", "running")
    view.event(Note("fh1", text))
    msg = view.rows["fh1"].msg
    assert msg.startswith("install: xxx") and msg.endswith("…") and len(msg) == STEP_WIDTH
    assert "ort in this venv" not in msg  # the control: what the old view showed


def test_a_refusal_shows_its_reason_in_the_row_and_in_one_line():
    view, _ = _live()
    view.event(Note("fh1", REFUSAL))
    view.state("fh1", "refused")
    assert "site-packages /opt/venv_sglang/lib/python3.11/site-packages does not exist" in view.rows["fh1"].msg
    assert one_line(REFUSAL).count("nothing was changed: site-packages") == 1
    assert one_line("just one line") == "just one line"
    # the control: the first line alone, which the view showed, says no reason
    assert REFUSAL.split("\n")[0] == "refused: fh1: preflight refused; nothing was changed:"


def test_a_phase_stops_counting_when_a_step_ends_it_and_a_failure_shows_the_rollback(clock):
    view, _ = _live()
    view.state("fh1", "running")
    view.event(PhaseStarted("fh1", "soak"))
    clock.now += 12
    assert view.rows["fh1"].phase_cell(clock.now) == "soak 12 s"
    view.event(StepDone("fh1", "soak", "healthy"))
    clock.now += 30
    assert view.rows["fh1"].phase_cell(clock.now) == "soak 12 s, done"
    view.event(PhaseStarted("fh1", "health gate"))
    clock.now += 3
    view.event(Failed("fh1", "health gate", "/generate 500"))
    clock.now += 5
    assert view.rows["fh1"].phase_cell(clock.now) == "rolling back 5 s"
    view.state("fh1", "running")  # a second run of the host (an abort's revert) starts without a phase
    assert view.rows["fh1"].phase_cell(clock.now) == ""


def test_a_note_prints_once_without_a_source_tag():
    view, out = _live()
    view.note("canary: fh1")
    text = out.getvalue()
    assert text.count("canary: fh1") == 1 and ".py:" not in text, text
    view.console.log("control")  # what the view used to call: it tags the line with file:line
    assert ".py:" in out.getvalue()
    table = Console(file=io.StringIO(), width=200)
    table.print(view._table())
    assert "canary: fh1" not in table.file.getvalue()  # not repeated as the table's title


def test_the_last_line_says_how_many_hosts_are_done_and_the_routers_pool():
    view, _ = _live(pool=lambda: "router http://r:1: 2 of 3 workers ready")
    view.state("fh1", "deployed")
    view.state("fh2", "refused")
    view.state("fh3", "running")
    view.pool_line = view._pool()
    assert view.footer() == "2/3 done (1 deployed, 1 refused) · router http://r:1: 2 of 3 workers ready"
    view.state("fh3", "deployed")
    assert view.footer().startswith("3/3 done (2 deployed, 1 refused)")


def test_plain_lines_say_how_far_the_rollout_is(capsys):
    view = PlainProgress()
    view.start(["fh1", "fh2", "fh3"], [["fh1"], ["fh2", "fh3"]])
    view.state("fh1", "running")
    view.state("fh1", "deployed")
    view.state("fh2", "running")
    assert capsys.readouterr().err == "== 1/3 done (fh1: deployed)\n"


def test_the_pool_reader_counts_the_routers_ready_workers(tmp_path, monkeypatch):
    import contextlib

    monkeypatch.setenv("DDTREE_TEST_ROUTER_KEY", "k-1")
    router = {"url": "http://router.test:30000", "admin_key_env": "DDTREE_TEST_ROUTER_KEY"}
    doc = fake_inventory(2, router=router)
    doc["all"]["hosts"] = {f"fh{i}": {"address": f"10.200.0.{i}"} for i in (1, 2)}
    inv = parse_inventory(doc, "inv.yaml")
    targets = [Target(h.name, (h,)) for h in inv.hosts.values()]
    smg = FakeSmg([t.hosts[0].base_url for t in targets], key="k-1")

    @contextlib.contextmanager
    def routers(host):
        yield smg.client(host.router)

    read = pool_reader(targets, routers)
    assert read() == "router http://router.test:30000: 2 of 2 workers ready"
    next(iter(smg.workers.values()))["status"] = "not_ready"  # control: one worker stops being routed to
    assert read() == "router http://router.test:30000: 1 of 2 workers ready"
    smg.down = True
    assert read().startswith("router pool not readable: ")
    plain = parse_inventory(fake_inventory(2), "inv.yaml")
    assert pool_reader([Target(h.name, (h,)) for h in plain.hosts.values()]) is None


def _canary_rollout(outcome, code: int, message: str):
    from ddtree_ops.fleet.rollout import Rollout
    from ddtree_ops.runbook.results import HostResult

    inv = parse_inventory(fake_inventory(2), "inv.yaml")
    targets = [Target(h.name, (h,)) for h in inv.hosts.values()]

    def act(t, report):
        return [HostResult(t.name, outcome, code, message=message)]
    return Rollout(targets, act, canary=1).run()


def test_a_refused_canary_is_shown_as_refused_with_its_reason(capsys):
    from ddtree_ops.cli.tables import print_rollout
    from ddtree_ops.runbook.results import Outcome

    res = _canary_rollout(Outcome.REFUSED, 2, "fh1: " + REFUSAL.split(": ", 2)[2])
    assert res.abort_reason == ("canary refused (1 of 1): fh1: site-packages "
                                "/opt/venv_sglang/lib/python3.11/site-packages does not exist"), res.abort_reason
    print_rollout(res)
    table = capsys.readouterr().out
    assert "canary failed" not in table and "nothing was changed: site-packages /opt/venv_sglang" in table, table
    control = _canary_rollout(Outcome.ROLLED_BACK, 3, "fh1: health gate failed; rolled back")
    assert control.abort_reason == "canary failed (1 of 1)"
