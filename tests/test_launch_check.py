"""The launch check that runs before anything stops: the launch line
from the rendered unit, the verdicts, and the agent's parse and port holders for real."""

from __future__ import annotations

import dataclasses
import socket
import sys

import pytest

from ddtree_ops.artifacts.unit_service import service_exec, unit_words
from ddtree_ops.artifacts.units import render_unit
from ddtree_ops.host.agent.unit_identity import parse_environment_file
from ddtree_ops.runbook.launch_check import (
    identity_problems,
    launch_line,
    launch_request,
    parse_problems,
    port_problems,
    ports_to_check,
    ran_as,
)
from ddtree_ops.testing.fake_host import fake_hosts
from ddtree_ops.testing.local_agent import local_agent


def test_the_launch_line_comes_from_the_rendered_units_exec_start(tmp_path):
    host = fake_hosts(tmp_path, extra_args=["--mem-fraction-static", "0.8"])[0].host
    line = launch_line(render_unit(host))
    assert (line.python, line.module, line.sglang) == (host.python, "sglang.launch_server", True)
    assert line.args[:2] == ("--model-path", host.model_path) and line.args[-2:] == ("--mem-fraction-static", "0.8")
    assert launch_line("[Service]\nExecStart=/bin/sh -c 'exec x'\n") is None
    custom = dataclasses.replace(host, launch_module="my.launcher")
    assert not launch_line(render_unit(custom)).sglang


def test_rank_0_of_a_multinode_server_also_checks_the_dist_init_port(tmp_path):
    fakes = fake_hosts(tmp_path, 2, multinode=True)
    rank0, rank1 = (f.host for f in fakes)
    port = int(rank0.dist_init_addr.rsplit(":", 1)[1])
    assert ports_to_check(rank0) == [rank0.port, port] and ports_to_check(rank1) == [rank1.port]


def test_verdicts_name_the_parser_and_the_foreign_holder(tmp_path):
    line = launch_line(render_unit(fake_hosts(tmp_path)[0].host))
    assert parse_problems(line, {"rc": 0}) == []
    [p] = parse_problems(line, {"rc": 2, "stderr": "usage: ...\nsglang serve: error: unrecognized arguments: --x 1\n"})
    assert p.startswith("SGLang's argument parser refuses the new launch line (exit 2)") and "--x 1" in p
    holders = {"30000": [{"pid": 9, "cmd": "nginx", "ancestors": [1]}, {"pid": 12, "cmd": "py", "ancestors": [7, 1]}]}
    [p] = port_problems(holders, ours={7})
    assert "port 30000 is held by pid 9 (nginx)" in p and "pid 12" not in p
    assert port_problems(holders, ours={7, 9}) == []


def test_the_agent_parses_with_the_launchers_own_parser_and_finds_who_holds_a_port(tmp_path):
    """The real agent, locally: a launcher module with `--parse-only` (as the sandbox's stand-in
    offers) accepts or refuses; a socket this test listens on is found, with this process."""
    mod = tmp_path / "mylauncher.py"
    mod.write_text("import argparse, sys\n"
                   "p = argparse.ArgumentParser(allow_abbrev=False)\n"
                   "p.add_argument('--parse-only', action='store_true'); p.add_argument('--port', type=int)\n"
                   "p.parse_args()\n")
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    port = lsock.getsockname()[1]
    ch = local_agent()
    try:
        def check(*args):
            return ch.call({"op": "launch_check", "python": sys.executable, "module": "mylauncher", "sglang": False,
                            "args": list(args), "ports": [port], "site_packages": str(tmp_path)}, 60)
        ok = check("--port", str(port))
        assert ok["rc"] == 0
        [holder] = ok["holders"][str(port)]
        assert holder["pid"] == __import__("os").getpid()
        bad = check("--port", "x")
        assert bad["rc"] == 2 and "invalid int value: 'x'" in bad["stderr"]
    finally:
        ch.close()
        lsock.close()


# --------------------------------------------------------------------------- the unit's identity and environment

def test_the_parse_does_not_see_the_agents_pythonpath(tmp_path):
    """Isolated (-I -S): a module reachable only through the agent's own PYTHONPATH is not found,
    the same module in the request's site-packages is (the control)."""
    only_here = tmp_path / "elsewhere"
    only_here.mkdir()
    (only_here / "hidden_launcher.py").write_text("import sys; sys.exit(0)\n")
    ch = local_agent(env={"PYTHONPATH": str(only_here)})
    try:
        def check(site):
            return ch.call({"op": "launch_check", "python": sys.executable, "module": "hidden_launcher",
                            "args": [], "ports": [], "site_packages": site}, 60)
        hidden = check(str(tmp_path))
        assert hidden["rc"] == 1 and "No module named hidden_launcher" in hidden["stderr"]
        assert check(str(only_here))["rc"] == 0
    finally:
        ch.close()


def test_user_group_and_environment_come_from_the_rendered_units_service_section(tmp_path):
    host = dataclasses.replace(
        fake_hosts(tmp_path)[0].host, service_user="sglang",
        environment=(("HF_HOME", "/data/hf cache"), ("PCT", "50%"), ("Q", 'say "hi" \\ $HOME')),
        environment_file="/etc/sglang/env-%H")
    svc = service_exec(render_unit(host))
    assert (svc.user, svc.group, svc.working_directory) == ("sglang", None, None)
    assert svc.environment == ("HF_HOME=/data/hf cache", "PCT=50%", 'Q=say "hi" \\ $HOME')
    assert svc.environment_files == ("/etc/sglang/env-%H",)  # %% in the unit, one literal % here
    assert not svc.runs_as_root and service_exec(render_unit(fake_hosts(tmp_path)[0].host)).runs_as_root


def test_service_settings_follow_systemds_assignment_rules():
    unit = "\n".join([
        "[Unit]", "User=fromunitsection", "Environment=U=unit",
        "[Service]",
        "User=first", "User=second",  # the last one wins
        "Group=grp", "SupplementaryGroups=a b", "SupplementaryGroups=", "SupplementaryGroups=c",
        'Environment=A=1 "B=two words" C=x\\ty', "Environment=bad-name=1 D=%h E=100%%",
        "EnvironmentFile=-/etc/a", "EnvironmentFile=/etc/b",
        "WorkingDirectory=~",
        "Environment=F=cont \\",
        "  inued",
        "[Install]", "Environment=Z=install",
    ])
    svc = service_exec(unit)
    assert (svc.user, svc.group, svc.supplementary_groups) == ("second", "grp", ("c",))
    # bad-name=1 and the word without `=` are dropped, as systemd drops them; %h stays as written
    assert svc.environment == ("A=1", "B=two words", "C=x\ty", "D=%h", "E=100%", "F=cont")
    assert svc.environment_files == ("-/etc/a", "/etc/b") and svc.working_directory == "~"
    reset = service_exec(unit.replace("[Install]", "Environment=\nEnvironmentFile=\nUser=\n[Install]"))
    assert reset.environment == () and reset.environment_files == () and reset.runs_as_root


def test_unit_words_unquote_and_unescape_as_systemd_does():
    assert unit_words('a "b c" d\\se') == ["a", "b c", "d e"]
    assert unit_words("x'y z'w \"q\\\"r\" \\x41\\101") == ["xy zw", 'q"r', "AA"]
    assert unit_words('"" z') == ["", "z"]
    assert unit_words("a  b") != ["a  b"]  # the control: whitespace separates


@pytest.mark.parametrize(("text", "pairs"), [
    ("A=1\nB = two  \n", [("A", "1"), ("B", "two")]),
    ("# c\n; c\nA='x  y' \nB=\"q \\\"r\\\" \\n\"\n", [("A", "x  y"), ("B", 'q "r" \\n')]),
    ("A=one\\\ntwo\nB=a\\ b\n", [("A", "onetwo"), ("B", "a b")]),
    ("bad-name=1\n1X=2\nnovalue\nOK=\n", [("OK", "")]),
    ("A='multi\nline'\n", [("A", "multi\nline")]),
])
def test_environment_files_are_parsed_by_systemds_rules(text, pairs):
    assert parse_environment_file(text) == pairs


def test_an_environment_file_naive_split_would_get_wrong_is_read_right():
    """The control for the parser: quotes and comments a `partition('=')` reader keeps."""
    text = "# HF_TOKEN=old\nHF_TOKEN=\"new value\"\n"
    naive = [tuple(line.split("=", 1)) for line in text.splitlines() if "=" in line]
    assert parse_environment_file(text) == [("HF_TOKEN", "new value")] != naive


def test_the_request_carries_the_units_identity_and_the_controller_names_a_refusal(tmp_path):
    host = dataclasses.replace(fake_hosts(tmp_path)[0].host, service_user="sglang", environment=(("A", "b"),))
    unit = render_unit(host)
    req = launch_request(launch_line(unit), host, unit)
    assert (req.user, req.environment, req.site_packages) == ("sglang", ["A=b"], host.site_packages)
    assert req.ports == ports_to_check(host)
    [p] = identity_problems({"rc": 217, "refused": "the unit's User=sglang does not exist on this host"})
    assert "User=sglang does not exist" in p
    assert identity_problems({"rc": 0}) == []
    assert ran_as({"ran_as": {"user": "sglang", "uid": 999}}) == "as User=sglang (uid 999), isolated"


def test_the_sglang_form_parses_with_server_args_from_the_requests_site_packages(tmp_path):
    """`sglang.launch_server` lines go through ServerArgs.add_cli_args, imported from the request's
    site-packages by the isolated interpreter; a .pth file's code there never runs (a marker it
    would write stays absent), and a bad value is refused with argparse's message (the control)."""
    srt = tmp_path / "sglang" / "srt"
    srt.mkdir(parents=True)
    for init in (tmp_path / "sglang" / "__init__.py", srt / "__init__.py"):
        init.write_text("")
    (srt / "server_args.py").write_text(
        "class ServerArgs:\n"
        "    @staticmethod\n"
        "    def add_cli_args(parser):\n"
        "        parser.add_argument('--port', type=int)\n")
    marker = tmp_path / "pth-ran"
    (tmp_path / "aa.pth").write_text(f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')\n")
    ch = local_agent()
    try:
        def check(*args):
            return ch.call({"op": "launch_check", "python": sys.executable, "module": "sglang.launch_server",
                            "sglang": True, "args": list(args), "ports": [], "site_packages": str(tmp_path)}, 60)
        assert check("--port", "30000")["rc"] == 0
        bad = check("--port", "x")
        assert bad["rc"] == 2 and "sglang serve: error: argument --port: invalid int value: 'x'" in bad["stderr"]
        assert not marker.exists()
    finally:
        ch.close()
