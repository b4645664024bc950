"""What one speculative decode step costs outside the model, counted on a CPU: kernel launches
outside CUDA graphs, collectives (count and bytes, by kind) and host synchronisations.

Used by bench/step_cost_rank.py (inside the .venv-sglang rank processes); torch only.

* **Launches**: torch's profiler over the step, counted by ``tests/payload/launch_count.py``'s
  rule (an ``aten::`` operator that does work itself), with two kinds of region counted once:
  ``ddtree_graph_replay`` (a CUDA graph on the GPU: the toy model forwards, the tree step's
  replay, DFLASH's in-graph draft head) and ``triton_kernel_launch`` (one kernel on the GPU that
  runs here as Triton's interpreter or as a PyTorch reference). A collective outside a graph is
  one launch more (an NCCL kernel on the GPU).
* **Collectives**: every ``GroupCoordinator`` call (the outermost one, so a coordinator method
  that calls another counts once) and every direct ``torch.distributed`` call, by kind, with the
  bytes this rank contributes (its input tensor; a broadcast's tensor at every rank).
* **Host syncs**: a read of a device tensor's values by the host: ``item``, ``tolist``,
  ``bool()``/``int()``/``float()``, ``nonzero``, boolean-mask indexing, ``equal``, a blocking
  copy to a host tensor, ... (``SYNC_METHODS``). Every tensor here lives on the CPU, so which are
  "device" tensors is tracked the way they would be placed on a GPU (:class:`Placement`): the
  step's inputs are device tensors unless registered as host ones (``seq_lens_cpu``); a tensor
  made inside the step is a host tensor when made with no device or ``device="cpu"`` written
  out, or from host tensors only, and a device tensor otherwise. The worker and pools are given
  the device as :data:`DEVICE` (a ``str`` that equals ``"cpu"``), so a factory call with the
  worker's device is told apart from one that asks for the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import traceback
import weakref
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests" / "payload"))
import launch_count  # noqa: E402

GRAPH = launch_count.REPLAY
KERNEL = launch_count.TRITON
REGION = launch_count.REGION


class DeviceName(str):
    """The worker's device: equal to ``"cpu"`` for torch, recognisable for :class:`Placement`."""


DEVICE = DeviceName("cpu")

T = torch.Tensor
# host reads of the tensor in the first argument
SYNC_METHODS = {
    T.item, T.tolist, T.numpy, T.__bool__, T.__int__, T.__float__, T.__index__, T.__array__,
    T.nonzero, torch.nonzero, torch.argwhere, T.argwhere, torch.masked_select, T.masked_select,
    torch.equal, T.equal, torch.unique, T.unique, torch.unique_consecutive, torch.allclose,
    T.allclose, T.__contains__, T.__format__, T.__repr__,
}
FACTORIES = {
    torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.tensor, torch.as_tensor,
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace, torch.eye,
}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _asks_for_host(device) -> bool:
    """A device argument that asks for the host: ``"cpu"`` written out (not :data:`DEVICE`)."""
    return type(device) is str and device.startswith("cpu")


def _call_site() -> str:
    """The first frame outside torch and this module: where the step read the value."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        f = frame.filename
        if "/torch/" not in f and not f.endswith("step_counters.py"):
            return f"{f.split('site-packages/')[-1].split('/overlay/')[-1]}:{frame.lineno} {frame.name}"
    return "?"


class Placement(TorchFunctionMode):
    """Tracks which tensors a GPU would hold on the host and counts the host's reads of device
    tensors (module docstring). ``suspended()`` turns both off (a graph replay's inside, an
    interpreted kernel: they are neither host code nor host reads)."""

    def __init__(self):
        super().__init__()
        self._host: dict[int, weakref.ref] = {}
        self.syncs: Counter = Counter()
        self._suspended = 0

    def mark_host(self, *tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                key = id(t)
                self._host[key] = weakref.ref(t, lambda _, k=key: self._host.pop(k, None))

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    @contextlib.contextmanager
    def suspended(self):
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def _sync(self, what: str) -> None:
        self.syncs[f"{what} at {_call_site()}"] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._suspended:
            return func(*args, **kwargs)
        ins = list(_tensors(args)) + list(_tensors(kwargs))
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        device_in = [t for t in ins if not self.is_host(t)]
        if func in SYNC_METHODS and first is not None and not self.is_host(first):
            self._sync(getattr(func, "__name__", str(func)))
        elif func in (T.__getitem__, T.__setitem__) and any(
                t.dtype == torch.bool and not self.is_host(t) for t in _tensors(args[1:2])):
            self._sync("boolean-mask index")
        elif func is T.copy_ and first is not None and self.is_host(first) and any(
                not self.is_host(t) for t in _tensors(args[1:2])) and not kwargs.get("non_blocking", False):
            self._sync("blocking copy to a host tensor")
        elif func in (T.cpu, T.to) and first is not None and not self.is_host(first):
            if func is T.cpu or any(_asks_for_host(a) for a in list(args[1:]) + [kwargs.get("device")]):
                if not kwargs.get("non_blocking", False) and not (len(args) > 2 and args[2] is True):
                    self._sync(f"{func.__name__}() to the host")
        if "device" in kwargs and kwargs["device"] is not None:
            host = _asks_for_host(kwargs["device"])
        elif func is T.cpu:
            host = True
        elif func is T.to and any(_asks_for_host(a) for a in args[1:]):
            host = True
        elif func is T.to and any(isinstance(a, (torch.device, DeviceName)) for a in args[1:]):
            host = False
        elif func in FACTORIES or not ins:
            host = True  # no device named, nothing on a device in: the host, as on a GPU
        else:
            host = not device_in
        if host and not device_in:  # the host's own work on host tensors: no launch
            with torch.profiler.record_function(HOST_OP):
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
            if host and out is first:  # .cpu() of a CPU tensor is the tensor: a GPU copies it
                out = out.clone()
        if host:
            self.mark_host(*_tensors(out))
        return out


class Collectives:
    """Counts collectives by kind and bytes while installed (module docstring)."""

    COORDINATOR = ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast",
                   "broadcast_object", "broadcast_object_list", "broadcast_tensor_dict",
                   "reduce_scatter_tensor", "all_to_all_single", "gather", "barrier", "send", "recv")
    RAW = ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "broadcast_object_list",
           "all_gather_object", "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter",
           "barrier", "send", "recv")

    def __init__(self):
        self.count: Counter = Counter()
        self.bytes: Counter = Counter()
        self.outside_graphs = 0
        self.bytes_in_graphs = 0
        self.in_graph = 0
        self.active = False
        self._depth = 0
        self._undo = []

    def _wrap(self, owner, name: str, kind: str, payload):
        real = getattr(owner, name)

        @functools.wraps(real)
        def counted(*args, **kwargs):
            if not self.active or self._depth:
                return real(*args, **kwargs)
            n = payload(args, kwargs)
            self.count[kind] += 1
            self.bytes[kind] += n
            self.outside_graphs += not self.in_graph
            self.bytes_in_graphs += n if self.in_graph else 0
            self._depth += 1
            try:
                return real(*args, **kwargs)
            finally:
                self._depth -= 1

        setattr(owner, name, counted)
        self._undo.append((owner, name, real))

    def install(self):
        from sglang.srt.distributed.parallel_state import GroupCoordinator

        def tensor_bytes(skip_self: bool, index: int):
            def payload(args, kwargs):
                rest = args[1:] if skip_self else args
                ts = list(_tensors(rest[index:index + 1])) if len(rest) > index else []
                if not ts:  # keyword or object payload: every tensor passed
                    ts = list(_tensors(rest)) + list(_tensors(kwargs))
                return sum(t.numel() * t.element_size() for t in ts)
            return payload

        # (output, input) signatures: the input is what this rank contributes
        input_second = {"all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"}
        for name in self.COORDINATOR:
            if hasattr(GroupCoordinator, name):
                self._wrap(GroupCoordinator, name, name,
                           tensor_bytes(True, 1 if name in input_second else 0))
        for name in self.RAW:
            if hasattr(torch.distributed, name):
                self._wrap(torch.distributed, name, "torch.distributed." + name,
                           tensor_bytes(False, 1 if name in input_second else 0))
        return self

    def uninstall(self):
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)
        self._undo.clear()


@contextlib.contextmanager
def graph_region(placement: Placement | None, collectives: Collectives | None):
    """What a CUDA graph replay is on the GPU: one launch, no host code inside."""
    if collectives is not None:
        collectives.in_graph += 1
    try:
        with torch.profiler.record_function(GRAPH), (
                placement.suspended() if placement is not None else contextlib.nullcontext()):
            yield
    finally:
        if collectives is not None:
            collectives.in_graph -= 1


def one_kernel(fn, placement_ref):
    """``fn`` (a PyTorch reference or an interpreted Triton kernel) is one kernel on the GPU."""
    @functools.wraps(fn)
    def launch(*args, **kwargs):
        placement = placement_ref()
        with torch.profiler.record_function(KERNEL), (
                placement.suspended() if placement is not None else contextlib.nullcontext()):
            return fn(*args, **kwargs)
    return launch


PHASE = "phase:"
HOST_OP = "host_op"


def _innermost_phase(event) -> str:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(PHASE):
            return parent.name[len(PHASE):]
        parent = parent.cpu_parent
    return "(step)"


def phase(name: str, fn):
    """``fn`` inside a ``phase:NAME`` range: the launch counts are also given per phase."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.profiler.record_function(PHASE + name):
            return fn(*args, **kwargs)
    return run


def count_launches(prof) -> tuple[int, dict, dict, dict]:
    """Launches in the step region as launch_count counts them, less the operators the host
    runs on host tensors (``host_op`` ranges: no GPU launch), with one per graph replay and per
    one-kernel range; also by phase and by operator."""
    by_phase: Counter = Counter()
    ops: Counter = Counter()
    detail: Counter = Counter()
    one = (GRAPH, KERNEL, HOST_OP)
    for event in prof.events():
        if not launch_count._inside(event, REGION) or any(launch_count._inside(event, n) for n in one):
            continue
        if event.name in (GRAPH, KERNEL) or launch_count._is_launch(event):
            by_phase[_innermost_phase(event)] += 1
            ops[event.name] += 1
            detail[f"{_innermost_phase(event)}: {event.name}"] += 1
    return sum(ops.values()), dict(by_phase.most_common()), dict(ops.most_common()), dict(sorted(detail.items()))


def count_step(step, placement: Placement, collectives: Collectives):
    """Run ``step()`` once, counted. Returns ``(result, counts)``."""
    placement.syncs.clear()
    collectives.count.clear()
    collectives.bytes.clear()
    collectives.outside_graphs = 0
    collectives.bytes_in_graphs = 0
    collectives.active = True
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with torch.profiler.record_function(REGION), placement:
                result = step()
    finally:
        collectives.active = False
    launches, by_phase, ops, detail = count_launches(prof)
    return result, {
        # a graph replay is one launch, as is a collective outside a graph
        "launches_outside_graphs": launches + collectives.outside_graphs,
        "graph_replays": ops.get(GRAPH, 0),
        "kernels_as_one": ops.get(KERNEL, 0),
        "collectives_outside_graphs": collectives.outside_graphs,
        "launches_by_phase": by_phase,
        "launches_by_phase_and_op": detail,
        "ops": ops,
        "collectives": dict(collectives.count),
        "collective_bytes": dict(collectives.bytes),
        "collective_bytes_in_graphs": collectives.bytes_in_graphs,
        "host_syncs": sum(placement.syncs.values()),
        "host_sync_sites": dict(placement.syncs),
    }
