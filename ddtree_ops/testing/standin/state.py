"""What the server knows and answers: its arguments, counters, info documents, /generate (paced, streamed
or not) and the Prometheus text of /metrics.

Pacing (per request, as one server with room for every request would serve it): after admission (a
free slot under SGLang's --max-running-requests, when given) the prefill takes --standin-ttft-seconds,
then the first verify step's tokens come (the first stream chunk), then one chunk per verify step.
A verify step commits the release's accept length's worth of tokens (`State.accept_length`: step i
commits floor((i+1)A) - floor(iA)): the --standin-accept-length knob; else what the DDTree payload
accepted when it was measured at start-up (calibration.py); else, with DDTREE and no payload
functions, `default_accept_length`'s formula; else 1. A step takes n/R seconds with
--standin-tokens-per-second R, else the verify cost model's step time (costmodel.py, which says
why): with --standin-verify-steps-per-second N (default BASE_VERIFY_STEPS_PER_SECOND) and the knee
K of --standin-verify-knee-tokens (default costmodel.DEFAULT_KNEE_TOKENS, 256),
(1/N) x max(1, batch x width / K), where width is the tokens each request verifies per step
(`State.verify_width`: a DDTree's budget + 1, DFlash's 16, or --speculative-num-draft-tokens) and
batch the requests generating when the step is scheduled (`State.active`, read at each step). So
the decode rate is N x the accept length tokens/s while batch x width stays under K (a wide tree
is free at batch 1) and falls as K / (batch x width) past it (the best tree shrinks as the
concurrency grows); K <= 0 or inf turns the model off (always 1/N). Neither R nor
--standin-generate-seconds uses the model.

The tokens themselves are the toy model's, sampled one by one (a few microseconds each; a tree
verify is lossless, so they follow the same distribution as the payload's), and no maths of the
payload runs per request, so every release slows alike on a busy machine (the same verdict of the
perf gate on a busy machine as on an idle one). A step is due one step time after the previous
step was due or, when that one came out late, after it came out: as on a GPU, where a forward
that starts late ends late, a server that was starved for a while goes on at its step time and
never emits the steps it missed back to back (a burst of chunks a fraction of a millisecond
apart, which a client would read as an inter-token latency far below the release's). Between two
chunks on the server's clock there is therefore always at least one step time (with
--standin-tokens-per-second R, the second chunk's tokens / R); only --standin-generate-seconds,
which fixes a generation's whole duration, keeps its chunks on a schedule from the admission.
/server_info's `standin_paced_gen_throughput` is the last request's decode rate on that schedule
(the rate the modelled GPU made); `sglang:gen_throughput` is SGLang's, on the process's clock,
lower when the stand-in was starved of CPU."""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import random
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddtree_ops.config.redaction import MASK

from .args import masked
from .calibration import Calibration, cached_calibrate
from .costmodel import cost_model_on, verified_tokens_per_request, verify_step_seconds
from .logs import log
from .payload import PayloadError, list_ddtree_modules, lookup_ddtree_functions
from .toymodel import (
    ToyModel,
    _params,
    _prompt_tokens,
    _seed_of,
    detokenize,
    iter_autoregressive,
)

SGLANG_VERSION = "0.5.23"
DEFAULT_BUDGET = 16
# Verify steps (target forwards) per second and request: tokens/s at accept length 1
# (--standin-verify-steps-per-second's default).
BASE_VERIFY_STEPS_PER_SECOND = 400.0


def default_accept_length(budget: int, topk_cap: int) -> float:
    """The accept length a DDTree release gets when nothing measures one: monotone in the budget
    (deeper trees) and the top-k cap (wider ones), 1 + log2(1 + budget/4) + (min(topk_cap, budget) - 1)/4.
    Budget 16 / top-k cap 4: 4.07; 7/1: 2.46; 8/2: 2.83; 24/6: 5.06."""
    budget = max(1, int(budget))
    topk = max(1, min(int(topk_cap), budget))
    return 1.0 + math.log2(1.0 + budget / 4.0) + (topk - 1) / 4.0


def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"))


# -- Prometheus --------------------------------------------------------------------------
# SGLang 0.5.23's default buckets (srt/observability/metrics_collector.py, TokenizerMetricsCollector).
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = TTFT_BUCKETS + (600, 1200, 1800, 2400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
               0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)
GRAPH_PHASES = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend")
STARTUP_PHASES = ("load_weight", "kv_cache_allocation", "scheduler_e2e", "tokenizer_e2e")

# name: (type, help, buckets) -- in the order they are shown
_FAMILIES: dict[str, tuple[str, str, tuple[float, ...] | None]] = {
    "sglang:num_running_reqs": ("gauge", "The number of running requests.", None),
    "sglang:num_queue_reqs": ("gauge", "The number of requests in the waiting queue.", None),
    "sglang:gen_throughput": ("gauge", "The generation throughput (token/s).", None),
    "sglang:cache_hit_rate": ("gauge", "The prefix cache hit rate.", None),
    "sglang:token_usage": ("gauge", "The token usage.", None),
    "sglang:num_used_tokens": ("gauge", "The number of used tokens.", None),
    "sglang:spec_accept_length": (
        "gauge", "Mean acceptance length of speculative decoding (accepted drafts + bonus token per forward).",
        None),
    "sglang:spec_accept_rate": (
        "gauge", "Speculative acceptance rate (`accepted drafts / proposed drafts` in batch).", None),
    "sglang:startup_time_seconds": ("gauge", "Engine startup duration by phase in seconds.", None),
    "sglang:startup_cuda_graph_time_seconds": ("gauge", "CUDA graph capture duration by phase in seconds.", None),
    "sglang:prompt_tokens_total": ("counter", "Number of prefill tokens processed.", None),
    "sglang:generation_tokens_total": ("counter", "Number of generation tokens processed.", None),
    "sglang:spec_verify_calls_total": ("counter", "Number of speculative decoding verification calls.", None),
    "sglang:num_requests_total": ("counter", "Number of requests processed.", None),
    "sglang:num_aborted_requests_total": ("counter", "Number of requests aborted.", None),
    "sglang:time_to_first_token_seconds": (
        "histogram", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "sglang:inter_token_latency_seconds": (
        "histogram", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    "sglang:request_time_per_output_token_seconds": (
        "histogram", "Per-request TPOT in seconds: (finished_time - first_token_time) / (completion_tokens - 1).",
        ITL_BUCKETS),
    "sglang:e2e_request_latency_seconds": (
        "histogram", "Histogram of End-to-end request latency in seconds", E2E_BUCKETS),
}


def go_float(d: float) -> str:
    """prometheus_client's floatToGoString: how a sample value or bucket bound is written."""
    d = float(d)
    if d == math.inf:
        return "+Inf"
    if d == -math.inf:
        return "-Inf"
    if math.isnan(d):
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return s


def _label_text(labels: tuple[tuple[str, str], ...]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels) + "}" if labels else ""


class Metrics:
    """The few SGLang metrics a gate or a soak reads, kept as prometheus_client keeps them and written
    as SGLang's multi-process collector writes them (labels sorted by name, `le` last, no _created)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # family -> {sorted label items: value | [bucket counts, count, sum]}
        self.series: dict[str, dict[tuple[tuple[str, str], ...], Any]] = {name: {} for name in _FAMILIES}

    @staticmethod
    def _key(labels: dict[str, Any]) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((k, str(v)) for k, v in labels.items()))

    def set(self, name: str, labels: dict[str, Any], value: float) -> None:
        with self.lock:
            self.series[name][self._key(labels)] = float(value)

    def inc(self, name: str, labels: dict[str, Any], value: float = 1.0) -> None:
        with self.lock:
            key = self._key(labels)
            self.series[name][key] = self.series[name].get(key, 0.0) + float(value)

    def observe(self, name: str, labels: dict[str, Any], value: float, count: int = 1) -> None:
        """`count` observations of `value` with `value * count` added to the sum (SGLang's inter-token
        latency: a chunk of n tokens after an interval t counts n observations of t/n)."""
        buckets = _FAMILIES[name][2] or ()
        with self.lock:
            key = self._key(labels)
            ser = self.series[name].setdefault(key, [[0] * (len(buckets) + 1), 0, 0.0])
            idx = next((i for i, b in enumerate(buckets) if value <= b), len(buckets))
            ser[0][idx] += count
            ser[1] += count
            ser[2] += value * count

    def render(self) -> str:
        out: list[str] = []
        with self.lock:
            for name, (mtype, doc, buckets) in _FAMILIES.items():
                out.append(f"# HELP {name} {doc}")
                out.append(f"# TYPE {name} {mtype}")
                for key, val in sorted(self.series[name].items()):
                    if mtype != "histogram":
                        out.append(f"{name}{_label_text(key)} {go_float(val)}")
                        continue
                    acc = 0
                    for bound, n in zip((*(buckets or ()), math.inf), val[0], strict=True):
                        acc += n
                        out.append(f"{name}_bucket{_label_text(key + (('le', go_float(bound)),))} {go_float(acc)}")
                    out.append(f"{name}_count{_label_text(key)} {go_float(val[1])}")
                    out.append(f"{name}_sum{_label_text(key)} {go_float(val[2])}")
        return "\n".join(out) + "\n"


class State:
    def __init__(self, args: argparse.Namespace, extra: dict[str, Any], imported: dict[str, str],
                 site_packages: Path | None):
        self.args = args
        self.extra = extra
        self.imported = imported
        self.site_packages = site_packages
        self.status = "Starting"  # Starting | Up
        self.lock = threading.Lock()
        self.slot_free = threading.Condition(self.lock)
        self.running = 0  # /generate requests in flight, queued ones included (/v1/loads, the SIGTERM drain)
        self.queued = 0  # of which waiting for a slot (--max-running-requests)
        self.active = 0  # of which generating (SGLang's running requests)
        self.running_rids: dict[str, None] = {}
        self.gracefully_exiting = False  # SIGTERM received while Up: /health 503, finish what runs
        self.health_counter = 0
        self.total_verify_ct = 0
        self.total_committed = 0
        self.generate_count = 0
        self.ddtree_fns = lookup_ddtree_functions()
        self.calibration: Calibration | None = None  # set by `calibrate_payload`
        self.payload_errors = 0
        # The last counted request's decode rate on the pacing's schedule: what the modelled GPU
        # made, whatever CPU this process got (gen_throughput, on its clock, counts the time a
        # starved stand-in was not scheduled); None until a paced request has finished.
        self.paced_gen_throughput: float | None = None
        self.start_time = time.time()
        self.metrics = Metrics()
        self.metrics_enabled = _truthy(extra.get("enable_metrics"))
        self.incremental_streaming = _truthy(extra.get("incremental_streaming_output"))
        try:
            self.max_running = max(1, int(extra["max_running_requests"]))
        except (KeyError, TypeError, ValueError):
            self.max_running = None
        self.startup_time: dict[str, Any] | None = None
        for name in ("sglang:gen_throughput", "sglang:cache_hit_rate", "sglang:token_usage",
                     "sglang:num_used_tokens", "sglang:spec_accept_length", "sglang:spec_accept_rate"):
            self.metrics.set(name, self.scheduler_labels(), 0.0)

    # -- info ------------------------------------------------------------------------
    def budget(self) -> int:
        return self.args.speculative_ddtree_budget or DEFAULT_BUDGET

    def topk_cap(self) -> int:
        return self.args.speculative_ddtree_topk_cap or self.budget()

    def served_model_name(self) -> str:
        return self.args.served_model_name or self.args.model_path

    def calibrate_payload(self) -> None:
        """Measure the payload's accept length once (calibration.py), before the server is ready; a
        payload function that raises is logged with its traceback, and requests decode
        autoregressively (accept length 1)."""
        if self.ddtree_fns is None:
            return
        try:
            self.calibration = cached_calibrate(self.ddtree_fns, self.budget(), self.topk_cap(),
                                                list_ddtree_modules(self.site_packages),
                                                getattr(self.args, "standin_calibration_cache", None))
        except PayloadError as exc:
            self.payload_errors += 1
            log(f"DDTree payload error at start-up, falling back to autoregressive decoding: "
                f"{exc}\n{traceback.format_exc()}", "TP0")

    def accept_length(self, temperature: float) -> float:
        """Tokens per verify step a request at `temperature` is paced and counted with (see the
        module's docstring and `args.build_parser`'s help)."""
        a = self.args
        if a.standin_accept_length is not None:
            return max(1.0, float(a.standin_accept_length))
        if self.calibration is not None:
            return self.calibration.accept_length(temperature)
        if self.ddtree_fns is not None:
            return 1.0  # the payload raised when measured
        if (a.speculative_algorithm or "").upper() == "DDTREE":
            return default_accept_length(self.budget(), self.topk_cap())
        return 1.0

    def describe_accept_length(self) -> str:
        """The start-up log's words for where the accept length comes from."""
        a = self.args
        if a.standin_accept_length is not None:
            return f"{self.accept_length(0.0):.2f} (--standin-accept-length)"
        if self.calibration is not None:
            return f"measured from the payload at start-up: {self.calibration.describe()}"
        if self.ddtree_fns is not None:
            return "1.00 (the payload raised when measured)"
        return f"{self.accept_length(0.0):.2f}"

    def num_draft_tokens(self) -> int:
        """Tokens verified per request and step: --speculative-num-draft-tokens, else DFlash's default
        block (16), else the DDTree's budget + 1 (its root and its nodes)."""
        n = self.args.speculative_num_draft_tokens
        if n:
            return n
        return 16 if (self.args.speculative_algorithm or "").upper() == "DFLASH" else self.budget() + 1

    def verify_width(self) -> int:
        """Tokens each request verifies per step, as the cost model counts them
        (costmodel.verified_tokens_per_request: `num_draft_tokens` with speculative decoding, else 1)."""
        a = self.args
        return verified_tokens_per_request(a.speculative_algorithm, self.budget(), a.speculative_num_draft_tokens)

    def verify_steps_per_second(self) -> float:
        """N of the pacing (--standin-verify-steps-per-second; BASE_VERIFY_STEPS_PER_SECOND when not
        above 0)."""
        n = getattr(self.args, "standin_verify_steps_per_second", None) or 0.0
        return n if n > 0 else BASE_VERIFY_STEPS_PER_SECOND

    def verify_knee_tokens(self) -> float | None:
        """The cost model's knee when it paces this server's steps, else None: off with a knee <= 0
        or inf, and unused with --standin-tokens-per-second or --standin-generate-seconds."""
        a = self.args
        if (a.standin_tokens_per_second or 0) > 0 or (a.standin_generate_seconds or 0) > 0:
            return None
        knee = getattr(a, "standin_verify_knee_tokens", None)
        return float(knee) if knee is not None and cost_model_on(knee) else None

    def describe_cost_model(self) -> str:
        """The start-up log's words for the verify cost model in effect."""
        a = self.args
        if (a.standin_tokens_per_second or 0) > 0:
            return "verify cost model unused (--standin-tokens-per-second paces)"
        if (a.standin_generate_seconds or 0) > 0:
            return "verify cost model unused (--standin-generate-seconds paces)"
        knee = self.verify_knee_tokens()
        if knee is None:
            return f"verify cost model off (--standin-verify-knee-tokens {a.standin_verify_knee_tokens:g})"
        width = self.verify_width()
        flat = int(knee // width)
        return (f"verify cost model: step x max(1, batch x {width} tokens / {knee:g} knee tokens), "
                + (f"flat up to a batch of {flat}" if flat >= 1 else "past the knee from batch 1"))

    def verify_step_seconds(self) -> float:
        """One verify step's time for a step scheduled now (the cost model at the current batch)."""
        return verify_step_seconds(self.verify_steps_per_second(), self.verify_width(), self.active,
                                   self.verify_knee_tokens())

    def draft_tokens_per_step(self) -> int:
        """Drafts proposed per verify step (SGLang: speculative_num_draft_tokens - 1)."""
        return max(1, self.num_draft_tokens() - 1)

    def scheduler_labels(self) -> dict[str, Any]:
        """SGLang 0.5.23's SchedulerMetricsCollector labels (one TP rank 0, no PD disaggregation)."""
        return {"model_name": self.served_model_name(), "engine_type": "unified", "tp_rank": 0, "pp_rank": 0,
                "moe_ep_rank": 0}

    def tokenizer_labels(self) -> dict[str, Any]:
        return {"model_name": self.served_model_name(), "engine_type": "unified"}

    def set_startup_time(self, startup: dict[str, Any]) -> None:
        """SGLang's `Engine startup timings` as /metrics shows them (TokenizerMetricsCollector.emit_startup_time)."""
        self.startup_time = startup
        for phase in STARTUP_PHASES:
            self.metrics.set("sglang:startup_time_seconds", {**self.tokenizer_labels(), "phase": phase},
                             startup[phase])
        for phase, seconds in startup["cuda_graph"].items():
            self.metrics.set("sglang:startup_cuda_graph_time_seconds", {**self.tokenizer_labels(), "phase": phase},
                             seconds)

    def metrics_text(self) -> str:
        with self.lock:
            running, queued = self.active, self.queued
        self.metrics.set("sglang:num_running_reqs", self.scheduler_labels(), running)
        self.metrics.set("sglang:num_queue_reqs", self.scheduler_labels(), queued)
        return self.metrics.render()

    def server_info(self) -> dict[str, Any]:
        a = self.args
        info: dict[str, Any] = {
            "model_path": a.model_path,
            "served_model_name": a.served_model_name or a.model_path,
            "tokenizer_path": a.tokenizer_path or a.model_path,
            "host": a.host,
            "port": a.port,
            "tp_size": a.tp_size,
            "dp_size": a.dp_size,
            "nnodes": a.nnodes,
            "node_rank": a.node_rank,
            "dist_init_addr": a.dist_init_addr,
            "api_key": MASK if a.api_key else None,
            "speculative_algorithm": a.speculative_algorithm,
            "speculative_draft_model_path": a.speculative_draft_model_path,
            "speculative_num_draft_tokens": a.speculative_num_draft_tokens,
            "speculative_num_steps": a.speculative_num_steps,
            "speculative_eagle_topk": a.speculative_eagle_topk,
            "speculative_ddtree_budget": a.speculative_ddtree_budget,
            "speculative_ddtree_topk_cap": a.speculative_ddtree_topk_cap,
        }
        for k, v in masked(self.extra).items():
            info.setdefault(k, v)
        state: dict[str, Any] = {}
        with self.lock:
            if self.total_verify_ct:
                state["avg_spec_accept_length"] = self.total_committed / self.total_verify_ct
        info.update({
            "version": SGLANG_VERSION,
            "standin": True,
            "standin_ddtree_modules": dict(self.imported),
            "standin_ddtree_path": self.ddtree_fns is not None,
            "standin_payload_errors": self.payload_errors,
            "standin_paced_gen_throughput": self.paced_gen_throughput,
            "standin_verify_knee_tokens": self.verify_knee_tokens(),
            "standin_verify_width": self.verify_width(),
            "standin_extra_args": masked(self.extra),
            "internal_states": [dict(state) for _ in range(max(1, a.dp_size))],
            "status": self.status,
        })
        return info

    def model_info(self) -> dict[str, Any]:
        a = self.args
        return {
            "model_path": a.model_path,
            "tokenizer_path": a.tokenizer_path or a.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "standin",
            "architectures": ["StandinToyForCausalLM"],
            "served_model_name": a.served_model_name or a.model_path,
        }

    # -- admission -------------------------------------------------------------------
    def admit(self, rid: str) -> None:
        """Count the request in flight, then wait for a slot (SGLang's --max-running-requests)."""
        with self.slot_free:
            self.running += 1
            self.running_rids[rid] = None
            self.queued += 1
            try:
                while self.max_running is not None and self.active >= self.max_running:
                    self.slot_free.wait(0.5)
            finally:
                self.queued -= 1
            self.active += 1

    def free_slot(self) -> None:
        """The request's generation ended: a queued one may start. It stays in flight until answered."""
        with self.slot_free:
            self.active -= 1
            self.slot_free.notify()

    def release(self, rid: str) -> None:
        """The request was answered (or its client left): no longer in flight."""
        with self.slot_free:
            self.running -= 1
            self.running_rids.pop(rid, None)
            self.slot_free.notify()

    # -- generation ------------------------------------------------------------------
    def generate_one(self, text: str, sp: dict[str, Any], count_stats: bool = True) -> dict[str, Any]:
        """One non-streamed generation, paced, start to end (what POST /generate answers)."""
        gen = Generation(self, text, sp, count_stats=count_stats)
        gen.start()
        try:
            return gen.run()
        finally:
            gen.release()


class Generation:
    """One /generate request: tokens a verify step at a time, each step's chunk due when the release's
    pacing says (see the module's docstring); `chunks()` yields what SGLang 0.5.23's tokenizer manager
    would send for a stream (text and output_ids cumulative, or deltas with
    --incremental-streaming-output; meta_info.completion_tokens cumulative; finish_reason, e2e_latency
    and the spec_* figures on the last chunk only)."""

    def __init__(self, state: State, text: str, sp: dict[str, Any], *, stream: bool = False,
                 count_stats: bool = True, warmup: bool = False):
        self.state = state
        self.warmup = warmup  # the server's own warm-up request: not counted, not --standin-generate-seconds
        count_stats = count_stats and not warmup
        self.text = text
        self.params = _params(sp)
        self.max_new = self.params[3]
        self.stream = stream
        self.count_stats = count_stats
        self.rid = uuid.uuid4().hex
        self.arrival = time.monotonic()
        self.prompt = _prompt_tokens(text)
        self.incremental = stream and state.incremental_streaming
        self.used_ddtree = state.calibration is not None  # paced with what the payload accepts
        self.done = False
        self._paced_s = 0.0  # the steps after the first on the pacing's schedule, lateness left out
        self._slot_held = False
        self._admitted = False

    def start(self) -> None:
        self.state.admit(self.rid)
        self._admitted = self._slot_held = True

    def release(self) -> None:
        if self._slot_held:
            self._slot_held = False
            self.state.free_slot()
        if self._admitted:
            self._admitted = False
            self.state.release(self.rid)

    def run(self) -> dict[str, Any]:
        last: dict[str, Any] = {}
        for chunk in self.chunks():
            last = chunk
        return last

    # -- tokens ---------------------------------------------------------------------
    def _steps(self) -> Iterator[list[int]]:
        """Verify steps: each the tokens it commits, the request's accept length A on average."""
        seed = _seed_of(self.text)
        tokens = iter_autoregressive(_toy_model(seed), self.prompt[-1], self.params, random.Random(seed))
        a = self.state.accept_length(self.params[0])
        for i in itertools.count():
            want = math.floor((i + 1) * a + 1e-9) - math.floor(i * a + 1e-9)
            yield list(itertools.islice(tokens, want))

    # -- the paced stream -----------------------------------------------------------
    def chunks(self) -> Iterator[dict[str, Any]]:
        a = self.state.args
        rate = a.standin_tokens_per_second if (a.standin_tokens_per_second or 0) > 0 else None
        total_s = 0.0 if self.warmup else max(0.0, a.standin_generate_seconds or 0.0)
        ttft = max(0.0, a.standin_ttft_seconds or 0.0)
        if total_s > 0:
            ttft = min(ttft, total_s)
        t0 = time.monotonic()  # admitted
        committed: list[int] = []
        verify_ct = 0
        first_n = 0
        sent = 0  # tokens already sent (incremental streaming)
        times: list[float] = []
        due = t0 + ttft
        steps = self._steps()
        try:
            while True:
                step: list[int] = []
                if len(committed) < self.max_new:
                    step = next(steps)[: self.max_new - len(committed)]
                    verify_ct += 1
                committed.extend(step)
                final = len(committed) >= self.max_new
                if not times:
                    first_n = len(committed)
                    due = t0 + ttft
                elif total_s > 0:
                    left = max(1, self.max_new - first_n)
                    due = t0 + ttft + (total_s - ttft) * (len(committed) - first_n) / left
                else:
                    # A step starts when the previous one is out, and not before it was due: a late
                    # chunk shifts the steps after it (never a burst of missed steps to catch up).
                    # Its time is the cost model's at the batch generating now (costmodel.py).
                    took = len(step) / rate if rate is not None else self.state.verify_step_seconds()
                    due = max(due, times[-1]) + took
                    self._paced_s += took
                if final and total_s > 0:
                    due = t0 + total_s
                _sleep_until(due)
                now = time.monotonic()
                self._observe_chunk(now, times, len(step))
                times.append(now)
                if final:
                    self.done = True
                out = self._out(committed, sent, final, verify_ct, now, first_n, times)
                sent = len(committed)
                yield out
                if final:
                    return
        finally:
            steps.close()
            if self._slot_held:
                self._slot_held = False
                self.state.free_slot()
            if not self.done and self.count_stats:
                self.state.metrics.inc("sglang:num_aborted_requests_total", self.state.tokenizer_labels())

    def _observe_chunk(self, now: float, times: list[float], n: int) -> None:
        if not self.count_stats:
            return
        m, labels = self.state.metrics, self.state.tokenizer_labels()
        if not times:
            m.observe("sglang:time_to_first_token_seconds", {**labels, "is_streaming": _bool(self.stream)},
                      now - self.arrival)
        elif n > 0:
            m.observe("sglang:inter_token_latency_seconds", labels, (now - times[-1]) / n, n)

    def _out(self, committed: list[int], sent: int, final: bool, verify_ct: int, now: float, first_n: int,
             times: list[float]) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": {"type": "length", "length": self.max_new} if final else None,
            "prompt_tokens": len(self.prompt),
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(committed),
            "cached_tokens": 0,
        }
        ids = committed[sent:] if self.incremental else list(committed)
        text = detokenize(committed)
        if self.incremental:
            text = text[len(detokenize(committed[:sent])):] if sent else text
        if final:
            meta.update(self._finish(committed, verify_ct, now, first_n, times))
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def _finish(self, committed: list[int], verify_ct: int, now: float, first_n: int,
                times: list[float]) -> dict[str, Any]:
        """The last chunk's figures; the request's counters, gauges and `Decode batch` line."""
        st = self.state
        n = len(committed)
        e2e = now - self.arrival
        accept_len = (n / verify_ct) if verify_ct else 1.0
        proposed = verify_ct * st.draft_tokens_per_step()
        correct = max(0, n - verify_ct)
        accept_rate = min(1.0, correct / proposed) if proposed else 0.0
        if len(times) >= 2 and times[-1] > times[0]:
            throughput = (n - first_n) / (times[-1] - times[0])
        else:
            throughput = n / max(e2e, 1e-6)
        if self.count_stats:
            with st.lock:
                if self._paced_s > 0:
                    st.paced_gen_throughput = (n - first_n) / self._paced_s
                st.generate_count += 1
                st.total_verify_ct += verify_ct if verify_ct else 1
                st.total_committed += n if verify_ct else 1
                active, queued = st.active, st.queued
            m, tl, sl = st.metrics, st.tokenizer_labels(), st.scheduler_labels()
            streaming = {**tl, "is_streaming": _bool(self.stream)}
            m.inc("sglang:prompt_tokens_total", streaming, len(self.prompt))
            m.inc("sglang:generation_tokens_total", streaming, n)
            m.inc("sglang:num_requests_total", streaming)
            if verify_ct:
                m.inc("sglang:spec_verify_calls_total", tl, verify_ct)
            m.observe("sglang:e2e_request_latency_seconds", streaming, e2e)
            if n > 1:
                m.observe("sglang:request_time_per_output_token_seconds", streaming, (now - times[0]) / (n - 1))
            m.set("sglang:spec_accept_length", sl, accept_len)
            m.set("sglang:spec_accept_rate", sl, accept_rate)
            m.set("sglang:gen_throughput", sl, throughput)
            # SGLang 0.5.23's line (scheduler_components/metrics_reporter.py report_decode_stats), here
            # one per finished request
            log(f"Decode batch, #running-req: {active}, #token: {len(self.prompt) + n}, "
                f"token usage: 0.00, accept len: {accept_len:.2f}, accept rate: {accept_rate:.2f}, "
                f"cuda graph: True, gen throughput (token/s): {throughput:.2f}, #queue-req: {queued}", "TP0")
        return {
            "e2e_latency": e2e,
            "spec_accept_rate": accept_rate,
            "spec_accept_length": accept_len,
            "spec_num_correct_drafts": correct,
            "spec_num_proposed_drafts": proposed,
            "spec_verify_ct": verify_ct,
            "spec_ddtree": self.used_ddtree,
        }


@functools.lru_cache(maxsize=64)
def _toy_model(seed: int) -> ToyModel:
    """A prompt's toy model, kept: its rows and sampling tables cost more CPU than its tokens."""
    return ToyModel(seed)


def _bool(flag: bool) -> str:
    return "true" if flag else "false"


def _sleep_until(deadline: float) -> None:
    left = deadline - time.monotonic()
    if left > 0:
        time.sleep(left)
