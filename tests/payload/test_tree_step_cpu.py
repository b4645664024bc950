"""The per-step tree work as one captured unit (``ddtree_step.DDTreeStepRunner``).

Plain torch (the payload modules from patches/, like test_tree_builder):

* the runner replayed from "graphs" (``launch_count.ReplayedCall``, the CPU
  stand-in: the captured body re-run on the same static buffers) gives exactly
  what the eager ``ddtree_tree_step`` gives, for batches that fill a graph, that
  are padded up to one (stale rows from a larger batch left in the static
  buffers), and past the largest graph (eager, a fresh mask); padding rows
  write their mask window after the real rows', inside the buffer;
* the whole body runs on the meta device (no data-dependent host work: what a
  CUDA-graph capture needs), and with every Python-level way of reading a
  tensor value forbidden.

In the real worker step (sglang-marked, ``worker_fakes.run_case`` in
.venv-sglang), under torch's CPU profiler: the tree work of one step (draft
top-k through the verify input) launches at most 30 kernels outside the graph
(the issue's target; 2.0 measured ~420 at bs 32), with the tree step replayed;
the same step with graphs off is the control (far more). The replayed step
passes the same token / KV / reference-tree checks as the eager one.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from launch_count import ReplayedCall

HERE = pathlib.Path(__file__).resolve().parent
BUDGET, CAP, L, W = 12, 3, 6, 13
CONTEXT = 40


@pytest.fixture(scope="module")
def step_mod():
    from sglang.srt.speculative import ddtree_step, ddtree_verify

    return ddtree_step, ddtree_verify


def inputs(bs: int, seed: int):
    """Draft candidates (some rows sampled with top-k / top-p, some greedy),
    roots and prefix lengths, as the worker hands them to the runner."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, L, 40, generator=g) * 2
    lp = torch.log_softmax(logits, -1)
    top_lp, top_ids = torch.topk(lp, CAP, dim=-1)
    top_k = torch.tensor([1, 1 << 30, 2, 1 << 30, 1, 5, 1 << 30, 1][:bs] * (bs // 8 + 1))[:bs]
    top_p = torch.tensor([1.0, 0.8, 1.0, 0.6, 1.0, 0.9, 1.0, 1.0][:bs] * (bs // 8 + 1))[:bs]
    bonus = torch.randint(0, 40, (bs,), generator=g)
    prefix = torch.randint(1, CONTEXT, (bs,), generator=g)
    return top_lp, top_ids, top_k, top_p, bonus, prefix


def eager(step_mod, args):
    _, dv = step_mod
    bs, prefix = args[0].shape[0], args[5]
    mask = torch.zeros(int(W * prefix.sum()) + bs * W * W, dtype=torch.uint8)
    out = dv.ddtree_tree_step(*args, mask, BUDGET, CAP)
    return out, mask


def window(mask: torch.Tensor, prefix: torch.Tensor, du) -> torch.Tensor:
    return mask[du.ddtree_window_mask_index(prefix, W)]


def assert_same_step(a, b, prefix, du) -> None:
    (out_a, mask_a), (out_b, mask_b) = a, b
    for name, x, y in zip(out_a._fields, out_a, out_b, strict=True):
        assert torch.equal(x, y), name
    assert torch.equal(window(mask_a, prefix, du), window(mask_b, prefix, du)), "mask window"


def make_runner(step_mod, max_bs=4):
    ds, _ = step_mod
    buffer = torch.zeros(max_bs * W * (CONTEXT + W), dtype=torch.uint8)
    runner = ds.DDTreeStepRunner(budget=BUDGET, topk_cap=CAP, draft_len=L, device="cpu",
                                 mask_buffer=buffer, mask_bs_limit=max_bs)
    runner.capture([1, 2, 4], ReplayedCall)
    return runner, buffer


def run(runner, args):
    return runner.run(*args, mask_numel=lambda: int(W * args[5].sum()) + args[0].shape[0] * W * W)


def test_replayed_unit_equals_the_eager_step(step_mod, du):
    runner, buffer = make_runner(step_mod)
    assert runner.capture_bs == [1, 2, 4]
    statics = None
    for bs, seed in ((4, 1), (3, 2), (1, 3), (2, 4), (4, 5)):
        args = inputs(bs, seed)
        got = run(runner, args)
        assert got[1] is buffer, "graph batches write the backend's buffer"
        assert_same_step(got, eager(step_mod, args), args[5], du)
        if statics is None:
            statics = [t.untyped_storage().data_ptr() for t in got[0]]
        assert [t.untyped_storage().data_ptr() for t in got[0]] == statics, "fixed output addresses"
    replays = {bs: g.replays for bs, g in runner._graphs.items()}
    assert replays == {1: 1, 2: 1, 4: 3}, replays  # 3 padded to 4


def test_a_batch_past_the_largest_graph_runs_eagerly_into_a_fresh_mask(step_mod, du):
    runner, buffer = make_runner(step_mod)
    args = inputs(6, 7)
    out, mask = run(runner, args)
    assert mask is not buffer and mask.numel() == int(W * args[5].sum()) + 6 * W * W
    assert_same_step((out, mask), eager(step_mod, args), args[5], du)
    assert all(g.replays == 0 for g in runner._graphs.values())


def mask_dtypes(runner) -> set:
    """The verify mask's dtype at each batch size: from graphs, padded, eager in the buffer and
    past the largest graph (a fresh mask). Triton compiles a kernel per pointer dtype, so two
    dtypes here would be a second attention compile while serving."""
    return {run(runner, inputs(bs, 40 + bs))[1].dtype for bs in (1, 3, 4, 6)}


def test_every_batch_size_gets_the_buffers_mask_dtype(step_mod):
    ds, _ = step_mod
    runner, buffer = make_runner(step_mod)
    assert mask_dtypes(runner) == {buffer.dtype} == {ds.MASK_DTYPE}
    bare = ds.DDTreeStepRunner(budget=BUDGET, topk_cap=CAP, draft_len=L, device="cpu")
    assert mask_dtypes(bare) == {ds.MASK_DTYPE}  # no buffer (no graphs): still the backend's dtype
    # Control: 2.1's over-size mask, torch.bool beside the uint8 buffer, is seen.
    runner.mask_dtype = torch.bool
    assert mask_dtypes(runner) == {torch.uint8, torch.bool}


def test_padding_rows_write_after_the_real_rows_inside_the_buffer(step_mod, du):
    runner, buffer = make_runner(step_mod)
    run(runner, inputs(4, 11))  # stale rows in the static buffers
    args = inputs(3, 12)
    buffer.fill_(7)
    run(runner, args)
    real = du.ddtree_window_mask_index(args[5], W).reshape(-1)
    assert bool((buffer[real] != 7).all()), "every real window entry written"
    touched = set((buffer != 7).nonzero().view(-1).tolist()) - set(real.tolist())
    pad_start = int(W * (args[5].sum() + 3 * W))  # right after the three real requests
    assert touched and min(touched) >= pad_start and max(touched) < pad_start + W * W, pad_start


def test_a_forgotten_static_input_is_caught(step_mod, du, monkeypatch):
    """Control: a runner that does not refresh one static input (top-p) replays
    the previous batch's value; the equality check sees it."""
    runner, _ = make_runner(step_mod)
    run(runner, inputs(4, 21))
    real_copy = torch.Tensor.copy_
    static_top_p = runner._static["top_p"]

    def skip_top_p(self, src, *a, **k):
        if self.untyped_storage().data_ptr() == static_top_p.untyped_storage().data_ptr():
            return self
        return real_copy(self, src, *a, **k)

    args = inputs(4, 22)
    args = args[:3] + (torch.full((4,), 0.3),) + args[4:]
    monkeypatch.setattr(torch.Tensor, "copy_", skip_top_p)
    got = run(runner, args)
    monkeypatch.undo()
    with pytest.raises(AssertionError):
        assert_same_step(got, eager(step_mod, args), args[5], du)


def test_the_unit_has_no_host_sync(step_mod, du, monkeypatch):
    # In this process, after whatever files ran before in this worker. It once raised "'<='
    # not supported between instances of 'Tensor' and 'int'" in about 3 full runs of 10: the first
    # meta-device operation of a process imports torch._dynamo (`k <= 0` in
    # restrict_draft_logprobs, here), ansible-core, imported by tests/test_ansible_inventory.py
    # earlier in the same worker, had replaced `sys.intern`, torch._dynamo's polyfill of it
    # raised TypeError, and the comparison turned that into NotImplemented. That file now puts
    # ansible's process-wide patches back when it is done.
    _, dv = step_mod
    meta = torch.device("meta")
    bs = 3
    out = dv.ddtree_tree_step(
        torch.empty(bs, L, CAP, device=meta), torch.empty(bs, L, CAP, dtype=torch.long, device=meta),
        torch.empty(bs, dtype=torch.long, device=meta), torch.empty(bs, device=meta),
        torch.empty(bs, dtype=torch.long, device=meta), torch.empty(bs, dtype=torch.long, device=meta),
        torch.empty(bs * W * (CONTEXT + W), dtype=torch.uint8, device=meta), BUDGET, CAP)
    assert out and all(t.device.type == "meta" and t.shape == (bs, W) for t in out)
    args = inputs(4, 31)
    want = eager(step_mod, args)  # warms the builder's plan cache
    mask = torch.zeros_like(want[1])

    def boom(*a, **k):
        raise AssertionError("host synchronisation in the tree step")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    monkeypatch.setattr(torch, "nonzero", boom)
    got = dv.ddtree_tree_step(*args, mask, BUDGET, CAP)
    monkeypatch.undo()
    assert_same_step((got, mask), want, args[5], du)


# -- the real worker step, counted ------------------------------------------------

LAUNCH_CASE = {"budget": 8, "cap": 3, "block": 5, "host_mirror": True, "prefixes": [7, 11, 3, 19],
               "ranks": [[0, 0, 0, 0], [0, 1, 0, None], [None], [0, 0, 2]],
               "sampling": [{"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.9},
                            {"temperature": 0.0}, {"temperature": 0.0}]}
MAX_LAUNCHES = 30


@pytest.fixture(scope="module")
def counted(tmp_path_factory, sglang_overlay):
    from sglang_env import run_sglang

    code = f"""
    sys.path.insert(0, {str(HERE)!r})
    import worker_fakes as wf  # first: sets TRITON_INTERPRET / SGLANG_NATIVE_MOVE_KV_CACHE
    import torch
    torch.manual_seed(5)
    OUT["graph"] = wf.run_case(model=MODEL, **{LAUNCH_CASE!r}, verify_mask_bs=8, graph_bs=(1, 2, 4, 8),
                               profile=True)
    torch.manual_seed(5)
    OUT["eager"] = wf.run_case(model=MODEL, **{LAUNCH_CASE!r}, profile=True)
    """
    return run_sglang(code, tmp_path_factory.mktemp("launches"), sglang_overlay, timeout=600, triton_interpret=True)


@pytest.mark.sglang
def test_tree_work_launches_at_most_30_kernels_outside_the_graph(counted):
    from test_worker_decode_cpu import check_calls, check_draft_kv_append, check_kv, check_result

    out = counted["graph"]
    got = out["result"]["launches"]
    assert out["result"]["graph_bs"] == [1, 2, 4, 8]
    assert got["replays"] == 1, got
    assert got["launches"] <= MAX_LAUNCHES, got
    # the replayed step is the same step: tokens, lengths, KV, reference trees (checked
    # inside the fake target), through the backend's buffer
    assert all(out["expect"]["walk_valid"]), out["expect"]["walk_valid"]
    check_calls(out)
    check_result(out)
    check_draft_kv_append(out)
    check_kv(out)


@pytest.mark.sglang
def test_the_eager_tree_work_is_what_the_count_sees(counted):
    """Control: graphs off, the same tree work is hundreds of launches, and the
    counter attributes them to the tree (builder, retrieve, mask) operators."""
    got = counted["eager"]["result"]["launches"]
    assert got["replays"] == 0 and got["launches"] > 3 * MAX_LAUNCHES, got
    assert {"aten::topk", "aten::gather", "aten::searchsorted", "aten::scatter_"} <= set(got["ops"]), got["ops"]
    assert counted["eager"]["expect"]["out"] == counted["graph"]["expect"]["out"]


def test_the_runner_reports_what_each_of_its_buffers_holds(step_mod):
    from sglang.srt.speculative import ddtree_worker

    runner, buffer = make_runner(step_mod)
    run(runner, inputs(3, 51))
    runner.retrieve_index(3)
    got = runner.memory_bytes()
    assert got["verify_mask"] == buffer.numel() == 4 * W * (CONTEXT + W)
    # static inputs and outputs for the largest graph batch (4): int64 / float32 tensors
    per_row = L * CAP * (4 + 8) + 8 + 4 + 8 + 8 + 4 * W * 8
    assert got["step_buffers"] == 4 * per_row
    assert got["retrieve_index"] == runner._retrieve_index.numel() * 8 > 0
    line = ddtree_worker.ddtree_memory_line(got, 3 << 20)
    assert line.startswith(f"DDTREE memory per rank: verify mask {got['verify_mask'] / (1 << 20):.1f} MiB, ")
    assert "tree-step graphs 3.0 MiB" in line
    assert f"{(sum(got.values()) + (3 << 20)) / (1 << 20):.1f} MiB in all" in line
