"""The DDTree worker against the target's triton backend, on CPU.

1. The patched triton backend's graph replay and the DDTree step's in-place mask.

Under DDTREE the tree step writes its tree window straight into the triton
backend's verify-mask buffer, and the verify input's ``custom_mask`` IS that
buffer. 0.5.23's ``_update_target_verify_buffers`` (the CUDA-graph replay path)
copies ``spec_info.custom_mask`` into the buffer every replay: onto itself, the
whole FULL_MASK span (up to ``G*W*(C+W)`` bytes at long context) each step.
The patched backend skips exactly that self-copy, under DDTREE only.

Real (in .venv-sglang with the overlay): ``TritonAttnBackend._update_target_verify_buffers``
and ``_target_verify_num_tokens_per_req``, the published runtime context. The
backend object is ``object.__new__`` with the attributes that method reads (a real
one needs a model runner on a GPU), and ``_fill_kv_indptr_and_indices`` (the
KV-index part, untouched by the patch) returns a fixed indptr. The buffer is a
tensor subclass that records slice assignments.

2. What the worker refuses at start-up, once the server is built
(``DDTreeWorkerV2.ddtree_startup_refusals``, real, on an ``object.__new__``
worker): the backend object that really runs the target verify (a hybrid
backend's prefill side, or its decode side under --speculative-attention-mode
decode) must be the triton one, and the options are checked again as resolved,
since a model's resolution hook runs after the parse-time check (here: a page
size set after parsing, as MiniMax-M3's hook sets 128).
"""

from __future__ import annotations

import pytest

from sglang_env import run_sglang

pytestmark = pytest.mark.sglang

CODE = r'''
import types
import torch
from sglang.srt import runtime_context as rc
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.server_args import prepare_server_args


class Recording(torch.Tensor):
    """A buffer that records ``buf[...] = value`` (the replay's copy)."""

    def __setitem__(self, key, value):
        self.writes.append(str(key))
        super().__setitem__(key, value)


def replay(algorithm_args, same_buffer):
    args = prepare_server_args(["--model-path", MODEL, "--device", "cuda"] + algorithm_args)
    rc.reset_context()
    rc.publish(args, role="scheduler")
    bs, W = 2, 5
    buf = torch.zeros(200, dtype=torch.uint8).as_subclass(Recording)
    buf.writes = []
    backend = object.__new__(TritonAttnBackend)
    backend.__dict__.update(
        device="cpu", qo_indptr=torch.zeros(bs + 1, dtype=torch.int32),
        mask_indptr=torch.zeros(bs + 1, dtype=torch.int64), window_kv_indptr=None,
        sliding_window_size=None, target_verify_num_tokens_per_req=W,
        _verify_mask=types.SimpleNamespace(buffer=buf),
        cuda_graph_kv_indices=torch.zeros(16, dtype=torch.int64))
    backend._fill_kv_indptr_and_indices = lambda *a: torch.zeros(bs + 1, dtype=torch.int32)
    mask = buf if same_buffer else torch.ones(100, dtype=torch.uint8)
    spec_info = types.SimpleNamespace(custom_mask=mask, num_tokens_per_req=W)
    out = backend._update_target_verify_buffers(None, bs, torch.tensor([3, 7]), spec_info, None)
    return {"writes": list(buf.writes), "mask_is_buffer": out[2] is buf,
            "ones_copied": int(torch.Tensor(buf)[:100].sum()),
            "mask_indptr": out[3].tolist()}


D = ["--speculative-draft-model-path", MODEL]
DDTREE = ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "4"] + D
DFLASH = ["--speculative-algorithm", "DFLASH"] + D
OUT["ddtree_same"] = replay(DDTREE, True)
OUT["ddtree_other"] = replay(DDTREE, False)
OUT["dflash_same"] = replay(DFLASH, True)

from sglang.srt.arg_groups.overrides import declare_resolution
from sglang.srt.speculative.ddtree_worker import get_ddtree_worker_cls
from sglang.test.parallel_groups import publish


def startup(attn_backend, mode="prefill", page_size=None):
    args = prepare_server_args(["--model-path", MODEL, "--device", "cuda"] + DDTREE
                               + ["--speculative-attention-mode", mode])
    if page_size is not None:  # what a model's resolution hook may do after the parse check
        declare_resolution(args, "model_hook", page_size=page_size)
    rc.reset_context()
    publish(args, role="scheduler")
    worker = object.__new__(get_ddtree_worker_cls())
    runner = types.SimpleNamespace(model=types.SimpleNamespace(lm_head=types.SimpleNamespace(
        weight=torch.zeros(4, 4))), attn_backend=attn_backend)
    worker.__dict__.update(_target_worker=types.SimpleNamespace(model_runner=runner),
                           _need_mamba_verify_commit=False, selector=None, lilicorr=None,
                           _is_domino=False)
    return worker.ddtree_startup_refusals(args)


triton = object.__new__(TritonAttnBackend)
other = type("FlashInferAttnBackend", (), {})()
hybrid = types.SimpleNamespace(prefill_backend=triton, decode_backend=other)
OUT["startup_triton"] = startup(triton)
OUT["startup_hybrid_prefill"] = startup(hybrid)
OUT["startup_hybrid_decode"] = startup(hybrid, mode="decode")
OUT["startup_page_after_parse"] = startup(triton, page_size=128)

# 3. The sampling pre-warm, with CUDA's memory counters and the two sampling kernels faked (no GPU
# here); the bound, SGLang's borrow switch and its fallback are the real ones.
import sglang.kernels.ops.sampling as sampling_ops
import sglang.kernels.ops.sampling.renorm as renorm_ops
import sglang.srt.utils as srt_utils
from sglang.srt.model_executor.runner_utils import pool as graph_pool
from sglang.srt.speculative.ddtree_worker import DDTreeConfig
from sglang.kernels.ops.speculative import sampling as spec_sampling_jit, tree as spec_tree_jit


def prewarm(oom_on_measure):
    publish(prepare_server_args(["--model-path", MODEL, "--device", "cuda"] + DDTREE), role="scheduler")
    worker = object.__new__(get_ddtree_worker_cls())
    calls = {"peaks": [], "disabled": []}
    runner = types.SimpleNamespace(max_running_requests=48, max_decode_logits_rows=lambda: 8 * 5)
    worker.__dict__.update(ddtree_config=DDTreeConfig(4, 4, 8), device="cpu",  # W = 5
                           model_runner=runner, model_config=types.SimpleNamespace(vocab_size=32))
    borrowing = [True]

    def softmax(logits, temperatures):
        calls["peaks"].append((logits.shape[0], borrowing[0] and graph_pool.graph_pool_borrow_enabled()))
        if oom_on_measure and len(calls["peaks"]) == 2:  # the measured pass, whatever borrows
            raise torch.OutOfMemoryError("graph pool exhausted")
        return torch.softmax(logits, -1)

    def disable(reason):
        calls["disabled"].append(reason)
        borrowing[0] = False

    def loaded(name):
        return lambda *args: calls.setdefault("jit_modules", []).append([name, *args])

    fakes = {(sampling_ops, "softmax"): softmax,
             (spec_tree_jit, "_jit_tree_module"): loaded("speculative_tree"),
             (spec_sampling_jit, "_jit_sampling_module"): loaded("speculative_sampling"),
             (renorm_ops, "top_p_renorm_prob"): lambda probs, top_p: probs,
             (srt_utils, "is_cuda"): lambda: True, (graph_pool, "disable_graph_pool_borrow"): disable,
             (graph_pool, "graph_pool_borrow_enabled"):
                 lambda: borrowing[0] and bool(envs.SGLANG_ENABLE_GRAPH_POOL_BORROW.get()),
             (torch.cuda, "synchronize"): lambda: None, (torch.cuda, "reset_peak_memory_stats"): lambda: None,
             (torch.cuda, "memory_stats"): lambda: {"allocated_bytes.all.current": 100,
                                                    "allocated_bytes.all.peak": 1100}}
    saved = {key: getattr(*key) for key in fakes}
    for (module, name), fake in fakes.items():
        setattr(module, name, fake)
    # the accept's Triton kernels: test_commit_kernel warms them for real
    worker.ddtree_warm_accept_kernels = loaded("ddtree_accept_kernels")
    try:
        result = worker.prewarm_sampling()
        calls["result"] = [result.sampling_input_bytes, result.sampling_headroom_bytes]
    except torch.OutOfMemoryError as e:
        calls["raised"] = str(e)
    finally:
        for (module, name), real in saved.items():
            setattr(module, name, real)
    return calls


from sglang.srt.environ import envs
with envs.SGLANG_ENABLE_GRAPH_POOL_BORROW.override(True):
    OUT["prewarm"] = prewarm(oom_on_measure=False)
    OUT["prewarm_oom"] = prewarm(oom_on_measure=True)
with envs.SGLANG_ENABLE_GRAPH_POOL_BORROW.override(False):
    OUT["prewarm_oom_not_borrowing"] = prewarm(oom_on_measure=True)

# 4. The tree step's graphs capture in "thread_local" mode, as upstream's secondary graphs do.
import contextlib
from sglang.srt.speculative import ddtree_step
captured = {}
real_graph = torch.cuda.graph
class FakeStream:
    def wait_stream(self, other):
        pass
torch.cuda.graph = lambda g, **kw: (captured.update(kw), contextlib.nullcontext())[1]
saved_cuda = (torch.cuda.Stream, torch.cuda.stream, torch.cuda.current_stream, torch.cuda.CUDAGraph)
torch.cuda.Stream, torch.cuda.stream = FakeStream, (lambda s: contextlib.nullcontext())
torch.cuda.current_stream, torch.cuda.CUDAGraph = FakeStream, object
try:
    ddtree_step.CudaGraphUnit(pool="pool").capture(lambda: None)
finally:
    torch.cuda.graph = real_graph
    torch.cuda.Stream, torch.cuda.stream, torch.cuda.current_stream, torch.cuda.CUDAGraph = saved_cuda
OUT["capture_kwargs"] = captured
'''


@pytest.fixture(scope="module")
def replays(tmp_path_factory, sglang_overlay):
    return run_sglang(CODE, tmp_path_factory.mktemp("mask-buffer"), sglang_overlay)


def test_ddtree_replay_does_not_copy_the_buffer_onto_itself(replays):
    got = replays["ddtree_same"]
    assert got["writes"] == [] and got["mask_is_buffer"], got
    assert got["mask_indptr"] == [0, 5 * (3 + 5), 5 * (3 + 5) + 5 * (7 + 5)]


def test_a_mask_built_elsewhere_is_still_copied_in(replays):
    """Control: a verify input whose mask is another tensor (an eager batch's
    fresh mask, or another algorithm) is copied into the buffer as upstream does."""
    got = replays["ddtree_other"]
    assert got["writes"] == ["slice(None, 100, None)"] and got["ones_copied"] == 100, got


def test_other_algorithms_keep_upstreams_copy(replays):
    got = replays["dflash_same"]
    assert got["writes"] == ["slice(None, 200, None)"], got


def test_a_served_configuration_starts(replays):
    assert replays["startup_triton"] == []
    assert replays["startup_hybrid_prefill"] == [], "the verify runs on the hybrid's prefill side"


def test_a_verify_that_would_run_on_another_backend_is_refused_at_start(replays):
    why = replays["startup_hybrid_decode"]
    assert len(why) == 1 and "FlashInferAttnBackend" in why[0] and "--attention-backend triton" in why[0]


def test_options_changed_after_the_parse_check_are_refused_at_start(replays):
    why = replays["startup_page_after_parse"]
    assert any("--page-size 128" in w for w in why), why


def test_the_sampling_prewarm_is_bounded_as_upstream_bounds_it(replays):
    """At W = 5 rows a request: the largest graph batch (8 x 5 logits rows -> 8 requests),
    not --max-running-requests (48); rehearsed once unborrowed, then measured borrowing."""
    got = replays["prewarm"]
    assert got["peaks"] == [[8 * 5, False], [8 * 5, True]], got
    assert got["disabled"] == [] and got["result"] == [8 * 5 * 32 * 4, 1000 + 8 * 5 * 32 * 4], got


def test_a_prewarm_that_runs_out_of_graph_pool_memory_stops_borrowing_and_measures_again(replays):
    got = replays["prewarm_oom"]
    assert len(got["disabled"]) == 1 and "DDTREE sampling rehearsal" in got["disabled"][0], got
    assert got["peaks"][-1] == [8 * 5, False] and got["result"][1] == 1000 + 8 * 5 * 32 * 4, got
    # not borrowing, an out-of-memory error is real: it is raised, as upstream raises it
    assert "raised" in replays["prewarm_oom_not_borrowing"]
    assert replays["prewarm_oom_not_borrowing"]["disabled"] == []


def test_the_tree_step_graphs_capture_thread_local(replays):
    assert replays["capture_kwargs"] == {"pool": "pool", "capture_error_mode": "thread_local"}


def test_the_tree_verifys_jit_modules_are_loaded_at_start_up(replays):
    """Before the server says ready: the greedy tree verify's module and the tree sampler at
    this vocabulary's vector size (gcd(4, 32) = 4), deterministic as eagle_sample calls it."""
    assert replays["prewarm"]["jit_modules"] == [["speculative_tree"], ["speculative_sampling", 4, True],
                                                 ["ddtree_accept_kernels"]]
