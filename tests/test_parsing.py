"""Pure parsers and small rules, table-driven (fast tier): systemctl output, secret redaction,
outcomes and exit codes, and the product's import graph."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ddtree_ops.config.redaction import is_secret_flag, is_secret_name, redact
from ddtree_ops.errors import DeployFailed, HostKeyError, InputError, LockHeldError, RollbackFailed, UnreachableError
from ddtree_ops.host.services import UnitState, parse_main_pid, parse_probe, parse_states, probe_argvs, states_argv
from ddtree_ops.runbook.results import HostResult, Outcome, failed_result, overall_exit_code


@pytest.mark.parametrize("text, pid", [
    ("MainPID=1234\n", 1234), ("MainPID=0\n", None), ("", None), ("MainPID=\n", None),
    ("Id=x\nMainPID=77\n", 77), ("MainPID=abc\n", None), ("mainpid=5\n", None),
])
def test_main_pid(text, pid):
    assert parse_main_pid(text) == pid


def test_states_one_block_per_unit_matched_by_id_and_unknown_for_the_rest():
    out = ("Id=a.service\nMainPID=42\nActiveState=active\nUnitFileState=enabled\n\n"
           "Id=b.service\nActiveState=inactive\nUnitFileState=disabled\nMainPID=0\n\n"
           "garbage line\n")
    got = parse_states(out, ("a.service", "b.service", "c.service"))
    assert got == {"a.service": UnitState("a.service", "active", "enabled", 42),
                   "b.service": UnitState("b.service", "inactive", "disabled", None),
                   "c.service": UnitState("c.service", "unknown", "unknown", None)}
    assert states_argv(("a.service",))[:2] == ["systemctl", "show"]


def test_states_of_a_unit_that_does_not_exist_are_unknown_not_empty():
    # real systemd prints empty properties for a unit it cannot find
    got = parse_states("Id=x.service\nActiveState=inactive\nUnitFileState=\nMainPID=0\n", ("x.service",))
    assert got["x.service"] == UnitState("x.service", "inactive", "unknown", None)


def test_probe_reads_state_pid_and_log():
    p = parse_probe("MainPID=9\nActiveState=activating\n", "line 1\n\nLoad weight begin\n")
    assert (p.active, p.main_pid, p.log) == ("activating", 9, ["line 1", "Load weight begin"])
    assert parse_probe("", "").active == "unknown"
    assert probe_argvs("a.service", 5)[1] == ["journalctl", "-u", "a.service", "-n", "18", "--no-pager"]


# Under real systemd 252, a crash during the weight load: the traceback, then PID 1's lines.
CRASH_JOURNAL = """\
Dec 01 20:15:08 sbx1 python[3395]: [TP0] Load weight begin
Dec 01 20:15:08 sbx1 python[3395]: [TP0] Scheduler hit an exception: Traceback (most recent call last):
Dec 01 20:15:08 sbx1 python[3395]: [TP0] RuntimeError: crash during weight loading
Dec 01 20:15:08 sbx1 systemd[1]: sglang-k26-ddtree.service: Main process exited, code=exited, status=1/FAILURE
Dec 01 20:15:08 sbx1 systemd[1]: sglang-k26-ddtree.service: Failed to kill control group, ignoring
Dec 01 20:15:08 sbx1 systemd[1]: sglang-k26-ddtree.service: Failed to kill control group, ignoring
Dec 01 20:15:08 sbx1 systemd[1]: sglang-k26-ddtree.service: Failed with result 'exit-code'.
Dec 01 20:15:13 sbx1 systemd[1]: sglang-k26-ddtree.service: Scheduled restart job, restart counter is at 1.
"""


def test_a_log_tail_keeps_the_servers_traceback_before_systemds_own_lines():
    p = parse_probe("ActiveState=activating\n", CRASH_JOURNAL, lines=2)
    assert p.log[:2] == ["Dec 01 20:15:08 sbx1 python[3395]: [TP0] Scheduler hit an exception: Traceback (most "
                         "recent call last):", "Dec 01 20:15:08 sbx1 python[3395]: [TP0] RuntimeError: crash during "
                                                "weight loading"]
    assert len(p.log) == 2 + 3 and p.log[-1].endswith("restart counter is at 1.")
    # The control: a plain tail of as many lines shows PID 1's lines only.
    assert not any("python[" in ln for ln in CRASH_JOURNAL.splitlines()[-5:])


@pytest.mark.parametrize("text, expected", [
    ("--api-key sk-1 --port 1", "--api-key *** --port 1"),
    ("--api-key=sk-1", "--api-key=***"),
    ('--admin-api-key "a b"', "--admin-api-key ***"),
    ("--api-key ${SGLANG_KEY}", "--api-key ${SGLANG_KEY}"),
    ('Environment="HF_TOKEN=hf_x"', 'Environment="HF_TOKEN=***"'),
    ("DB_PASSWORD=p other", "DB_PASSWORD=*** other"),
    ("--hf-token t --token=u", "--hf-token *** --token=***"),
    ("--tokenizer-path /m --port 30000", "--tokenizer-path /m --port 30000"),
    ("--trust-remote-code --api-ke sk-2 --port 1", "--trust-remote-code --api-ke *** --port 1"),
    ("---api-key sk-3", "---api-key ***"),  # a removed line of a unified diff
])
def test_redact(text, expected):
    assert redact(text) == expected


def test_one_secret_list_for_flags_and_names():
    assert is_secret_flag("--api-key") and is_secret_flag("--admin-api-key=x") and not is_secret_flag("--port")
    assert is_secret_name("api_key") and is_secret_name("HF_TOKEN") and not is_secret_name("model_path")


@pytest.mark.parametrize("exc, outcome, code", [
    (LockHeldError("x"), Outcome.LOCKED, 5), (HostKeyError("x"), Outcome.HOST_KEY_REFUSED, 2),
    (UnreachableError("x"), Outcome.UNREACHABLE, 1), (RollbackFailed("x"), Outcome.ROLLBACK_FAILED, 4),
    (InputError("x"), Outcome.REFUSED, 2), (RuntimeError("x"), Outcome.FAILED, 1),
])
def test_failed_result_follows_the_exception(exc, outcome, code):
    r = failed_result("h", exc, 1.0)
    assert (r.outcome, r.exit_code, r.message) == (outcome, code, "x")


def test_failed_result_prefers_the_result_an_exception_carries():
    e = DeployFailed("x")
    e.result = HostResult("h", Outcome.ROLLED_BACK, 3, release="r1")
    assert failed_result("h", e, 0.0) is e.result


@pytest.mark.parametrize("codes, overall", [
    ([0, 0], 0), ([0, 2], 2), ([5, 2], 5), ([3, 5], 3), ([4, 3, 5, 2], 4), ([1, 2], 2), ([1, 0], 1), ([], 0),
])
def test_the_most_serious_exit_code_wins(codes, overall):
    assert overall_exit_code([HostResult("h", Outcome.DEPLOYED, c) for c in codes]) == overall


def _imports(path: Path, package: str) -> set[str]:
    """Every ddtree_ops module `path` imports, at any depth (imports inside functions included)."""
    mod = package + "." + path.stem if path.stem != "__init__" else package
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.rsplit(".", node.level - (path.stem == "__init__"))[0] if node.level else ""
                target = f"{base}.{node.module}" if node.module else base
                names = [f"{target}.{a.name}" for a in node.names]
            else:
                target, names = node.module or "", []
            for t in [target, *names]:
                if t.startswith("ddtree_ops"):
                    out.add(t)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("ddtree_ops"))
    return out


def test_the_product_and_its_test_rig_have_no_import_cycles_not_even_inside_functions():
    """TYPE_CHECKING imports count too (the rig's fake_host and fake_systemd imported each other)."""
    root = Path(__file__).resolve().parent.parent
    files = {".".join(p.relative_to(root).with_suffix("").parts): p for p in (root / "ddtree_ops").rglob("*.py")
             if p.stem != "__init__"}
    graph = {m: {t for t in _imports(p, m.rsplit(".", 1)[0]) if t in files and t != m} for m, p in files.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert "ddtree_ops.runbook.deploy" in graph["ddtree_ops.fleet.actions"]  # the graph is really read
    assert "ddtree_ops.testing.fake_systemd" in graph["ddtree_ops.testing.fake_host"]


@pytest.mark.parametrize("flag, secret", [
    ("--api-key", True), ("--api-ke=x", True), ("--hf-tok", True), ("--admin-api", True), ("--tok", True),
    ("--token=t", True), ("--port", False), ("--tokenizer-path", False), ("--", False), ("-k", False),
])
def test_secret_flags_include_what_argparse_would_abbreviate(flag, secret):
    assert is_secret_flag(flag) is secret


@pytest.mark.parametrize("name, secret", [
    ("HF_TOKEN", True), ("OPENAI_API_KEY", True), ("APIKEY", True), ("db-password", True), ("MY_SECRET", True),
    ("TOKENIZERS_PARALLELISM", False), ("CUDA_VISIBLE_DEVICES", False), ("model_path", False),
    ("KEYBOARD", False),
])
def test_secret_names_go_by_words(name, secret):
    assert is_secret_name(name) is secret


def test_redaction_keeps_harmless_names_readable():
    text = 'Environment="TOKENIZERS_PARALLELISM=false" "HF_TOKEN=hf_x" "A=1"'
    assert redact(text) == 'Environment="TOKENIZERS_PARALLELISM=false" "HF_TOKEN=***" "A=1"'


def test_the_agent_runs_isolated_without_site_or_pythonpath(tmp_path):
    """No sitecustomize, .pth or PYTHONPATH module runs with the agent (it runs as root)."""
    import os
    import sys

    from ddtree_ops.host.channel import agent_argv

    marker = tmp_path / "ran"
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    (evil / "json.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")  # shadowing the stdlib
    from ddtree_ops.testing.local_agent import local_agent

    ch = local_agent(env={**os.environ, "PYTHONPATH": str(evil)}, cwd=str(evil))
    try:
        assert "releases" in ch.call({"op": "history", "state_dir": str(tmp_path / "state")}, 60)
        assert ch.conn.channels[0].proc.args == agent_argv(sys.executable)
    finally:
        ch.close()
    assert not marker.exists()


def test_gpu_apps_from_nvidia_smi_csv_and_which_holders_are_not_ours():
    from ddtree_ops.host.gpus import GpuApp, describe, foreign_apps, parse_gpu_apps

    def foreign(apps, procs, ours):
        return [describe(a, procs) for a in foreign_apps(apps, procs, ours)]

    text = "1234, 81920\n5678, [N/A]\nNo running processes found\n\n"
    assert parse_gpu_apps(text) == [GpuApp(1234, 81920), GpuApp(5678, 0)]
    procs = {"1234": {"cmd": "python3 -m sglang.launch_server", "ancestors": [1]},
             "5678": {"cmd": "sglang::scheduler", "ancestors": [1234, 1]}}
    assert foreign(parse_gpu_apps(text), procs, ours={1234}) == []
    assert foreign(parse_gpu_apps(text), procs, ours={99}) == [
        "pid 1234 (python3 -m sglang.launch_server) holds 81920 MiB", "pid 5678 (sglang::scheduler) holds 0 MiB"]
    assert foreign([GpuApp(7, 10)], {}, ours=set()) == ["pid 7 (gone) holds 10 MiB"]


def test_gpu_holders_read_from_a_real_nvidia_smi_tell_the_units_worker_from_an_orphan():
    """The output and ancestry recorded on a real H200 (driver 580.159.04) by
    bench/gpu_nvidia_smi_check.py: a unit's worker child and a double-forked leftover."""
    import json
    from pathlib import Path

    from ddtree_ops.host.gpus import foreign_apps, parse_gpu_apps

    rec = json.loads((Path(__file__).parent.parent / "bench/results/gpu_nvidia_smi.json").read_text())
    apps = parse_gpu_apps(rec["busy_raw"])
    assert {a.pid for a in apps} == {rec["worker_pid"], rec["orphan_pid"]}
    assert all(a.used_mib > 1000 for a in apps)
    assert parse_gpu_apps(rec["idle_raw"]) == []
    strangers = foreign_apps(apps, rec["procs"], {rec["unit_pid"]})
    assert [a.pid for a in strangers] == [rec["orphan_pid"]]
