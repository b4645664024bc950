"""The accept's one kernel (``ddtree_verify._ddtree_commit_kernel``, run by Triton's CPU
interpreter in .venv-sglang) against the same step in plain torch, on random walks: paths of
every length, -1 padding, nodes already in place, a chain, one request and several."""

from __future__ import annotations

import pytest

from sglang_env import run_sglang

pytestmark = pytest.mark.sglang

CODE = """
import torch
from sglang.srt.speculative import ddtree_verify as dv

g = torch.Generator().manual_seed(3)
cases = []
for bs, W, S, width in [(1, 17, 16, 16), (8, 17, 16, 16), (5, 9, 5, 8), (3, 16, 16, 16)]:
    for trial in range(4):
        num = torch.randint(0, S, (bs,), generator=g)
        accept_index = torch.full((bs, S), -1, dtype=torch.int32)
        for b in range(bs):
            # a root-to-leaf path: strictly increasing node ids (parents precede children)
            nodes = sorted(torch.randperm(W - 1, generator=g)[: int(num[b])].add(1).tolist())
            if trial == 0:  # already in place: node k at depth k (a chain's path)
                nodes = list(range(1, int(num[b]) + 1))
            accept_index[b, : len(nodes) + 1] = torch.tensor([0] + nodes, dtype=torch.int32) + b * W
        predict = torch.randint(0, 1000, (bs * W,), dtype=torch.int32, generator=g)
        loc = torch.randperm(4 * bs * W, generator=g)[: bs * W].to(torch.int64)
        prefix = torch.randint(1, 200, (bs,), dtype=torch.int64, generator=g)
        args = (predict, accept_index, (num + 1).to(torch.int32), loc, prefix, width)
        kernel = dv.ddtree_commit_step(*args, use_triton=True)
        ref = dv.ddtree_commit_step(*args, use_triton=False)
        cases.append({name: [getattr(kernel, name).tolist(), getattr(ref, name).tolist()]
                      for name in kernel._fields})
OUT["cases"] = cases
"""


def test_the_commit_kernel_computes_what_the_torch_step_computes(tmp_path, sglang_overlay):
    cases = run_sglang(CODE, tmp_path, sglang_overlay, timeout=300, triton_interpret=True)["cases"]
    assert len(cases) == 16
    for i, case in enumerate(cases):
        for name, (kernel, ref) in case.items():
            assert kernel == ref, (i, name)
    # the cases move KV: some entries really move, and in the in-place trial none does
    moved = [sum(t != s for t, s in zip(c["kv_tgt"][0], c["kv_src"][0], strict=True)) for c in cases]
    assert any(moved) and moved[0] == 0, moved


MOVE = """
import os
os.environ["SGLANG_NATIVE_MOVE_KV_CACHE"] = "1"  # the reference pools' own move: torch, gather then scatter
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.speculative import ddtree_verify as dv

def pools():
    return {
        "mha": MHATokenToKVPool(64, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=8, layer_num=3,
                                device="cpu", enable_memory_saver=False, enable_alt_stream=False),
        # Kimi K2.6's layout per rank: latent 512 + rope 64 (here 3 layers)
        "mla": MLATokenToKVPool(64, page_size=1, dtype=torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64,
                                layer_num=3, device="cpu", enable_memory_saver=False),
    }

def buffers(pool):
    return list(pool.kv_buffer) if hasattr(pool, "kv_buffer") else list(pool.k_buffer) + list(pool.v_buffer)

g = torch.Generator().manual_seed(5)
out = {}
mine, theirs = pools(), pools()
for name in mine:
    for a, b in zip(buffers(mine[name]), buffers(theirs[name]), strict=True):
        a.copy_(torch.randn(a.shape, generator=g).to(a.dtype))
        b.copy_(a)
    # two requests' windows at slots 8.. and 30..: path nodes to the front, the rest onto itself
    tgt = torch.tensor([8, 9, 10, 11, 12, 30, 31, 32, 33, 34])
    src = torch.tensor([8, 11, 12, 11, 12, 30, 31, 34, 33, 34])
    dv.move_accepted_kv(mine[name], tgt, src, 5)
    theirs[name].move_kv_cache(tgt, src)  # SGLang's own move (the pool's torch path here)
    out[name] = {"same": all(torch.equal(a, b) for a, b in zip(buffers(mine[name]), buffers(theirs[name]))),
                 "moved": not torch.equal(buffers(mine[name])[0][9], buffers(pools()[name])[0][9]),
                 "one_launch_table": bool(getattr(mine[name], "_ddtree_move_table", ()))}
OUT.update(out)
"""


def test_the_one_launch_kv_move_moves_what_the_pools_own_move_does(tmp_path, sglang_overlay):
    """``move_accepted_kv`` through its kernel (interpreted) on an MHA and an MLA pool (Kimi's
    latent + rope rows) leaves every layer as the pool's own ``move_kv_cache`` does."""
    out = run_sglang(MOVE, tmp_path, sglang_overlay, timeout=300, triton_interpret=True)
    for name in ("mha", "mla"):
        assert out[name] == {"same": True, "moved": True, "one_launch_table": True}, (name, out[name])


WARM = """
import os
from types import SimpleNamespace
import torch
from triton.runtime.interpreter import InterpretedFunction
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.speculative.ddtree_worker import DDTreeConfig, get_ddtree_worker_cls

launched = []
real = InterpretedFunction.run
def run(self, *args, **kwargs):
    launched.append(self.fn.__name__)
    return real(self, *args, **kwargs)
InterpretedFunction.run = run

pool = MHATokenToKVPool(64, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=8, layer_num=2,
                        device="cpu", enable_memory_saver=False, enable_alt_stream=False)
before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
out = {}
for cap in (4, 1):
    launched.clear()
    worker = object.__new__(get_ddtree_worker_cls())
    worker.__dict__.update(ddtree_config=DDTreeConfig(16, cap, 16), device="cpu", block_size=16,
                           model_runner=SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(
                               get_kvcache=lambda: pool)))
    worker.ddtree_warm_accept_kernels()
    out[cap] = list(launched)
OUT["launched"] = out
OUT["pool_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, pool.k_buffer + pool.v_buffer))
"""


def test_the_accept_kernels_are_launched_at_start_up_and_move_nothing(tmp_path, sglang_overlay):
    """``ddtree_warm_accept_kernels`` (called from the start-up warm-up) launches the commit
    kernel and, for a real tree, the move kernel, at the served shapes, and leaves the pool as
    it was (slot 0 onto itself); a chain has no move to warm."""
    out = run_sglang(WARM, tmp_path, sglang_overlay, timeout=300, triton_interpret=True)
    assert out["launched"] == {"4": ["_ddtree_commit_kernel", "_ddtree_move_kv_kernel"],
                               "1": ["_ddtree_commit_kernel"]}, out["launched"]
    assert out["pool_unchanged"]
