"""One real ``DDTreeWorkerV2.ddtree_decode`` step on CPU, for test_worker_decode_cpu.

Imported only in .venv-sglang (sglang 0.5.23 with the patch overlay first on
``sys.path``), inside the subprocess that ``sglang_env.run_sglang`` starts;
:func:`run_case` returns plain lists, the test asserts on them. Import this
module BEFORE anything imports triton or sglang: it sets the two environment
switches below, which are read at import / pool-construction time.

Real (SGLang 0.5.23 + patch set): the published runtime context
(``prepare_server_args`` + ``publish``), ``Req`` / ``ScheduleBatch`` /
``SamplingBatchInfo.from_schedule_batch``, ``ReqToTokenPool``,
``TokenToKVPoolAllocator``, two ``MHATokenToKVPool`` (target and draft; the
fake target writes its KV through ``set_kv_buffer(KVWriteLoc.for_batch(fb))``),
``KVIndexTranslator`` (plans, ``bind``), ``ForwardBatch`` / ``ForwardMode``,
``DDTreeVerifyInput.prepare_for_verify`` -> ``ForwardBatch.init_new``,
``assign_extend_cache_locs_func``, ``eagle_sample`` (greedy path),
``move_accept_tokens_to_target_kvcache`` -> ``fill_front_out_cache_loc_func`` /
``fill_accept_out_cache_loc_func`` -> ``MHATokenToKVPool.move_kv_cache``,
``compute_spec_logprobs`` (when the case asks for logprobs),
``make_draft_input_v2`` / ``make_draft_block_spec_info`` /
``build_block_pos_offsets``, ``resolve_draft_parallel_layout``, ``SpecTpSync``,
``GenerationBatchResult``, ``LogitsProcessorOutput``, ``ModelRunnerOutput``,
and every line of the worker's decode step.

How the kernels run here (this host has no GPU, no ``sgl_kernel`` and is not
``SGLANG_USE_CPU_ENGINE``, so SGLang's platform dispatchers find no branch):

* ``TRITON_INTERPRET=1``: SGLang's own Triton kernels (``assign_extend_cache_locs``,
  ``fill_front_out_cache_loc``, ``fill_accept_out_cache_loc``) run unchanged in
  Triton's CPU interpreter (``run_case(index_kernels="torch")``: their PyTorch
  versions instead, ``"checked"``: both, compared; :func:`_patch_index_kernels`).
  ``assign_extend_cache_locs_func`` only launches its Triton kernel behind
  ``_is_cuda or _is_hip or _is_musa or _is_xpu``, so that module's ``_is_xpu``
  flag is set (it selects the Triton branch and nothing else in ``cache_locs``).
* ``SGLANG_NATIVE_MOVE_KV_CACHE=1``: the pool's own torch move
  (``move_kv_cache_native``) instead of the pointer-table Triton copy kernel.
* ``verify_tree_greedy_func`` (CUDA kernel / ``sgl_kernel`` CPU op) is the one
  kernel replaced: by the payload's PyTorch reference
  ``ddtree_utils.verify_tree_greedy_reference`` (same in-place outputs).

Fakes (all here): the target worker's ``forward_batch_generation`` (a toy model
that asserts the TARGET_VERIFY batch and writes KV markers into the real pool),
the DFlash draft runner's ``forward`` (asserts the block batch, returns toy hidden
states), the target model object (an ``lm_head`` weight only), the model config
(the few fields read), the attention backend (records ``init_forward_metadata``),
the TP group (``sglang.test.parallel_groups.publish``: world size 1),
``_append_target_hidden_to_draft_kv_by_loc`` (a recorder: it writes draft-model KV)
and ``batch.seq_lens.record_stream`` (:class:`StreamRecordedTensor`: torch has no
CPU kernel for ``record_stream``). The server arguments say ``--device cuda``
(DFLASH's argument hook refuses ``cpu``); every tensor of the step is on the CPU.
The worker is ``object.__new__`` + the attributes ``DFlashWorkerV2.__init__`` /
``DDTreeWorkerV2.__init__`` would set (those load models and capture graphs).

Sampled batches (``run_case(sampling=...)``, test_worker_sampled_cpu): the
sampled requests see :func:`spread_logits`, ``eagle_sample`` takes its sampling
branch with the kernels :func:`_patch_sampling` puts in, and the expectations
follow the walk the committed tokens take (:func:`walk_tokens`).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import os
from array import array
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"
os.environ["SGLANG_NATIVE_MOVE_KV_CACHE"] = "1"

import torch


def _scan_triton_language_once() -> None:
    """Speed only, for Triton's interpreter: at every kernel launch `_patch_lang` swaps each
    builtin of triton.language (and of tl.tensor, tl.math, tensor_descriptor_base) for its
    interpreted form and restores them after the launch, finding them with `inspect.getmembers`
    over the whole module each time: about 1.4 ms of every launch, a quarter of
    test_worker_sampled_cpu's subprocess (cProfile: 35 of 130 s, 25,000 launches). The builtins a
    module has do not change between launches (each launch restores what it replaced), so the
    scan runs once per module, when nothing is patched; what is patched, with what, and the
    restore are the interpreter's own (`_patch_attr`, its scope). Without those two functions
    (another Triton), nothing changes."""
    import inspect

    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    scan, patch_attr = getattr(ti, "_patch_builtin", None), getattr(ti, "_patch_attr", None)
    if scan is None or patch_attr is None or getattr(scan, "scans_once", False):
        return
    builtins: dict[int, list] = {}

    def patch_builtin(pkg, builder, scope):
        found = builtins.get(id(pkg))
        if found is None:
            found = builtins[id(pkg)] = [(n, m) for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        for name, member in found:
            patch_attr(pkg, name, member, builder, scope)

    patch_builtin.scans_once = True
    ti._patch_builtin = patch_builtin


_scan_triton_language_once()

V = 50  # vocabulary
H = 16  # hidden size
MASK_ID = V - 1  # DFlash mask token
TARGET_LAYERS = 2
HEAD_DIM = 4
POOL_SLOTS = 512
CONTEXT = 96


# -- the toy models (pure functions of their inputs) ---------------------------

def _randn(seed: int, *shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def lm_head_weight() -> torch.Tensor:
    """The target LM head ``[V, H]`` the worker projects draft hidden states with."""
    return _randn(1234, V, H)


def embed_table() -> torch.Tensor:
    """DFlash's noise embedding (``_full_embed_gpu``)."""
    return _randn(99, V, H)


def draft_hidden(bonus: int, pos: int) -> torch.Tensor:
    """The fake draft's hidden state for block row ``(bonus, position)``."""
    return _randn(100_003 * int(bonus) + int(pos) + 7, H) * 2.0


def path_code(root: int, path) -> int:
    """An integer (< 2**20, exact in float32) naming a node: its root token and
    the draft tokens on the way to it."""
    c = 1 + 7919 * int(root)
    for i, t in enumerate(path):
        c = (c * 131 + (int(t) + 1) * (i + 2)) % 999_983
    return c


def kv_marker(code: int, layer: int, depth: int):
    """What the fake target writes at a node's slot: (k row, v row)."""
    k = [float(code), float(layer + 1), float(depth), 1.0]
    v = [-float(code), float(layer + 1), -float(depth), 2.0]
    return k, v


def background(slot: int, layer: int):
    """KV present before the step in every allocated slot."""
    return [-float(slot), float(layer), -1.0, 0.0], [float(slot), float(layer), -1.0, 0.0]


def target_hidden(code: int, depth: int, b: int) -> list:
    return [float(code), float(depth), float(b)] + [float(j) for j in range(H - 3)]


def target_next(plan, root: int, path) -> int:
    """The toy target's greedy next token after ``root, *path``: the planned
    continuation while the path follows the plan, else a hash of the path."""
    path = tuple(int(t) for t in path)
    if len(path) < len(plan) and path == tuple(plan[: len(path)]):
        return int(plan[len(path)])
    return (7 + 13 * path_code(root, path)) % (V - 1)


# -- the independent reference -------------------------------------------------

def draft_topk(bonus: int, prefix: int, block: int, k: int):
    """Per depth 1..block-1: the top-``k`` (token, log-prob) of the draft
    distribution, float64 (the worker: float32 through the real LM head path)."""
    w = lm_head_weight()
    out = []
    for d in range(1, block):
        lp = torch.log_softmax(draft_hidden(bonus, prefix + d) @ w.T, dim=-1)
        vals, ids = torch.topk(lp, k)
        out.append([(int(i), float(v)) for v, i in zip(vals, ids, strict=False)])
    return out


def sampling_of(params: dict):
    """(temperature, top_k, top_p) as SamplingParams normalises them: a
    temperature below 1e-6 is greedy (temperature 1, top-k 1); no top-k = all."""
    t = float(params.get("temperature", 1.0))
    if t < 1e-6:
        return 1.0, 1, 1.0
    k = int(params.get("top_k", -1))
    return t, (V if k <= 0 else min(k, V)), float(params.get("top_p", 1.0))


def tempered_topk(bonus: int, prefix: int, block: int, k: int, params: dict):
    """The draft candidates the tree of a request with sampling ``params`` is
    built from (float64, independent of the payload): per depth, the draft's
    top-``k`` tokens scored by their log-probability under the draft at the
    request's temperature, restricted to its top-k then top-p support and
    renormalised, as SGLang's verify restricts the target; tokens outside the
    support dropped. Where the candidates cannot decide the normaliser (a top-k
    above ``k``, a nucleus still open after them), the documented bound is used:
    the full-vocabulary mass, and ``top_p``. Greedy requests: :func:`draft_topk`."""
    temp, top_k, top_p = sampling_of(params)
    if top_k == 1:
        return draft_topk(bonus, prefix, block, k)
    w = lm_head_weight()
    out = []
    for d in range(1, block):
        probs = torch.softmax((draft_hidden(bonus, prefix + d) @ w.T) / temp, dim=-1)
        order = torch.argsort(probs, descending=True).tolist()
        p = [float(probs[t]) for t in order]
        kept_k = p[:top_k] if top_k <= k else p
        z_k = sum(kept_k)
        cands, before = [], 0.0
        for t, q in zip(order[: min(k, top_k)], p[: min(k, top_k)], strict=True):
            if before >= top_p:
                break
            cands.append((t, q / z_k))
            before += q / z_k
        z_p = sum(q for _, q in cands) if before >= top_p or len(cands) == top_k else top_p
        out.append([(t, math.log(q / z_p)) for t, q in cands])
    return out


def reference_tree(top, budget: int, max_depth: int):
    """The best ``budget`` prefixes (score = sum of log-probs), best first:
    a heap over (first child, next sibling) moves, as the DDTree paper."""
    heap = [(-top[0][0][1], (0,))]  # ranks per depth
    nodes, scores = [], []
    while heap and len(nodes) < budget + 1:
        neg, ranks = heapq.heappop(heap)
        nodes.append(tuple(top[d][r][0] for d, r in enumerate(ranks)))
        scores.append(-neg)
        d = len(ranks) - 1
        if ranks[-1] + 1 < len(top[d]):
            sib = ranks[:-1] + (ranks[-1] + 1,)
            heapq.heappush(heap, (neg + top[d][ranks[-1]][1] - top[d][ranks[-1] + 1][1], sib))
        if d + 1 < max_depth:
            heapq.heappush(heap, (neg - top[d + 1][0][1], ranks + (0,)))
    gaps = [a - b for a, b in itertools.pairwise(scores)]
    return nodes[:budget], min(gaps) if gaps else math.inf


def make_plan(top, ranks):
    """Planned target continuation: the draft's rank ``r`` token per depth;
    ``None`` = a token outside the draft's top-k there (ends the plan)."""
    plan = []
    for d, r in enumerate(ranks):
        if r is None:
            taken = {t for t, _ in top[d]}
            plan.append(next(t for t in range(V - 2, -1, -1) if t not in taken))
            break
        plan.append(top[d][r][0])
    return plan


def expected_step(root: int, plan, nodes, max_depth: int, banned=()):
    """Greedy tree walk of the toy target over the reference tree:
    committed tokens, accepted node ids (0 = root), their paths. ``banned``
    tokens (a custom logit processor's) are never chosen: the greedy token is
    then the first one of the flat rest of the row (argmax's first maximum)."""
    index = {p: i + 1 for i, p in enumerate(nodes)}
    cur, out, ids, paths = (), [], [0], [()]
    while True:
        t = target_next(plan, root, cur)
        if t in banned:
            t = next(x for x in range(V) if x not in banned)
        out.append(t)
        nxt = cur + (t,)
        if len(cur) < max_depth and nxt in index:
            cur = nxt
            ids.append(index[nxt])
            paths.append(nxt)
        else:
            return out, ids, paths


# -- the sampled toy target (test_worker_sampled_cpu) ---------------------------

# Logits of a sampled request's node, by rank: the draft's candidates for the
# next depth interleaved with other tokens, so the target's mass is split
# between tree children (accepted) and non-children (rejected, final sample).
PROFILE = (2.0, 1.6, 1.3, 1.0, 0.6, 0.2, -0.3, -0.8, -1.5, -2.0)
LOW = -30.0  # every other token (and MASK_ID)


def spread_logits(top, root: int, path, max_depth: int) -> list:
    """The toy target's logits at node ``root, *path`` of a sampled request:
    ``PROFILE`` over ``[c0, o0, c1, o1, ...]`` (``c`` = the draft's top tokens
    at the next depth in rank order, none at ``max_depth``; ``o`` = the other
    tokens in a path-dependent hash order), ``LOW`` elsewhere."""
    path = tuple(int(t) for t in path)
    fav = [t for t, _ in top[len(path)]] if len(path) < max_depth else []
    code = path_code(root, path)
    rest = sorted((t for t in range(V - 1) if t not in fav), key=lambda t: (t * 7919 + code) % 9973)
    order = []
    for i in range(max(len(fav), len(rest))):
        order += ([fav[i]] if i < len(fav) else []) + ([rest[i]] if i < len(rest) else [])
    out = [LOW] * V
    for rank, t in enumerate(order[: len(PROFILE)]):
        out[t] = PROFILE[rank]
    return out


def walk_tokens(root: int, tokens, nodes, max_depth: int):
    """The tree walk committed ``tokens`` describe (reference tree ``nodes``):
    every token but the last is a child of the previous node, the last (the
    final sample) is not a child of the last accepted node. Returns
    ``(node ids, paths, valid)``."""
    index = {p: i + 1 for i, p in enumerate(nodes)}
    cur, ids, paths = (), [0], [()]
    for t in tokens[:-1]:
        nxt = cur + (int(t),)
        if len(cur) >= max_depth or nxt not in index:
            return ids, paths, False
        cur = nxt
        ids.append(index[nxt])
        paths.append(nxt)
    valid = len(tokens) >= 1 and not (len(cur) < max_depth and cur + (int(tokens[-1]),) in index)
    return ids, paths, valid


# -- the step ------------------------------------------------------------------

class StreamRecordedTensor(torch.Tensor):
    """``batch.seq_lens`` for the step: torch has no CPU kernel for
    ``Tensor.record_stream`` (the worker's first line, as DFlashWorkerV2's), so
    this tensor records the call instead. Torch functions see a plain tensor
    (their results are plain tensors)."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    streams: list

    def record_stream(self, stream):
        self.streams.append(stream)


def stream_recorded(t: torch.Tensor) -> StreamRecordedTensor:
    out = t.as_subclass(StreamRecordedTensor)
    out.streams = []
    return out


def _setup_runtime(budget: int, cap: int, block: int, model: str, extra_args=()):
    from sglang.srt.runtime_context import reset_context
    from sglang.srt.server_args import prepare_server_args
    from sglang.test.parallel_groups import (
        publish,  # rank bundle + world-size-1 TP groups
    )

    # DFLASH refuses --device cpu when arguments resolve (a platform check);
    # the arguments say cuda, every tensor of the step is on the CPU.
    args = prepare_server_args([
        "--model-path", model, "--speculative-draft-model-path", model, "--device", "cuda",
        "--speculative-algorithm", "DDTREE",
        "--speculative-ddtree-budget", str(budget),
        "--speculative-ddtree-topk-cap", str(cap),
        "--speculative-num-draft-tokens", str(block), *extra_args,
    ])
    reset_context()
    publish(args, role="scheduler")
    return args


def _assign_extend_cache_locs_torch(grid, req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                    pool_len, bs_upper):
    """What the Triton kernel ``cache_locs.assign_extend_cache_locs[grid]`` stores, in PyTorch:
    program i < grid[0] copies row ``req_pool_indices[i]`` of ``req_to_token`` (rows ``pool_len``
    apart), columns ``start_offset[i]:end_offset[i]``, to ``out_cache_loc`` after the lengths of
    the programs before it."""
    del bs_upper  # the kernel's lane count (a power of two >= bs): no effect on what it stores
    flat, n_programs = req_to_token.reshape(-1), grid[0]
    at = 0  # the kernel's out_offset: the sum of end - start before this program
    for row, a, b in zip(req_pool_indices[:n_programs].tolist(), start_offset[:n_programs].tolist(),
                         end_offset[:n_programs].tolist(), strict=True):
        n = max(0, b - a)
        out_cache_loc[at:at + n] = flat[row * pool_len + a:row * pool_len + a + n]
        at += b - a


def _fill_accept_out_cache_loc_torch(grid, accept_index, out_cache_loc, accept_out_cache_loc, size_upper):
    """What ``eagle.fill_accept_out_cache_loc[grid]`` stores: program i < grid[0], when
    ``accept_index[i] > -1``, writes ``out_cache_loc[accept_index[i]]`` at the number of
    entries before i that are not -1 (the kernel reads the index tensor as flat memory)."""
    del size_upper
    idx = accept_index.reshape(-1)[:grid[0]].long()
    not_minus_one = (idx != -1).long()
    dst = torch.cumsum(not_minus_one, 0) - not_minus_one
    take = idx > -1
    accept_out_cache_loc[dst[take]] = out_cache_loc[idx[take]].to(accept_out_cache_loc.dtype)


class _IndexKernel:
    """Stands where SGLang's module holds a Triton kernel (``kernel[grid](*args)``) and runs the
    PyTorch version (``index_kernels="torch"``) or the kernel in Triton's interpreter, then the
    PyTorch version on copies of its arguments, comparing every argument afterwards
    (``"checked"``). Counts in ``calls``: launches, and those compared that differed."""

    def __init__(self, name, kernel, torch_fn, mode, calls):
        self.name, self.kernel, self.torch_fn, self.mode, self.calls = name, kernel, torch_fn, mode, calls

    def __getitem__(self, grid):
        def launch(*args):
            self.calls[self.name] = self.calls.get(self.name, 0) + 1
            if self.mode == "torch":
                return self.torch_fn(grid, *args)
            copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            self.kernel[grid](*args)
            self.torch_fn(grid, *copies)
            self.calls[self.name + ":checked"] = self.calls.get(self.name + ":checked", 0) + 1
            if any(isinstance(a, torch.Tensor) and not torch.equal(a, c) for a, c in zip(args, copies, strict=True)):
                self.calls[self.name + ":differed"] = self.calls.get(self.name + ":differed", 0) + 1
        return launch


_TRITON_INDEX_KERNELS: dict = {}  # module attribute -> SGLang's Triton kernel, as first imported
_REAL: dict = {}  # functions wrapped per run_case, as first imported (wrapped once, not per case)


def _patch_index_kernels(mode: str, calls: dict) -> None:
    """SGLang's Triton index kernels behind ``assign_extend_cache_locs_func``,
    ``fill_front_out_cache_loc_func`` and ``fill_accept_out_cache_loc_func``. ``"triton"``:
    the kernels themselves, in Triton's interpreter. The interpreter runs every program of a
    launch in Python, ~2 ms each: about 80 % of a 129-request sampled step. ``"torch"``: their
    PyTorch versions above, with SGLang's wrappers (allocation, dtypes, grids) still its own;
    ``"checked"``: both, compared at every launch (test_worker_sampled_cpu runs its big
    statistics steps on ``"torch"`` and its other steps ``"checked"``)."""
    from sglang.kernels.ops.speculative import cache_locs, eagle

    sites = {(cache_locs, "assign_extend_cache_locs"): _assign_extend_cache_locs_torch,
             (eagle, "fill_accept_out_cache_loc"): _fill_accept_out_cache_loc_torch}
    for (module, attr), torch_fn in sites.items():
        kernel = _TRITON_INDEX_KERNELS.setdefault((module.__name__, attr), getattr(module, attr))
        if mode == "triton":
            setattr(module, attr, kernel)
        elif mode in ("torch", "checked"):
            setattr(module, attr, _IndexKernel(attr, kernel, torch_fn, mode, calls))
        else:
            raise ValueError(mode)


def _patch_kernels(no_kv_move: bool, index_kernels: str = "triton", calls: dict | None = None):
    from sglang.kernels.ops.speculative import cache_locs
    from sglang.srt.speculative import eagle_utils
    from sglang.srt.speculative.ddtree_utils import verify_tree_greedy_reference

    # assign_extend_cache_locs_func: take its Triton branch (TRITON_INTERPRET runs it).
    cache_locs._is_xpu = True
    _patch_index_kernels(index_kernels, calls if calls is not None else {})

    # The CUDA kernel / sgl_kernel CPU op behind eagle_sample's greedy verify is
    # not on this host: the payload's PyTorch reference, same in-place outputs.
    def verify_tree_greedy_func(*, predicts, accept_index, accept_token_num, candidates,
                                retrieve_index, retrieve_next_token, retrieve_next_sibling,
                                target_predict, topk=-1):
        verify_tree_greedy_reference(
            predicts, accept_index, accept_token_num, candidates, retrieve_index,
            retrieve_next_token, retrieve_next_sibling, target_predict,
        )
        return predicts, accept_index, accept_token_num

    eagle_utils.verify_tree_greedy_func = verify_tree_greedy_func
    # The accepted-KV move (the payload's one-launch kernel, interpreted): counted; the
    # mutation skips it.
    from sglang.srt.speculative import ddtree_verify

    if not hasattr(ddtree_verify, "move_accepted_kv"):  # a patch set before 2.2 (bench_launches)
        return
    real_move = _REAL.setdefault("move_accepted_kv", ddtree_verify.move_accepted_kv)

    def move_accepted_kv(pool, tgt_loc, src_loc, per_request):
        if calls is not None:
            calls["kv_moves"] = calls.get("kv_moves", 0) + 1
        if not no_kv_move:
            real_move(pool, tgt_loc, src_loc, per_request)

    ddtree_verify.move_accepted_kv = move_accepted_kv


def _patch_sampling(mutation: str | None, renorm: str, kernel_calls: dict):
    """``eagle_sample``'s sampling branch on this host (test_worker_sampled_cpu).

    * ``eagle_utils._is_cpu`` is already False here (``SGLANG_USE_CPU_ENGINE``
      unset): set False so the branch is selected whatever the environment.
    * ``sampling_softmax`` (temperature softmax) is SGLang's own: its CPU path
      is ``torch.softmax(logits / temperatures)``. Not replaced.
    * ``top_k_renorm_prob`` / ``top_p_renorm_prob`` are ``None`` off CUDA/HIP/
      NPU/MUSA. ``renorm="torch"``: the payload's PyTorch references
      ``ddtree_utils.top_k_renorm_probs`` / ``top_p_renorm_probs``.
      ``renorm="triton"``: SGLang's ROCm implementation (``renorm_triton``:
      torch sort and pivot + its Triton mask/normalise kernels, FlashInfer's
      threshold semantics) in Triton's interpreter, only its ``_prepare_probs``
      device check (CUDA/HIP tensors only) lifted; each call is compared with
      the PyTorch reference (largest difference in ``renorm_max_diff``). The
      interpreter takes ~5 ms per probability row, hence both.
    * ``tree_speculative_sampling_target_only`` (CUDA JIT kernel, ``None``
      here): the payload's PyTorch reference
      ``ddtree_utils.tree_speculative_sampling_reference`` (same keyword
      arguments, same in-place outputs). Controls the distribution test must
      reject: ``mutation="first_child"`` zeroes its coins (the first child with
      non-zero probability is always accepted); ``"reused_coin"`` gives every
      node of a request the root's coin (first token still exact, the second
      biased); ``"coin_tree"`` lets the tree depend on the coins (the root's
      first child unlinked exactly when the root's coin would accept it): what a
      tree built after the coins are drawn could do, which breaks losslessness."""
    from sglang.kernels.ops.sampling import renorm_triton
    from sglang.srt.speculative import eagle_utils
    from sglang.srt.speculative.ddtree_utils import (
        top_k_renorm_probs,
        top_p_renorm_probs,
        tree_speculative_sampling_reference,
    )

    kernel_calls["is_cpu_before"] = bool(eagle_utils._is_cpu)
    eagle_utils._is_cpu = False

    def prepare_probs(probs: torch.Tensor) -> torch.Tensor:
        if probs.ndim != 2:
            raise ValueError(f"probs must be 2D, got shape={tuple(probs.shape)}")
        return probs.float().contiguous()

    def checked(name, fn, ref=None):
        def renorm(probs, values):
            out = fn(probs, values)
            if ref is not None:
                diff = float((out - ref(probs, values)).abs().max())
                kernel_calls["renorm_max_diff"] = max(kernel_calls.get("renorm_max_diff", 0.0), diff)
            kernel_calls["renorm"].append(name)
            return out
        return renorm

    kernel_calls["renorm"] = []
    if renorm == "triton":
        renorm_triton._prepare_probs = prepare_probs
        eagle_utils.top_k_renorm_prob = checked(
            "top_k:triton", renorm_triton.top_k_renorm_probs_triton, top_k_renorm_probs)
        eagle_utils.top_p_renorm_prob = checked(
            "top_p:triton", renorm_triton.top_p_renorm_probs_triton, top_p_renorm_probs)
    elif renorm == "torch":
        eagle_utils.top_k_renorm_prob = checked("top_k:torch", top_k_renorm_probs)
        eagle_utils.top_p_renorm_prob = checked("top_p:torch", top_p_renorm_probs)
    else:
        raise ValueError(renorm)

    def kernel_contract(kw) -> list:
        """What the CUDA kernel's host checks (``TensorMatcher`` in
        jit/csrc/speculative/sampling.cuh) would refuse: shape, dtype, contiguity."""
        bs, n = kw["candidates"].shape[:2]
        s, v = kw["accept_index"].shape[-1], kw["target_probs"].shape[-1]
        want = {name: ((bs, n), torch.int64) for name in
                ("candidates", "retrive_index", "retrive_next_token", "retrive_next_sibling")}
        want.update(accept_index=((bs, s), torch.int32), accept_token_num=((bs,), torch.int32),
                    predicts=((bs * n,), torch.int32), uniform_samples=((bs, n), torch.float32),
                    uniform_samples_for_final_sampling=((bs,), torch.float32),
                    target_probs=((bs, n, v), torch.float32), draft_probs=((bs, n, v), torch.float32))
        bad = [f"{name}: {tuple(kw[name].shape)} {kw[name].dtype} contiguous={kw[name].is_contiguous()}"
               for name, (shape, dtype) in want.items()
               if tuple(kw[name].shape) != shape or kw[name].dtype != dtype or not kw[name].is_contiguous()]
        if not 0 <= kw["threshold_single"] <= 1:
            bad.append(f"threshold_single={kw['threshold_single']}")
        return bad

    def tree_sampling(**kw):
        kernel_calls["tree_sampling"] += 1
        kernel_calls["contract_violations"] = kernel_contract(kw)
        kernel_calls["sampling_args"] = {
            "threshold_single": kw["threshold_single"], "threshold_acc": kw["threshold_acc"],
            "deterministic": kw["deterministic"], "target_probs": list(kw["target_probs"].shape),
            "accept_index": list(kw["accept_index"].shape),
            "draft_probs_zero": bool((kw["draft_probs"] == 0).all()),
        }
        coins = kw["uniform_samples"]
        if mutation == "first_child":
            kw["uniform_samples"] = torch.zeros_like(coins)
        elif mutation == "reused_coin":
            kw["uniform_samples"] = coins[:, :1].expand_as(coins).contiguous()
        elif mutation == "coin_tree":
            # a tree chosen knowing the coins: the root's first child is unlinked
            # exactly when the root's coin would accept it (its next sibling
            # becomes the first child)
            nt, ns = kw["retrive_next_token"].clone(), kw["retrive_next_sibling"]
            first = nt[:, 0].clamp(min=0)
            tok = kw["candidates"].gather(1, first.unsqueeze(1))
            p_first = kw["target_probs"][:, 0].gather(1, tok).squeeze(1)
            drop = (coins[:, 0] < p_first) & (nt[:, 0] >= 0)
            nt[:, 0] = torch.where(drop, ns.gather(1, first.unsqueeze(1)).squeeze(1), nt[:, 0])
            kw["retrive_next_token"] = nt
        elif mutation is not None:
            raise ValueError(mutation)
        tree_speculative_sampling_reference(**kw)

    eagle_utils.tree_speculative_sampling_target_only = tree_sampling


def record_accepts(accepted: list) -> None:
    """Record every greedy tree verify's ``accept_index`` (global node rows) into
    ``accepted``: the chained and overlap tests check the KV moves against it."""
    from sglang.srt.speculative import eagle_utils

    greedy = eagle_utils.verify_tree_greedy_func

    def recording_verify(**kw):
        out = greedy(**kw)
        accepted.append(kw["accept_index"].tolist())
        return out

    eagle_utils.verify_tree_greedy_func = recording_verify


def _grammar_probe(log: list):
    """``GrammarTree.from_device`` and ``build_grammar_vocab_mask`` replaced by
    recorders (returns the undo). The real tree still makes its host copy."""
    from sglang.srt.speculative import spec_utils

    real_tree, real_build = spec_utils.GrammarTree, spec_utils.build_grammar_vocab_mask

    class ProbeTree(real_tree):
        @classmethod
        def from_device(cls, next_token, next_sibling, draft_token):
            log.append(["tree_copied", next_token.tolist(), next_sibling.tolist(), draft_token.tolist()])
            return super().from_device(next_token, next_sibling, draft_token)

    def build(*, reqs, tree, sampling_info, device, barrier):
        log.append(["mask_built"] + [t.tolist() for t in tree.resolve()])

    spec_utils.GrammarTree, spec_utils.build_grammar_vocab_mask = ProbeTree, build

    def undo():
        spec_utils.GrammarTree, spec_utils.build_grammar_vocab_mask = real_tree, real_build

    return undo


def _worker_cls(mutation: str | None, grammar_log=None):
    """The worker class, rebuilt (it binds its SGLang imports when built) with
    the mutation's replacement (and the grammar probe) in place."""
    from sglang.srt.layers import sampler
    from sglang.srt.speculative import ddtree_worker

    undo_probe = _grammar_probe(grammar_log) if grammar_log is not None else (lambda: None)
    real = sampler.apply_custom_logit_processor
    if mutation == "processor_roots_only":
        def roots_only(logits, info, num_tokens_in_batch=1):
            roots = logits.view(len(info), num_tokens_in_batch, -1)[:, 0]
            real(roots, info, num_tokens_in_batch=1)

        sampler.apply_custom_logit_processor = roots_only
    elif mutation not in (None, "no_mask_capture"):
        raise ValueError(mutation)
    ddtree_worker._WORKER_CLS = None
    try:
        cls = ddtree_worker.get_ddtree_worker_cls()
    finally:
        sampler.apply_custom_logit_processor = real
        undo_probe()
    if mutation == "no_mask_capture":
        cls = type("NoMaskCapture", (cls,), {"ddtree_capture_sampling_mask": lambda self, *a: None})
    return cls


def profiled_step(worker, step):
    """Run ``step`` under torch's profiler with the worker's tree work (the
    draft top-k and the verify input: everything between the draft forward and
    the target verify) marked, and count its launches."""
    from launch_count import REGION, count_launches, mark_triton_launches

    def marked(method):
        def run(*args, **kwargs):
            with torch.profiler.record_function(REGION):
                return method(*args, **kwargs)
        return run

    worker.ddtree_draft_topk = marked(worker.ddtree_draft_topk)
    worker.ddtree_verify_input = marked(worker.ddtree_verify_input)
    undo = mark_triton_launches()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            result = step()
    finally:
        undo()
    return result, count_launches(prof)


def scheduler_sampling_masks(reqs, result):
    """What the scheduler makes of a step's sampling masks: its own
    ``materialize_sampling_mask_output`` and ``add_sampling_mask_return_values``
    (the call that raised ``TypeError`` when a decode step built no capture),
    each request's committed tokens appended first, as the result processor
    does. Per ``return_sampling_mask`` request: ``{"masks", "logprobs"}`` (its
    queued rows), or ``{"error"}`` with what the scheduler raised."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor as Processor,
    )

    if not any(r.return_sampling_mask for r in reqs):
        return None
    out = result.logits_output
    lens = result.accept_lens.tolist()
    toks = result.next_token_ids.view(len(reqs), -1).tolist()
    rows = {}
    try:
        Processor.materialize_sampling_mask_output(reqs, out)
        proc = SimpleNamespace(_visible_output_len=lambda req: len(req.output_ids))
        for i, r in enumerate(reqs):
            if not r.return_sampling_mask:
                continue
            r.output_ids.extend(toks[i][: lens[i]])
            Processor.add_sampling_mask_return_values(proc, i, r, out, accept_len=lens[i])
            masks, logprobs = r.sampling_mask_rows.take().to_lists(support_logprobs=False)
            rows[i] = {"masks": masks, "logprobs": logprobs}
    except Exception as exc:  # the pre-2.1 crash, reported to the test instead
        return {"error": f"{type(exc).__name__}: {exc}"}
    return rows


def make_pools(*, rows, slots, context, head_dim, target_layers, dev):
    """The real 0.5.23 pools a decode step touches (page size 1, float32): req_to_token, the
    target and draft KV pools, the token allocator and both KV index translators."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    req_pool = ReqToTokenPool(size=rows, max_context_len=context, device=dev, enable_memory_saver=False)
    kv_pool = MHATokenToKVPool(slots, page_size=1, dtype=torch.float32, head_num=1,
                               head_dim=head_dim, layer_num=target_layers, device=dev,
                               enable_memory_saver=False, enable_alt_stream=False)
    draft_pool = MHATokenToKVPool(slots, page_size=1, dtype=torch.float32, head_num=1,
                                  head_dim=head_dim, layer_num=1, device=dev,
                                  enable_memory_saver=False, enable_alt_stream=False)
    allocator = TokenToKVPoolAllocator(slots, dtype=torch.float32, device=dev,
                                       kvcache=kv_pool, need_sort=False)
    return SimpleNamespace(
        req_pool=req_pool, kv_pool=kv_pool, draft_pool=draft_pool, allocator=allocator,
        target_translator=KVIndexTranslator(
            req_to_token=req_pool.req_to_token, token_to_kv_pool_allocator=allocator,
            token_to_kv_pool=kv_pool, page_size=1, device=dev),
        draft_translator=KVIndexTranslator(
            req_to_token=req_pool.req_to_token, token_to_kv_pool_allocator=allocator,
            token_to_kv_pool=draft_pool, page_size=1, device=dev, is_draft_worker=True),
    )


class DeferredShardLogits:
    """The target's logits processor as DFLASH's deferred verify gather has it under TP, at one
    rank (the shard is the whole vocabulary): SGLang's own ``deferred_argmax`` (its row-maxima
    kernel, then the all-gather of ``[rows, 2]``, here over a one-rank group) and
    ``finish_deferred_gather`` (the full-vocabulary gather; at one rank the logits themselves),
    each counted in ``gathers``. 0.5.23 defers the gather only for a model with a final logit
    softcap (``LogitsProcessor._can_defer...``: ``bool(final_logit_softcapping)``), hence the
    cap here; it is monotonic, so the argmax is the uncapped one."""

    SOFTCAP = 30.0

    def __init__(self, vocab: int, gathers: dict):
        self.defer_verify_gather, self.vocab_size, self.final_logit_softcapping = True, vocab, self.SOFTCAP
        self.gathers = gathers

    def is_deferred_shard(self, logits) -> bool:
        return logits is not None

    def finish_deferred_gather(self, logits):
        self.gathers["full"] += 1
        return logits

    def deferred_argmax(self, logits):
        import sglang.srt.layers.logits_processor as lp_module
        from sglang.srt.runtime_context import get_parallel

        self.gathers["row_maxima"] += 1
        group = get_parallel().tp_group
        assert group.world_size == 1
        if not hasattr(group, "all_gather_into_tensor"):  # one rank: the gather is a copy
            group.all_gather_into_tensor = lambda out, t: out.copy_(t.view_as(out))
        # Triton's interpreter has no libdevice tanh: the row-maxima kernel's PyTorch equivalent
        # (bench/compile_targets.py compiles the kernel itself for both chips).
        real, lp_module.softcap_row_argmax = lp_module.softcap_row_argmax, _softcap_row_argmax_torch
        try:
            return lp_module.LogitsProcessor.deferred_argmax(self, logits)
        finally:
            lp_module.softcap_row_argmax = real


def _softcap_row_argmax_torch(logits, final_logit_softcapping, valid_width, col_offset):
    """``softcap_row_argmax``: per row ``(max, first argmax + col_offset)`` of the softcapped
    logits over the first ``valid_width`` columns, fp32 ``[rows, 2]``."""
    capped = torch.tanh(logits[:, :valid_width] / final_logit_softcapping) * final_logit_softcapping
    best = capped.argmax(dim=-1)  # the first of equal maxima, as the kernel's tie break
    return torch.stack([capped.gather(1, best[:, None])[:, 0], (best + col_offset).float()], dim=1)


def make_worker(cls, *, cfg, block, mask_id, dev, lm_weight, embed, model_config, req_pool,
                allocator, kv_pool, target_translator, draft_translator, draft_pool, attn_backend,
                target_forward, draft_forward, append_draft_kv):
    """A ``DDTreeWorkerV2`` without ``__init__`` (which loads models): the attributes its decode
    step reads, the real pools and translators, and the given fake forwards."""
    from types import SimpleNamespace

    from sglang.srt.layers.dp_attention import get_dp_tp_group
    from sglang.srt.speculative.draft_parallel import (
        model_draft_parallel_spec,
        resolve_draft_parallel_layout,
    )
    from sglang.srt.speculative.draft_worker_common import (
        build_block_pos_offsets,
        make_draft_block_spec_info,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    target_runner = SimpleNamespace(
        model=SimpleNamespace(lm_head=SimpleNamespace(weight=lm_weight)),
        model_config=model_config, device=dev, is_draft_worker=False,
        req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator,
        token_to_kv_pool=kv_pool, kv_index_translator=target_translator,
        ngram_embedding_manager=SimpleNamespace(enabled=False), lora_manager=None,
        decode_cuda_graph_runner=None, attn_backend=attn_backend, watermark_state=None,
        spec_algorithm=SpeculativeAlgorithm.DFLASH,
    )
    target_worker = SimpleNamespace(model_runner=target_runner, device=dev,
                                    forward_batch_generation=target_forward)
    draft_runner = SimpleNamespace(kv_index_translator=draft_translator, forward=draft_forward,
                                   model_config=model_config, token_to_kv_pool=draft_pool)
    worker = object.__new__(cls)
    worker.__dict__.update(
        server_args=None, gpu_id=0, _target_worker=target_worker, model_runner=target_runner,
        device=dev, page_size=1, ddtree_config=cfg, block_size=block,
        speculative_num_draft_tokens=block, _mask_token_id=mask_id,
        _block_pos_offsets=build_block_pos_offsets(length=block, device=dev),
        _full_embed_gpu=embed, _noise_embed_scale=1.0,
        _draft_block_spec_info=make_draft_block_spec_info(draft_token_num=block, device=dev),
        draft_model_runner=draft_runner,
        draft_parallel_layout=resolve_draft_parallel_layout(
            model_draft_parallel_spec(None, spec_algorithm=SpeculativeAlgorithm.DFLASH),
            collapse_cp=True),
        _target_logits_processor=None, _selector_sample=None, _tp_sync=SpecTpSync(get_dp_tp_group()),
        _draft_sampler=None,
        # DFlashWorkerV2.__init__'s block state: its buffers, grown on first use, and its
        # Triton block kernel (Triton's interpreter here; run_case(triton_block=False): the
        # eager fallback)
        _draft_block_ids_buf=None, _draft_block_positions_buf=None, _draft_block_tokens_buf=None,
        _draft_verify_out_cache_loc_buf=None, _draft_block_end_buf=None, _draft_seq_lens_cpu_buf=None,
        _use_triton_prepare_block=True,
        _append_target_hidden_to_draft_kv_by_loc=append_draft_kv,
        selector=None, lilicorr=None, _is_domino=False, _need_mamba_verify_commit=False,
    )
    return worker


def run_case(*, model: str, budget: int, cap: int, block: int, prefixes, ranks,
             host_mirror: bool, return_logprob: bool = False, no_kv_move: bool = False,
             sampling=None, bonus=None, mutation: str | None = None, renorm: str = "torch",
             req_kwargs=None, extra_args=(), worker_mutation: str | None = None,
             grammar_probe: bool = False, verify_mask_bs: int = 0, graph_bs=(),
             profile: bool = False, index_kernels: str = "triton", deferred_gather: bool = False,
             draft_graph: bool = False, triton_block: bool = True) -> dict:
    """Build pools, batch and worker, run one ``ddtree_decode``; return what the
    test checks (plain lists) and the reference's expectations.

    ``sampling`` (test_worker_sampled_cpu): per request, ``SamplingParams``
    keywords (default greedy). A request with ``temperature > 0`` sees the
    :func:`spread_logits` toy target, the others the greedy one; with any such
    request the sampling branch is patched in (:func:`_patch_sampling`,
    ``mutation`` / ``renorm`` passed on) and ``expect`` describes the walk the committed
    tokens take through the reference tree (:func:`walk_tokens`; the greedy
    reference walk stays in ``expect["greedy_out"]``). ``bonus``: per-request
    root tokens (default: a formula of the request index). ``req_kwargs``: per
    request, extra ``Req`` keywords (``return_sampling_mask``,
    ``custom_logit_processor``); a request whose sampling ``custom_params`` name
    ``token_ids`` (the real ``DisallowedTokensLogitsProcessor``'s parameter)
    expects a greedy walk that never takes them. ``extra_args``: more server
    arguments (``--enable-custom-logit-processor``). ``worker_mutation``
    (controls): ``"no_mask_capture"`` skips the sampling-mask capture (the 2.0
    step), ``"processor_roots_only"`` applies custom logit processors to each
    request's root row only. ``grammar_probe``: the batch has a grammar; the
    tree's host copy, the verify and the bitmask build are logged in order
    (``result["grammar_log"]``; the bitmask builder is a recorder that resolves
    the host tree and applies no mask). ``verify_mask_bs``: the attention
    backend owns a persistent verify-mask buffer for that many requests (as
    the triton backend does under CUDA graphs); ``graph_bs``: the tree step is
    "captured" for those batch sizes with :class:`launch_count.ReplayedCall`;
    ``profile``: the step runs under torch's profiler and
    ``result["launches"]`` counts the tree work's launches
    (``launch_count.count_launches``). ``draft_graph``: the draft forward runs "as its
    graph", which runs the worker's in-graph top-k head (``_maybe_build_draft_sampler``, as
    the draft runner's capture hook calls it) and says ``can_run_graph``; the worker reads
    the head's outputs instead of running its eager top-k. ``triton_block``: the draft block
    from DFlash's Triton kernel (else its eager fallback). ``index_kernels``: how SGLang's Triton
    index kernels run (:func:`_patch_index_kernels`; their launches, and the
    compared ones that differed, in ``result["kernels"]["index"]``)."""
    server_args = _setup_runtime(budget, cap, block, model, extra_args)
    req_kwargs = [dict(k) for k in req_kwargs] if req_kwargs is not None else [{} for _ in prefixes]
    kernel_calls = {"greedy_verify": 0, "tree_sampling": 0, "index": {}}
    _patch_kernels(no_kv_move, index_kernels, kernel_calls["index"])
    bs = len(prefixes)
    sampling = [dict(s) for s in sampling] if sampling is not None else [{} for _ in range(bs)]
    spread = [float(s.get("temperature", 0.0)) > 0 for s in sampling]
    if any(spread):
        _patch_sampling(mutation, renorm, kernel_calls)
    from sglang.srt.speculative import eagle_utils

    greedy_verify = eagle_utils.verify_tree_greedy_func

    def counted_greedy_verify(**kw):
        kernel_calls["greedy_verify"] += 1
        return greedy_verify(**kw)

    eagle_utils.verify_tree_greedy_func = counted_greedy_verify

    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.mem_cache.memory_pool import (
        KVWriteLoc,
    )
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardMode,
    )
    from sglang.srt.model_executor.model_runner import ModelRunnerOutput
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.ddtree_kv import ddtree_decode_reserve
    from sglang.srt.speculative.ddtree_worker import DDTreeConfig
    from sglang.srt.speculative.draft_worker_common import (
        make_draft_input_v2,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    grammar_log = [] if grammar_probe else None
    cls = _worker_cls(worker_mutation, grammar_log)
    cfg = DDTreeConfig.from_server_args(server_args, block)  # as the worker's __init__ builds it
    W, D = cfg.verify_width, cfg.max_depth
    dev = "cpu"

    # -- scenario and its reference (before, and independent of, the worker) --
    if bonus is None:
        bonus = [(11 + 17 * b) % (V - 1) for b in range(bs)]
    bonus = [int(t) for t in bonus]
    trees, plans, tops, expect = [], [], [], {"out": [], "ids": [], "paths": []}
    untempered_trees = []  # the best-first trees of the draft at T = 1, unrestricted (2.0's)
    # --speculative-ddtree-tree-distribution raw: every request's tree is the untempered one
    raw_tree = "raw" in [b for a, b in zip(extra_args, list(extra_args)[1:], strict=False)
                         if a == "--speculative-ddtree-tree-distribution"]
    min_gap = math.inf
    memo = {}
    for b in range(bs):
        key = (bonus[b], prefixes[b], sampling_of(sampling[b]))
        if key not in memo:  # identical requests: one reference tree
            top = draft_topk(bonus[b], prefixes[b], block, cap)
            scored = top if raw_tree else tempered_topk(bonus[b], prefixes[b], block, cap, sampling[b])
            memo[key] = (top,) + reference_tree(scored, budget, D) + (reference_tree(top, budget, D)[0],)
        top, nodes, gap, untempered = memo[key]
        min_gap = min(min_gap, gap)
        plan = make_plan(top, ranks[b])
        banned = set(sampling[b].get("custom_params", {}).get("token_ids", ()))
        out, ids, paths = expected_step(bonus[b], plan, nodes, D, banned if req_kwargs[b] else ())
        tops.append(top)
        trees.append(nodes)
        untempered_trees.append(untempered)
        plans.append(plan)
        expect["out"].append(out)
        expect["ids"].append(ids)
        expect["paths"].append([list(p) for p in paths])

    # -- real pools -------------------------------------------------------------
    reserve = ddtree_decode_reserve(block, budget)
    pool_slots = max(POOL_SLOTS, sum(prefixes) + 9 + (bs + 1) * reserve + 64)
    pools = make_pools(rows=bs + 2, slots=pool_slots, context=CONTEXT, head_dim=HEAD_DIM,
                       target_layers=TARGET_LAYERS, dev=dev)
    req_pool, kv_pool, draft_pool, allocator = pools.req_pool, pools.kv_pool, pools.draft_pool, pools.allocator
    target_translator, draft_translator = pools.target_translator, pools.draft_translator

    # Requests: the batch's bs plus one bystander that must stay untouched.
    lens = list(prefixes) + [9]
    reqs = []
    for i, n in enumerate(lens):
        params = {"temperature": 0.0, "max_new_tokens": 64}
        params.update(sampling[i] if i < bs else {})
        r = Req(f"r{i}", "", array("i", [(3 * i + j) % (V - 1) for j in range(n)]),
                SamplingParams(**params), vocab_size=V, **(req_kwargs[i] if i < bs else {}))
        reqs.append(r)
    rows = req_pool.alloc(list(reversed(reqs)))  # rows in an order unrelated to the batch
    rows = list(reversed(rows))
    slots_needed = [n + reserve for n in lens]
    flat = allocator.alloc(sum(slots_needed))
    flat = flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(5))]
    start = 0
    for r, row, n in zip(reqs, rows, slots_needed, strict=False):
        req_pool.write((row, slice(0, n)), flat[start:start + n].to(torch.int32))
        start += n
        r.kv.kv_committed_len = n - reserve
        r.kv.kv_allocated_len = n
    for layer in range(TARGET_LAYERS):
        for s in flat.tolist():
            k, v = background(s, layer)
            kv_pool.k_buffer[layer][s, 0] = torch.tensor(k)
            kv_pool.v_buffer[layer][s, 0] = torch.tensor(v)
    kv_before = [kv_pool.k_buffer[i].clone() for i in range(TARGET_LAYERS)], \
        [kv_pool.v_buffer[i].clone() for i in range(TARGET_LAYERS)]

    batch_reqs = reqs[:bs]
    rpi = torch.tensor(rows[:bs], dtype=torch.int64)
    prefix_t = torch.tensor(prefixes, dtype=torch.int64)
    req_to_token = req_pool.req_to_token

    draft_input = make_draft_input_v2(bonus_tokens=torch.tensor(bonus), new_seq_lens=prefix_t)
    # what DFlashDraftInputV2.prepare_for_decode derives from the requests every step
    top_ks = [int(r.sampling_params.top_k) for r in batch_reqs]
    draft_input.max_top_k = max(max(top_ks), 1)
    draft_input.uniform_top_k_value = top_ks[0] if len(set(top_ks)) == 1 else None
    if not host_mirror:  # overlap scheduling: only the reservation is on the host
        draft_input.nxt_kv_lens_cpu = torch.tensor([n + reserve for n in prefixes], dtype=torch.int32)
        draft_input.nxt_kv_lens_sum = int(draft_input.nxt_kv_lens_cpu.sum())
    batch = ScheduleBatch(
        reqs=batch_reqs, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator,
        device=dev, forward_mode=ForwardMode.DECODE, req_pool_indices=rpi,
        seq_lens=stream_recorded(prefix_t.clone()), orig_seq_lens=prefix_t.to(torch.int32),
        seq_lens_cpu=prefix_t.clone() if host_mirror else None,
        seq_lens_sum=int(prefix_t.sum()) if host_mirror else None,
        spec_algorithm=SpeculativeAlgorithm.DFLASH, spec_info=draft_input,
        return_logprob=return_logprob,
    )
    batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, V)
    batch.has_grammar = grammar_probe

    # -- fakes ------------------------------------------------------------------
    weight = lm_head_weight().float()
    embed = embed_table().float()
    calls = {"target": [], "draft": [], "attn_init": [], "append": [], "publish": []}
    # per request: [path, logits] of its depth <= 1 nodes (every node for sampling-mask requests)
    node_logits = [[] for _ in range(bs)]
    model_config = SimpleNamespace(context_len=CONTEXT, vocab_size=V, model_is_mrope=False,
                                   hidden_size=H, is_matryoshka=False,
                                   requires_mm_token_modalities=False)

    class AttnBackend:
        verify_mask = None

        def init_forward_metadata(self, fb):
            calls["attn_init"].append(fb)

    if verify_mask_bs:  # FULL_MASK rows for the longest context a step can start at
        AttnBackend.verify_mask = SimpleNamespace(
            buffer=torch.zeros(verify_mask_bs * W * (CONTEXT + block + W), dtype=torch.uint8),
            max_bs=verify_mask_bs)

    def window(b, width):
        p = prefixes[b]
        return req_to_token[rows[b], p:p + width].to(torch.int64)

    def target_forward(batch=None, forward_batch=None, is_verify=False, **kw):
        fb = forward_batch
        assert batch is None and is_verify, (batch, is_verify)
        assert fb.forward_mode == ForwardMode.TARGET_VERIFY and fb.forward_mode.is_target_verify()
        assert not calls["target"], "target forward called twice"
        calls["target"].append(kw)
        assert calls["attn_init"] and calls["attn_init"][-1] is fb, "attention metadata not planned"
        if grammar_log is not None:
            si = fb.spec_info
            grammar_log.append(["verify", si.retrieve_next_token.tolist(), si.retrieve_next_sibling.tolist(),
                                si.draft_token.view(bs, W).tolist()])
        assert fb.batch_size == bs and fb.input_ids.shape == (bs * W,), fb.input_ids.shape
        assert isinstance(fb.spec_info, cls.DDTreeVerifyInput), type(fb.spec_info)
        assert fb.spec_info.draft_token_num == W and fb.spec_info.max_tree_depth == D + 1
        assert fb.capture_hidden_mode == CaptureHiddenMode.FULL
        assert torch.equal(fb.req_pool_indices, rpi) and torch.equal(fb.seq_lens, prefix_t)
        host = prefix_t + W if host_mirror else draft_input.nxt_kv_lens_cpu.long()
        assert torch.equal(fb.seq_lens_cpu.long(), host), (fb.seq_lens_cpu, host)
        assert fb.seq_lens_sum == int(host.sum())
        mask = fb.spec_info.custom_mask
        # bool (a fresh mask) or uint8 (the triton backend's buffer): one byte per entry
        assert mask is not None and mask.dtype in (torch.bool, torch.uint8), mask.dtype
        # FULL_MASK sized from the host bound of the prefixes (exact when mirrored,
        # else the reservation capped at the context: no device->host sync); the
        # blocks sit at offsets from the exact device lengths, the tail is unused.
        bound = prefixes if host_mirror else [
            min(int(n), CONTEXT) for n in draft_input.nxt_kv_lens_cpu]
        if AttnBackend.verify_mask is not None and bs <= verify_mask_bs:
            assert mask is AttnBackend.verify_mask.buffer, "the backend's buffer, written in place"
        else:
            assert mask.numel() == sum(W * (n + W) for n in bound), (mask.numel(), bound, W)
        assert torch.equal(fb.positions, fb.spec_info.positions)
        assert torch.equal(fb.input_ids, fb.spec_info.draft_token)
        logits = torch.full((bs * W, V), -2.0)
        hidden = torch.zeros(bs * W, H)
        new_k = torch.zeros(TARGET_LAYERS, bs * W, 1, HEAD_DIM)
        new_v = torch.zeros(TARGET_LAYERS, bs * W, 1, HEAD_DIM)
        off = 0
        for b in range(bs):
            p = prefixes[b]
            loc = window(b, W)
            assert torch.equal(fb.out_cache_loc[b * W:(b + 1) * W].long(), loc), "verify window"
            assert translator_write_ids(fb)[b * W:(b + 1) * W].tolist() == loc.tolist()
            m = mask[off:off + W * (p + W)].view(W, p + W)
            off += W * (p + W)
            # only the tree window is written: the kernel never reads the prefix part
            # (every node sees the whole prefix; test_tree_attention_kernel proves it)
            anc = m[:, p:].bool()
            toks = fb.input_ids[b * W:(b + 1) * W].tolist()
            depth = (anc.sum(dim=1) - 1).tolist()
            for i in range(W):
                chain = sorted((j for j in range(W) if anc[i, j]), key=lambda j: depth[j])
                assert toks[0] == bonus[b], "root is the bonus token"
                if i > len(trees[b]):
                    # padding (fewer prefixes than the budget): sees only itself,
                    # carries the root's token and position, is never linked
                    assert chain == [i] and toks[i] == bonus[b], (b, i, chain, toks[i])
                    path = ()
                else:
                    assert chain[0] == 0 and chain[-1] == i and all(
                        depth[c] == n for n, c in enumerate(chain)), (b, i, chain)
                    path = tuple(toks[c] for c in chain[1:])
                if 0 < i <= len(trees[b]):  # node i is the reference's i-th best prefix
                    assert path == trees[b][i - 1], (b, i, path, trees[b][i - 1])
                assert int(fb.positions[b * W + i]) == p + depth[i], "positions = prefix + depth"
                code = path_code(bonus[b], path)
                if spread[b]:
                    logits[b * W + i] = torch.tensor(spread_logits(tops[b], bonus[b], path, D))
                else:
                    logits[b * W + i, target_next(plans[b], bonus[b], path)] = 3.0
                if depth[i] <= 1 or req_kwargs[b].get("return_sampling_mask"):
                    node_logits[b].append([list(path), logits[b * W + i].tolist()])
                hidden[b * W + i] = torch.tensor(target_hidden(code, depth[i], b))
                for layer in range(TARGET_LAYERS):
                    k, v = kv_marker(code, layer, depth[i])
                    new_k[layer, b * W + i, 0] = torch.tensor(k)
                    new_v[layer, b * W + i, 0] = torch.tensor(v)
        assert off <= mask.numel()
        # The forward's own KV, written as an attention layer does: the pool's
        # write door at the batch's out_cache_loc (its bound plan's write ids).
        for layer in range(TARGET_LAYERS):
            kv_pool.set_kv_buffer(SimpleNamespace(layer_id=layer), KVWriteLoc.for_batch(fb),
                                  new_k[layer], new_v[layer])
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden),
            can_run_cuda_graph=False,
        )

    draft_in_graph = [False]  # set below, once the worker is built

    def translator_write_ids(fb):
        return target_translator.write_ids(fb)

    def draft_forward(fb):
        assert fb.forward_mode == ForwardMode.TARGET_VERIFY
        assert not calls["draft"], "draft forward called twice"
        calls["draft"].append(fb.input_ids.numel())
        assert fb.batch_size == bs and fb.input_ids.shape == (bs * block,)
        ids = fb.input_ids.view(bs, block)
        assert ids[:, 0].tolist() == bonus and bool((ids[:, 1:] == MASK_ID).all()), ids
        pos = prefix_t.view(-1, 1) + torch.arange(block)
        assert torch.equal(fb.positions.view(bs, block).long(), pos), fb.positions
        assert torch.equal(fb.seq_lens, prefix_t)
        host = prefix_t + block if host_mirror else draft_input.nxt_kv_lens_cpu.long()
        assert torch.equal(fb.seq_lens_cpu.long(), host) and fb.seq_lens_sum == int(host.sum())
        assert fb.spec_info is worker._draft_block_spec_info
        assert fb.capture_hidden_mode == CaptureHiddenMode.NULL
        assert torch.equal(fb.input_embeds, embed[fb.input_ids]), "noise = embedding of the block"
        for b in range(bs):
            assert fb.out_cache_loc[b * block:(b + 1) * block].long().tolist() == window(b, block).tolist()
        assert draft_translator.write_ids(fb).tolist() == fb.out_cache_loc.long().tolist()
        hs = torch.stack([draft_hidden(int(ids[b, 0]), int(pos[b, j])).float()
                          for b in range(bs) for j in range(block)])
        if draft_in_graph[0]:  # what the draft runner's capture tail hook runs inside the graph
            worker._draft_sampler(hs, fb.input_ids)
            calls["draft_head"] = calls.get("draft_head", 0) + 1
        return ModelRunnerOutput(
            logits_output=LogitsProcessorOutput(next_token_logits=None, hidden_states=hs),
            can_run_graph=draft_in_graph[0],
        )

    def append_draft_kv(**kw):
        calls["append"].append({k: (v.tolist() if torch.is_tensor(v) else v) for k, v in kw.items()})

    worker = make_worker(
        cls, cfg=cfg, block=block, mask_id=MASK_ID, dev=dev, lm_weight=weight, embed=embed,
        model_config=model_config, req_pool=req_pool, allocator=allocator, kv_pool=kv_pool,
        target_translator=target_translator, draft_translator=draft_translator, draft_pool=draft_pool,
        attn_backend=AttnBackend(), target_forward=target_forward, draft_forward=draft_forward,
        append_draft_kv=append_draft_kv,
    )

    if draft_graph:
        from sglang.srt.runtime_context import get_exec

        # a batch past the largest graph runs its draft eagerly (no hook, no head)
        draft_in_graph[0] = bs <= max(get_exec().graph.cuda_graph_config.decode.bs)
        worker._draft_sampler = worker._maybe_build_draft_sampler()
        assert worker._draft_sampler is not None, "no in-graph head for a dense LM head"
    worker._use_triton_prepare_block = triton_block
    gathers = {"full": 0, "row_maxima": 0}
    if deferred_gather:
        worker._target_logits_processor = DeferredShardLogits(V, gathers)
    if graph_bs:
        from launch_count import ReplayedCall

        worker.ddtree_tree_runner().capture(graph_bs, ReplayedCall)
    seq_lens_in = batch.seq_lens
    step = functools.partial(worker.forward_batch_generation, batch,
                             on_publish=lambda n: calls["publish"].append(n.tolist()))
    launches = None
    if profile:
        result, launches = profiled_step(worker, step)
    else:
        result = step()

    walk_valid = None
    if any(spread):  # the expected walk is the one the committed tokens describe
        expect["greedy_out"] = expect["out"]
        expect["out"], expect["ids"], expect["paths"], walk_valid = [], [], [], []
        toks, lens_out = result.next_token_ids.view(bs, block).tolist(), result.accept_lens.tolist()
        for b in range(bs):
            o = toks[b][: max(1, min(int(lens_out[b]), block))]
            ids, paths, ok = walk_tokens(bonus[b], o, trees[b], D)
            expect["out"].append(o)
            expect["ids"].append(ids)
            expect["paths"].append([list(p) for p in paths])
            walk_valid.append(ok)

    # -- what the test checks -------------------------------------------------
    # The pool the step must leave, from the reference alone: the target's
    # markers at every window slot (node i at slot i), then the k-th accepted
    # node's at slot k (gather-then-scatter); everything else as before.
    exp_k = [t.clone() for t in kv_before[0]]
    exp_v = [t.clone() for t in kv_before[1]]
    for b in range(bs):
        loc = window(b, W).tolist()
        node_paths = [()] + list(trees[b]) + [()] * (W - 1 - len(trees[b]))  # padding: the root's
        moves = [(loc[i], node_paths[i]) for i in range(W)]
        moves += [(loc[k], tuple(p)) for k, p in enumerate(expect["paths"][b])]
        for slot, path in moves:
            for layer in range(TARGET_LAYERS):
                k, v = kv_marker(path_code(bonus[b], path), layer, len(path))
                exp_k[layer][slot, 0] = torch.tensor(k)
                exp_v[layer][slot, 0] = torch.tensor(v)
    sampling_mask = scheduler_sampling_masks(batch_reqs, result)
    lp = result.logits_output.next_token_logprobs
    nd = result.next_draft_input
    kv_k = [kv_pool.k_buffer[i][:, 0].tolist() for i in range(TARGET_LAYERS)]
    kv_v = [kv_pool.v_buffer[i][:, 0].tolist() for i in range(TARGET_LAYERS)]
    return {
        "config": {"W": W, "D": D, "V": V, "block": block, "bs": bs, "prefixes": list(prefixes),
                   "layers": TARGET_LAYERS, "reserve": reserve},
        "result": {
            "type": type(result).__name__,
            "next_token_ids": result.next_token_ids.tolist(),
            "accept_lens": result.accept_lens.tolist(),
            "new_seq_lens": result.new_seq_lens.tolist(),
            "num_draft_tokens": result.speculative_num_draft_tokens,
            "can_run_cuda_graph": result.can_run_cuda_graph,
            "hidden_dropped": result.logits_output.hidden_states is None,
            "next_bonus": nd.bonus_tokens.tolist(),
            "next_seq_lens": nd.new_seq_lens.tolist(),
            "next_draft_type": type(nd).__name__,
            "batch_mode": batch.forward_mode.name,
            "next_token_logprobs": None if lp is None else lp.tolist(),
            "record_stream": [type(x).__name__ for x in seq_lens_in.streams],
            "node_logits": node_logits,
            "kernels": kernel_calls,
            "is_all_greedy": bool(batch.sampling_info.is_all_greedy),
            "sampling_mask": sampling_mask,
            "grammar_log": grammar_log,
            "launches": launches,
            "verify_gathers": gathers,
            "triton_block": bool(worker._use_triton_prepare_block),
            "graph_bs": list(worker.ddtree_tree_runner().capture_bs)
            if hasattr(worker, "ddtree_tree_runner") else None,  # 2.0 had no tree unit
        },
        "calls": {
            "target": len(calls["target"]), "target_kwargs": [sorted(k) for k in calls["target"]],
            "draft_tokens": calls["draft"], "attn_init": len(calls["attn_init"]),
            "draft_head": calls.get("draft_head", 0),
            "publish": calls["publish"], "append": calls["append"],
        },
        "expect": {
            "out": expect["out"], "ids": expect["ids"],
            "codes": [[path_code(bonus[b], p) for p in expect["paths"][b]] for b in range(bs)],
            "paths": [[list(p) for p in expect["paths"][b]] for b in range(bs)],
            "depths": [[len(p) for p in expect["paths"][b]] for b in range(bs)],
            "bonus": bonus, "min_score_gap": min_gap, "plans": plans,
            "trees": [[list(p) for p in t] for t in trees],
            "untempered_trees": [[list(p) for p in t] for t in untempered_trees],
            "greedy_out": expect.get("greedy_out", expect["out"]), "walk_valid": walk_valid,
        },
        "slots": {
            "rows": [req_to_token[row, :n].tolist() for row, n in zip(rows, slots_needed, strict=False)],
            "allocated": flat.tolist(),
        },
        "kv": {"k": kv_k, "v": kv_v,
               "k_expected": [t[:, 0].tolist() for t in exp_k],
               "v_expected": [t[:, 0].tolist() for t in exp_v],
               "k_before": [t[:, 0].tolist() for t in kv_before[0]]},
    }
