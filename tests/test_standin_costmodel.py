"""The stand-in's verify cost model (ddtree_ops/testing/standin/costmodel.py): the pure functions
from data, the knobs as the server parses them, and -- in stand-in server processes on 127.0.0.1
(marked `sandbox`, as the rig's own server tests are) -- a batch that slows each request's decode by
the model's factor, and a DDTree budget above --standin-fail-budget-above ending start-up while the
verify CUDA graph is captured."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_perfgate_standin import _formula_site

from ddtree_ops.testing.sandbox.smg import free_port
from ddtree_ops.testing.standin import costmodel
from ddtree_ops.testing.standin.args import build_parser
from ddtree_ops.testing.standin.costmodel import (
    DEFAULT_KNEE_TOKENS,
    cost_model_on,
    expected_decode_tps,
    expected_output_tps,
    expected_request_seconds,
    steps_to_commit,
    verified_tokens_per_request,
    verify_step_seconds,
)
from ddtree_ops.testing.standin.state import State, default_accept_length

REPO = Path(__file__).resolve().parents[1]
BUDGETS = (4, 8, 16, 32)
TOPK_CAPS = (1, 2, 4)


# -- the pure model --------------------------------------------------------------------------------

def test_a_step_is_flat_at_batch_1_for_every_width_under_the_knee():
    for width in (1, 5, 9, 16, 17, 33, 128, 256):
        assert verify_step_seconds(400, width, 1, 256) == pytest.approx(1 / 400), width


def test_past_the_knee_a_step_grows_linearly_with_the_batchs_verified_tokens():
    assert verify_step_seconds(400, 33, 16, 256) == pytest.approx((16 * 33 / 256) / 400)
    assert verify_step_seconds(100, 16, 4, 32) == pytest.approx(2 / 100)
    # twice the batch past the knee: twice the time
    assert verify_step_seconds(400, 17, 32, 256) == pytest.approx(2 * verify_step_seconds(400, 17, 16, 256))


def test_the_perf_gates_dflash_baseline_and_ddtree_16_4_pace_alike_at_its_concurrencies_by_default():
    """The existing contract the default knee keeps: width 16 and 17 at concurrency 1-4 both 1/N."""
    dflash = verified_tokens_per_request("DFLASH", 16)
    ddtree = verified_tokens_per_request("DDTREE", 16)
    assert (dflash, ddtree) == (16, 17)
    for c in (1, 2, 4):
        assert verify_step_seconds(400, dflash, c, DEFAULT_KNEE_TOKENS) == 1 / 400
        assert verify_step_seconds(400, ddtree, c, DEFAULT_KNEE_TOKENS) == 1 / 400


@pytest.mark.parametrize("knee", [None, 0, -5, math.inf])
def test_a_knee_of_zero_or_below_or_infinite_turns_the_model_off(knee):
    assert not cost_model_on(knee)
    assert verify_step_seconds(400, 33, 64, knee) == 1 / 400


def test_a_step_rate_of_zero_is_refused_with_its_name():
    with pytest.raises(ValueError, match="steps_per_second"):
        verify_step_seconds(0, 17, 1, 256)


def test_the_width_is_what_each_request_verifies_per_step():
    assert verified_tokens_per_request("DDTREE", 8) == 9
    assert verified_tokens_per_request("ddtree", 32) == 33
    assert verified_tokens_per_request("DFLASH", 32) == 16
    assert verified_tokens_per_request("DFLASH", 32, num_draft_tokens=8) == 8
    assert verified_tokens_per_request(None, 16) == 1
    assert verified_tokens_per_request(None, 16, num_draft_tokens=8) == 1  # plain decode ignores it


def _steps_by_the_standins_rule(a: float, n: int) -> int:
    """state.Generation._steps and chunks, re-done: step i commits floor((i+1)A) - floor(iA), capped."""
    committed = steps = 0
    while committed < n:
        committed += math.floor((steps + 1) * a + 1e-9) - math.floor(steps * a + 1e-9)
        steps += 1
    return steps


def test_steps_to_commit_counts_the_last_partial_step_as_the_server_does():
    assert steps_to_commit(1.0, 64) == 64
    assert steps_to_commit(4.0, 64) == 16
    assert steps_to_commit(4.2, 64) == 16  # 15 steps commit 63: the 16th is a partial one
    assert steps_to_commit(4.07, 64) == 16
    for a in (1.0, 1.3, 2.0, 2.46, 2.83, 3.32, 4.07, 4.33, 4.92, 5.06, 7.5):
        for n in (1, 2, 7, 8, 16, 63, 64, 65, 120, 256):
            assert steps_to_commit(a, n) == _steps_by_the_standins_rule(a, n), (a, n)


def test_a_requests_time_is_its_prefill_then_a_step_time_per_further_step():
    # 64 tokens at A 4.07 (16 steps), width 17 at batch 16 (past the 256 knee by 272/256)
    step = (16 * 17 / 256) / 400
    assert expected_request_seconds(4.07, 17, 16, 400, 256, 64, 0.03) == pytest.approx(0.03 + 15 * step)
    assert expected_output_tps(4.07, 17, 16, 400, 256, 64, 0.03) == pytest.approx(16 * 64 / (0.03 + 15 * step))
    assert expected_decode_tps(4.07, 17, 16, 400, 256) == pytest.approx(4.07 / step)


def _best(concurrency: int, rate) -> tuple[int, int]:
    return max(((b, k) for b in BUDGETS for k in TOPK_CAPS),
               key=lambda bk: rate(default_accept_length(*bk), verified_tokens_per_request("DDTREE", bk[0]),
                                   concurrency))


def test_the_best_tree_shrinks_as_the_concurrency_grows():
    """With the formula's accept lengths (the stand-in's without a payload) and the default knee: the
    widest tree while the batch stays under the knee, then about the one that fills it."""
    def decode(a: float, width: int, c: int) -> float:
        return c * expected_decode_tps(a, width, c, 400, DEFAULT_KNEE_TOKENS)

    def output(a: float, width: int, c: int) -> float:
        return expected_output_tps(a, width, c, 400, DEFAULT_KNEE_TOKENS, 64, 0.03)

    for rate in (decode, output):
        best = {c: _best(c, rate) for c in (1, 4, 16, 64)}
        assert best == {1: (32, 4), 4: (32, 4), 16: (16, 4), 64: (4, 4)}, (rate.__name__, best)
    # without the model a bigger tree always wins
    flat = {c: _best(c, lambda a, w, c: expected_output_tps(a, w, c, 400, math.inf, 64, 0.03)) for c in (1, 64)}
    assert flat == {1: (32, 4), 64: (32, 4)}


def test_the_prefill_never_reorders_two_configs_but_shrinks_their_ratio():
    fast, slow = (default_accept_length(8, 4), 9), (default_accept_length(32, 4), 33)  # at c 16: 8/4 wins

    def ratio(ttft: float) -> float:
        return (expected_output_tps(*fast, 16, 400, 256, 64, ttft)
                / expected_output_tps(*slow, 16, 400, 256, 64, ttft))

    assert ratio(0.0) > ratio(0.03) > ratio(1.0) > 1.0


# -- the knobs ---------------------------------------------------------------------------------------

def test_the_knee_knob_defaults_to_256_and_takes_inf_or_zero_to_turn_the_model_off():
    p = build_parser()
    assert p.parse_args([]).standin_verify_knee_tokens == DEFAULT_KNEE_TOKENS == 256
    assert p.parse_args(["--standin-verify-knee-tokens", "64"]).standin_verify_knee_tokens == 64
    assert p.parse_args(["--standin-verify-knee-tokens", "inf"]).standin_verify_knee_tokens == math.inf
    assert p.parse_args(["--standin-verify-knee-tokens", "0"]).standin_verify_knee_tokens == 0
    assert p.parse_args([]).standin_fail_budget_above is None
    assert p.parse_args(["--standin-fail-budget-above", "8"]).standin_fail_budget_above == 8


@pytest.mark.parametrize("value", ["nan", "lots"])
def test_a_knee_that_is_not_a_number_is_argparses_error_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--standin-verify-knee-tokens", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --standin-verify-knee-tokens: not a number of tokens" in err and repr(value) in err


def _state(*argv: str) -> State:
    args, unknown = build_parser().parse_known_args(list(argv))
    assert not unknown
    return State(args, {}, {}, None)


def test_the_server_paces_with_the_model_only_in_the_verify_steps_mode():
    ddtree = ("--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "8")
    s = _state(*ddtree, "--standin-verify-knee-tokens", "64", "--standin-verify-steps-per-second", "100")
    assert (s.verify_width(), s.verify_knee_tokens(), s.verify_steps_per_second()) == (9, 64.0, 100.0)
    s.active = 16  # 16 x 9 = 144 tokens: 2.25 x the step
    assert s.verify_step_seconds() == pytest.approx(2.25 / 100)
    assert "batch x 9 tokens / 64 knee tokens), flat up to a batch of 7" in s.describe_cost_model()
    assert s.server_info()["standin_verify_knee_tokens"] == 64.0
    narrow_knee = _state(*ddtree, "--standin-verify-knee-tokens", "4")
    assert "/ 4 knee tokens), past the knee from batch 1" in narrow_knee.describe_cost_model()
    assert s.server_info()["standin_verify_width"] == 9
    for more, words in ((("--standin-verify-knee-tokens", "inf"), "off (--standin-verify-knee-tokens inf)"),
                        (("--standin-tokens-per-second", "50"), "unused (--standin-tokens-per-second paces)"),
                        (("--standin-generate-seconds", "2"), "unused (--standin-generate-seconds paces)")):
        off = _state(*ddtree, *more)
        off.active = 16
        assert off.verify_knee_tokens() is None and off.server_info()["standin_verify_knee_tokens"] is None
        assert off.verify_step_seconds() == 1 / 400
        assert words in off.describe_cost_model(), more


# -- stand-in servers (a DDTree module without the payload's functions: the formula's accept length)



class _Server:
    def __init__(self, tmp: Path, name: str, *flags: str):
        self.port = free_port()
        self.log_path = tmp / f"{name}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_formula_site(tmp / f"sp-{name}")), str(REPO)])}
        env.pop("DDTREE_STANDIN_LOAD_SECONDS", None)
        with open(self.log_path, "wb") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ddtree_ops.testing.standin", "--host", "127.0.0.1", "--port",
                 str(self.port), "--model-path", "/models/toy", "--standin-load-seconds", "0",
                 "--standin-warmup-seconds", "0", "--standin-gpu-dir", "", *flags],
                stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, env=env)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def port_open(self) -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def get(self, path: str) -> tuple[int | None, dict | None]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, None
        except (urllib.error.URLError, ConnectionError):
            return None, None

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.get("/health")[0] != 200:
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.log}"
            assert time.monotonic() < deadline, f"never healthy:\n{self.log}"
            time.sleep(0.05)

    def generate(self, max_new_tokens: int) -> dict:
        body = json.dumps({"text": "x", "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}})
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/generate", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())["meta_info"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def servers(tmp_path):
    started: list[_Server] = []

    def start(name: str, *flags: str) -> _Server:
        started.append(_Server(tmp_path, name, *flags))
        return started[-1]

    try:
        yield start
    finally:
        for s in started:
            s.stop()


def _decode_seconds(server: _Server, concurrency: int, max_new_tokens: int) -> list[float]:
    """Each request's time after its prefill, on the server's clock (e2e_latency less the 30 ms
    prefill), `concurrency` of them sent at once."""
    metas: list[dict] = []

    def one() -> None:
        metas.append(server.generate(max_new_tokens))

    threads = [threading.Thread(target=one) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(metas) == concurrency and all(m["completion_tokens"] == max_new_tokens for m in metas), metas
    return [m["e2e_latency"] - 0.03 for m in metas]


@pytest.mark.sandbox
def test_four_requests_at_once_decode_slower_than_one_by_the_models_factor(servers):
    """DFlash (width 16, accept length 1) at 100 steps/s with a knee of 32 tokens: one request is
    flat (16 < 32), four at once verify 64 tokens a step, twice the knee: each step takes 20 ms
    instead of 10. The same server without the model (knee inf) decodes four as fast as one.
    Ratios in one run on one server, so the machine's speed cancels; sleeps dominate at 10 ms a step.
    The DFlash control row ignores --standin-fail-budget-above: it has no DDTree budget."""
    common = ("--speculative-algorithm", "DFLASH", "--standin-verify-steps-per-second", "100",
              "--standin-fail-budget-above", "1")
    modelled = servers("knee32", *common, "--standin-verify-knee-tokens", "32")
    plain = servers("knee-inf", *common, "--standin-verify-knee-tokens", "inf")
    modelled.wait_healthy()
    plain.wait_healthy()
    n = 40
    model_ratio = ((expected_request_seconds(1.0, 16, 4, 100, 32, n, 0.03) - 0.03)
                   / (expected_request_seconds(1.0, 16, 1, 100, 32, n, 0.03) - 0.03))
    assert model_ratio == pytest.approx(2.0)
    # A late step (a loaded machine) makes the lone request's 10 ms steps later by more, relatively,
    # than the batch's 20 ms ones: the ratio reads low then, so the lone time is the better of two.
    alone = min(_decode_seconds(modelled, 1, n) + _decode_seconds(modelled, 1, n))
    together = _decode_seconds(modelled, 4, n)
    ratio = (sum(together) / len(together)) / alone
    assert 0.75 * model_ratio < ratio < 1.15 * model_ratio, (alone, together)
    plain_alone = min(_decode_seconds(plain, 1, n) + _decode_seconds(plain, 1, n))
    plain_together = _decode_seconds(plain, 4, n)
    assert (sum(plain_together) / 4) / plain_alone < 1.3, (plain_alone, plain_together)
    assert modelled.get("/server_info")[1]["standin_verify_knee_tokens"] == 32
    assert plain.get("/server_info")[1]["standin_verify_knee_tokens"] is None
    assert "verify cost model: step x max(1, batch x 16 tokens / 32 knee tokens)" in modelled.log
    assert "verify cost model off (--standin-verify-knee-tokens inf)" in plain.log


@pytest.mark.sandbox
def test_a_budget_above_the_fail_knob_dies_capturing_cuda_graphs_before_the_port_opens(servers):
    ddtree = ("--speculative-algorithm", "DDTREE", "--speculative-ddtree-topk-cap", "4",
              "--standin-fail-budget-above", "8")
    too_big = servers("budget16", *ddtree, "--speculative-ddtree-budget", "16")
    at_limit = servers("budget8", *ddtree, "--speculative-ddtree-budget", "8")
    deadline = time.monotonic() + 30
    while too_big.proc.poll() is None:
        assert not too_big.port_open(), too_big.log
        assert time.monotonic() < deadline, f"still running:\n{too_big.log}"
        time.sleep(0.02)
    assert too_big.proc.returncode == 1, too_big.log
    log = too_big.log
    assert "Capture target verify CUDA graph begin. backend=full, num_tokens_per_req=17" in log
    assert "Scheduler hit an exception: Traceback (most recent call last)" in log
    assert "RuntimeError: CUDA error: too many resources requested" in log
    assert "Exception: Capture cuda graph failed: " in log and "speculative_ddtree_budget=16" in log
    for never in ("Capture target verify CUDA graph end", "Uvicorn running on", "fired up"):
        assert never not in log, log
    at_limit.wait_healthy()
    assert "Capture cuda graph failed" not in at_limit.log
    assert at_limit.get("/server_info")[1]["speculative_ddtree_budget"] == 8
    assert costmodel.DEFAULT_KNEE_TOKENS == at_limit.get("/server_info")[1]["standin_verify_knee_tokens"]


# --------------------------------------------------------------------------- the calibration cache


def test_the_payloads_accept_length_is_measured_once_per_payload_files_and_config(tmp_path, monkeypatch):
    from ddtree_ops.testing.standin import calibration as cal

    measured = []

    def fake_calibrate(fns, budget, topk_cap):
        measured.append((budget, topk_cap))
        return cal.Calibration(2.0 + budget / 100, 1.5, 128, 0.7)
    monkeypatch.setattr(cal, "calibrate", fake_calibrate)
    module = tmp_path / "ddtree_utils.py"
    module.write_bytes(b"# payload v1\n")
    cache = str(tmp_path / "cache")

    first = cal.cached_calibrate(None, 16, 4, [module], cache)
    again = cal.cached_calibrate(None, 16, 4, [module], cache)
    assert measured == [(16, 4)] and not first.cached and again.cached
    assert (again.greedy, again.sampled, again.steps) == (first.greedy, first.sampled, first.steps)
    assert "cached from an earlier start" in again.describe() and "128 verify steps each" in again.describe()

    cal.cached_calibrate(None, 8, 4, [module], cache)  # another config
    module.write_bytes(b"# payload v2\n")  # another release of the payload
    cal.cached_calibrate(None, 16, 4, [module], cache)
    assert measured == [(16, 4), (8, 4), (16, 4)]

    for f in (tmp_path / "cache").iterdir():
        f.write_text("{not json")
    assert not cal.cached_calibrate(None, 16, 4, [module], cache).cached  # an odd file: measured again
    cal.cached_calibrate(None, 16, 4, [module], None)  # no cache: every start measures
    assert len(measured) == 5
