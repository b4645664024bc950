"""Kernel launches of a region, counted from torch's CPU profiler.

A launch is an ``aten::`` operator that does work itself: no ``aten::`` operator
under it does work, and it is not one that only makes a view or reads
metadata (those launch nothing on a GPU). On a GPU most such operators are one
kernel launch (a few, such as ``topk`` or ``sort``, are more), so the count is
the CPU-side measure the issue's 420 was taken with, the same rule before and
after. Work inside a region named ``ddtree_graph_replay`` (the stand-in for a
CUDA-graph replay) is counted once per replay: on a GPU a replay is one launch;
so is a Triton kernel the interpreter runs (``triton_kernel_launch``,
:func:`mark_triton_launches`).

Stdlib + torch; used by test_tree_step_cpu (in the sglang subprocess, through
worker_fakes) and bench/bench_launches.py.
"""

from __future__ import annotations

from collections import Counter

import torch

REPLAY = "ddtree_graph_replay"
REGION = "ddtree_tree_work"
# A Triton kernel run by Triton's CPU interpreter: one launch on a GPU, whatever
# tensor copies the interpreter makes to run it.
TRITON = "triton_kernel_launch"
ONE_LAUNCH = (REPLAY, TRITON)

# Operators that make views, allocate without writing, or read metadata.
NON_LAUNCH = frozenset(
    "aten::" + name for name in (
        "view", "reshape", "_reshape_alias", "as_strided", "slice", "select", "expand",
        "expand_as", "unsqueeze", "squeeze", "t", "transpose", "permute", "alias", "detach",
        "empty", "empty_like", "empty_strided", "resize_", "lift_fresh", "_unsafe_view", "split",
        "split_with_sizes", "chunk", "unbind", "contiguous", "result_type", "size", "stride",
        "numel", "dim", "to", "_to_copy", "view_as", "flatten", "unflatten", "narrow",
        "is_nonzero", "broadcast_tensors", "set_", "_has_compatible_shallow_copy_type",
        "index_select_backward", "diagonal", "movedim", "view_as_real", "_nested_tensor_size",
        "data", "requires_grad_", "new_empty", "new_empty_strided", "resolve_conj", "resolve_neg",
        "numpy_T", "real", "conj",
    )
)


def _is_launch(event) -> bool:
    name = event.name
    if not name.startswith("aten::") or name in NON_LAUNCH:
        return False
    return not _does_work_below(event)


def _does_work_below(event) -> bool:
    return any(_is_launch(c) or _does_work_below(c) for c in event.cpu_children)


def _inside(event, name: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def count_launches(prof: torch.profiler.profile, region: str = REGION) -> dict:
    """Launches inside ``region`` (record_function ranges of that name): the
    operators outside graph replays, plus one per replay."""
    ops: Counter = Counter()
    replays = 0
    for event in prof.events():
        if not _inside(event, region) or any(_inside(event, name) for name in ONE_LAUNCH):
            continue
        if event.name in ONE_LAUNCH:
            ops[event.name] += 1
            replays += event.name == REPLAY
        elif _is_launch(event):
            ops[event.name] += 1
    return {"launches": sum(ops.values()), "replays": replays, "ops": dict(ops.most_common())}


def mark_triton_launches():
    """Wrap every Triton kernel the interpreter runs in a ``triton_kernel_launch``
    range (returns the undo)."""
    from triton.runtime.interpreter import InterpretedFunction

    real = InterpretedFunction.run

    def run(self, *args, **kwargs):
        with torch.profiler.record_function(TRITON):
            return real(self, *args, **kwargs)

    InterpretedFunction.run = run

    def undo():
        InterpretedFunction.run = real

    return undo


class ReplayedCall:
    """A CPU stand-in for a CUDA graph with the runner's ``capture``/``replay``
    interface: capture runs the body once (the warm-up a real capture does) and
    keeps it; replay runs the same body again, on the same static buffers, inside
    a ``ddtree_graph_replay`` range. What a real graph adds (frozen addresses,
    no host synchronisation) is checked separately: the whole body on the meta
    device here, the capture itself on a GPU by bench/gpu_kernels.py."""

    def __init__(self):
        self.body = None
        self.replays = 0

    def capture(self, body) -> None:
        body()
        self.body = body

    def replay(self) -> None:
        self.replays += 1
        with torch.profiler.record_function(REPLAY):
            self.body()
