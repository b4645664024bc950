"""Fixtures for every test under tests/: the sandbox kit (kit.py) and the fast tier's fake hosts
(fast_kit.py); the test modules import them by those names for the helpers.

Tiers: a test that needs the test rig (real test hosts, or the real SGLang 0.5.23 venv) is
marked `sandbox` here, from the fixtures it uses, so `pytest -m "not sandbox"` is the quick loop.
"""

import os
import sys

import pytest

# Tests import the patch set's modules straight from patches/ (and start Python subprocesses
# that do): bytecode written there would be an unlisted file the patch-set loader refuses.
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
sys.dont_write_bytecode = True

from fast_kit import *  # noqa: E402,F403  (pytest registers the fixtures it finds here)
from kit import *  # noqa: E402,F403

# Fixtures that start or need the test rig: a test using any of them (directly or through other
# fixtures) is a sandbox test. `fake_sglang` serves a stand-in SGLang server for the GPU scripts'
# orchestration tests (server processes on loopback, like the sandbox's stand-in).
RIG_FIXTURES = {"sandbox", "sglang_overlay", "fake_sglang"}


def pytest_configure(config):
    # .ci/run runs these once more with SIGINT ignored, as a background job starts the suite.
    config.addinivalue_line("markers", "interrupts: interrupts the tool or the test with a signal; "
                                       "must pass whatever signal dispositions the test run inherited")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if RIG_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("sglang"):
            item.add_marker(pytest.mark.sandbox)


def pytest_terminal_summary(terminalreporter):
    """What a test measured and reports (`record_property("measured", text)`), printed at the end
    of the run, also from xdist workers (whose prints are not shown): the zero-downtime test's
    requests sent and failed."""
    lines = [f"{r.nodeid.split('::')[-1]}: {v}" for key in ("passed", "failed")
             for r in terminalreporter.stats.get(key, []) if getattr(r, "when", "call") == "call"
             for k, v in getattr(r, "user_properties", []) if k == "measured"]
    if lines:
        terminalreporter.write_sep("-", "measured by the tests")
        for line in lines:
            terminalreporter.write_line(line)
