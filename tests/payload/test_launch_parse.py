"""The launch check's parse with SGLang 0.5.23's OWN argument parser (ddtree_ops/remote_agent.py
SGLANG_PARSE_ONLY), run by the real agent against the real sglang in `.venv-sglang`: the patched
tree accepts the DDTree launch line the unit template renders, an unknown flag is refused as the
server would refuse it at start, and the pristine tree refuses the DDTree flags (which is why the
check runs after the new files are installed)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from ddtree_ops.artifacts.units import render_unit
from ddtree_ops.runbook.launch_check import launch_line
from ddtree_ops.testing.fake_host import fake_hosts
from ddtree_ops.testing.local_agent import local_agent
from sglang_env import PY, need_venv, site_packages

pytestmark = pytest.mark.sglang


def _check(args, overlay):
    need_venv()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # The parse runs isolated (-I -S) with the unit's environment, not the agent's: the patched
    # tree reaches it as a unit's Environment=PYTHONPATH would, site-packages as the request names it.
    unit_env = [f"PYTHONPATH={overlay}"] if overlay is not None else []
    ch = local_agent(env=env)
    try:
        return ch.call({"op": "launch_check", "python": str(PY), "module": "sglang.launch_server", "sglang": True,
                        "args": list(args), "ports": [], "site_packages": str(site_packages()),
                        "environment": unit_env}, 300)
    finally:
        ch.close()


def test_sglangs_own_parser_accepts_the_rendered_ddtree_line_and_refuses_an_unknown_flag(tmp_path, sglang_overlay):
    line = launch_line(render_unit(fake_hosts(tmp_path, extra_args=["--mem-fraction-static", "0.8"])[0].host))
    assert line.sglang and "--speculative-ddtree-budget" in line.args
    # Three parses, each a fresh interpreter importing SGLang's parser (most of their time): side by
    # side, each with its own agent.
    with ThreadPoolExecutor(3) as pool:
        ok, bad, pristine = pool.map(lambda job: _check(*job), [
            (line.args, sglang_overlay), ([*line.args, "--no-such-flag", "1"], sglang_overlay), (line.args, None)])
    assert ok["rc"] == 0, ok["stderr"][-2000:]
    assert bad["rc"] == 2 and "unrecognized arguments: --no-such-flag 1" in bad["stderr"]
    assert pristine["rc"] == 2 and "--speculative-ddtree-budget" in pristine["stderr"]
