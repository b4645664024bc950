"""The stand-in's verify-step cost model: how long one target forward takes for a batch of requests
each verifying a tree (or a DFlash block) of `width` tokens. Pure functions, no clock: the stand-in
paces with `verify_step_seconds`, and a tune test imports the same model to work out, independently
of the server, which budget / top-k cap should win at each concurrency (`expected_output_tps`).

Why a cost model at all. Without one a verify step took 1/N s whatever the tree, so a bigger tree
(more tokens accepted per step) always won and a tune had nothing to find. On a GPU a decode or
verify forward is memory-bound while the batch's tokens are few: it reads every weight once, and
the matrix units idle, so the forward costs about the same for 1 token or 100. Once the tokens the
whole batch verifies (batch x width) reach the chip's compute knee (its FLOP/s over its bytes/s,
times the bytes per parameter: a few hundred tokens on an H100/H200/B200 in bf16/fp8), the forward
becomes compute-bound and grows linearly with them. That is the roofline::

    step_s = (1 / steps_per_second) x max(1, batch x width / knee_tokens)

So a wide tree is free at batch 1 (its extra accepted tokens are pure gain) and costly at batch 16
(every verified token past the knee costs time, and a tree's accept length grows only with the log
of its budget): the best tree shrinks as concurrency grows, to about the one whose width fills the
knee at that batch (width ~ knee / batch), as the paper and an independent vLLM implementation saw
a tree lose its edge over a flat chain as the batch grew.

Why the hard `max` and not the smoother 1 + batch x width / knee: below the knee a real forward is
flat (the weight reads dominate), and the stand-in's existing contract -- a DFlash baseline (width
16) and DDTree 16/4 (width 17) at concurrency 1 to 4 paced at exactly N steps/s, which the perf gate's
and the stand-in's own tests rely on -- holds to the digit with the default knee of 256 tokens
(`DEFAULT_KNEE_TOKENS`: 4 x 17 = 68 is far below it); the smooth form would slow every release by
width / knee even at batch 1 and favour narrow trees where the GPU does not.

What it ignores (the same for every config, or not modelled at all):

* the tree attention's own overhead beyond its tokens (mask building, the walk of the tree): the
  vLLM implementation's tree 31.6 % slower than the chain at batch 1 with CUDA graphs is not here;
* the drafter's forward (DFlash drafts a block in one forward whatever the tree; its cost is folded
  into the step time N);
* prefill: a request's prefill (--standin-ttft-seconds) is a fixed delay that does not slow the
  batch's verify steps, and the first verify step's tokens come with it (`state`'s pacing);
* the KV cache: memory, paging and the sequence length do not change the step time;
* the batch is the requests generating when a step is scheduled (`State.active`: admitted, in
  prefill or decoding; queued ones behind --max-running-requests are not on the GPU), read per
  request and step -- each request is paced by its own clock, as if every request of a batch ran
  its own forward at the batch's cost, which is what a continuous-batching GPU's per-request decode
  rate amounts to.

Knee <= 0 or infinite turns the model off (`cost_model_on`): the step time is 1/N whatever the batch.
"""

from __future__ import annotations

import math

# --standin-verify-knee-tokens's default: the batch's verified tokens past which a forward is
# compute-bound. At it a DFlash baseline (16) and DDTree 16/4 (17) are both flat up to concurrency 15.
DEFAULT_KNEE_TOKENS = 256.0
DFLASH_BLOCK_TOKENS = 16  # DFlash's default block: tokens verified per request and step


def cost_model_on(knee_tokens: float | None) -> bool:
    """Whether `knee_tokens` turns the model on: a finite number above 0."""
    return knee_tokens is not None and math.isfinite(knee_tokens) and knee_tokens > 0


def verified_tokens_per_request(algorithm: str | None, budget: int, num_draft_tokens: int | None = None) -> int:
    """The width: tokens verified per request and step. 1 without speculative decoding (plain
    decode runs the one token it sampled); else --speculative-num-draft-tokens when given, else
    DFlash's block (16), else a DDTree's budget + 1 (its root and its nodes; the stand-in models any
    other speculative algorithm so too). `State.verify_width` is this for the server's flags."""
    if not algorithm:
        return 1
    if num_draft_tokens:
        return int(num_draft_tokens)
    if algorithm.upper() == "DFLASH":
        return DFLASH_BLOCK_TOKENS
    return int(budget) + 1


def verify_step_seconds(steps_per_second: float, width: int, batch: int, knee_tokens: float | None) -> float:
    """One verify step's time for each request of a batch of `batch` requests verifying `width`
    tokens each: (1 / steps_per_second) x max(1, batch x width / knee_tokens); 1 / steps_per_second
    with the model off (`cost_model_on`). A batch under 1 (a step scheduled as the request itself
    is being counted) counts as 1."""
    if not steps_per_second > 0:
        raise ValueError(f"steps_per_second must be > 0, got {steps_per_second!r}")
    base = 1.0 / steps_per_second
    if knee_tokens is None or not cost_model_on(knee_tokens):
        return base
    load = max(1, int(batch)) * max(1, int(width)) / knee_tokens
    return base * max(1.0, load)


def steps_to_commit(accept_length: float, max_new_tokens: int) -> int:
    """Verify steps a request needs for `max_new_tokens` tokens under the stand-in's rule (step i
    commits floor((i+1)A) - floor(iA) tokens, `state.Generation._steps`): the least S with
    floor(S x A) >= max_new_tokens. The last step is whole even when it commits fewer tokens than A:
    it costs a full step time, so for short generations a slightly higher accept length can need
    the same number of steps (64 tokens at A = 4.0 and at A = 4.2 both take 16)."""
    a = max(1.0, float(accept_length))
    n = max(1, int(max_new_tokens))
    s = max(1, math.ceil(n / a - 1e-9))
    while math.floor(s * a + 1e-9) < n:  # float rounding of n / a
        s += 1
    while s > 1 and math.floor((s - 1) * a + 1e-9) >= n:
        s -= 1
    return s


def expected_decode_tps(accept_length: float, width: int, concurrency: int, steps_per_second: float,
                        knee_tokens: float | None) -> float:
    """One request's steady decode rate (tokens/s) when `concurrency` requests generate at once:
    accept length / step time. What `/server_info`'s standin_paced_gen_throughput approaches for a
    long generation."""
    return max(1.0, float(accept_length)) / verify_step_seconds(steps_per_second, width, concurrency, knee_tokens)


def expected_request_seconds(accept_length: float, width: int, concurrency: int, steps_per_second: float,
                             knee_tokens: float | None, max_new_tokens: int, ttft_s: float) -> float:
    """One request's time from admission to its last token on the stand-in's clock: the prefill
    (`ttft_s`, which brings the first step's tokens), then one step time per further step."""
    steps = steps_to_commit(accept_length, max_new_tokens)
    step_s = verify_step_seconds(steps_per_second, width, concurrency, knee_tokens)
    return max(0.0, ttft_s) + (steps - 1) * step_s


def expected_output_tps(accept_length: float, width: int, concurrency: int, steps_per_second: float,
                        knee_tokens: float | None, max_new_tokens: int, ttft_s: float) -> float:
    """Aggregate output tokens/s of a closed loop of `concurrency` streams (the perf gate's
    workload: each stream sends its next request when the last one ends) against one stand-in:
    concurrency x max_new_tokens / `expected_request_seconds`.

    For ranking configs at one workload: the prefill is the same for every config, so it adds the
    same time to each request and never reorders two configs by itself, but it shrinks their
    ratios (a gain over DFlash reads smaller with a long prefill and short generations); the last,
    partial step does reorder near-ties (`steps_to_commit`), which is why this counts whole steps
    instead of max_new_tokens / accept_length. It ignores what a client adds (the gap between a
    stream's requests, HTTP time) and a window's edges (requests cut by the measurement's end),
    which are the same for every config, and the accept length's spread between requests (the stand-in
    paces each request with the release's mean)."""
    seconds = expected_request_seconds(accept_length, width, concurrency, steps_per_second, knee_tokens,
                                       max_new_tokens, ttft_s)
    if seconds <= 0:
        return math.inf
    return max(1, int(concurrency)) * max(1, int(max_new_tokens)) / seconds
