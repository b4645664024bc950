"""The per-step tree work as one captured unit (ddtree-temp patch set, 2.1).

Between the DFlash draft forward and the target verify, a DDTree step turns the
draft's per-depth candidates into the verify's inputs: restrict them to each
request's sampling support, build the best-first tree, encode it for SGLang's
tree kernels, compute positions and write the tree window of the verify mask
(:func:`ddtree_verify.ddtree_tree_step`). Eagerly that is a few hundred small
kernels per step; here it is one CUDA-graph replay per step, one graph per
graph batch size (the target's decode capture sizes), fed by static buffers,
beside the draft model's graphs. Batches larger than the largest graph, and
servers without CUDA graphs, run the same function eagerly.

Module level imports only stdlib, torch and the other ddtree modules.
"""

from __future__ import annotations

import bisect
from typing import Callable, Optional, Sequence

import torch

from sglang.srt.speculative.ddtree_verify import DDTreeStepOut, ddtree_tree_step

# The verify mask's dtype at every batch size: the triton backend's persistent
# buffer is uint8, and Triton specializes a kernel on its pointers' dtypes, so
# an over-size batch in another dtype would compile the attention kernels again,
# while serving, on every rank.
MASK_DTYPE = torch.uint8
CAPTURE_ERROR_MODE = "thread_local"


class DDTreeStepRunner:
    """Runs :func:`ddtree_tree_step` for a batch: replayed from a graph captured
    for the smallest capture size that holds the batch, else eagerly.

    ``mask_buffer``: the target attention backend's persistent verify-mask
    buffer (FULL_MASK layout, ``max_bs`` requests at the longest context), or
    ``None``. Captured graphs write into it; an eager batch writes into it when
    it holds ``mask_bs_limit`` requests or fewer, else into a fresh buffer of
    the same dtype (:data:`MASK_DTYPE` without a buffer).
    ``graph_factory``: makes a graph object with ``capture(fn)`` / ``replay()``
    (:class:`CudaGraphUnit` on CUDA; the tests pass a CPU stand-in)."""

    def __init__(
        self,
        *,
        budget: int,
        topk_cap: int,
        draft_len: int,
        device,
        mask_buffer: Optional[torch.Tensor] = None,
        mask_bs_limit: int = 0,
    ):
        self.budget = int(budget)
        self.topk_cap = int(topk_cap)
        self.draft_len = int(draft_len)  # L: depths the draft scores (block - 1)
        self.width = self.budget + 1
        self.device = torch.device(device)
        self.mask_buffer = mask_buffer
        self.mask_dtype = mask_buffer.dtype if mask_buffer is not None else MASK_DTYPE
        self.mask_bs_limit = int(mask_bs_limit) if mask_buffer is not None else 0
        self.capture_bs: list = []
        self._graphs: dict = {}
        self._static = None
        self._ones = False  # the static top_k / top_p hold 1 in every row (known on the host)
        self._top_buffers = None  # the draft head's outputs, adopted as the static top_lp / top_ids
        self._retrieve_index = torch.zeros((0, self.width), dtype=torch.int64, device=self.device)

    # -- capture ------------------------------------------------------------
    def adopt_top_buffers(self, top_lp: torch.Tensor, top_ids: torch.Tensor) -> None:
        """Use the draft head's static outputs (``[rows, K]``, rows >= max_bs * L) as the
        graphs' ``top_lp`` / ``top_ids`` inputs, so a step whose head ran inside the draft
        graph copies nothing into them. Before :meth:`capture`."""
        self._top_buffers = (top_lp, top_ids)

    def capture(self, capture_bs: Sequence[int], graph_factory: Callable[[], object]) -> None:
        """One graph per batch size (largest first, so a shared memory pool
        holds the largest working set once). Needs the mask buffer: the graphs
        write the tree window into it at fixed addresses."""
        sizes = sorted({int(b) for b in capture_bs if 0 < int(b) <= self.mask_bs_limit})
        if not sizes:
            return
        self._static = self._make_static(sizes[-1])
        for bs in reversed(sizes):
            graph = graph_factory()
            graph.capture(self._bound_step(bs))
            self._graphs[bs] = graph
        self.capture_bs = sizes

    def _make_static(self, max_bs: int) -> dict:
        dev, L, K, W = self.device, self.draft_len, self.topk_cap, self.width
        top_lp = torch.full((max_bs, L, K), float("-inf"), dtype=torch.float32, device=dev)
        top_ids = torch.zeros((max_bs, L, K), dtype=torch.int64, device=dev)
        if self._top_buffers is not None:
            lp, ids = self._top_buffers
            if lp.shape[0] >= max_bs * L and lp.shape[1] == K and ids.shape == lp.shape:
                top_lp, top_ids = lp[: max_bs * L].view(max_bs, L, K), ids[: max_bs * L].view(max_bs, L, K)
        self._ones = True
        return {
            "top_lp": top_lp,
            "top_ids": top_ids,
            "top_k": torch.ones((max_bs,), dtype=torch.int64, device=dev),
            "top_p": torch.ones((max_bs,), dtype=torch.float32, device=dev),
            "bonus": torch.zeros((max_bs,), dtype=torch.int64, device=dev),
            "prefix": torch.zeros((max_bs,), dtype=torch.int64, device=dev),
            # outputs: written inside the graph, read after the replay
            "draft_token": torch.zeros((max_bs, W), dtype=torch.int64, device=dev),
            "positions": torch.zeros((max_bs, W), dtype=torch.int64, device=dev),
            "next_token": torch.full((max_bs, W), -1, dtype=torch.int64, device=dev),
            "next_sibling": torch.full((max_bs, W), -1, dtype=torch.int64, device=dev),
        }

    def _bound_step(self, bs: int) -> Callable[[], None]:
        """The captured body: reads the first ``bs`` rows of the static inputs,
        writes the static outputs (fixed addresses, so every graph's outputs
        are the same tensors) and the mask buffer."""
        s, mask = self._static, self.mask_buffer

        def body() -> None:
            out = ddtree_tree_step(
                s["top_lp"][:bs], s["top_ids"][:bs], s["top_k"][:bs], s["top_p"][:bs],
                s["bonus"][:bs], s["prefix"][:bs], mask, self.budget, self.topk_cap,
            )
            s["draft_token"][:bs].copy_(out.draft_token)
            s["positions"][:bs].copy_(out.positions)
            s["next_token"][:bs].copy_(out.retrive_next_token)
            s["next_sibling"][:bs].copy_(out.retrive_next_sibling)

        return body

    # -- one step -------------------------------------------------------------
    def retrieve_index(self, bs: int) -> torch.Tensor:
        """``[bs, W]`` global node rows ``b*W + i``: the same for every step,
        so built once (grown when a larger batch comes)."""
        if self._retrieve_index.shape[0] < bs:
            rows = max(bs, 2 * self._retrieve_index.shape[0])
            self._retrieve_index = torch.arange(
                rows * self.width, dtype=torch.int64, device=self.device
            ).view(rows, self.width)
        return self._retrieve_index[:bs]

    def memory_bytes(self) -> dict:
        """What the runner's buffers hold, by part (bytes): the verify-mask
        buffer it writes (the backend's), its static inputs/outputs and the
        retrieve index. The graphs' own pool is measured around the capture."""
        def size(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        return {
            "verify_mask": 0 if self.mask_buffer is None else size([self.mask_buffer]),
            "step_buffers": 0 if self._static is None else size(self._static.values()),
            "retrieve_index": size([self._retrieve_index]),
        }

    def graph_bs(self, bs: int) -> Optional[int]:
        i = bisect.bisect_left(self.capture_bs, bs)
        return self.capture_bs[i] if i < len(self.capture_bs) else None

    def run(
        self,
        top_lp: torch.Tensor,
        top_ids: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        bonus: torch.Tensor,
        prefix_lens: torch.Tensor,
        *,
        mask_numel: Callable[[], int],
    ):
        """Returns ``(DDTreeStepOut with [bs, W] tensors, mask)``. ``top_k`` /
        ``top_p`` None: every row unrestricted and untempered (an all-greedy batch,
        the raw tree distribution). ``mask_numel`` sizes a fresh mask when the
        batch does not fit the buffer (it may read host lengths; it is not called
        otherwise). Inputs already in the static buffers (the draft head's
        outputs, :meth:`adopt_top_buffers`) are not copied."""
        bs = int(top_lp.shape[0])
        gbs = self.graph_bs(bs)
        if gbs is not None:
            s = self._static
            for name, t in (("top_lp", top_lp), ("top_ids", top_ids)):
                if t.data_ptr() != s[name].data_ptr():
                    s[name][:bs].copy_(t)
            if top_k is None:
                if not self._ones:  # after a sampled batch: ones again, once
                    s["top_k"].fill_(1)
                    s["top_p"].fill_(1.0)
                    self._ones = True
            else:
                s["top_k"][:bs].copy_(top_k)
                s["top_p"][:bs].copy_(top_p)
                self._ones = False
            s["bonus"][:bs].copy_(bonus)
            s["prefix"][:bs].copy_(prefix_lens)
            if gbs > bs:
                # Padding rows write their window right after the real rows':
                # a zero prefix keeps those writes inside the buffer.
                s["prefix"][bs:gbs].zero_()
            self._graphs[gbs].replay()
            out = DDTreeStepOut(s["draft_token"][:bs], s["positions"][:bs],
                                s["next_token"][:bs], s["next_sibling"][:bs])
            return out, self.mask_buffer
        if self.mask_buffer is not None and bs <= self.mask_bs_limit:
            mask = self.mask_buffer
        else:
            mask = torch.empty((int(mask_numel()),), dtype=self.mask_dtype, device=self.device)
        if top_k is None:
            top_k = torch.ones((bs,), dtype=torch.int64, device=self.device)
            top_p = torch.ones((bs,), dtype=torch.float32, device=self.device)
        out = ddtree_tree_step(top_lp, top_ids, top_k, top_p, bonus, prefix_lens, mask,
                               self.budget, self.topk_cap)
        return out, mask


class CudaGraphUnit:
    """``capture(fn)`` records ``fn`` into a CUDA graph (after one eager
    warm-up run on a side stream, as torch recommends: the builder's per-shape
    plans are cached then), ``replay()`` replays it. One memory pool is shared
    by every unit of a runner (captured largest batch first)."""

    def __init__(self, pool=None):
        self.pool = pool
        self.graph = None

    def capture(self, fn: Callable[[], None]) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # "thread_local", as upstream's secondary graphs: in "global" mode a CUDA
        # call another thread of the process makes during the capture (the
        # scheduler's helper threads) invalidates it.
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode=CAPTURE_ERROR_MODE):
            fn()

    def replay(self) -> None:
        self.graph.replay()


def cuda_graph_factory() -> Callable[[], CudaGraphUnit]:
    pool = torch.cuda.graph_pool_handle()
    return lambda: CudaGraphUnit(pool)
