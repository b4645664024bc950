"""Payload test fixtures: make the patch set's files importable.

The patch set's files live under patches/ddtree-temp/files/ laid out as in
site-packages. When no real ``sglang`` is installed in this interpreter (the
usual CI venv), that folder is put on ``sys.path`` and ``sglang`` resolves to a
namespace package holding only the DDTree modules. The tests of the real
0.5.23 integration run their code in .venv-sglang (sglang_env.run_sglang).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PATCH_DIR = REPO / "patches" / "ddtree-temp"
FILES_DIR = PATCH_DIR / "files"

# Nothing the tests import may leave bytecode in the patch set: every file under files/ is
# shipped, and the patch-set loader refuses an unlisted one.
sys.dont_write_bytecode = True

if importlib.util.find_spec("sglang") is None:
    sys.path.insert(0, str(FILES_DIR))


@pytest.fixture(autouse=True)
def environment_kept():
    """Each test leaves os.environ as it found it. torch sets TORCHINDUCTOR_CACHE_DIR (to its
    default) the first time a process imports torch._dynamo, which the first meta-device
    operation does (test_tree_builder, test_tree_step_cpu): left set, it reached every later
    `run_sglang` call of the worker, and a fork server is keyed by the environment."""
    saved = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    yield
    now = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    if now != saved:
        for k in set(now) - set(saved):
            del os.environ[k]
        os.environ.update(saved)


@pytest.fixture(scope="session")
def du():
    from sglang.srt.speculative import ddtree_utils

    return ddtree_utils


# The patched-sglang overlay, shared by every test that runs code against the real 0.5.23.
from sglang_env import sglang_overlay  # noqa: E402,F401
