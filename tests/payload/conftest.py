"""Payload test fixtures: make the patch set's files importable.

The patch set's files live under patches/ddtree-temp/files/ laid out as in
site-packages. When no real ``sglang`` is installed in this interpreter (the
usual CI venv), that folder is put on ``sys.path`` and ``sglang`` resolves to a
namespace package holding only the DDTree modules. The tests of the real
0.5.23 integration run in a separate interpreter (see test_sglang_integration).
"""

from __future__ import annotations

import importlib.util
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


@pytest.fixture(scope="session")
def du():
    from sglang.srt.speculative import ddtree_utils

    return ddtree_utils


# The patched-sglang overlay, shared by every test that runs code against the real 0.5.23.
from sglang_env import sglang_overlay  # noqa: E402,F401
