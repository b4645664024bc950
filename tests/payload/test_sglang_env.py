"""The fork server behind `sglang_env.run_sglang`: each run is the process a fresh `python -c`
of `.venv-sglang` would be (the same `sys.path`, environment, cwd, `__main__`, fresh seeds),
shares nothing with other runs, and fails, times out and refuses as that process would."""

from __future__ import annotations

import os
import subprocess

import pytest

from sglang_env import run_sglang

pytestmark = pytest.mark.sglang

PROBE = """
import os, threading
import torch
OUT.update(path=sys.path[:2], cwd=os.getcwd(), argv=sys.argv, name=__name__,
           main=sorted(k for k in globals() if k.startswith("__")),
           pythonpath=os.environ.get("PYTHONPATH"), interpret=os.environ.get("TRITON_INTERPRET"),
           sglang_before=sorted(m for m in sys.modules if m.split(".")[0] == "sglang"),
           dtype=str(torch.get_default_dtype()), threads=threading.active_count(),
           seed=torch.initial_seed(), rand=torch.rand(2).tolist(), marker=os.environ.get("RUN_MARKER"))
import sglang.srt.server_args as sa
OUT["server_args"] = sa.__file__
"""

LEAK = """
import os
import torch
import sglang.srt.server_args as sa
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
sa.ServerArgs.leaked_by_a_run = True
os.environ["RUN_MARKER"] = "left by a run"
OUT["ok"] = True
"""


def test_a_run_starts_as_a_fresh_interpreter_and_sees_the_patched_or_the_pristine_tree(
        tmp_path_factory, sglang_overlay):
    patched = run_sglang(PROBE, tmp_path_factory.mktemp("patched"), sglang_overlay)
    pristine = run_sglang(PROBE, tmp_path_factory.mktemp("pristine"), None)
    for out in (patched, pristine):
        assert out["argv"] == ["-c"] and out["name"] == "__main__" and out["interpret"] is None
        assert out["main"] == ["__annotations__", "__builtins__", "__doc__", "__loader__", "__name__",
                               "__package__", "__spec__"]
        assert out["sglang_before"] == [] and out["threads"] == 1 and out["dtype"] == "torch.float32"
    assert patched["path"] == ["", str(sglang_overlay)] and patched["pythonpath"] == str(sglang_overlay)
    assert patched["server_args"].startswith(str(sglang_overlay))
    assert pristine["path"][0] == "" and pristine["pythonpath"] is None
    assert "/site-packages/sglang/" in pristine["server_args"]
    assert patched["cwd"].endswith("patched0") and pristine["cwd"].endswith("pristine0")
    # torch's generator is seeded from the OS in each run, as in each fresh interpreter
    assert patched["seed"] != pristine["seed"] and patched["rand"] != pristine["rand"]


def test_what_a_run_changes_ends_with_it(tmp_path_factory, sglang_overlay):
    assert run_sglang(LEAK, tmp_path_factory.mktemp("leak"), sglang_overlay) == {"ok": True}
    after = run_sglang(PROBE + "OUT['leaked'] = hasattr(sa.ServerArgs, 'leaked_by_a_run')\n",
                       tmp_path_factory.mktemp("after"), sglang_overlay)
    assert after["dtype"] == "torch.float32" and after["seed"] != 0 and after["marker"] is None
    assert after["leaked"] is False and after["sglang_before"] == []


def test_a_failing_run_fails_the_call_with_its_traceback(tmp_path):
    with pytest.raises(AssertionError, match="ValueError: boom"):
        run_sglang("raise ValueError('boom')\n", tmp_path, None)
    with pytest.raises(AssertionError, match="exit code seven"):
        run_sglang("sys.exit('exit code seven')\n", tmp_path, None)


def test_a_run_past_its_timeout_is_killed(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_sglang("import time\ntime.sleep(120)\n", tmp_path, None, timeout=3)


def test_a_run_that_sets_triton_interpret_itself_must_say_so(tmp_path):
    """The server imported triton (torch._dynamo does) with the call's TRITON_INTERPRET, and
    @triton.jit reads it then: a run changing it would get kernels a fresh interpreter would not."""
    if os.environ.get("DDTREE_SGLANG_FORKSERVER") == "0":
        pytest.skip("fresh interpreters (DDTREE_SGLANG_FORKSERVER=0): a run may set what it likes")
    code = "import os\nos.environ['TRITON_INTERPRET'] = '1'\n"
    with pytest.raises(AssertionError, match="changed TRITON_INTERPRET"):
        run_sglang(code, tmp_path, None)
    assert run_sglang(code + "OUT['ok'] = 1\n", tmp_path, None, triton_interpret=True) == {"ok": 1}
