#!/usr/bin/env python3
"""End-to-end DDTree checks against real SGLang 0.5.23 servers.

For an operator's GPU host whose venv has SGLang 0.5.23 with the ddtree-temp patch
set installed (the lent GPU machine has no sglang and cannot run a server):

    python bench/gpu_server_check.py --out bench/results/            # everything, TP 1
    python bench/gpu_server_check.py --tp 2 --out bench/results/     # TP 2 (two GPUs), before CT200
    python bench/gpu_server_check.py --targets llama --modes nospec,ddtree
    python bench/gpu_server_check.py --dry-run                        # models + commands only

The defaults are CT200's shape: budget 16 / top-k cap 4, decode graphs up to 8
requests and batches up to 48 (``--cuda-graph-max-bs``, ``--max-running-requests``),
so the 32 requests sent at once, and the throughput run at concurrency 32, are
served by eager batches past the largest graph, as CT200's busy hours are.

It builds tiny random-weight models locally (no hub, no tokenizer: the servers
run with ``--skip-tokenizer-init`` and get token ids):

* ``llama``: an MHA ``LlamaForCausalLM`` target;
* ``dsv3``: an MLA ``DeepseekV3ForCausalLM`` target shaped like Kimi K2.6
  (q/kv LoRA ranks, decoupled RoPE head, a small sigmoid-routed MoE with a
  shared expert);
* all modes run ``--attention-backend triton`` (the backend the patch set
  verifies DDTrees with, MHA and MLA; it refuses flashinfer/fa3 for DDTREE), page size 1;
* for each, a matching ``DFlashDraftModel`` (sglang/srt/models/dflash.py): Qwen3
  style layers, ``fc`` over ``len(target_layer_ids)`` target hidden states,
  ``dflash_config`` with ``block_size``, ``target_layer_ids``, ``mask_token_id``;
  no embedding or LM head of its own (it borrows the target's, as DFlash does).

The weights are random but shaped so that the checks mean something: every
embedding row is a shared direction plus per-token noise, so the next-token
distribution is peaked (top-p keeps a few tokens), depends on the context, and
the draft (which sees the mask token's embedding) agrees with the target often
enough for drafts to be accepted.

For each target it launches ``python -m sglang.launch_server`` (CUDA graphs on,
127.0.0.1, a free port) once per mode -- ``nospec``, ``dflash``
(``--speculative-algorithm DFLASH``) and ``ddtree`` (``--speculative-algorithm
DDTREE --speculative-ddtree-budget N --speculative-ddtree-topk-cap K``) -- and checks:

* ``greedy_vs_nospec`` / ``greedy_vs_dflash``: greedy outputs of 32 prompts of
  mixed lengths, one request at a time, token-identical. A divergence where the
  no-spec server's top-2 log-probabilities differ by less than ``--tie-tol`` is
  counted as a numerical near-tie (reported, not a failure): bf16 verify and
  decode kernels round differently;
* ``concurrent_vs_sequential``: the same 32 requests sent at once == one by one;
* ``sampled_distribution``: under temperature/top-p, the tokens produced by
  speculative verify steps (every output position up to ``--sampled-positions``,
  8 by default: deeper tree nodes as the position grows, and the pair 0-1)
  against the no-spec server's, by a two-sample chi-square test per prompt and
  position (Bonferroni over all tests of a mode at ``--alpha``); DFLASH is run
  through the same test as a control;
* ``throughput``: output tokens/s (client wall clock) at concurrency 1, 8 and 32,
  greedy and sampled, with ``meta_info.spec_accept_length`` and
  ``/server_info`` ``internal_states[0].avg_spec_accept_length``, beside DFLASH.

Waits are bounded; every server is ended in ``finally`` by signalling the process
group it was started in (its own PID). Results: ``<out>/gpu_server_check.json``
and ``.md``; a check that fails is recorded as failed, one that could not run as
not run, with the reason. The end of the output says plainly which checks ran.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]

MODES = ("nospec", "dflash", "ddtree")
TARGETS = ("llama", "dsv3")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_PROMPT_ID = 3  # prompts use ids in [3, vocab - 2]; vocab - 1 is the DFlash mask token


# ---------------------------------------------------------------------------
# Tiny models: configs and weights (CPU only: torch + safetensors)
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LlamaSpec:
    vocab_size: int = 2048
    hidden_size: int = 512
    intermediate_size: int = 1024
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5


@dataclasses.dataclass(frozen=True)
class DeepseekV3Spec:
    """Kimi K2.6 / DeepSeek-V3 layout at toy width (per-head dims as in V3)."""

    vocab_size: int = 2048
    hidden_size: int = 512
    intermediate_size: int = 1024
    moe_intermediate_size: int = 256
    num_hidden_layers: int = 3
    num_attention_heads: int = 16
    q_lora_rank: int | None = 384
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6


@dataclasses.dataclass(frozen=True)
class DraftSpec:
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 1024
    block_size: int = 16


@dataclasses.dataclass(frozen=True)
class WeightStyle:
    """How the random weights are drawn (see the module docstring)."""

    linear_std: float = 0.02
    token_noise: float = 0.7  # per-token share of each embedding row (shared direction = 1)
    logit_std: float = 4.0  # spread of the LM head's logits


def llama_config(spec: LlamaSpec, dtype: str = "bfloat16") -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": spec.rms_norm_eps,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": dtype,
        "use_cache": True,
    }


def deepseek_v3_config(spec: DeepseekV3Spec, dtype: str = "bfloat16") -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_attention_heads,
        "q_lora_rank": spec.q_lora_rank,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "n_routed_experts": spec.n_routed_experts,
        "n_shared_experts": spec.n_shared_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "first_k_dense_replace": spec.first_k_dense_replace,
        "moe_layer_freq": 1,
        "n_group": spec.n_group,
        "topk_group": spec.topk_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": spec.routed_scaling_factor,
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": spec.rms_norm_eps,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": dtype,
        "use_cache": True,
    }


def default_target_layer_ids(num_target_layers: int) -> list[int]:
    """Two context features; SGLang captures "before layer id + 1", so ids stay
    below the last layer."""
    if num_target_layers < 2:
        raise ValueError("the DFlash draft needs a target with at least 2 layers")
    if num_target_layers == 2:
        return [0]
    return [num_target_layers - 3, num_target_layers - 2]


def dflash_draft_config(target_cfg: dict, spec: DraftSpec, *, target_layer_ids=None,
                        mask_token_id: int | None = None, dtype: str = "bfloat16") -> dict:
    """A DFlash draft config as SGLang 0.5.23's DFlashDraftModel reads it
    (parse_dflash_draft_config): Qwen3 layer fields, ``dflash_config`` and the
    top-level ``block_size`` / ``num_target_layers`` that published drafts carry."""
    n_target = int(target_cfg["num_hidden_layers"])
    ids = list(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(n_target)
    if any(not 0 <= i < n_target - 1 for i in ids):
        raise ValueError(f"target_layer_ids {ids} must lie in [0, {n_target - 2}]")
    vocab = int(target_cfg["vocab_size"])
    mask = vocab - 1 if mask_token_id is None else int(mask_token_id)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": int(target_cfg["hidden_size"]),
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(target_cfg["max_position_embeddings"]),
        "rope_theta": float(target_cfg.get("rope_theta", 10000.0)),
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "block_size": spec.block_size,
        "num_target_layers": n_target,
        "dflash_config": {
            "block_size": spec.block_size,
            "target_layer_ids": ids,
            "num_target_layers": n_target,
            "mask_token_id": mask,
        },
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": dtype,
    }


def _embed_and_head(gen, vocab, hidden, style: WeightStyle):
    import torch

    shared = torch.randn(hidden, generator=gen)
    embed = shared.unsqueeze(0) + style.token_noise * torch.randn(vocab, hidden, generator=gen)
    head = torch.randn(vocab, hidden, generator=gen) * (style.logit_std / math.sqrt(hidden))
    return embed, head


def _lin(gen, out_f, in_f, std):
    import torch

    return torch.randn(out_f, in_f, generator=gen) * std


def llama_weights(cfg: dict, seed: int = 0, style: WeightStyle = WeightStyle()) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    s = style.linear_std
    embed, head = _embed_and_head(gen, v, h, style)
    w = {"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": torch.ones(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": _lin(gen, q, h, s),
            p + "self_attn.k_proj.weight": _lin(gen, kv, h, s),
            p + "self_attn.v_proj.weight": _lin(gen, kv, h, s),
            p + "self_attn.o_proj.weight": _lin(gen, h, q, s),
            p + "mlp.gate_proj.weight": _lin(gen, inter, h, s),
            p + "mlp.up_proj.weight": _lin(gen, inter, h, s),
            p + "mlp.down_proj.weight": _lin(gen, h, inter, s),
        })
    return w


def deepseek_v3_weights(cfg: dict, seed: int = 0, style: WeightStyle = WeightStyle()) -> dict:
    """Checkpoint names of the DeepSeek-V3 / Kimi K2 releases (per-expert MoE
    weights), which is what SGLang's loader expects."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, v, s = cfg["hidden_size"], cfg["vocab_size"], style.linear_std
    heads = cfg["num_attention_heads"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    qr, kvr = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    embed, head = _embed_and_head(gen, v, h, style)
    w = {"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": torch.ones(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        if qr:
            w[p + "self_attn.q_a_proj.weight"] = _lin(gen, qr, h, s)
            w[p + "self_attn.q_a_layernorm.weight"] = torch.ones(qr)
            w[p + "self_attn.q_b_proj.weight"] = _lin(gen, heads * (nope + rope), qr, s)
        else:
            w[p + "self_attn.q_proj.weight"] = _lin(gen, heads * (nope + rope), h, s)
        w[p + "self_attn.kv_a_proj_with_mqa.weight"] = _lin(gen, kvr + rope, h, s)
        w[p + "self_attn.kv_a_layernorm.weight"] = torch.ones(kvr)
        w[p + "self_attn.kv_b_proj.weight"] = _lin(gen, heads * (nope + vd), kvr, s)
        w[p + "self_attn.o_proj.weight"] = _lin(gen, h, heads * vd, s)
        if i < cfg["first_k_dense_replace"]:
            inter = cfg["intermediate_size"]
            w[p + "mlp.gate_proj.weight"] = _lin(gen, inter, h, s)
            w[p + "mlp.up_proj.weight"] = _lin(gen, inter, h, s)
            w[p + "mlp.down_proj.weight"] = _lin(gen, h, inter, s)
            continue
        mi, n_exp = cfg["moe_intermediate_size"], cfg["n_routed_experts"]
        w[p + "mlp.gate.weight"] = _lin(gen, n_exp, h, s)
        w[p + "mlp.gate.e_score_correction_bias"] = torch.zeros(n_exp, dtype=torch.float32)
        for e in range(n_exp):
            q = f"{p}mlp.experts.{e}."
            w[q + "gate_proj.weight"] = _lin(gen, mi, h, s)
            w[q + "up_proj.weight"] = _lin(gen, mi, h, s)
            w[q + "down_proj.weight"] = _lin(gen, h, mi, s)
        if cfg["n_shared_experts"]:
            si = mi * cfg["n_shared_experts"]
            w[p + "mlp.shared_experts.gate_proj.weight"] = _lin(gen, si, h, s)
            w[p + "mlp.shared_experts.up_proj.weight"] = _lin(gen, si, h, s)
            w[p + "mlp.shared_experts.down_proj.weight"] = _lin(gen, h, si, s)
    return w


def dflash_draft_weights(cfg: dict, seed: int = 0, style: WeightStyle = WeightStyle()) -> dict:
    """Names DFlashDraftModel.load_weights resolves; no embed_tokens / lm_head."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    k_ctx = len(cfg["dflash_config"]["target_layer_ids"])
    s = style.linear_std
    w = {"norm.weight": torch.ones(h), "hidden_norm.weight": torch.ones(h),
         "fc.weight": _lin(gen, h, k_ctx * h, s)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w.update({
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": _lin(gen, q, h, s),
            p + "self_attn.k_proj.weight": _lin(gen, kv, h, s),
            p + "self_attn.v_proj.weight": _lin(gen, kv, h, s),
            p + "self_attn.o_proj.weight": _lin(gen, h, q, s),
            p + "self_attn.q_norm.weight": torch.ones(hd),
            p + "self_attn.k_norm.weight": torch.ones(hd),
            p + "mlp.gate_proj.weight": _lin(gen, inter, h, s),
            p + "mlp.up_proj.weight": _lin(gen, inter, h, s),
            p + "mlp.down_proj.weight": _lin(gen, h, inter, s),
        })
    return w


def write_model(path: pathlib.Path, config: dict, tensors: dict, dtype: str = "bfloat16") -> pathlib.Path:
    """config.json + generation_config.json + model.safetensors (1-D norms and
    biases stay float32 only where the checkpoint format has them so)."""
    import torch
    from safetensors.torch import save_file

    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}, indent=1) + "\n")
    out = {k: (t if t.dtype == torch.float32 and k.endswith("e_score_correction_bias") else t.to(tdt)).contiguous()
           for k, t in tensors.items()}
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@dataclasses.dataclass
class BuiltModels:
    name: str
    target: pathlib.Path
    draft: pathlib.Path
    attention_backend: str
    target_config: dict
    draft_config: dict


def build_models(root: pathlib.Path, targets=TARGETS, seed: int = 0, dtype: str = "bfloat16",
                 llama: LlamaSpec = LlamaSpec(), dsv3: DeepseekV3Spec = DeepseekV3Spec(),
                 draft: DraftSpec = DraftSpec(), style: WeightStyle = WeightStyle(),
                 attention_backend: str = "triton") -> dict:
    """Writes ``<root>/<target>/{target,draft}`` for each target; returns
    ``{name: BuiltModels}``. Every mode of a target uses one attention backend:
    triton, the one the patch set verifies DDTrees with (MHA and MLA); it
    refuses flashinfer and fa3 for DDTREE at parse time."""
    backend = attention_backend
    built = {}
    for i, name in enumerate(targets):
        if name == "llama":
            tcfg = llama_config(llama, dtype)
            tw = llama_weights(tcfg, seed + 10 * i, style)
        elif name == "dsv3":
            tcfg = deepseek_v3_config(dsv3, dtype)
            tw = deepseek_v3_weights(tcfg, seed + 10 * i, style)
        else:
            raise ValueError(f"unknown target {name!r} (known: {', '.join(TARGETS)})")
        dcfg = dflash_draft_config(tcfg, draft, dtype=dtype)
        dw = dflash_draft_weights(dcfg, seed + 10 * i + 1, style)
        t_dir = write_model(root / name / "target", tcfg, tw, dtype)
        d_dir = write_model(root / name / "draft", dcfg, dw, dtype)
        built[name] = BuiltModels(name, t_dir, d_dir, backend, tcfg, dcfg)
    return built


def transformers_check(model_dir: pathlib.Path, forward: bool = True) -> dict:
    """Load the folder with transformers (config + weights, with its checkpoint
    conversion for MoE experts) and report missing/unexpected keys; skipped for
    DFlash drafts (not a transformers architecture: config only)."""
    try:
        import torch
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        return {"status": "not run", "reason": f"transformers not importable ({exc})"}
    cfg = AutoConfig.from_pretrained(str(model_dir))
    out = {"transformers": transformers.__version__, "config_class": type(cfg).__name__}
    arch = (json.loads((model_dir / "config.json").read_text()).get("architectures") or [""])[0]
    if arch == "DFlashDraftModel":
        out.update(status="ok", detail="config instantiates; DFlash weights are checked by shape only")
        return out
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(model_dir), output_loading_info=True, dtype=torch.float32)
    except TypeError:  # transformers 4.x spells it torch_dtype
        model, info = AutoModelForCausalLM.from_pretrained(
            str(model_dir), output_loading_info=True, torch_dtype=torch.float32)
    missing = [k for k in info.get("missing_keys", []) if "rotary" not in k]
    unexpected = list(info.get("unexpected_keys", []))
    mismatched = [str(x) for x in info.get("mismatched_keys", [])]
    out.update(model_class=type(model).__name__, missing_keys=missing, unexpected_keys=unexpected,
               mismatched_keys=mismatched, parameters=sum(p.numel() for p in model.parameters()))
    if forward:
        vocab = cfg.vocab_size
        ids = torch.randint(FIRST_PROMPT_ID, vocab - 1, (1, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        probs = torch.softmax(logits, dim=-1)
        out.update(logit_std=round(float(logits.std(dim=-1).mean()), 3),
                   top1_prob_mean=round(float(probs.max(dim=-1).values.mean()), 3),
                   distinct_argmax=int(torch.unique(logits.argmax(dim=-1)).numel()))
    out["status"] = "ok" if not (missing or unexpected or mismatched) else "failed"
    return out


def check_model_files(model_dir: pathlib.Path, expected: dict) -> dict:
    """Shapes in model.safetensors == ``expected`` (name -> shape)."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    exp = {k: tuple(v) for k, v in expected.items()}
    return {"missing": sorted(set(exp) - set(got)), "unexpected": sorted(set(got) - set(exp)),
            "wrong_shape": {k: [got[k], exp[k]] for k in set(got) & set(exp) if got[k] != exp[k]}}


# ---------------------------------------------------------------------------
# Command lines
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class ServerOptions:
    python: str = sys.executable
    dtype: str = "bfloat16"
    budget: int = 16  # CT200's tree
    topk_cap: int = 4
    block_size: int = 16
    mem_fraction_static: float = 0.4
    context_length: int = 4096
    # CT200's shape: graphs up to 8 requests, batches up to 48, so the 32 requests sent at once
    # (and the throughput's concurrency 32) run eager batches past the largest graph
    cuda_graph_max_bs: int = 8
    max_running_requests: int = 48
    tp: int = 1
    disable_radix_cache: bool = True
    extra_args: tuple = ()
    ddtree_extra_args: tuple = ()


def server_command(mode: str, models: BuiltModels, port: int, opts: ServerOptions,
                   host: str = "127.0.0.1") -> list[str]:
    """``python -m sglang.launch_server ...`` for one mode; CUDA graphs stay on
    (no --disable-cuda-graph), page size 1 (the tree verify needs it)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    cmd = [opts.python, "-m", "sglang.launch_server",
           "--model-path", str(models.target), "--host", host, "--port", str(port),
           "--skip-tokenizer-init", "--dtype", opts.dtype,
           "--attention-backend", models.attention_backend, "--page-size", "1",
           "--mem-fraction-static", str(opts.mem_fraction_static),
           "--context-length", str(opts.context_length),
           "--cuda-graph-max-bs-decode", str(opts.cuda_graph_max_bs),
           "--max-running-requests", str(opts.max_running_requests),
           "--random-seed", "0"]
    if opts.tp > 1:
        cmd += ["--tp-size", str(opts.tp)]
    if opts.disable_radix_cache:
        cmd.append("--disable-radix-cache")
    if mode != "nospec":
        cmd += ["--speculative-draft-model-path", str(models.draft),
                "--speculative-num-draft-tokens", str(opts.block_size)]
        if mode == "dflash":
            cmd += ["--speculative-algorithm", "DFLASH"]
        else:
            cmd += ["--speculative-algorithm", "DDTREE",
                    "--speculative-ddtree-budget", str(opts.budget),
                    "--speculative-ddtree-topk-cap", str(opts.topk_cap)]
            cmd += list(opts.ddtree_extra_args)
    cmd += list(opts.extra_args)
    return cmd


# ---------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------


def _gammaincc(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x) (series / continued fraction)."""
    if x <= 0:
        return 1.0
    gln = math.lgamma(a)
    if x < a + 1.0:  # series for P
        ap, total, delta = a, 1.0 / a, 1.0 / a
        for _ in range(10_000):
            ap += 1.0
            delta *= x / ap
            total += delta
            if abs(delta) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(-x + a * math.log(x) - gln))
    tiny = 1e-300  # modified Lentz for the continued fraction of Q
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return min(1.0, math.exp(-x + a * math.log(x) - gln) * h)


def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof)."""
    if dof <= 0:
        return 1.0
    return _gammaincc(dof / 2.0, stat / 2.0)


def _merge_cells(pooled: dict, keep) -> tuple[list, bool]:
    """Categories kept as their own cell (``keep(cat)``), the rest pooled into
    one "other" cell; returns (cells, has_other)."""
    cats = sorted(pooled, key=lambda c: (-pooled[c], str(c)))
    kept = [c for c in cats if keep(c)]
    return kept, len(kept) < len(cats)


def chi_square_two_sample(a, b, min_expected: float = 5.0) -> dict:
    """Two-sample chi-square test of homogeneity of two samples of categories
    (iterables of hashables, or ``{category: count}`` dicts). Cells whose
    expected count in either sample is below ``min_expected`` are pooled into
    one "other" cell (and that cell into the smallest kept one if it is still
    too small)."""
    ca = _as_counts(a)
    cb = _as_counts(b)
    na, nb = sum(ca.values()), sum(cb.values())
    if na == 0 or nb == 0:
        raise ValueError("both samples must be non-empty")
    n = na + nb
    pooled = {c: ca.get(c, 0) + cb.get(c, 0) for c in set(ca) | set(cb)}
    fmin = min(na, nb) / n
    kept, has_other = _merge_cells(pooled, lambda c: pooled[c] * fmin >= min_expected)
    rows_a = [ca.get(c, 0) for c in kept]
    rows_b = [cb.get(c, 0) for c in kept]
    if has_other:
        oa, ob = na - sum(rows_a), nb - sum(rows_b)
        if (oa + ob) * fmin >= min_expected or not kept:
            rows_a.append(oa)
            rows_b.append(ob)
        else:  # too small on its own: fold into the smallest kept cell
            rows_a[-1] += oa
            rows_b[-1] += ob
    k = len(rows_a)
    if k < 2:
        return {"stat": 0.0, "dof": 0, "p_value": 1.0, "cells": k, "n_a": na, "n_b": nb,
                "degenerate": True}
    stat = 0.0
    for oa, ob in zip(rows_a, rows_b, strict=True):
        tot = oa + ob
        ea, eb = tot * na / n, tot * nb / n
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    dof = k - 1
    return {"stat": round(stat, 4), "dof": dof, "p_value": chi2_sf(stat, dof), "cells": k,
            "n_a": na, "n_b": nb, "degenerate": False}


def chi_square_goodness(sample, probs: dict, min_expected: float = 5.0) -> dict:
    """One-sample chi-square goodness of fit of ``sample`` to ``probs``
    ({category: probability}; categories absent from ``probs`` have p = 0, and
    observing one gives p_value 0)."""
    counts = _as_counts(sample)
    n = sum(counts.values())
    if n == 0:
        raise ValueError("empty sample")
    outside = sum(v for c, v in counts.items() if probs.get(c, 0.0) <= 0.0)
    if outside:
        return {"stat": math.inf, "dof": None, "p_value": 0.0, "n": n, "impossible": outside}
    total_p = sum(probs.values())
    exp = {c: p / total_p * n for c, p in probs.items() if p > 0}
    kept, has_other = _merge_cells(exp, lambda c: exp[c] >= min_expected)
    obs = [counts.get(c, 0) for c in kept]
    ex = [exp[c] for c in kept]
    if has_other:
        oo, eo = n - sum(obs), n - sum(ex)
        if eo >= min_expected or not kept:
            obs.append(oo)
            ex.append(eo)
        else:
            obs[-1] += oo
            ex[-1] += eo
    if len(obs) < 2:
        return {"stat": 0.0, "dof": 0, "p_value": 1.0, "n": n, "degenerate": True}
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, ex, strict=True))
    return {"stat": round(stat, 4), "dof": len(obs) - 1, "p_value": chi2_sf(stat, len(obs) - 1),
            "n": n, "cells": len(obs)}


def _as_counts(x) -> dict:
    if isinstance(x, dict):
        return {k: int(v) for k, v in x.items() if v}
    counts: dict = {}
    for v in x:
        counts[v] = counts.get(v, 0) + 1
    return counts


def compare_token_lists(ref: list, got: list, ref_gaps: list | None = None, tie_tol: float = 0.0) -> dict:
    """Per-request comparison of token-id lists. ``ref_gaps[r][j]`` (optional)
    is the reference's top-1 minus top-2 log-probability at output position j;
    a first divergence where it is below ``tie_tol`` counts as a near-tie."""
    if len(ref) != len(got):
        raise ValueError(f"{len(ref)} reference outputs vs {len(got)}")
    equal, near_ties, mismatches = 0, [], []
    for r, (a, b) in enumerate(zip(ref, got, strict=True)):
        if a == b:
            equal += 1
            continue
        j = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        gap = None
        if ref_gaps is not None and r < len(ref_gaps) and ref_gaps[r] is not None and j < len(ref_gaps[r]):
            gap = ref_gaps[r][j]
        rec = {"request": r, "first_divergence": j, "len_ref": len(a), "len_got": len(b),
               "ref_token": a[j] if j < len(a) else None, "got_token": b[j] if j < len(b) else None,
               "ref_top2_gap": None if gap is None else round(gap, 5)}
        if gap is not None and gap < tie_tol and len(a) == len(b):
            near_ties.append(rec)
        else:
            mismatches.append(rec)
    return {"requests": len(ref), "equal": equal, "near_ties": near_ties, "mismatches": mismatches,
            "ok": not mismatches}


# ---------------------------------------------------------------------------
# Request sets (deterministic)
# ---------------------------------------------------------------------------


def greedy_requests(vocab: int, n: int = 32, seed: int = 0, max_prompt: int = 600) -> list[dict]:
    """Prompts of mixed lengths and mixed max_new_tokens."""
    r = random.Random(seed)
    out = []
    for i in range(n):
        length = r.choice([1, 3, 8, 17, 40, 100, 250, max_prompt]) if i % 4 else r.randint(2, max_prompt)
        out.append({"input_ids": [r.randrange(FIRST_PROMPT_ID, vocab - 1) for _ in range(length)],
                    "max_new_tokens": r.choice([8, 24, 48, 96])})
    return out


def sampled_prompts(vocab: int, n: int = 2, seed: int = 1, length: int = 12) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(FIRST_PROMPT_ID, vocab - 1) for _ in range(length)] for _ in range(n)]


# ---------------------------------------------------------------------------
# Servers and HTTP (stdlib only)
# ---------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_json(url: str, payload=None, timeout: float = 120.0):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method="GET" if payload is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # loopback only
        body = resp.read()
    return json.loads(body) if body else None


class ServerDied(RuntimeError):
    pass


class Server:
    """One ``sglang.launch_server`` process in its own session (process group
    id = its PID), ended by signalling that group: only what we started."""

    def __init__(self, cmd: list[str], log_path: pathlib.Path, host: str, port: int):
        self.cmd, self.log_path, self.url = cmd, log_path, f"http://{host}:{port}"
        self.proc = None
        self._log = None

    def start(self):
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self._log.write("$ " + " ".join(self.cmd) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=dict(os.environ))

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        pause = 0.2
        while True:
            if self.proc.poll() is not None:
                raise ServerDied(f"server exited with rc={self.proc.returncode} while starting")
            try:
                urllib.request.urlopen(self.url + "/ready", timeout=5).close()
                return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"server not ready after {timeout_s:.0f} s")
            time.sleep(pause)
            pause = min(2.0, pause * 1.5)

    def stop(self, grace_s: float = 60.0) -> str:
        how = "not started"
        if self.proc is not None and self.proc.poll() is None:
            pgid = self.proc.pid  # start_new_session: the group we created
            how = "SIGTERM"
            try:
                os.killpg(pgid, signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                how = "SIGKILL after SIGTERM timed out"
                os.killpg(pgid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                how = "already gone"
            try:  # children left in our group (e.g. a scheduler that ignored TERM)
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        elif self.proc is not None:
            how = f"had exited (rc={self.proc.returncode})"
        if self._log is not None:
            self._log.close()
            self._log = None
        return how


def generate(url: str, input_ids, sampling: dict, timeout: float, **extra) -> list | dict:
    payload = {"input_ids": input_ids, "sampling_params": sampling, **extra}
    return http_json(url + "/generate", payload, timeout=timeout)


def _output_ids(resp: dict) -> list[int]:
    for k in ("output_ids", "token_ids"):
        if k in resp:
            return list(resp[k])
    raise KeyError(f"no output_ids in response keys {sorted(resp)}")


def _top2_gaps(meta: dict) -> list | None:
    tops = meta.get("output_top_logprobs")
    if not tops:
        return None
    gaps = []
    for row in tops:
        vals = sorted((float(x[0]) for x in (row or []) if x and x[0] is not None), reverse=True)
        gaps.append(vals[0] - vals[1] if len(vals) >= 2 else math.inf)
    return gaps


# ---------------------------------------------------------------------------
# One server's work
# ---------------------------------------------------------------------------


def run_mode(url: str, mode: str, vocab: int, args, res: dict | None = None) -> dict:
    """All requests for one server; raw results (comparisons come later).
    Fills ``res`` as it goes (``res["phase"]`` names the phase running), so a
    failure leaves what was collected and says where it stopped."""
    t = args.request_timeout
    res = {} if res is None else res
    res["mode"] = mode
    res["phase"] = "greedy_sequential"
    greedy = {"temperature": 0.0, "ignore_eos": True}
    reqs = greedy_requests(vocab, args.num_greedy, args.seed)
    want_gaps = mode == "nospec"
    seq, gaps, accept = [], [], []
    for q in reqs:  # one by one
        extra = {"return_logprob": True, "top_logprobs_num": 2} if want_gaps else {}
        r = generate(url, q["input_ids"], {**greedy, "max_new_tokens": q["max_new_tokens"]}, t, **extra)
        seq.append(_output_ids(r))
        meta = r.get("meta_info", {})
        if want_gaps:
            gaps.append(_top2_gaps(meta))
        if "spec_accept_length" in meta:
            accept.append(meta["spec_accept_length"])
    res["greedy_sequential"] = seq
    if want_gaps:
        res["greedy_top2_gaps"] = gaps
    res["greedy_accept_length_mean"] = _mean(accept)

    def one(q):
        return _output_ids(generate(url, q["input_ids"], {**greedy, "max_new_tokens": q["max_new_tokens"]}, t))

    res["phase"] = "greedy_concurrent"
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(reqs)) as ex:  # all at once
        res["greedy_concurrent"] = list(ex.map(one, reqs))
    res["phase"] = "sampled"

    # sampled first tokens: batched requests of 64
    samp = {"temperature": args.temperature, "top_p": args.top_p, "max_new_tokens": args.sampled_positions,
            "ignore_eos": True}
    if args.top_k:
        samp["top_k"] = args.top_k
    res["sampled"] = []
    for p in sampled_prompts(vocab, args.num_sampled_prompts, args.seed + 1):
        outs = []
        left = args.num_samples
        batches = []
        while left > 0:
            k = min(64, left)
            batches.append(k)
            left -= k

        def batch(k, p=p):
            r = generate(url, [p] * k, samp, t)
            return [_output_ids(x) for x in (r if isinstance(r, list) else [r])]

        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as ex:
            for got in ex.map(batch, batches):
                outs += got
        res["sampled"].append({"prompt": p, "outputs": outs})

    res["phase"] = "throughput"
    res["throughput"] = throughput(url, vocab, args)
    res["phase"] = "server_info"
    try:
        info = http_json(url + "/server_info", timeout=30)
        st = (info or {}).get("internal_states") or [{}]
        res["avg_spec_accept_length_server"] = st[0].get("avg_spec_accept_length")
        res["server_info_algorithm"] = {k: info.get(k) for k in (
            "speculative_algorithm", "speculative_ddtree_budget", "speculative_ddtree_topk_cap",
            "attention_backend", "speculative_num_draft_tokens", "version") if k in info}
    except (urllib.error.URLError, OSError, ValueError) as exc:
        res["server_info_error"] = f"{type(exc).__name__}: {exc}"
    res["phase"] = "done"
    return res


def throughput(url: str, vocab: int, args) -> list[dict]:
    r = random.Random(args.seed + 7)
    prompts = [[r.randrange(FIRST_PROMPT_ID, vocab - 1) for _ in range(r.choice([16, 64, 256]))]
               for _ in range(args.perf_requests)]
    rows = []
    for label, samp in (("greedy", {"temperature": 0.0}),
                        ("sampled", {"temperature": args.temperature, "top_p": args.top_p})):
        samp = {**samp, "max_new_tokens": args.perf_tokens, "ignore_eos": True}
        for conc in (1, 8, 32):  # 32: past the largest graph batch (8)
            def one(p, samp=samp):
                resp = generate(url, p, samp, args.request_timeout)
                return len(_output_ids(resp)), resp.get("meta_info", {}).get("spec_accept_length")

            t0 = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(max_workers=conc) as ex:
                got = list(ex.map(one, prompts))
            wall = time.monotonic() - t0
            toks = sum(g[0] for g in got)
            rows.append({"sampling": label, "concurrency": conc, "requests": len(prompts),
                         "output_tokens": toks, "wall_s": round(wall, 3),
                         "tokens_per_s": round(toks / wall, 1) if wall > 0 else None,
                         "spec_accept_length_mean": _mean([g[1] for g in got if g[1] is not None])})
    return rows


def _mean(xs):
    xs = [float(x) for x in xs if x is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


# ---------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------


def sampled_tests(ref: dict, got: dict, alpha: float) -> dict:
    """Two-sample chi-square per prompt on every output position the requests have (0: the
    prefill's, a sanity check; 1 on: tokens of speculative verify steps, deeper nodes of the tree
    as the position grows) and the pair 0-1."""
    tests = []
    for pi, (a, b) in enumerate(zip(ref["sampled"], got["sampled"], strict=True)):
        n = min(len(o) for o in a["outputs"] + b["outputs"])
        keys = [(f"pos{j}", lambda o, j=j: o[j]) for j in range(n)] + [("pair01", lambda o: (o[0], o[1]))]
        for label, key in keys:
            xa = [key(o) for o in a["outputs"]]
            xb = [key(o) for o in b["outputs"]]
            r = chi_square_two_sample(xa, xb)
            tests.append({"prompt": pi, "statistic": label, **r})
    n_tests = len(tests)
    thr = alpha / max(1, n_tests)
    min_p = min(t["p_value"] for t in tests) if tests else None
    return {"tests": tests, "alpha": alpha, "bonferroni_threshold": thr, "min_p": min_p,
            "ok": all(t["p_value"] >= thr for t in tests)}


class Checks:
    def __init__(self):
        self.rows: list[dict] = []

    def add(self, target, name, mode, status, detail="", data=None):
        row = {"target": target, "check": name, "mode": mode, "status": status, "detail": detail}
        if data is not None:
            row["data"] = data
        self.rows.append(row)
        print(f"[gpu_server_check] {target}/{mode} {name}: {status} {detail}", flush=True)


def prefix_gaps(ns: dict | None, ref_seqs: list) -> list | None:
    """The no-spec server's top-2 gaps, per request, cut to the prefix where
    the no-spec output equals ``ref_seqs[r]`` (the gap at position j belongs
    to the context prompt + first j tokens)."""
    if not ns or "error" in ns or not ns.get("greedy_top2_gaps"):
        return None
    out = []
    for g, a, b in zip(ns["greedy_top2_gaps"], ns["greedy_sequential"], ref_seqs, strict=True):
        if g is None:
            out.append(None)
            continue
        common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        out.append(g[: common + 1])
    return out


def evaluate(target: str, results: dict, checks: Checks, args) -> None:
    ns = results.get("nospec")
    for mode in MODES:
        r = results.get(mode)
        if r is None:
            continue
        if "error" in r:
            checks.add(target, "server", mode, "failed", r["error"][:500])
            continue
        checks.add(target, "server", mode, "ok", f"ready in {r.get('ready_s')} s")
        c = compare_token_lists(r["greedy_sequential"], r["greedy_concurrent"],
                                prefix_gaps(ns, r["greedy_sequential"]), args.tie_tol)
        checks.add(target, "concurrent_vs_sequential", mode, "ok" if c["ok"] else "failed",
                   f"{c['equal']}/{c['requests']} identical, {len(c['near_ties'])} near-ties, "
                   f"{len(c['mismatches'])} mismatches", c)
        if mode == "nospec":
            continue
        for ref_mode, check in (("nospec", "greedy_vs_nospec"), ("dflash", "greedy_vs_dflash")):
            if ref_mode == mode:
                continue
            ref = results.get(ref_mode)
            if ref is None or "error" in ref:
                checks.add(target, check, mode, "not run", f"no {ref_mode} results")
                continue
            c = compare_token_lists(ref["greedy_sequential"], r["greedy_sequential"],
                                    prefix_gaps(ns, ref["greedy_sequential"]), args.tie_tol)
            checks.add(target, check, mode, "ok" if c["ok"] else "failed",
                       f"{c['equal']}/{c['requests']} identical, {len(c['near_ties'])} near-ties "
                       f"(no-spec top-2 gap < {args.tie_tol}), {len(c['mismatches'])} mismatches", c)
        if mode == "ddtree":  # the patch set is what answered: DDTREE -> DFLASH + budget
            info = r.get("server_info_algorithm") or {}
            active = info.get("speculative_ddtree_budget") == args.budget
            checks.add(target, "ddtree_active", mode, "ok" if active else "failed",
                       f"/server_info: {json.dumps(info)[:300]}")
        if ns is None or "error" in ns:
            checks.add(target, "sampled_distribution", mode, "not run", "no nospec results")
        else:
            s = sampled_tests(ns, r, args.alpha)
            checks.add(target, "sampled_distribution", mode, "ok" if s["ok"] else "failed",
                       f"{len(s['tests'])} chi-square tests vs nospec, min p {s['min_p']:.3g} "
                       f"(Bonferroni threshold {s['bonferroni_threshold']:.2g}); T={args.temperature} "
                       f"top_p={args.top_p}" + (f" top_k={args.top_k}" if args.top_k else ""), s)
    perf = []
    for mode in MODES:
        r = results.get(mode)
        if r and "error" not in r:
            for row in r["throughput"]:
                perf.append({"mode": mode, **row, "avg_spec_accept_length_server": r.get(
                    "avg_spec_accept_length_server")})
    if perf:
        def tps(mode, samp, conc):
            return next((p["tokens_per_s"] for p in perf if p["mode"] == mode and p["sampling"] == samp
                         and p["concurrency"] == conc), None)

        detail = "; ".join(
            f"{samp} c{conc}: " + ", ".join(f"{m} {tps(m, samp, conc)}" for m in MODES if tps(m, samp, conc))
            for samp in ("greedy", "sampled") for conc in (1, 8, 32))
        checks.add(target, "throughput", "all", "measured", detail + " tok/s", perf)


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def gpu_available(tp: int = 1) -> tuple[bool, str]:
    """Whether ``tp`` GPUs are visible, and what they are (or why not)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False, "torch.cuda.is_available() is False"
        n = torch.cuda.device_count()
        if n < tp:
            return False, f"{n} GPU(s) visible, --tp {tp} needs {tp}"
        return True, f"{tp} x {torch.cuda.get_device_name(0)}" if tp > 1 else torch.cuda.get_device_name(0)
    except ImportError:
        smi = shutil.which("nvidia-smi")
        return (smi is not None), ("nvidia-smi present, torch missing" if smi else "no torch, no nvidia-smi")


def render_markdown(doc: dict) -> str:
    md = ["# DDTree server checks (bench/gpu_server_check.py)", ""]
    for k, v in doc["meta"].items():
        if k != "commands":
            md.append(f"- {k}: {v}")
    md += ["", "## Checks", "", "| target | mode | check | status | detail |", "|---|---|---|---|---|"]
    for r in doc["checks"]:
        md.append(f"| {r['target']} | {r['mode']} | {r['check']} | {r['status']} | "
                  f"{str(r['detail']).replace('|', '/')[:400]} |")
    perf = [row for r in doc["checks"] if r["check"] == "throughput" for row in r.get("data", [])]
    if perf:
        cols = ["mode", "sampling", "concurrency", "tokens_per_s", "spec_accept_length_mean",
                "avg_spec_accept_length_server", "output_tokens", "wall_s"]
        md += ["", "## Throughput (tiny random models: relative numbers only)", "",
               "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        md += ["| " + " | ".join(str(p.get(c)) for c in cols) + " |" for p in perf]
    md += ["", "## Commands", ""]
    for name, cmd in doc["meta"].get("commands", {}).items():
        md.append(f"- {name}: `{' '.join(cmd)}`")
    return "\n".join(md) + "\n"


def write_results(out: pathlib.Path, meta: dict, checks: Checks, raw: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "checks": checks.rows}
    (out / "gpu_server_check.json").write_text(json.dumps({**doc, "raw": raw}, indent=1, default=str) + "\n")
    (out / "gpu_server_check.md").write_text(render_markdown(doc))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--work-dir", default=None,
                    help="models (~80 MB) and server logs (default: a new folder under the system temp dir)")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--python", default=sys.executable, help="interpreter with sglang 0.5.23 + the patch set")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--budget", type=int, default=16, help="DDTREE budget (CT200's: 16)")
    ap.add_argument("--topk-cap", type=int, default=4, help="DDTREE top-k cap (CT200's: 4)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallel size of every server (--tp-size); needs that many visible GPUs")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=8,
                    help="largest decode graph batch; requests sent together beyond it run eager batches")
    ap.add_argument("--max-running-requests", type=int, default=48)
    ap.add_argument("--sampled-positions", type=int, default=8,
                    help="output positions per sampled request tested against the no-spec server "
                         "(0 is the prefill's; 1 on are speculative steps, at tree depths up to the block)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--mem-fraction-static", type=float, default=0.4)
    ap.add_argument("--extra-server-args", default="", help="appended to every launch (split on spaces)")
    ap.add_argument("--ddtree-server-args", default="", help="appended to DDTREE launches, e.g. a tree-verify flag")
    ap.add_argument("--attention-backend", default="triton", help="for every mode (DDTREE accepts triton)")
    ap.add_argument("--keep-radix-cache", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-greedy", type=int, default=32)
    ap.add_argument("--num-sampled-prompts", type=int, default=2)
    ap.add_argument("--num-samples", type=int, default=1200, help="sampled requests per prompt and mode")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--alpha", type=float, default=1e-3, help="family-wise, Bonferroni over a mode's tests")
    ap.add_argument("--tie-tol", type=float, default=None,
                    help="near-tie top-2 log-prob gap (default 0.1 for bf16/fp16, 1e-3 for fp32)")
    ap.add_argument("--perf-requests", type=int, default=8)
    ap.add_argument("--perf-tokens", type=int, default=256)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--dry-run", action="store_true", help="build the models, print the commands, launch nothing")
    ap.add_argument("--skip-gpu-check", action="store_true",
                    help="launch even when this interpreter sees no CUDA device")
    args = ap.parse_args(argv)
    if args.tie_tol is None:
        args.tie_tol = 1e-3 if args.dtype == "float32" else 0.1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = pathlib.Path(args.out)
    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="ddtree_server_check_"))
    targets = [t for t in args.targets.split(",") if t]
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; known: {', '.join(MODES)}")
    opts = ServerOptions(python=args.python, dtype=args.dtype, budget=args.budget, topk_cap=args.topk_cap,
                         block_size=args.block_size, mem_fraction_static=args.mem_fraction_static,
                         tp=args.tp, cuda_graph_max_bs=args.cuda_graph_max_bs,
                         max_running_requests=args.max_running_requests,
                         disable_radix_cache=not args.keep_radix_cache,
                         extra_args=tuple(args.extra_server_args.split()),
                         ddtree_extra_args=tuple(args.ddtree_server_args.split()))
    has_gpu, gpu = gpu_available(args.tp)
    meta = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpu": gpu,
            "python": opts.python, "targets": targets, "modes": modes, "dtype": args.dtype,
            "budget": args.budget, "topk_cap": args.topk_cap, "block_size": args.block_size,
            "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k or None,
            "tie_tol": args.tie_tol, "alpha": args.alpha, "dry_run": args.dry_run,
            "work_dir": str(work), "commands": {}}
    try:
        sg = subprocess.run([opts.python, "-c", "import sglang; print(sglang.__version__)"],
                            capture_output=True, text=True, timeout=300, check=False)
        meta["sglang"] = sg.stdout.strip() or f"not importable: {sg.stderr.strip()[-300:]}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        meta["sglang"] = f"not checked: {exc}"
    checks = Checks()
    raw: dict = {}
    built = build_models(work / "models", targets, seed=args.seed, dtype=args.dtype,
                         attention_backend=args.attention_backend)
    for name, m in built.items():
        for part, d in (("target", m.target), ("draft", m.draft)):
            try:
                tc = transformers_check(d)
            except Exception as exc:  # noqa: BLE001 - recorded as a failed check
                tc = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:600]}
            checks.add(name, f"model_files_{part}", "-", tc.pop("status"),
                       tc.get("reason") or json.dumps({k: v for k, v in tc.items() if k != "reason"})[:400], tc)
        for mode in modes:  # the port is chosen at launch; 30000 stands for it here
            meta["commands"][f"{name}/{mode}"] = server_command(mode, m, 30000, opts)
    write_results(out, meta, checks, raw)
    if args.dry_run or not (has_gpu or args.skip_gpu_check):
        why = "dry run" if args.dry_run else f"no GPU ({gpu})"
        for name in built:
            for mode in modes:
                checks.add(name, "server+all request checks", mode, "not run", why)
        write_results(out, meta, checks, raw)
        return summarize(checks, out, 0 if args.dry_run else 2)

    for name, m in built.items():
        results: dict = {}
        vocab = int(m.target_config["vocab_size"])
        for mode in modes:
            port = free_port()
            cmd = server_command(mode, m, port, opts)
            meta["commands"][f"{name}/{mode}"] = cmd
            srv = Server(cmd, work / "logs" / f"{name}_{mode}.log", "127.0.0.1", port)
            rec: dict = {"cmd": cmd, "log": str(srv.log_path)}
            try:
                srv.start()
                rec["phase"] = "startup"
                rec["ready_s"] = round(srv.wait_ready(args.startup_timeout), 1)
                run_mode(srv.url, mode, vocab, args, res=rec)
            except Exception as exc:  # noqa: BLE001 - recorded as this mode's failure
                rec["error"] = (f"in phase {rec.get('phase')}: {type(exc).__name__}: {exc}\n"
                                f"{traceback.format_exc()[-1500:]}\n--- log tail ---\n{srv.log_tail()}")
            finally:
                rec["stopped"] = srv.stop()
            results[mode] = rec
            raw[f"{name}/{mode}"] = {k: v for k, v in rec.items() if k not in ("greedy_top2_gaps",)}
            write_results(out, meta, checks, raw)
        evaluate(name, results, checks, args)
        write_results(out, meta, checks, raw)
    failed = any(r["status"] == "failed" for r in checks.rows)
    return summarize(checks, out, 1 if failed else 0)


def summarize(checks: Checks, out: pathlib.Path, rc: int) -> int:
    ran = [r for r in checks.rows if r["status"] in ("ok", "failed", "measured")]
    not_run = [r for r in checks.rows if r["status"] not in ("ok", "failed", "measured")]
    print("\n=== gpu_server_check: checks that RAN ===")
    for r in ran:
        print(f"  {r['status'].upper():8} {r['target']}/{r['mode']} {r['check']}: {str(r['detail'])[:160]}")
    print("=== checks that did NOT run ===")
    for r in not_run or [{"status": "-", "target": "-", "mode": "-", "check": "(none)", "detail": ""}]:
        print(f"  {r['status'].upper():8} {r['target']}/{r['mode']} {r['check']}: {str(r['detail'])[:160]}")
    print(f"results: {out / 'gpu_server_check.json'} and gpu_server_check.md")
    return rc


if __name__ == "__main__":
    sys.exit(main())
