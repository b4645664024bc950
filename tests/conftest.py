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
# One compute thread per process (torch, and the SGLang processes tests start): four workers share
# two cores, and torch's default of a thread per core made each worker's OpenMP threads spin against
# the others' (the payload's quick tests 56 -> 35 CPU-s, 28 -> 18 s). Set before torch is imported;
# a value the caller chose is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

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


# -- the quick loop's temp folders in memory --------------------------------------------------------
# The fast tier's fake hosts are the real agent on temp folders, and the agent fsyncs every write, as
# it must on a host: about 30,000 fsyncs in the quick loop, each one a wait on this machine's disk
# (shared with whatever else runs). With `-m "not sandbox"` and no --basetemp, the run's temp
# folders go to /dev/shm when it is a tmpfs with room (fsync returns at once there; nothing else
# changes, the agent's calls included); removed when the run ends. The sandbox tier stays on disk.
QUICK_TMP = "/dev/shm"
QUICK_TMP_PREFIX = "pytest-quick-"  # no product word in it: tests look for those in paths
QUICK_TMP_MIN_FREE = 4 << 30


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    if (hasattr(config, "workerinput") or config.option.basetemp
            or "not sandbox" not in (getattr(config.option, "markexpr", "") or "")):
        return None
    import shutil
    import tempfile

    try:
        with open("/proc/mounts") as fh:
            if not any(ln.split()[1:3] == [QUICK_TMP, "tmpfs"] for ln in fh if len(ln.split()) > 2):
                return None
        st = os.statvfs(QUICK_TMP)
        if st.f_bavail * st.f_frsize < QUICK_TMP_MIN_FREE:
            return None
        _remove_stale_quick_tmp()
        root = tempfile.mkdtemp(prefix=f"{QUICK_TMP_PREFIX}{os.getpid()}-", dir=QUICK_TMP)
    except OSError:
        return None
    config.option.basetemp = os.path.join(root, "basetemp")
    config.add_cleanup(lambda: shutil.rmtree(root, ignore_errors=True))
    return None


def _remove_stale_quick_tmp():
    """Folders of quick loops that were killed before they could remove theirs (their pid is gone)."""
    import shutil

    for name in os.listdir(QUICK_TMP):
        pid = name[len(QUICK_TMP_PREFIX):].split("-", 1)[0]
        if not (name.startswith(QUICK_TMP_PREFIX) and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(QUICK_TMP, name), ignore_errors=True)
        except OSError:
            pass


# -- xdist: which work goes to a worker first ---------------------------------------------------------
# `--dist loadfile` (addopts) keeps a file on one worker, so a file's tests share its module fixtures
# and sandbox boots are not repeated; but one long file then bounds the whole run, and xdist hands
# out files by their number of tests, so a file of two long tests came last. Three changes, for
# `--dist loadfile` only (another --dist is xdist's own):
# - these fast-tier files (no sandbox test, no module- or session-scoped fixture of their own) go out
#   test by test: their tests are independent fault matrices and real-time waits;
SPLIT_BY_TEST = ("tests/test_runbook.py", "tests/test_heal_report.py", "tests/test_heal.py",
                 "tests/test_lease_agent.py", "tests/test_bounded_http.py", "tests/test_bundle_hostile.py")
# - these files go out together, to one worker: each does its process's first meta-device
#   operation, which imports torch._dynamo (4-6 CPU-s; two workers paid it in every quick loop);
SAME_WORKER = {"tests/payload/test_tree_step_cpu.py": "tests/payload/test_tree_builder.py"}
# - work whose node id starts with one of these goes out first, in this order (the longest first;
#   measured in the quick loop on 2 cores): a wrong or stale entry costs only time. (Sending the
#   sandbox tier's longest files out first too was tried on 2026-12-04: the whole run took 609 s
#   against 546 s without, every heavy file contending at once; left out.)
LONG_FIRST = (
    # The two longest sandbox files (228 s and 191 s + 49 s of ev23's run): handed out last by
    # xdist's order they were the run's tail, each alone on its worker for its last minutes.
    "tests/test_ansible_molecule.py",
    "tests/test_tune_sandbox.py",
    "tests/test_runbook.py::test_a_controller_killed_at_any_call",
    "tests/test_heal_report.py::test_a_controller_killed_at_any_call",
    "tests/test_runbook.py::test_a_connection_lost_at_any_remote_call",
    "tests/test_runbook.py::test_a_fault_at_any_remote_call",
    "tests/test_perfgate_standin.py",
    "tests/payload/test_e2e_tiny_model.py",
    "tests/payload/test_tree_sampling.py",
    "tests/test_wheel.py",
    "tests/test_bundle_hostile.py::test_a_gzip_bomb",
    "tests/test_fleet.py",
    "tests/payload/test_tree_step_cpu.py",
    "tests/payload/test_tree_builder.py",
    "tests/test_remote_agent.py",
    "tests/test_signals.py",
    "tests/test_lease_agent.py",
    "tests/test_bounded_http.py",
)


def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongFirstLoadFile(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return nodeid if file in SPLIT_BY_TEST else SAME_WORKER.get(file, file)

        def _assign_work_unit(self, node) -> None:
            if self.workqueue:  # the first of the longest left, else xdist's own order
                scope = min(self.workqueue, key=_long_first_rank)
                self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return LongFirstLoadFile(config, log)


def _long_first_rank(scope: str) -> int:
    return next((i for i, prefix in enumerate(LONG_FIRST) if scope.startswith(prefix)), len(LONG_FIRST))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """Cache pytest's assertion-rewritten test modules (tests/**/__pycache__, never patches/).

    `sys.dont_write_bytecode` (above, and tests/payload/conftest.py) also stops pytest from caching
    the test modules it rewrites, so every xdist worker parsed and rewrote every test file again on
    every run: about 4 of the 9 CPU-seconds a worker spends collecting. Here the main process (the
    xdist controller, or the one process of `-n 0`) writes that cache before any worker collects;
    nothing is imported or executed, so nothing else gets bytecode. Pytest checks the source's hash
    when it reads the cache. Uses pytest's own rewrite helpers; if they change shape, this does
    nothing and every worker rewrites as before."""
    if hasattr(session.config, "workerinput"):
        return
    import fnmatch
    from pathlib import Path

    try:
        from _pytest.assertion import rewrite as rw

        state = session.config.stash[rw.assertstate_key]
        patterns = list(session.config.getini("python_files")) + ["conftest.py"]
        saved, sys.dont_write_bytecode = sys.dont_write_bytecode, False
        try:
            for fn in sorted(Path(__file__).resolve().parent.rglob("*.py")):
                if "__pycache__" in fn.parts or not any(fnmatch.fnmatch(fn.name, p) for p in patterns):
                    continue
                pyc = rw.get_cache_dir(fn) / (fn.name[:-3] + rw.PYC_TAIL)
                if rw._read_pyc(fn, pyc) is None and rw.try_makedirs(pyc.parent):
                    source_hash, co = rw._rewrite_test(fn, session.config)
                    rw._write_pyc(state, co, source_hash, pyc)
        finally:
            sys.dont_write_bytecode = saved
    except (AttributeError, ImportError, KeyError, TypeError, ValueError, SyntaxError, OSError):
        return  # pytest's internals moved, or a file does not parse (its collection reports that)


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



def _collects(config) -> bool:
    """Whether this process collects: an xdist worker or a run without workers, not xdist's
    controller (which never does, so it never reaches pytest_collection_finish)."""
    return hasattr(config, "workerinput") or not config.getoption("numprocesses", None)


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session):
    """No garbage collection while collecting: importing torch and the test modules allocates a
    million objects that all stay, and the collector walked them again and again (each of the four
    workers collects everything: torch's import alone 1.45 -> 1.2 CPU-s)."""
    if _collects(session.config):
        import gc

        gc.disable()


def pytest_collection_finish(session):
    """What collection left (torch, SGLang's modules, thousands of test items) is never garbage:
    out of the collector's sight, so that each full collection a test's allocations trigger does
    not walk all of it again (the quick loop 103 -> 94 CPU-s)."""
    import gc

    gc.freeze()
    gc.enable()
