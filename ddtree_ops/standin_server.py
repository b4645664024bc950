"""Stand-in SGLang 0.5.23 server for test hosts without a GPU.

Run by the unit's ExecStart with the SGLang venv's interpreter::

    python -m ddtree_ops.standin_server --model-path M --host H --port P --tp 8 \
        --speculative-algorithm DDTREE --speculative-draft-model-path D \
        --speculative-ddtree-budget 16 --speculative-ddtree-topk-cap 4 [other SGLang flags]

It follows the start-up contract of ``sglang.launch_server`` 0.5.23 (see
shared/reference/sglang-0.5.23.md):

1. "loading": ``Load weight begin`` is logged, the port stays closed, every
   ``sglang/srt/speculative/ddtree*.py`` found beside the installed ``sglang`` package is
   imported (an exception ends the process with status 1 and the traceback in the log),
   ``Load weight end`` and the CUDA graph lines are logged;
2. warm-up: the port is bound; ``/health``, ``/health_generate`` and ``/ready`` answer 503;
3. ready: they answer 200 and ``The server is fired up and ready to roll!`` is logged.

Endpoints: ``/health``, ``/health_generate``, ``/ready``, ``/model_info``
(``/get_model_info``), ``/server_info`` (``/get_server_info``), ``/v1/models`` and
``POST /generate``. With ``--api-key`` every endpoint except ``/health*`` and ``/ready``
needs ``Authorization: Bearer KEY``.

``/generate`` runs a tiny seeded toy model (vocabulary of 64 tokens, Markov in the last
token). Where the payload module ``sglang.srt.speculative.ddtree_utils`` provides
``build_ddtree_tree``, ``compile_ddtree_retrieve`` and a tree sampling function, every
decode step builds a DDTree from toy draft log-probs and verifies it with that sampling
function, so the reported accept length is real; otherwise (or when a payload function
raises, which is logged with its traceback) generation is autoregressive with accept
length 1.0.

Fault and timing knobs (passed through the inventory's ``extra_args``) are the
``--standin-*`` flags below; ``DDTREE_STANDIN_LOAD_SECONDS`` in the environment overrides
``--standin-load-seconds``.

Only the standard library is needed; torch is imported lazily, on the DDTree path only.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import math
import os
import random
import signal
import sys
import threading
import time
import traceback
import types
import uuid
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
TOY_VOCAB = 64
MAX_NEW_TOKENS_CAP = 4096
DEFAULT_BUDGET = 16
# Names under which the payload may expose the reference tree sampler (first found wins).
SAMPLING_FUNCTION_NAMES = (
    "tree_speculative_sampling_reference",
    "tree_speculative_sampling_target_only_reference",
    "tree_speculative_sampling_target_only",
)
# Upstream 0.5.23 choices of --speculative-algorithm (for the argparse-like error).
UPSTREAM_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH")
SECRET_FLAG_WORDS = ("key", "token", "secret", "password")


# --------------------------------------------------------------------------------------
# logging (SGLang style: "[YYYY-mm-dd HH:MM:SS TP0] message"), every line flushed
# --------------------------------------------------------------------------------------

_log_lock = threading.RLock()


def log(msg: str, prefix: str = "") -> None:
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    head = f"[{stamp}{' ' + prefix if prefix else ''}] "
    text = "\n".join(head + line for line in str(msg).splitlines() or [""])
    with _log_lock:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def log_raw(msg: str) -> None:
    """A line without the SGLang prefix (uvicorn's, tracebacks)."""
    with _log_lock:
        sys.stdout.write(msg.rstrip("\n") + "\n")
        sys.stdout.flush()


# --------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch_server.py",
        description="Stand-in for sglang.launch_server 0.5.23 (no GPU).",
        allow_abbrev=False,
    )
    p.add_argument("--model-path", "--model", dest="model_path", default="stand-in-model")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp", "--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    p.add_argument("--dp", "--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-init-addr", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-ddtree-budget", type=int, default=None)
    p.add_argument("--speculative-ddtree-topk-cap", type=int, default=None)
    # stand-in knobs
    g = p.add_argument_group("stand-in knobs")
    g.add_argument("--standin-load-seconds", type=float, default=0.5,
                   help="seconds of 'weight loading' with the port closed "
                        "(env DDTREE_STANDIN_LOAD_SECONDS overrides)")
    g.add_argument("--standin-warmup-seconds", type=float, default=0.3,
                   help="seconds of warm-up with the port open and /health 503")
    g.add_argument("--standin-crash-during-load", action="store_true",
                   help="exit 1 with a traceback after half the load time")
    g.add_argument("--standin-never-listen", action="store_true",
                   help="load forever: the port never opens")
    g.add_argument("--standin-warmup-never-completes", action="store_true",
                   help="/health stays 503 forever")
    g.add_argument("--standin-health-flaps", action="store_true",
                   help="after ready, /health alternates 200, 503, 200, ... per request")
    g.add_argument("--standin-generate-fails", action="store_true",
                   help="/generate answers 500")
    g.add_argument("--standin-die-after-ready", type=float, default=None, metavar="SECONDS",
                   help="exit 1 SECONDS after the server declared itself ready")
    g.add_argument("--standin-site-packages", default=None, metavar="DIR",
                   help="where to look for sglang when it is not importable")
    return p


def _is_flag(tok: str) -> bool:
    if not tok.startswith("-") or tok == "-":
        return False
    try:
        float(tok)
        return False  # a negative number is a value
    except ValueError:
        return True


def record_unknown(unknown: list[str]) -> dict[str, Any]:
    """Turn unparsed SGLang flags into {dest: value} (value True for bare switches)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(unknown):
        tok = unknown[i]
        if _is_flag(tok):
            name, eq, val = tok.lstrip("-").partition("=")
            key = name.replace("-", "_")
            if eq:
                out[key] = val
            elif i + 1 < len(unknown) and not _is_flag(unknown[i + 1]):
                out[key] = unknown[i + 1]
                i += 1
            else:
                out[key] = True
        else:
            out.setdefault("_positional", []).append(tok)
        i += 1
    return out


def _masked(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        k: ("***" if any(w in k.lower() for w in SECRET_FLAG_WORDS) and v is not True else v)
        for k, v in extra.items()
    }


# --------------------------------------------------------------------------------------
# DDTree module discovery and import
# --------------------------------------------------------------------------------------


def find_site_packages(fallback: str | None) -> Path | None:
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]).resolve().parent
    if fallback:
        sp = Path(fallback).resolve()
        if (sp / "sglang").is_dir():
            sys.path.insert(0, str(sp))
            importlib.invalidate_caches()
            return sp
    return None


def list_ddtree_modules(site_packages: Path | None) -> list[Path]:
    if site_packages is None:
        return []
    return sorted((site_packages / "sglang" / "srt" / "speculative").glob("ddtree*.py"))


def prepare_parent_packages(site_packages: Path) -> str | None:
    """Make ``sglang.srt.speculative`` importable before the DDTree modules are imported.

    The real package is imported first. On a test host the venv holds the real sglang
    0.5.23 files without SGLang's dependencies (orjson, transformers, ...), so
    ``sglang/__init__.py`` fails for reasons that have nothing to do with the payload;
    then ``sglang``, ``sglang.srt`` and ``sglang.srt.speculative`` are replaced by bare
    package stubs pointing at the same folders, and the DDTree modules (and whatever they
    import themselves) are still imported from their files. Returns the reason when the
    stubs were needed, None otherwise."""
    try:
        importlib.import_module("sglang.srt.speculative")
        return None
    except Exception as exc:  # noqa: BLE001
        reason = f"{type(exc).__name__}: {exc}"
    for name in list(sys.modules):
        if name == "sglang" or name.startswith("sglang."):
            del sys.modules[name]
    parent = None
    for name, rel in (("sglang", "sglang"), ("sglang.srt", "sglang/srt"),
                      ("sglang.srt.speculative", "sglang/srt/speculative")):
        path = str(site_packages / rel)
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [path]
        mod = types.ModuleType(name)
        mod.__spec__ = spec
        mod.__path__ = [path]
        mod.__package__ = name
        sys.modules[name] = mod
        if parent is not None:
            setattr(parent, name.rsplit(".", 1)[1], mod)
        parent = mod
    importlib.invalidate_caches()
    return reason


def sha256_short(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


# --------------------------------------------------------------------------------------
# toy model and generation
# --------------------------------------------------------------------------------------


class PayloadError(Exception):
    """A payload function raised or returned something unusable."""


def _seed_of(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "replace")).digest()[:8], "big")


def _prompt_tokens(text: str) -> list[int]:
    words = text.split() or [""]
    return [_seed_of(w) % TOY_VOCAB for w in words]


class ToyModel:
    """A Markov model over TOY_VOCAB tokens: logits of the next token depend on the last."""

    def __init__(self, seed: int, vocab: int = TOY_VOCAB):
        rng = random.Random(seed)
        self.vocab = vocab
        self.logits = [[rng.gauss(0.0, 2.5) for _ in range(vocab)] for _ in range(vocab)]

    def probs(self, token: int, temperature: float, top_k: int, top_p: float) -> list[float]:
        """Target distribution after temperature, top-k, top-p (as eagle_sample does);
        greedy (temperature ~0) is a one-hot at the argmax."""
        row = self.logits[min(max(int(token), 0), self.vocab - 1)]
        if temperature <= 1e-5:
            best = max(range(self.vocab), key=row.__getitem__)
            return [1.0 if i == best else 0.0 for i in range(self.vocab)]
        m = max(row)
        p = [math.exp((x - m) / temperature) for x in row]
        order = sorted(range(self.vocab), key=p.__getitem__, reverse=True)
        if 0 < top_k < self.vocab:
            for i in order[top_k:]:
                p[i] = 0.0
        s = sum(p)
        p = [x / s for x in p]
        if 0.0 < top_p < 1.0:
            acc, keep = 0.0, set()
            for i in order:
                if p[i] <= 0.0:
                    break
                keep.add(i)
                acc += p[i]
                if acc >= top_p:
                    break
            p = [x if i in keep else 0.0 for i, x in enumerate(p)]
            s = sum(p)
            p = [x / s for x in p]
        return p

    def greedy_next(self, token: int) -> int:
        row = self.logits[token]
        return max(range(self.vocab), key=row.__getitem__)


def _sample(p: list[float], coin: float) -> int:
    acc = 0.0
    total = sum(p)
    last_pos = len(p) - 1
    for i, x in enumerate(p):
        if x <= 0.0:
            continue
        last_pos = i
        acc += x
        if acc > coin * total:
            return i
    return last_pos


def _params(sp: dict[str, Any]) -> tuple[float, int, float, int]:
    temperature = float(sp.get("temperature", 1.0) if sp.get("temperature") is not None else 1.0)
    top_k = int(sp.get("top_k", -1) if sp.get("top_k") is not None else -1)
    top_p = float(sp.get("top_p", 1.0) if sp.get("top_p") is not None else 1.0)
    mnt = sp.get("max_new_tokens", 128)
    mnt = 128 if mnt is None else int(mnt)
    return temperature, top_k, top_p, max(0, min(mnt, MAX_NEW_TOKENS_CAP))


class DDTreeFunctions:
    def __init__(self, build, compile_retrieve, sampling, sampling_name: str):
        self.build = build
        self.compile_retrieve = compile_retrieve
        self.sampling = sampling
        self.sampling_name = sampling_name


def lookup_ddtree_functions() -> DDTreeFunctions | None:
    """The payload API from ``sglang.srt.speculative.ddtree_utils``; a function missing
    there is looked up in the other imported ``ddtree*`` modules (sorted)."""
    prefix = "sglang.srt.speculative."
    main_mod = sys.modules.get(prefix + "ddtree_utils")
    if main_mod is None:
        return None
    others = [sys.modules[n] for n in sorted(sys.modules)
              if n.startswith(prefix + "ddtree") and n != prefix + "ddtree_utils"
              and sys.modules[n] is not None]
    mods = [main_mod, *others]

    def find(*names: str):
        for mod in mods:
            for name in names:
                fn = getattr(mod, name, None)
                if callable(fn):
                    return fn, name
        return None, ""

    build, _ = find("build_ddtree_tree")
    compile_retrieve, _ = find("compile_ddtree_retrieve")
    sampling, name = find(*SAMPLING_FUNCTION_NAMES)
    if build is None or compile_retrieve is None or sampling is None:
        return None
    return DDTreeFunctions(build, compile_retrieve, sampling, name)


def generate_autoregressive(model: ToyModel, last: int, n: int, params, rng: random.Random) -> list[int]:
    temperature, top_k, top_p, _ = params
    out = []
    for _ in range(n):
        last = _sample(model.probs(last, temperature, top_k, top_p), rng.random())
        out.append(last)
    return out


def ddtree_step(fns: DDTreeFunctions, torch, model: ToyModel, last: int, params,
                budget: int, topk_cap: int, gen) -> tuple[list[int], int, int]:
    """One draft-tree + verify step. Returns (committed tokens, accepted drafts, max depth)."""
    temperature, top_k, top_p, _ = params
    V = model.vocab
    L = max(1, min(15, budget))
    # Toy drafter: marginals near the target's greedy chain, plus noise.
    chain, t = [], last
    for _ in range(L):
        chain.append(t)
        t = model.greedy_next(t)
    draft_logits = torch.tensor([model.logits[c] for c in chain], dtype=torch.float32)
    draft_logits = draft_logits + torch.randn(draft_logits.shape, generator=gen) * 1.5
    draft_logprobs = torch.log_softmax(draft_logits, dim=-1).unsqueeze(0)  # [1, L, V]

    try:
        tokens, parents, depths, scores = fns.build(draft_logprobs, budget, topk_cap)
        N = budget + 1
        for name, ten in (("tokens", tokens), ("parents", parents), ("depths", depths), ("scores", scores)):
            if tuple(ten.shape) != (1, N):
                raise PayloadError(f"build_ddtree_tree returned {name} of shape {tuple(ten.shape)}, "
                                   f"expected (1, {N})")
        retrive_index, retrive_next_token, retrive_next_sibling = fns.compile_retrieve(parents, scores)
        for name, ten in (("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
                          ("retrive_next_sibling", retrive_next_sibling)):
            if tuple(ten.shape) != (1, N):
                raise PayloadError(f"compile_ddtree_retrieve returned {name} of shape "
                                   f"{tuple(ten.shape)}, expected (1, {N})")
        candidates = tokens.to(torch.int64).clone()
        candidates[0, 0] = last
        cand = candidates[0].tolist()
        target = torch.tensor(
            [model.probs(c if 0 <= c < V else 0, temperature, top_k, top_p) for c in cand],
            dtype=torch.float32,
        ).unsqueeze(0)  # [1, N, V]
        max_depth = int(depths.max().item())
        S = max_depth + 1
        predicts = torch.zeros(N, dtype=torch.int32)
        accept_index = torch.full((1, S), -1, dtype=torch.int32)
        accept_token_num = torch.zeros(1, dtype=torch.int32)
        hi = 1.0 - 2.0 ** -24
        coins = torch.rand((1, N), generator=gen, dtype=torch.float32).clamp_(max=hi)
        final_coin = torch.rand((1,), generator=gen, dtype=torch.float32).clamp_(max=hi)
        draft_probs = torch.zeros((1, N, V), dtype=torch.float32)
        fns.sampling(
            predicts, accept_index, accept_token_num, candidates,
            retrive_index.to(torch.int64), retrive_next_token.to(torch.int64),
            retrive_next_sibling.to(torch.int64), coins, final_coin, target, draft_probs,
            threshold_single=1.0, threshold_acc=1.0,
        )
        n = int(accept_token_num[0].item())
        if not 0 <= n <= S - 1:
            raise PayloadError(f"accept_token_num={n} outside [0, {S - 1}]")
        idx = accept_index[0, : n + 1].tolist()
        if any(i < 0 or i >= N for i in idx):
            raise PayloadError(f"accept_index {idx} has entries outside [0, {N})")
        committed = [int(predicts[i].item()) for i in idx]
        if any(not 0 <= tok < V for tok in committed):
            raise PayloadError(f"committed tokens {committed} outside the vocabulary")
        return committed, n, max_depth
    except PayloadError:
        raise
    except Exception as exc:  # a payload function raised
        raise PayloadError(f"{type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------------------
# server state
# --------------------------------------------------------------------------------------


class State:
    def __init__(self, args: argparse.Namespace, extra: dict[str, Any], imported: dict[str, str],
                 site_packages: Path | None):
        self.args = args
        self.extra = extra
        self.imported = imported
        self.site_packages = site_packages
        self.status = "Starting"  # Starting | Up
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
            "api_key": "***" if a.api_key else None,
            "speculative_algorithm": a.speculative_algorithm,
            "speculative_draft_model_path": a.speculative_draft_model_path,
            "speculative_num_draft_tokens": a.speculative_num_draft_tokens,
            "speculative_num_steps": a.speculative_num_steps,
            "speculative_eagle_topk": a.speculative_eagle_topk,
            "speculative_ddtree_budget": a.speculative_ddtree_budget,
            "speculative_ddtree_topk_cap": a.speculative_ddtree_topk_cap,
        }
        for k, v in _masked(self.extra).items():
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
            "standin_extra_args": _masked(self.extra),
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


# --------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------

NO_KEY_PREFIXES = ("/health", "/ready", "/metrics")


class Handler(BaseHTTPRequestHandler):
    server_version = "uvicorn"
    sys_version = ""
    protocol_version = "HTTP/1.1"
    state: State  # set on the subclass

    def log_message(self, fmt: str, *args: Any) -> None:  # uvicorn-like access log
        log_raw(f'INFO:     {self.client_address[0]}:{self.client_address[1]} - "{self.requestline}" '
                f"{args[1] if len(args) > 1 else ''}")

    def _send(self, code: int, body: Any = None) -> None:
        if body is None:
            data = b""
            ctype = "text/plain"
        elif isinstance(body, (bytes, str)):
            data = body.encode() if isinstance(body, str) else body
            ctype = "text/plain; charset=utf-8"
        else:
            data = json.dumps(body).encode()
            ctype = "application/json"
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    def _authorised(self, path: str) -> bool:
        key = self.state.args.api_key
        if not key or path.startswith(NO_KEY_PREFIXES):
            return True
        return self.headers.get("Authorization", "") == f"Bearer {key}"

    def _health(self) -> None:
        st = self.state
        if st.args.node_rank >= 1:
            self._send(200)
            return
        if st.status != "Up":
            self._send(503)
            return
        if st.args.standin_health_flaps:
            with st.lock:
                n = st.health_counter
                st.health_counter += 1
            self._send(200 if n % 2 == 0 else 503)
            return
        self._send(200)

    def do_GET(self) -> None:  # noqa: N802
        path = self._path()
        if not self._authorised(path):
            self._send(401, {"error": "Unauthorized"})
            return
        st = self.state
        if path in ("/health", "/health_generate"):
            self._health()
        elif path == "/ready":
            self._send(200 if st.status == "Up" else 503)
        elif path in ("/model_info", "/get_model_info"):
            self._send(200, st.model_info())
        elif path in ("/server_info", "/get_server_info"):
            self._send(200, st.server_info())
        elif path == "/v1/models":
            name = st.args.served_model_name or st.args.model_path
            self._send(200, {"object": "list", "data": [
                {"id": name, "object": "model", "created": int(st.start_time), "owned_by": "sglang",
                 "root": name}]})
        else:
            self._send(404, {"detail": "Not Found"})

    do_HEAD = do_GET

    def do_POST(self) -> None:  # noqa: N802
        path = self._path()
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not self._authorised(path):
            self._send(401, {"error": "Unauthorized"})
            return
        if path not in ("/generate",):
            self._send(404, {"detail": "Not Found"})
            return
        st = self.state
        if st.args.standin_generate_fails:
            log("Stand-in fault: /generate fails (--standin-generate-fails)", "TP0")
            self._send(500, {"error": {"message": "Internal server error (stand-in fault)"}})
            return
        try:
            req = json.loads(raw or b"{}")
            if not isinstance(req, dict):
                raise ValueError("request body must be a JSON object")
            text = req.get("text", "")
            sp = req.get("sampling_params") or {}
            if not isinstance(sp, dict):
                raise ValueError("sampling_params must be an object")
            if isinstance(text, list):
                self._send(200, [st.generate_one(str(t), sp) for t in text])
            else:
                self._send(200, st.generate_one(str(text), sp))
        except (ValueError, TypeError) as exc:
            self._send(400, {"error": {"message": str(exc)}})
        except Exception as exc:  # noqa: BLE001
            log(f"/generate failed: {exc}\n{traceback.format_exc()}", "TP0")
            self._send(500, {"error": {"message": str(exc)}})


class _Server(ThreadingHTTPServer):
    allow_reuse_address = True
    daemon_threads = True


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------


class _Terminate(BaseException):
    pass


def _on_sigterm(signum, frame):  # noqa: ARG001
    raise _Terminate()


def _sleep(seconds: float) -> None:
    end = time.monotonic() + max(0.0, seconds)
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.2))


def _crash_in_load() -> None:
    raise RuntimeError("Stand-in fault: crash during weight loading (--standin-crash-during-load)")


def run(argv: list[str] | None = None) -> int:
    try:
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
        sys.stderr.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    except (AttributeError, ValueError):
        pass
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    extra = record_unknown(unknown)
    env_load = os.environ.get("DDTREE_STANDIN_LOAD_SECONDS")
    if env_load:
        try:
            args.standin_load_seconds = float(env_load)
        except ValueError:
            log(f"Ignoring DDTREE_STANDIN_LOAD_SECONDS={env_load!r}: not a number")
    load_s = max(0.0, args.standin_load_seconds)

    signal.signal(signal.SIGTERM, _on_sigterm)
    httpd: _Server | None = None
    try:
        site_packages = find_site_packages(args.standin_site_packages)
        modules = list_ddtree_modules(site_packages)
        algo = (args.speculative_algorithm or "").upper()
        if algo == "DDTREE" and not modules:
            parser.print_usage(sys.stderr)
            choices = ", ".join(repr(c) for c in UPSTREAM_ALGORITHMS)
            sys.stderr.write(f"{parser.prog}: error: argument --speculative-algorithm: invalid choice: "
                             f"{args.speculative_algorithm!r} (choose from {choices})\n")
            sys.stderr.flush()
            return 2

        shown = {k: v for k, v in vars(args).items() if not k.startswith("standin_")}
        shown["api_key"] = "***" if args.api_key else None
        log("server_args=ServerArgs(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")")
        if extra:
            log(f"Stand-in: recorded SGLang flags it does not model: {_masked(extra)}")
        log(f"Stand-in SGLang {SGLANG_VERSION} server (no GPU); sglang found in "
            f"{site_packages if site_packages else '(nowhere)'}; pid {os.getpid()}")

        mem = 94.50
        t_load = time.monotonic()
        log(f"Load weight begin. avail mem={mem:.2f} GB", "TP0")
        if args.standin_never_listen:
            log("Stand-in fault: weight loading never ends (--standin-never-listen)", "TP0")
            while True:
                time.sleep(1.0)
        if args.standin_crash_during_load:
            _sleep(load_s / 2)
            try:
                _crash_in_load()
            except RuntimeError:
                log(f"Scheduler hit an exception: {traceback.format_exc()}", "TP0")
                return 1

        # Import the DDTree modules as SGLang does when it creates a DDTree worker.
        imported: dict[str, str] = {}
        if modules and site_packages is not None:
            why = prepare_parent_packages(site_packages)
            if why:
                log(f"Stand-in: the sglang package itself does not import in this venv ({why}); "
                    "importing the DDTree modules under bare sglang/sglang.srt/"
                    "sglang.srt.speculative package stubs", "TP0")
        for path in modules:
            name = f"sglang.srt.speculative.{path.stem}"
            try:
                importlib.import_module(name)
            except _Terminate:
                raise
            except BaseException:  # noqa: BLE001 - SystemExit in a module is a crash too
                tb = traceback.format_exc()
                log(f"Scheduler hit an exception: {tb}", "TP0")
                log(f"Failed to import {name} from {path}", "TP0")
                return 1
            imported[name] = sha256_short(path)
        if modules:
            log("DDTree modules imported: " + ", ".join(f"{n} (sha256 {h})" for n, h in imported.items()), "TP0")
        else:
            log("DDTree modules imported: (none)", "TP0")

        _sleep(load_s - (time.monotonic() - t_load))
        elapsed = time.monotonic() - t_load
        log(f"Load weight end. elapsed={elapsed:.2f} s, type=StandinToyForCausalLM, "
            f"avail mem={mem - 61.2:.2f} GB, mem usage=61.20 GB.", "TP0")
        if args.speculative_draft_model_path:
            log(f"Load weight begin. avail mem={mem - 61.2:.2f} GB", "TP0")
            log("Load weight end. elapsed=0.01 s, type=StandinToyDraftModel, "
                f"avail mem={mem - 63.1:.2f} GB, mem usage=1.90 GB.", "TP0")
        log(f"Memory pool end. avail mem={mem - 70.0:.2f} GB", "TP0")
        log(f"Capture cuda graph begin. This can take up to several minutes. avail mem={mem - 70.0:.2f} GB", "TP0")
        log(f"Capture cuda graph end. Time elapsed: 0.00 s. mem usage=0.00 GB. avail mem={mem - 70.0:.2f} GB.", "TP0")

        state = State(args, extra, imported, site_packages)
        if modules and state.ddtree_fns is None:
            log("DDTree functions for /generate not found in sglang.srt.speculative.ddtree_utils "
                "(build_ddtree_tree, compile_ddtree_retrieve, tree sampling): /generate decodes "
                "autoregressively", "TP0")
        elif state.ddtree_fns is not None:
            log(f"/generate exercises the DDTree payload (budget={state.budget()}, "
                f"topk_cap={state.topk_cap()}, sampler={state.ddtree_fns.sampling_name})", "TP0")

        handler = type("StandinHandler", (Handler,), {"state": state})
        try:
            httpd = _Server((args.host, args.port), handler)
        except OSError as exc:
            log_raw(f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address "
                    f"('{args.host}', {args.port}): {exc.strerror or exc}")
            log(f"Stand-in: cannot listen on {args.host}:{args.port}: {exc}. "
                f"Is another server already using the port?")
            return 1
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1},
                         name="http", daemon=True).start()
        log_raw(f"INFO:     Started server process [{os.getpid()}]")
        log_raw("INFO:     Waiting for application startup.")
        log_raw("INFO:     Application startup complete.")
        log_raw(f"INFO:     Uvicorn running on http://{args.host}:{args.port} (Press CTRL+C to quit)")

        t_warm = time.monotonic()
        warm = state.generate_one("The capital city of France is", {"temperature": 0, "max_new_tokens": 8},
                                  count_stats=False)
        log(f"Warm-up generate: {warm['meta_info']['completion_tokens']} tokens, "
            f"accept len {warm['meta_info']['spec_accept_length']:.2f}", "TP0")
        if args.standin_warmup_never_completes:
            log("Stand-in fault: warm-up never completes (--standin-warmup-never-completes)", "TP0")
            while True:
                time.sleep(1.0)
        _sleep(args.standin_warmup_seconds - (time.monotonic() - t_warm))
        state.status = "Up"
        log("The server is fired up and ready to roll!")

        die_at = None
        if args.standin_die_after_ready is not None:
            die_at = time.monotonic() + max(0.0, args.standin_die_after_ready)
        while True:
            if die_at is not None and time.monotonic() >= die_at:
                log("Stand-in fault: the server dies after it was declared healthy "
                    "(--standin-die-after-ready)", "TP0")
                log("Scheduler hit an exception: RuntimeError: stand-in fault", "TP0")
                os._exit(1)
            time.sleep(0.1)
    except _Terminate:
        log("Received sigterm with a graceful shutdown timeout of 0 seconds. Shutting down.")
        if httpd is not None:
            try:
                httpd.RequestHandlerClass.state.status = "Draining"  # type: ignore[attr-defined]
            except AttributeError:
                pass
            threading.Thread(target=httpd.shutdown, daemon=True).start()
            httpd.server_close()
        log("Stand-in server exited cleanly.")
        return 0


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(argv))


if __name__ == "__main__":
    main()
