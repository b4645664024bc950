"""The launch check that runs before anything stops: the launch line
from the rendered unit, the verdicts, and the agent's parse and port holders for real."""

from __future__ import annotations

import dataclasses
import socket
import sys

from ddtree_ops.artifacts.units import render_unit
from ddtree_ops.runbook.launch_check import launch_line, parse_problems, port_problems, ports_to_check
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
    ch = local_agent(env={"PYTHONPATH": str(tmp_path)})
    try:
        def check(*args):
            return ch.call({"op": "launch_check", "python": sys.executable, "module": "mylauncher", "sglang": False,
                            "args": list(args), "ports": [port]}, 60)
        ok = check("--port", str(port))
        assert ok["rc"] == 0
        [holder] = ok["holders"][str(port)]
        assert holder["pid"] == __import__("os").getpid()
        bad = check("--port", "x")
        assert bad["rc"] == 2 and "invalid int value: 'x'" in bad["stderr"]
    finally:
        ch.close()
        lsock.close()
