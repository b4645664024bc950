"""The typed agent protocol: the controller's typed calls put on the wire exactly the JSON objects
the fake host, the fault hooks and a host's agent read, every request class has an op on the
agent, and the agent refuses a request it does not know instead of guessing."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ddtree_ops.host.agent import OPS, Agent
from ddtree_ops.host.agent import protocol as p
from ddtree_ops.host.channel import ask
from ddtree_ops.host.release_store import LockHolder, ReleaseStore
from ddtree_ops.host.services import Services
from ddtree_ops.testing.fake_host import DDTREE_UNIT, DFLASH_UNIT, fake_hosts

STATE = "/var/lib/ddtree-ops"


class Recorder:
    """An AgentTransport that keeps each request as the wire carries it and answers from a script."""

    def __init__(self, answers: dict[str, Any] | None = None):
        self.sent: list[dict[str, Any]] = []
        self.answers = answers or {}

    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.sent.append(request)
        return self.answers.get(request["op"], {})

    def close(self) -> None:
        pass


@pytest.fixture
def host():
    """What the store reads of a host, with values that are easy to spot on the wire."""
    return SimpleNamespace(name="h1", state_dir=STATE, site_packages="SP", unit_path="UP", lock_lease_s=30.0,
                           python="PY", service_user="SU")


RUN_OK = {"rc": 0, "stdout": "", "stderr": ""}
ANSWERS = {
    "lock": {"acquired": True, "holder": {"token": "t"}}, "compile": {"errors": []}, "prune": {"removed": []},
    "verify_unit": {"available": False}, "remove_partial": {"backup_complete": True},
    "verify_backup": {"problems": []}, "restore": {"restored": [], "refused": False, "problems": []},
    "release_write": {"release": {}}, "facts": {"unit_text": None}, "run": RUN_OK,
    "backup": {"manifest": {}, "changed": []}, "restore_check": {"releases": [], "files": [], "versions": []},
}


def _wire_of(call, host) -> dict[str, Any]:
    rec = Recorder(ANSWERS)
    call(ReleaseStore(rec, host))
    [request] = rec.sent
    return request


# What the store sent before it was typed (the JSON objects `store.call("op", ...)` built), minus
# `state_dir` on the four ops that never read it.
WIRE = [
    ("facts", lambda s: s.facts(["/a"], ["/s"]),
     {"op": "facts", "state_dir": STATE, "site_packages": "SP", "unit_path": "UP", "paths": ["/a"],
      "secret_paths": ["/s"], "python": "PY", "service_user": "SU"}),
    ("facts, no paths", lambda s: s.facts([]),
     {"op": "facts", "state_dir": STATE, "site_packages": "SP", "unit_path": "UP", "paths": [], "secret_paths": [],
      "python": "PY", "service_user": "SU"}),
    ("unlock", lambda s: s.release_lock(LockHolder("t", {})), {"op": "unlock", "state_dir": STATE, "token": "t"}),
    ("journal", lambda s: s.journal(step="install"),
     {"op": "journal", "state_dir": STATE, "journal": {"step": "install"}}),
    ("clear journal", lambda s: s.clear_journal(), {"op": "journal", "state_dir": STATE, "clear": True}),
    ("compile", lambda s: s.compile(p.Compile({"/m.py": "eA=="}, "/py")),
     {"op": "compile", "files": {"/m.py": "eA=="}, "python": "/py"}),
    ("compile as the unit's user", lambda s: s.compile(p.Compile({"/m.py": "eA=="}, "/py", user="u", group="g",
                                                                 supplementary_groups=["s"])),
     {"op": "compile", "files": {"/m.py": "eA=="}, "python": "/py", "user": "u", "group": "g",
      "supplementary_groups": ["s"]}),
    ("verify_unit", lambda s: s.verify_unit("u.service", "[Unit]", ["systemd-analyze", "@PATH@"]),
     {"op": "verify_unit", "unit_name": "u.service", "text": "[Unit]", "argv": ["systemd-analyze", "@PATH@"]}),
    ("backup", lambda s: s.backup("r1", [p.BackupPath("/a"), p.BackupPath("/u", "unit")]),
     {"op": "backup", "state_dir": STATE, "release_id": "r1",
      "paths": [{"path": "/a", "kind": "file"}, {"path": "/u", "kind": "unit"}], "site_packages": "SP"}),
    ("backup, checked against preflight", lambda s: s.backup("r1", [p.BackupPath("/a", expect_sha256="ab"),
                                                                     p.BackupPath("/n", expect_absent=True)]),
     {"op": "backup", "state_dir": STATE, "release_id": "r1",
      "paths": [{"path": "/a", "kind": "file", "expect_sha256": "ab"},
                {"path": "/n", "kind": "file", "expect_absent": True}], "site_packages": "SP"}),
    ("restore_check", lambda s: s.restore_check(["r2", "r1"], to_original=True),
     {"op": "restore_check", "state_dir": STATE, "releases": ["r2", "r1"], "to_original": True}),
    ("restore_check of the journal", lambda s: s.journal_restore_check(),
     {"op": "restore_check", "state_dir": STATE, "journal": True}),
    ("restore_check for status", lambda s: s.installed_drift("r1"),
     {"op": "restore_check", "state_dir": STATE, "releases": ["r1"], "as_installed": True}),
    ("install", lambda s: s.install([p.InstallFile("/a", "eA==", "ab", 0o640)]),
     {"op": "install", "state_dir": STATE,
      "files": [{"path": "/a", "content_b64": "eA==", "sha256": "ab", "mode": 0o640}]}),
    ("install, paused", lambda s: s.install([], test_pause={"after": 1, "file": "/f"}),
     {"op": "install", "state_dir": STATE, "files": [], "test_pause": {"after": 1, "file": "/f"}}),
    ("remove_partial", lambda s: s.remove_partial("r1"),
     {"op": "remove_partial", "state_dir": STATE, "release_id": "r1"}),
    ("verify_backup", lambda s: s.verify_backup("r1"),
     {"op": "verify_backup", "state_dir": STATE, "backup_dir": f"{STATE}/releases/r1/backup"}),
    ("restore original", lambda s: s.restore("original"),
     {"op": "restore", "state_dir": STATE, "backup_dir": f"{STATE}/original"}),
    ("release_write", lambda s: s.write_release("r1", outcome="ok"),
     {"op": "release_write", "state_dir": STATE, "release_id": "r1", "fields": {"outcome": "ok"}}),
    ("set_current none", lambda s: s.set_current(None), {"op": "set_current", "state_dir": STATE, "release_id": None}),
    ("history", lambda s: s.history(), {"op": "history", "state_dir": STATE}),
    ("prune", lambda s: s.prune(3), {"op": "prune", "state_dir": STATE, "keep": 3}),
    ("proc_info", lambda s: s.proc_info([7]), {"op": "proc_info", "pids": [7]}),
    ("launch_check", lambda s: s.launch_check(p.LaunchCheck("/py", "m", ["--port", "1"], [1], True, ["/sec"], ["KEY"])),
     {"op": "launch_check", "python": "/py", "module": "m", "args": ["--port", "1"], "ports": [1], "sglang": True,
      "scrub_files": ["/sec"], "secret_words": ["KEY"]}),
]


@pytest.mark.parametrize("call,wire", [w[1:] for w in WIRE], ids=[w[0] for w in WIRE])
def test_each_typed_store_call_sends_the_json_object_the_agent_reads(host, call, wire):
    assert _wire_of(call, host) == wire


def test_the_wire_check_sees_a_renamed_field():
    """Control: the comparison above is on names, so a field renamed in a dataclass shows."""
    assert p.Prune(STATE, 3).to_wire() != {"op": "prune", "state_dir": STATE, "kept": 3}


def test_a_lock_is_sent_with_its_grace_and_a_break_without_it(host):
    rec = Recorder({"lock": {"acquired": False, "holder": {"token": "old"}}})
    store = ReleaseStore(rec, host)
    store.lock_grace_s = 0.5
    with pytest.raises(Exception, match="deploy lock held"):
        store.acquire_lock("deploy", break_tokens=("old",))
    first, breaking = rec.sent
    assert first["op"] == "lock" and first["wait_s"] == 0.5 and "break" not in first
    assert breaking["break"] == "old" and "wait_s" not in breaking and "resume_generation" not in breaking


def test_a_unit_action_and_a_probe_are_the_run_requests_the_hooks_name(host):
    rec = Recorder({"run": RUN_OK})
    Services(rec, host.name, ("/etc/secrets.yaml",)).restart("u.service")
    assert rec.sent == [{"op": "run", "argv": ["systemctl", "restart", "u.service"], "timeout": 300}]
    rec = Recorder({"run": {"results": [RUN_OK, RUN_OK]}})
    Services(rec, host.name, ("/etc/secrets.yaml",)).probe("u.service", 5)
    [probe] = rec.sent
    assert probe["argvs"][1] == ["journalctl", "-u", "u.service", "-n", "18", "--no-pager"]
    assert probe["scrub_files"] == ["/etc/secrets.yaml"] and "KEY" in probe["secret_words"] and "argv" not in probe


@pytest.mark.parametrize("cls", sorted(p.REQUESTS.values(), key=lambda c: c.OP), ids=lambda c: c.OP)
def test_every_request_comes_back_from_the_wire_as_it_was_sent(cls):
    request = _sample(cls)
    assert p.decode_request(request.to_wire()) == request


def test_every_request_class_has_an_op_on_the_agent():
    assert _unhandled(OPS) == set()
    assert _unhandled({k: v for k, v in OPS.items() if k is not p.Facts}) == {p.Facts}  # control


def _unhandled(ops) -> set[type]:
    by_the_process = {p.Hello, p.Renew, p.Lock, p.Unlock}  # the agent's own: its lease and its lock
    return set(p.REQUESTS.values()) - set(ops) - by_the_process


@pytest.mark.parametrize("doc,why", [
    ({"op": "histroy", "state_dir": "/s"}, "unknown op 'histroy'"),
    ({"op": "history", "state_dir": "/s", "stat_dir": "/t"}, "unknown field(s) stat_dir"),
    ({"op": "prune", "state_dir": "/s"}, "keep"),
    ({"op": "backup", "state_dir": "/s", "release_id": "r", "paths": [{"path": "/a", "knd": "file"}]},
     "BackupPath: unknown field(s) knd"),
])
def test_the_agent_refuses_a_request_it_does_not_know_and_runs_nothing(tmp_path, doc, why):
    doc = dict(doc, state_dir=str(tmp_path / "state"))
    answer = Agent().handle(doc)
    assert answer["ok"] is False and "ProtocolError" in answer["error"] and why in answer["error"]
    assert not (tmp_path / "state").exists()


def test_a_well_formed_request_is_answered(tmp_path):
    """Control for the refusals above: the same shape with the right names runs."""
    answer = Agent().handle({"op": "history", "state_dir": str(tmp_path / "state")})
    busy = answer.pop("busy_s")  # how long it worked: the controller's lease view starts after it
    assert answer == {"ok": True, "result": {"releases": [], "current": None, "original": False, "tunes": []}}
    assert 0 <= busy < 5


def test_a_reply_the_controller_reads_is_checked_against_its_class():
    assert p.LockReply.from_wire({"acquired": True, "holder": {}}).acquired
    with pytest.raises(p.ProtocolError, match="unknown field"):
        p.LockReply.from_wire({"acquired": True, "holder": {}, "brake_failed": True})


def test_status_reads_a_conflicting_units_execstart_through_the_agent(tmp_path):
    from ddtree_ops.fleet.status import _active_unit_text

    [fake] = fake_hosts(tmp_path)
    fake.write(f"/etc/systemd/system/{DFLASH_UNIT}", b"[Service]\nExecStart=/py -m x --speculative-algorithm DFLASH\n")
    session = fake.session()
    facts = session.store.facts([])
    fake.events.clear()
    text = _active_unit_text(session.store, fake.host, DFLASH_UNIT, facts)
    assert "--speculative-algorithm DFLASH" in text and fake.events == ["agent facts"]
    fake.events.clear()  # control: the tool's own unit is read with the facts, no second call
    assert _active_unit_text(session.store, fake.host, DDTREE_UNIT, dict(facts, unit_text="T")) == "T"
    assert fake.events == []


def test_ask_sends_the_request_as_its_wire_object():
    rec = Recorder({"history": {"releases": []}})
    assert ask(rec, p.History("/s"), 5) == {"releases": []}
    assert rec.sent == [{"op": "history", "state_dir": "/s"}]


def _sample(cls: type) -> p.Request:
    """A request of `cls` with every field set away from its default (a value of the field's type)."""
    import dataclasses
    import typing

    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        hint = str(f.type)
        if f.name == "break_token":
            values[f.name] = "tok"
        elif "BackupPath" in hint:
            values[f.name] = [p.BackupPath("/a", "unit")]
        elif "InstallFile" in hint:
            values[f.name] = [p.InstallFile("/a", "eA==", "ab", 0o600)]
        elif "WantedContent" in hint:
            values[f.name] = [p.WantedContent("/a", "ab")]
        elif "List[typing.List" in hint:
            values[f.name] = [["systemctl", "status"]]
        elif "List[int]" in hint:
            values[f.name] = [1, 2]
        elif "List" in hint:
            values[f.name] = ["x", "y"]
        elif "Dict" in hint:
            values[f.name] = {"k": "v"}
        elif f.type in (bool, typing.Optional[bool]):
            values[f.name] = True
        elif f.type in (int, float, typing.Optional[int], typing.Optional[float]):
            values[f.name] = 7
        else:
            values[f.name] = "s"
    return cls(**values)


def test_sample_requests_differ_from_their_defaults():
    """The round trip above would pass vacuously if the samples were all defaults."""
    import dataclasses

    for cls in p.REQUESTS.values():
        sample = _sample(cls)
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                assert getattr(sample, f.name) != f.default, (cls.OP, f.name)

