"""DDTree worker for SGLang 0.5.23 (ddtree-temp patch set).

Module level imports only stdlib, torch and the other ddtree modules; the
DFlash worker (and through it SGLang's scheduler, kernels and model code) is
imported by :func:`get_ddtree_worker_cls` on first use, the way SGLang's spec
registry imports workers lazily.

STATUS (see patches/ddtree-temp/README.md): the tree construction, retrieve
encoding, mask/positions and greedy/sampled tree verify are implemented and
proven on CPU in ddtree_utils. Wiring the tree verify into 0.5.23's DFlash
worker (verify width budget+1 instead of block_size in the KV allocation, the
CUDA-graph runners and the accepted-path KV compaction) has not been run on a
GPU. Until it is, the worker keeps DFlash's own chain verify for the forward
pass, which is lossless at every temperature, and only computes the DDTree
plan (tree statistics) when --speculative-ddtree-debug-metrics is set.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sglang.srt.speculative.ddtree_utils import (
    DDTree,
    RetrieveEncoding,
    build_ddtree_tree,
    compile_ddtree_retrieve,
    ddtree_positions,
    ddtree_tree_mask,
    draft_topk_logprobs,
)

logger = logging.getLogger(__name__)

_WORKER_CLS: Optional[type] = None


class DDTreeConfig:
    def __init__(self, budget: int, topk_cap: int, debug_metrics: bool = False):
        if budget < 1 or not 1 <= topk_cap <= budget:
            raise ValueError(f"invalid DDTree config budget={budget} topk_cap={topk_cap}")
        self.budget = int(budget)
        self.topk_cap = int(topk_cap)
        self.debug_metrics = bool(debug_metrics)

    @property
    def verify_width(self) -> int:
        return self.budget + 1

    @classmethod
    def from_server_args(cls, server_args) -> "DDTreeConfig":
        budget = getattr(server_args, "speculative_ddtree_budget", None)
        cap = getattr(server_args, "speculative_ddtree_topk_cap", None)
        if budget is None:
            raise ValueError("DDTree worker needs speculative_ddtree_budget")
        return cls(budget, cap if cap is not None else budget,
                   getattr(server_args, "speculative_ddtree_debug_metrics", False))


class DDTreePlan:
    """Everything the target verify forward needs for one step."""

    def __init__(self, tree: DDTree, retrieve: RetrieveEncoding, positions: torch.Tensor, tree_mask: torch.Tensor):
        self.tree = tree
        self.retrieve = retrieve
        self.positions = positions
        self.tree_mask = tree_mask


def plan_ddtree_step(
    draft_logits: torch.Tensor,
    root_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    config: DDTreeConfig,
) -> DDTreePlan:
    """Draft logits [bs, L, V] of the DFlash block (positions 1..L) -> tree,
    kernel encoding, positions (seq_lens + depth) and ancestor mask."""
    k = min(config.topk_cap, config.budget, draft_logits.shape[-1])
    top = draft_topk_logprobs(draft_logits, k)
    tree = build_ddtree_tree(top, config.budget, config.topk_cap, root_tokens=root_tokens)
    retrieve = compile_ddtree_retrieve(tree.parents, tree.scores)
    positions = ddtree_positions(tree.depths, seq_lens)
    mask = ddtree_tree_mask(tree.parents, max_depth=draft_logits.shape[1])
    return DDTreePlan(tree, retrieve, positions, mask)


def _build_worker_cls() -> type:
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    class DDTreeWorkerV2(DFlashWorkerV2):
        """DFlash worker with DDTree configuration (see module docstring)."""

        def __init__(self, server_args, *args, **kwargs):
            super().__init__(server_args, *args, **kwargs)
            self.ddtree_config = DDTreeConfig.from_server_args(server_args)
            self._ddtree_warned = False
            logger.warning(
                "DDTREE budget=%d topk_cap=%d: draft-tree verify is not wired into the "
                "0.5.23 DFlash forward yet (untested without a GPU); decoding uses "
                "DFlash's lossless chain verify.",
                self.ddtree_config.budget,
                self.ddtree_config.topk_cap,
            )

        def forward_batch_generation(self, batch, *args, **kwargs):
            return super().forward_batch_generation(batch, *args, **kwargs)

    return DDTreeWorkerV2


def get_ddtree_worker_cls() -> type:
    """The worker class, built on first use (imports SGLang's DFlash worker)."""
    global _WORKER_CLS
    if _WORKER_CLS is None:
        _WORKER_CLS = _build_worker_cls()
    return _WORKER_CLS
