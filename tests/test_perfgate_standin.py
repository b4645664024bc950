"""The performance gate against stand-in servers on 127.0.0.1 with both cores held by busy loops
(sandbox tier: stand-in server processes, and ten seconds of both cores busy, a load test of
whatever a quick loop ran beside it): the stand-in paces by a clock and the release's accept length,
measured once at start-up from the real DDTree payload, so the verdict is the release's, not the
machine's, round after round.

Three releases run side by side: a DFlash baseline (accept length 1), the DDTree patch set's payload
at budget 16 / top-k cap 4 (faster by its accept length: passes), and a DDTree release slowed with
the stand-in's --standin-tokens-per-second knob (fails). Each round measures the three at once with
the gate's own `measure` and judges with `compare` and the default thresholds."""

from __future__ import annotations

import multiprocessing
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from ddtree_ops.config.perfgate_settings import Thresholds
from ddtree_ops.config.workload_settings import Workload
from ddtree_ops.gates.perfgate import Verdict, compare, format_rows
from ddtree_ops.gates.workload import Measurement, measure
from kit import busy_loops

pytestmark = pytest.mark.sandbox

REPO = Path(__file__).resolve().parents[1]
PAYLOAD = REPO / "patches" / "ddtree-temp" / "files" / "sglang" / "srt" / "speculative" / "ddtree_utils.py"
ROUNDS = 10
BUSY_LOOPS = 2  # as many as the CI machine has cores
VERIFY_STEPS_PER_SECOND = 100
SLOWED_TOKENS_PER_SECOND = 40  # the baseline makes 100 per request: a clear slowdown (about −45 %)
# Short rounds, the gate's default sampling (temperature 0.7, top-p 0.9).
WORKLOAD = Workload(concurrency=2, duration_s=0.4, min_requests=4, max_new_tokens=16, request_timeout_s=20)
# The default limits but two, which only the machine moves here: the p99s of ten-odd requests are
# their slowest one, which one late wake-up makes (TTFT 52 -> 73 ms seen; the sandbox gate's tails
# are as loose), and the releases share one 30 ms prefill, so TTFT moves only when the loaded machine
# stalls a process (a median of 56 -> 122 ms seen with other jobs on the two cores besides the loops).
# The ITL p50 limits and the ITL floor are the defaults. A starved stand-in once caught up on an
# absolute clock with the steps it had missed, back to back: one round's DFlash baseline showed an
# ITL p50 of 0.3 ms (10 ms paced) in a fresh-clone CI run, and the DDTree release's 3.3 ms "failed"
# by +1164 %. Its steps are now never less than a step time apart (a late step shifts the ones after
# it, as on a GPU: tests/test_standin_server.py's starved-server test), so the ITL is the release's.
THRESHOLDS = Thresholds(ttft_p99_marginal=9.0, ttft_p99_fail=10.0, itl_p99_marginal=9.0, itl_p99_fail=10.0,
                        ttft_floor_s=0.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _payload_site(root: Path) -> Path:
    """sglang.srt.speculative with the patch set's ddtree_utils.py (stdlib and torch only)."""
    spec = root / "sglang" / "srt" / "speculative"
    spec.mkdir(parents=True)
    for d in (root / "sglang", root / "sglang" / "srt", spec):
        (d / "__init__.py").write_text("")
    (spec / "ddtree_utils.py").write_bytes(PAYLOAD.read_bytes())
    return root


def _formula_site(root: Path) -> Path:
    """A DDTree module without the payload's functions."""
    spec = root / "sglang" / "srt" / "speculative"
    spec.mkdir(parents=True)
    for d in (root / "sglang", root / "sglang" / "srt", spec):
        (d / "__init__.py").write_text("")
    (spec / "ddtree_info.py").write_text("X = 1\n")
    return root


@dataclass
class Standin:
    name: str
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False


def _start(tmp: Path, name: str, site: Path, *flags: str) -> Standin:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    env.pop("DDTREE_STANDIN_LOAD_SECONDS", None)
    log = tmp / f"{name}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ddtree_ops.testing.standin", "--host", "127.0.0.1", "--port", str(port),
             "--model-path", "/models/toy", "--standin-load-seconds", "0.05", "--standin-warmup-seconds", "0.05",
             "--standin-gpu-dir", "", "--standin-verify-steps-per-second", str(VERIFY_STEPS_PER_SECOND), *flags],
            stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, env=env)
    return Standin(name, proc, port, log)


def _wait_ready(servers: list[Standin], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for s in servers:
        while not s.ready():
            assert s.proc.poll() is None, f"{s.name} exited {s.proc.returncode}:\n{s.log.read_text()}"
            assert time.monotonic() < deadline, f"{s.name} never ready:\n{s.log.read_text()}"
            time.sleep(0.05)


def _end(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(10)


DDTREE = ("--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "16",
          "--speculative-ddtree-topk-cap", "4")


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> Iterator[dict[str, Standin]]:
    tmp = tmp_path_factory.mktemp("gate-standins")
    empty = tmp / "no-payload"
    empty.mkdir()
    servers = [
        _start(tmp, "baseline", empty, "--speculative-algorithm", "DFLASH"),
        _start(tmp, "ddtree", _payload_site(tmp / "sp-ddtree"), *DDTREE),
        # No payload (the formula's accept length): the knob makes it slow, and it starts sooner.
        _start(tmp, "slowed", _formula_site(tmp / "sp-slowed"), *DDTREE,
               "--standin-tokens-per-second", str(SLOWED_TOKENS_PER_SECOND)),
    ]
    try:
        _wait_ready(servers)
        yield {s.name: s for s in servers}
    finally:
        _end([s.proc for s in servers])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _measure(url: str) -> Measurement:
    with httpx.Client(base_url=url, trust_env=False) as client:
        return measure(client, WORKLOAD)


def _measure_all(pool: ProcessPoolExecutor, servers: dict[str, Standin]) -> dict[str, Measurement]:
    """The releases side by side, each measured by a process of its own (as a controller and its
    peers' measurements would not share one interpreter's lock on a busy machine)."""
    futures = {name: pool.submit(_measure, s.url) for name, s in servers.items()}
    return {name: f.result() for name, f in futures.items()}


def _measured_at_start_up(server: Standin) -> tuple[float, float]:
    """(greedy, temperature 1) accept lengths the stand-in logged when it measured its payload."""
    m = re.search(r"DDTree payload measured at start-up \(budget=16, topk_cap=4, [^)]*\): accept length "
                  r"([0-9.]+) greedy, ([0-9.]+) at temperature 1", server.log.read_text())
    assert m, server.log.read_text()
    return float(m.group(1)), float(m.group(2))


def test_the_payload_is_measured_once_at_start_up_not_per_request(releases):
    greedy, sampled = _measured_at_start_up(releases["ddtree"])
    assert greedy > sampled > 1.2  # the real payload's tree, drafts near the greedy chain
    log = releases["ddtree"].log.read_text()
    assert "DDTree payload error" not in log and log.count("DDTree payload measured") == 1, log
    plain = releases["baseline"].log.read_text()  # the control: no payload, nothing measured
    assert "DDTree payload measured" not in plain and "accept length 1.00" in plain, plain


def test_the_gates_verdict_is_the_releases_round_after_round_with_both_cores_busy(releases):
    rounds: list[dict[str, Measurement]] = []
    with ProcessPoolExecutor(len(releases), mp_context=multiprocessing.get_context("spawn")) as pool, \
            busy_loops(BUSY_LOOPS) as hogs:
        list(pool.map(time.sleep, [0.0] * len(releases)))  # the workers started before the loops
        for _ in range(ROUNDS):
            rounds.append(_measure_all(pool, releases))
        spun = [(p.poll(), _cpu_seconds(p.pid)) for p in hogs]
    # The loops spun the whole time (how much CPU they got depends on what else the machine runs).
    assert all(code is None and seconds > 0 for code, seconds in spun), spun
    faster = [compare(r["baseline"], r["ddtree"], THRESHOLDS) for r in rounds]
    slowed = [compare(r["baseline"], r["slowed"], THRESHOLDS) for r in rounds]
    detail = "\n\n".join(f"round {i}: ddtree {f.summary()}\n{format_rows(f.rows)}\nslowed {s.summary()}\n"
                         f"{format_rows(s.rows)}" for i, (f, s) in enumerate(zip(faster, slowed, strict=True)))
    assert [v.verdict for v in faster] == [Verdict.PASS] * ROUNDS, detail
    assert [v.verdict for v in slowed] == [Verdict.FAIL] * ROUNDS, detail
    assert all(any(r.startswith("output tok/s") for r in v.reasons) for v in slowed), detail
    # The DDTree release is faster by about its accept length, as the payload measured it (a request's
    # 30 ms prefill is the same for both, so a little less); the median of the rounds, as one round on
    # a machine with more jobs than the loops can starve both servers alike.
    greedy, sampled = _measured_at_start_up(releases["ddtree"])
    accept = greedy + (sampled - greedy) * WORKLOAD.temperature
    assert {r["baseline"].accept_length for r in rounds} == {1.0}, detail
    dd_accepts = {round(r["ddtree"].accept_length, 6) for r in rounds}  # the same every round
    assert len(dd_accepts) == 1 and dd_accepts.pop() == pytest.approx(accept, rel=0.1), detail
    ratios = sorted(r["ddtree"].output_tps / r["baseline"].output_tps for r in rounds)
    assert ratios[ROUNDS // 2] == pytest.approx(accept, rel=0.3), (ratios, detail)
