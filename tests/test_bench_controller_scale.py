"""The controller-scale bench (bench/bench_controller_scale.py) at a tiny size: it measures real
work (more hosts cost more CPU, the sampler sees the worker threads), it refuses a rollout that
did not deploy every host, and its report carries every size with spread and growth."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from ddtree_ops.testing.fake_host import FAKE_CRASH

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_controller_scale.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_controller_scale", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_controller_scale"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _load()


@pytest.fixture(scope="module")
def measured(bench, tmp_path_factory):
    """1 and 4 fake hosts, canary 1 then batches of 2: few hosts, as every deploy of the fake host
    writes (and fsyncs) real files."""
    plan = bench.Plan(canary=1, batch="2", forks=10)
    return {n: bench.measure_size(n, plan, tmp_path_factory.mktemp(f"scale{n}")) for n in (1, 4)}


def test_more_hosts_cost_more_controller_cpu_and_every_host_is_counted(measured):
    small, big = measured[1], measured[4]
    for run in (small, big):
        assert run.deploy.outcomes == {"deployed": run.hosts}
        assert run.rollback.outcomes == {"rolled_back": run.hosts}
        assert 0 < run.deploy.agent_cpu_s < run.deploy.cpu_s  # the in-process agent is measured apart
        # The peak is the kernel's high-water mark (VmHWM) reset to the RSS when the rollout begins.
        # Not "never below the RSS read on entry": both are the kernel's approximate counters (per-CPU
        # batches not folded in), the mark is only raised lazily (at unmap and reclaim, not at each
        # fault), and this VM's proactive reclaim (DAMON pageout) takes pages from a long-lived test
        # process while it runs: ev25 read a peak of 557,688 KiB after 557,848 KiB on entry. A few
        # MiB either way is the counters'; a peak far below the entry RSS would be a broken reading.
        # ru_maxrss, the process's lifetime mark, may read below VmRSS likewise.
        assert run.rss_before_kib > 0 and run.maxrss_kib > 0
        assert run.peaks.rss_kib >= run.rss_before_kib - 16 * 1024, (run.peaks, run.rss_before_kib)
    # Warm-up (first imports, first compiles) falls on the 1-host run, against this inequality.
    assert big.deploy.cpu_s > small.deploy.cpu_s
    assert big.rollback.cpu_s > small.rollback.cpu_s


def test_the_thread_count_is_the_rollouts_own_threads_counted_as_they_start_and_end(measured):
    """Counted, not sampled: a sampler thread reading /proc every 10 ms missed a short-lived peak,
    and in a pytest worker it counted the threads other tests had left running (and itself), so the
    4-host run could read no more threads than the 1-host one."""
    assert measured[1].largest_batch == 1 and measured[4].largest_batch == 2
    assert measured[1].peaks.py_threads == 2  # main + the one worker of each rollout's pool
    # main + at least the 2 workers a batch of 2 runs on at once, at most the pool's one per host
    # (a ThreadPoolExecutor adds a worker when none is idle yet, so a batch may find a new one)
    assert 3 <= measured[4].peaks.py_threads <= 1 + 4


def test_the_count_leaves_out_threads_that_are_not_the_rollouts(bench):
    """Ours: threads the block's thread starts, and those they start (a short-lived one counts as
    well). Not ours: a thread started before the block, and one it starts inside the block."""
    import threading

    go, spawned, release = threading.Event(), threading.Event(), threading.Event()
    strangers: list[threading.Thread] = []

    def stranger() -> None:
        go.wait(10)
        child = threading.Thread(target=release.wait, args=(10,))
        child.start()
        strangers.append(child)
        spawned.set()
        child.join(10)

    def ours() -> None:
        child = threading.Thread(target=lambda: None)
        child.start()
        child.join()  # two of ours alive at once: this one and its child

    before = threading.Thread(target=stranger)
    before.start()
    start = threading.Thread.start
    try:
        with bench.ThreadCount() as count:
            go.set()
            assert spawned.wait(10)  # the stranger's child runs inside the block
            mine = threading.Thread(target=ours)
            mine.start()
            mine.join()
    finally:
        release.set()
        before.join(10)
    assert count.py_threads == 3  # the block's thread + ours, not the stranger's two
    assert "run" in vars(mine) and "run" not in vars(strangers[0])
    assert threading.Thread.start is start  # put back
    after = threading.Thread(target=lambda: None)
    after.start()
    after.join()
    assert "run" not in vars(after)


def test_a_release_that_crashes_the_canary_is_no_measurement(bench, tmp_path):
    with pytest.raises(bench.BenchFailed, match="deployed"):
        bench.measure_size(2, bench.Plan(), tmp_path, marker=FAKE_CRASH)


def _run(hosts: int, cpu_per_host: float) -> dict:
    side = {"wall_s": 0.01 * hosts, "cpu_s": cpu_per_host * hosts / 2, "agent_cpu_s": 0.0, "sleep_wall_s": 0.0,
            "controller_cpu_s": cpu_per_host * hosts / 2}
    return {"hosts": hosts, "batches": 2, "largest_batch": hosts - 1, "deploy": side, "rollback": side,
            "peaks": {"py_threads": 2, "os_threads": 2, "fds": 5, "rss_kib": 70_000},
            "rss_before_kib": 60_000, "maxrss_kib": 70_000}


def test_growth_is_one_for_linear_cost_and_above_one_for_superlinear(bench):
    linear = bench.summarize([_run(4, 0.02), _run(16, 0.02), _run(4, 0.03), _run(16, 0.03)])
    assert linear["sizes"] == [4, 16]
    assert linear["growth"]["4->16"]["cpu_s_per_host"] == pytest.approx(1.0)
    spread = linear["per_size"]["4"]["cpu_s_per_host"]
    assert (spread["min"], spread["max"]) == pytest.approx((0.02, 0.03))
    worse = bench.summarize([_run(4, 0.02), _run(16, 0.08)])
    assert worse["growth"]["4->16"]["cpu_s_per_host"] == pytest.approx(4.0)


def test_the_report_has_a_row_per_size_and_the_measured_run_fits_it(bench, measured):
    runs = [r.to_dict() for r in measured.values()]
    doc = {"summary": bench.summarize(runs), "plan": {"canary": 1, "batch": "2", "forks": 10}, "when": "now",
           "command": "test", "repeats": 1, "machine": {"cpus": 2, "loadavg_before": [0], "loadavg_after": [0]}}
    md = bench.render_md(doc)
    rows = [line for line in md.splitlines() if line.startswith("| 1 |") or line.startswith("| 4 |")]
    assert len(rows) == 2 and "| 1->4 |" in md


def test_the_limits_follow_from_the_real_ssh_numbers_and_say_when_they_are_missing(bench):
    summary = bench.summarize([_run(4, 0.02), _run(16, 0.02)])
    real = {"deploy_peak_threads": 3, "deploy_peak_fds": 5, "deploy_cpu_s": 0.9, "startup_cpu_s": 0.4,
            "deploy_wall_s": 5.0}
    text = " ".join(bench.derive_limits(summary, bench.Plan(), real))
    assert "F ≈ 510" in text and "F ≥ 10" in text  # (1024 - 3) / 2 fds; 5 s / 0.5 CPU s
    more_fds = " ".join(bench.derive_limits(summary, bench.Plan(), {**real, "deploy_peak_fds": 7}))
    assert "F ≈ 255" in more_fds
    assert "not measured" in " ".join(bench.derive_limits(summary, bench.Plan(), None))


def test_the_verdict_says_worse_than_linear_only_beyond_the_runs_spread(bench):
    noisy_linear = bench.summarize([_run(4, 0.02), _run(16, 0.021), _run(4, 0.022), _run(16, 0.023)])
    assert "linear or better" in bench.growth_verdict(noisy_linear)
    superlinear = bench.summarize([_run(4, 0.02), _run(16, 0.04)])
    assert "WORSE than linear" in bench.growth_verdict(superlinear)
