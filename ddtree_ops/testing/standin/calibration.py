"""The accept length of the release's DDTree payload, measured once at start-up.

Requests are then paced by a clock with that accept length (state.Generation), so a busy machine
slows a release's tokens/s no more than another's: what the payload's maths cost per step never
sits between a request and its next chunk.

The measurement runs the payload's own tree build, retrieve compile and tree sampling
(toymodel.ddtree_step) for CALIBRATION_STEPS verify steps on each of CALIBRATION_MODELS seeded toy
models, greedy (temperature 0) and sampled (temperature 1, no top-k/top-p), and takes tokens
committed per step. Seeds are fixed: the same payload, budget and top-k cap give the same figures
at every start, so a baseline and a canary of one release measure alike. A request's accept length
is interpolated between the two by its temperature (clamped to [0, 1])."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .payload import DDTreeFunctions, PayloadError
from .toymodel import ToyModel, _params, ddtree_step

CALIBRATION_MODELS = 4
CALIBRATION_STEPS = 32  # per model and temperature: 128 steps each, about 0.4 s of CPU for both
GREEDY_TEMPERATURE = 0.0
SAMPLED_TEMPERATURE = 1.0


@dataclass(frozen=True)
class Calibration:
    greedy: float  # tokens committed per verify step at temperature 0
    sampled: float  # at temperature 1
    steps: int  # verify steps measured for each
    cpu_s: float  # what the measurement cost

    def accept_length(self, temperature: float) -> float:
        t = min(max(float(temperature), GREEDY_TEMPERATURE), SAMPLED_TEMPERATURE)
        return self.greedy + (self.sampled - self.greedy) * t

    def describe(self) -> str:
        return (f"accept length {self.greedy:.2f} greedy, {self.sampled:.2f} at temperature 1 "
                f"({self.steps} verify steps each, {self.cpu_s:.2f} s of CPU)")


def _one_torch_thread(torch) -> None:
    """A DDTree step works on tensors of a few hundred elements: torch's intra-op threads only cost
    (2.5x per step measured on 2 cores)."""
    try:
        torch.set_num_threads(1)
    except Exception:  # noqa: BLE001 - an optimisation only
        pass


def _mean_accept(fns: DDTreeFunctions, torch, budget: int, topk_cap: int, temperature: float) -> float:
    params = _params({"temperature": temperature})
    committed = steps = 0
    for seed in range(CALIBRATION_MODELS):
        model = ToyModel(seed)
        gen = torch.Generator().manual_seed(seed)
        last = 0
        for _ in range(CALIBRATION_STEPS):
            tokens, _, _ = ddtree_step(fns, torch, model, last, params, budget, topk_cap, gen)
            committed += len(tokens)
            steps += 1
            last = tokens[-1]
    return committed / steps


def calibrate(fns: DDTreeFunctions, budget: int, topk_cap: int) -> Calibration:
    """Raises PayloadError when a payload function raises or answers something unusable."""
    try:
        import torch  # the payload imports it anyway
    except ImportError as exc:
        raise PayloadError(f"torch does not import: {exc}") from exc
    _one_torch_thread(torch)
    t0 = time.process_time()
    greedy = _mean_accept(fns, torch, budget, topk_cap, GREEDY_TEMPERATURE)
    sampled = _mean_accept(fns, torch, budget, topk_cap, SAMPLED_TEMPERATURE)
    return Calibration(greedy=greedy, sampled=sampled, steps=CALIBRATION_MODELS * CALIBRATION_STEPS,
                       cpu_s=time.process_time() - t0)
