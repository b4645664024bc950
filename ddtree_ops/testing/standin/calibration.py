"""The accept length of the release's DDTree payload, measured once at start-up.

Requests are then paced by a clock with that accept length (state.Generation), so a busy machine
slows a release's tokens/s no more than another's: what the payload's maths cost per step never
sits between a request and its next chunk.

The measurement runs the payload's own tree build, retrieve compile and tree sampling
(toymodel.ddtree_step) for CALIBRATION_STEPS verify steps on each of CALIBRATION_MODELS seeded toy
models, greedy (temperature 0) and sampled (temperature 1, no top-k/top-p), and takes tokens
committed per step. Seeds are fixed: the same payload, budget and top-k cap give the same figures
at every start, so a baseline and a canary of one release measure alike. A request's accept length
is interpolated between the two by its temperature (clamped to [0, 1]).

Because the figures are a function of the payload's files and the config alone, `cached_calibrate`
keeps each result in a small JSON file (`--standin-calibration-cache DIR`, default
$DDTREE_STANDIN_CALIBRATION_CACHE: a sandbox host's systemd sets it to its own volatile
/var/cache/ddtree-standin, which lives until the host reboots; unset, nothing is cached)
under the sha256 of every imported DDTree module's bytes, this module's and the toy model's source,
and the budget and top-k cap; a later start of the same release reads it instead of spending
about a CPU-second again (a tune restarts the same configs, the suite the same releases, hundreds
of times). A payload that raises is never cached: it raises again at every start."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

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
    cached: bool = False  # read from an earlier start's measurement of the same files and config

    def accept_length(self, temperature: float) -> float:
        t = min(max(float(temperature), GREEDY_TEMPERATURE), SAMPLED_TEMPERATURE)
        return self.greedy + (self.sampled - self.greedy) * t

    def describe(self) -> str:
        cost = "cached from an earlier start with the same payload files" if self.cached else \
            f"{self.cpu_s:.2f} s of CPU"
        return (f"accept length {self.greedy:.2f} greedy, {self.sampled:.2f} at temperature 1 "
                f"({self.steps} verify steps each, {cost})")


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


def cache_key(modules: list[Path], budget: int, topk_cap: int) -> str:
    """What the figures depend on: the payload's module files, the measuring code, the config."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for p in (here / "calibration.py", here / "toymodel.py", *sorted(modules)):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(f"{budget}/{topk_cap}/{CALIBRATION_MODELS}/{CALIBRATION_STEPS}".encode())
    return h.hexdigest()


def cached_calibrate(fns: DDTreeFunctions, budget: int, topk_cap: int, modules: list[Path],
                     cache_dir: str | None) -> Calibration:
    """`calibrate`, or its earlier result for the same key (`cache_key`) from `cache_dir` (None: no
    cache). An unreadable or odd cache file is measured again and replaced; a cache that cannot be
    written is only not written."""
    if not cache_dir:
        return calibrate(fns, budget, topk_cap)
    try:
        path = Path(cache_dir) / f"{cache_key(modules, budget, topk_cap)}.json"
    except OSError:
        return calibrate(fns, budget, topk_cap)
    try:
        doc = json.loads(path.read_text())
        return Calibration(float(doc["greedy"]), float(doc["sampled"]), int(doc["steps"]), float(doc["cpu_s"]),
                           cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    found = calibrate(fns, budget, topk_cap)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({k: v for k, v in asdict(found).items() if k != "cached"}))
        os.replace(tmp, path)
    except OSError:
        pass
    return found
