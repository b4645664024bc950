"""What the server knows and answers: its arguments, counters, info documents and /generate."""

from __future__ import annotations

import argparse
import random
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from ddtree_ops.redaction import MASK

from .args import masked
from .logs import log
from .payload import lookup_ddtree_functions
from .toymodel import (
    ToyModel,
    _params,
    _prompt_tokens,
    _seed_of,
    ddtree_step,
    generate_autoregressive,
)

SGLANG_VERSION = "0.5.23"
DEFAULT_BUDGET = 16


class State:
    def __init__(self, args: argparse.Namespace, extra: dict[str, Any], imported: dict[str, str],
                 site_packages: Path | None):
        self.args = args
        self.extra = extra
        self.imported = imported
        self.site_packages = site_packages
        self.status = "Starting"  # Starting | Up
        self.running = 0  # /generate requests in flight (for /v1/loads and the SIGTERM drain)
        self.gracefully_exiting = False  # SIGTERM received while Up: /health 503, finish what runs
        self.lock = threading.Lock()
        self.health_counter = 0
        self.total_verify_ct = 0
        self.total_committed = 0
        self.generate_count = 0
        self.ddtree_fns = lookup_ddtree_functions()
        self.payload_errors = 0
        self.start_time = time.time()

    # -- info ------------------------------------------------------------------------
    def budget(self) -> int:
        return self.args.speculative_ddtree_budget or DEFAULT_BUDGET

    def topk_cap(self) -> int:
        return self.args.speculative_ddtree_topk_cap or self.budget()

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

    # -- generation ------------------------------------------------------------------
    def generate_one(self, text: str, sp: dict[str, Any], count_stats: bool = True) -> dict[str, Any]:
        t0 = time.time()
        params = _params(sp)
        max_new = params[3]
        seed = _seed_of(text)
        model = ToyModel(seed)
        prompt = _prompt_tokens(text)
        last = prompt[-1]
        out: list[int] = []
        verify_ct = 0
        accepted_drafts = 0
        max_depth_seen = 0
        used_ddtree = False
        fns = self.ddtree_fns
        if fns is not None and max_new > 0:
            try:
                import torch  # lazy: the payload imports it anyway
                gen = torch.Generator().manual_seed(seed & 0x7FFFFFFFFFFFFFFF)
                while len(out) < max_new:
                    committed, n, depth = ddtree_step(fns, torch, model, last, params,
                                                      self.budget(), self.topk_cap(), gen)
                    out.extend(committed)
                    last = committed[-1]
                    verify_ct += 1
                    accepted_drafts += n
                    max_depth_seen = max(max_depth_seen, depth)
                used_ddtree = True
            except Exception as exc:  # noqa: BLE001 - any payload failure falls back
                with self.lock:
                    self.payload_errors += 1
                log(f"DDTree payload error in /generate, falling back to autoregressive "
                    f"decoding: {exc}\n{traceback.format_exc()}", "TP0")
                out, verify_ct, accepted_drafts, max_depth_seen = [], 0, 0, 0
                last = prompt[-1]
        if not used_ddtree:
            rng = random.Random(seed)
            out = generate_autoregressive(model, last, max_new, params, rng)
            verify_ct = len(out)
        out = out[:max_new]
        committed_n = len(out)
        accept_len = (committed_n / verify_ct) if verify_ct else 1.0
        if used_ddtree and verify_ct and max_depth_seen:
            accept_rate = accepted_drafts / (verify_ct * max_depth_seen)
        else:
            accept_rate = 0.0
        if count_stats:
            with self.lock:
                self.generate_count += 1
                self.total_verify_ct += verify_ct if verify_ct else 1
                self.total_committed += committed_n if verify_ct else 1
        elapsed = time.time() - t0
        if count_stats:
            log(f"Decode batch. #running-req: 1, #token: {len(prompt) + committed_n}, "
                f"token usage: 0.00, accept len: {accept_len:.2f}, accept rate: {accept_rate:.2f}, "
                f"cuda graph: True, gen throughput (token/s): "
                f"{committed_n / max(elapsed, 1e-6):.2f}, #queue-req: 0", "TP0")
        return {
            "text": " ".join(f"tok{t}" for t in out),
            "output_ids": out,
            "meta_info": {
                "id": uuid.uuid4().hex,
                "prompt_tokens": len(prompt),
                "completion_tokens": committed_n,
                "cached_tokens": 0,
                "weight_version": "default",
                "spec_accept_length": accept_len,
                "spec_accept_rate": accept_rate,
                "spec_verify_ct": verify_ct,
                "spec_ddtree": used_ddtree,
                "finish_reason": {"type": "length", "length": max_new},
                "e2e_latency": elapsed,
            },
        }
