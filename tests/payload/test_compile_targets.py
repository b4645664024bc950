"""bench/compile_targets.py: the tree path's Triton kernels compiled on this CPU for sm_90 (H200)
and sm_120 (CT200's RTX PRO 6000), SGLang 0.5.23's own wrappers choosing block sizes as on each
chip, checked against each chip's shared memory and registers (in .venv-sglang, through the
patched overlay, Triton compiling instead of launching).

Controls: Hopper's extend-attention block sizes compiled for sm_120 exceed its 99 KB per block
(what an H200-only check would have passed), and 2.1's over-size batch mask (torch.bool beside the
uint8 buffer) is a second compile of the attention kernel.
"""

from __future__ import annotations

import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"

pytestmark = pytest.mark.sglang

MLA = "mla_h16_w17"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, sglang_overlay):
    from sglang_env import run_sglang

    code = f"""
    sys.path.insert(0, {str(BENCH)!r})
    import torch
    import compile_targets as ct
    sm90, sm120 = ct.TARGETS
    OUT["rows"] = ct.compile_all()
    hopper_blocks = ct._attention_launches(block_override=(32, 64), only=[{MLA!r}])
    OUT["hopper_blocks_on_sm120"] = ct.compile_launch(*hopper_blocks[0], sm120)
    bool_mask = ct._attention_launches(fresh_mask_dtype=torch.bool, only=[{MLA!r}])
    OUT["bool_fresh_mask"] = ct.compile_launch(*bool_mask[0], sm120)
    """
    return run_sglang(code, tmp_path_factory.mktemp("compile_targets"), sglang_overlay, timeout=900)


def _by(rows, **match):
    return [r for r in rows if all(r[k] == v for k, v in match.items())]


def test_every_tree_path_kernel_compiles_for_both_chips_within_their_limits(compiled):
    rows = compiled["rows"]
    sites = {r["site"] for r in rows}
    assert {f"extend_attention {MLA}", "extend_attention mla_h16_w65", "extend_attention mha_h8_kv2_d128_w65",
            "cache locs: verify window", "cache locs: draft block", "accept: commit and KV move lists",
            "greedy verify: row maxima (deferred gather)"} == sites
    for target in ("sm_90", "sm_120"):
        assert {r["site"] for r in _by(rows, target=target)} == sites, target
    assert {r["kernel"] for r in _by(rows, site="accept: commit and KV move lists", target="sm_120")} == {
        "_ddtree_commit_kernel", "_ddtree_move_kv_kernel"}
    for r in rows:
        assert r["over"] == [], r
        assert 0 <= r["shared_bytes"] <= r["shared_limit"] and 0 < r["registers"] <= 255, r
        assert r["registers"] * r["threads"] <= 65536, r
    # SGLang sizes the MLA tiles per chip: sm_120's are smaller, and so is what they need
    mla90 = _by(rows, site=f"extend_attention {MLA}", target="sm_90")[0]
    mla120 = _by(rows, site=f"extend_attention {MLA}", target="sm_120")[0]
    assert mla120["blocks"]["BLOCK_N"] < mla90["blocks"]["BLOCK_N"], (mla90["blocks"], mla120["blocks"])
    assert mla120["shared_bytes"] < mla90["shared_bytes"]


def test_the_verify_mask_is_one_dtype_so_each_attention_shape_compiles_once(compiled):
    for r in compiled["rows"]:
        if r["kernel"] == "_fwd_kernel":
            assert r["mask_dtype"] == "*u8" and r["specializations_at_site"] == 1, r
    # Control: a bool mask for the batch past the graphs is a second attention compile.
    (first, second) = compiled["bool_fresh_mask"]
    assert {first["mask_dtype"], second["mask_dtype"]} == {"*u8", "*u1"}  # Triton names torch.bool u1
    assert first["specializations_at_site"] == 2


def test_hopper_block_sizes_on_sm120_are_caught_as_over_its_shared_memory(compiled):
    (row,) = compiled["hopper_blocks_on_sm120"]
    assert row["target"] == "sm_120" and row["blocks"]["BLOCK_N"] == 64
    assert row["shared_bytes"] > 101_376
    assert any("shared memory" in why for why in row["over"]), row
    # the same tiles on the chip they were chosen for fit
    mla90 = _by(compiled["rows"], site=f"extend_attention {MLA}", target="sm_90")[0]
    assert mla90["blocks"] == row["blocks"] and mla90["over"] == []
