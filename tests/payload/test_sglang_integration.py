"""The patch set inside the real sglang 0.5.23 source (CPU, no GPU).

Runs in `.venv-sglang` with the patch set laid over the pristine wheel (sglang_env): the
DDTREE flags as SGLang's own parser sees them, the refusals of what the tree verify cannot
serve, the worker class SGLang builds, and the verify input's attention arguments against an
independent construction.
"""

from __future__ import annotations

import json
import shlex

import pytest

from ddtree_ops.artifacts import units
from ddtree_ops.config.inventory import load_inventory
from sglang_env import REPO, ancestors_or_self, run_sglang

pytestmark = pytest.mark.sglang

PARSE = """
from sglang.srt.server_args import prepare_server_args
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
base = ["--model-path", MODEL, "--device", "cuda", "--speculative-draft-model-path", MODEL]

def parse(*extra):
    try:
        a = prepare_server_args(base + list(extra))
    except ValueError as e:
        return "refused: " + str(e)
    except SystemExit as e:
        return "argparse exit %s" % e.code
    return [a.speculative_algorithm, a.speculative_ddtree_budget, a.speculative_ddtree_topk_cap,
            a.attention_backend, a.page_size]

D = ["--speculative-algorithm", "DDTREE"]
OUT["explicit"] = parse(*D, "--speculative-ddtree-budget", "32", "--speculative-ddtree-topk-cap", "8")
OUT["defaults"] = parse("--speculative-algorithm", "ddtree")
OUT["triton_named"] = parse(*D, "--attention-backend", "triton", "--page-size", "1")
OUT["plain_dflash"] = parse("--speculative-algorithm", "DFLASH")
OUT["plain_none"] = parse()

def distribution(*extra):
    try:
        return prepare_server_args(base + list(extra)).speculative_ddtree_tree_distribution
    except ValueError as e:
        return "refused: " + str(e)
    except SystemExit as e:
        return "argparse exit %s" % e.code

OUT["distribution"] = {
    "default": distribution(*D),
    "raw": distribution(*D, "--speculative-ddtree-tree-distribution", "raw"),
    "other": distribution(*D, "--speculative-ddtree-tree-distribution", "sharp"),
    "dflash": distribution("--speculative-algorithm", "DFLASH", "--speculative-ddtree-tree-distribution", "raw"),
    "plain": distribution("--speculative-algorithm", "DFLASH"),
}
cases = {
    "budget0": D + ["--speculative-ddtree-budget", "0"],
    "budget_big": D + ["--speculative-ddtree-budget", "2000"],
    "cap_over": D + ["--speculative-ddtree-budget", "8", "--speculative-ddtree-topk-cap", "9"],
    "cap0": D + ["--speculative-ddtree-budget", "8", "--speculative-ddtree-topk-cap", "0"],
    "eagle_budget": ["--speculative-algorithm", "EAGLE", "--speculative-ddtree-budget", "8"],
    "nonint": D + ["--speculative-ddtree-budget", "x"],
    "old_tree_flag": D + ["--speculative-ddtree-tree-verify"],
    "old_debug_flag": D + ["--speculative-ddtree-debug-metrics"],
    "trtllm_mla": D + ["--attention-backend", "trtllm_mla"],
    "flashmla": D + ["--attention-backend", "flashmla"],
    "fa3": D + ["--attention-backend", "fa3"],
    "flashinfer": D + ["--attention-backend", "flashinfer"],
    "prefill_fa3": D + ["--attention-backend", "triton", "--prefill-attention-backend", "fa3"],
    "page16": D + ["--page-size", "16"],
    "dp_attention": D + ["--enable-dp-attention", "--dp-size", "2", "--tp-size", "2"],
    "lora": D + ["--enable-lora"],
    "rejection": D + ["--speculative-use-rejection-sampling"],
    "threshold": D + ["--speculative-accept-threshold-acc", "0.5"],
}
OUT["bad"] = {k: parse(*v) for k, v in cases.items()}

algo = SpeculativeAlgorithm.from_string("DDTREE")
OUT["algo"] = [algo.name, algo.is_dflash()]
cls = algo.create_worker(prepare_server_args(base + D))
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
OUT["worker"] = [cls.__name__, issubclass(cls, DFlashWorkerV2),
                 issubclass(cls.DDTreeVerifyInput, DFlashVerifyInput)]
OUT["plain_worker"] = algo.create_worker(prepare_server_args(base + ["--speculative-algorithm", "DFLASH"])).__name__
"""


def test_ddtree_flags_parse_refuse_and_pick_the_worker(sglang_overlay, tmp_path):
    out = run_sglang(PARSE, tmp_path, sglang_overlay)
    assert out["explicit"] == ["DFLASH", 32, 8, "triton", 1]
    assert out["defaults"] == ["DFLASH", 64, 64, "triton", 1]
    assert out["triton_named"] == ["DFLASH", 64, 64, "triton", 1]
    # nothing changes for the other algorithms (no backend or page size picked)
    assert out["plain_dflash"] == ["DFLASH", None, None, None, None]
    assert out["plain_none"] == [None, None, None, None, None]
    dist = out["distribution"]
    assert (dist["default"], dist["raw"], dist["plain"]) == ("request", "raw", None)
    assert dist["other"] == "argparse exit 2"
    assert "--speculative-ddtree-tree-distribution requires --speculative-algorithm DDTREE" in dist["dflash"]
    bad = out["bad"]
    assert "1..1024" in bad["budget0"] and "1..1024" in bad["budget_big"]
    assert "1 <= topk_cap <= budget" in bad["cap_over"] and "1 <= topk_cap <= budget" in bad["cap0"]
    assert "require --speculative-algorithm DDTREE" in bad["eagle_budget"]
    assert bad["nonint"] == "argparse exit 2"
    # the experimental flag and the no-op debug flag are gone
    assert bad["old_tree_flag"] == "argparse exit 2"
    assert bad["old_debug_flag"] == "argparse exit 2"
    for name in ("trtllm_mla", "flashmla", "fa3", "flashinfer"):
        assert f"attention backend '{name}' cannot verify a DDTree" in bad[name], bad[name]
        assert "use --attention-backend triton" in bad[name]
    assert "attention backend 'fa3'" in bad["prefill_fa3"]  # the verify runs on the prefill backend
    assert "--page-size 16" in bad["page16"] and "use --page-size 1" in bad["page16"]
    assert "DP attention" in bad["dp_attention"], bad["dp_attention"]
    assert "--enable-lora" in bad["lora"]
    assert "--speculative-use-rejection-sampling" in bad["rejection"]
    assert "thresholds below 1" in bad["threshold"]
    assert out["algo"] == ["DFLASH", True]
    assert out["worker"] == ["DDTreeWorkerV2", True, True]
    assert out["plain_worker"] == "DFlashWorkerV2"


ATTN_ARGS = """
import torch
from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
from sglang.srt.server_args import prepare_server_args
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative import ddtree_verify as dv

cls = SpeculativeAlgorithm.from_string("DDTREE").create_worker(prepare_server_args(
    ["--model-path", MODEL, "--device", "cuda", "--speculative-draft-model-path", MODEL,
     "--speculative-algorithm", "DDTREE"]))
VI = cls.DDTreeVerifyInput
g = torch.Generator().manual_seed(7)
budget, cap, depth, V = 8, 3, 4, 50
prefix = torch.tensor([5, 2, 9])
rpi = torch.tensor([2, 0, 3])
bs, W = 3, budget + 1
req_to_token = torch.randperm(4 * 40, generator=g).view(4, 40).to(torch.int32)
plan = dv.ddtree_prepare_verify(torch.randn(bs, depth, V, generator=g), torch.tensor([1, 2, 3]),
                                prefix, budget, cap, seq_lens_sum=int(prefix.sum()))
tree_loc = torch.cat([req_to_token[r, p:p + W] for r, p in zip(rpi.tolist(), prefix.tolist())]).long()
translator = KVIndexTranslator(req_to_token=req_to_token, token_to_kv_pool_allocator=None,
                               token_to_kv_pool=None, page_size=1, device="cpu")
kv_plan = translator.plan(req_pool_indices=rpi, seq_lens=prefix, seq_lens_cpu=prefix,
                          write_virtual=tree_loc, read_extent=W)
vi = VI(draft_token=plan.draft_token, positions=plan.positions, draft_token_num=W,
        custom_mask=plan.custom_mask, retrieve_index=plan.retrieve.retrive_index,
        retrieve_next_token=plan.retrieve.retrive_next_token,
        retrieve_next_sibling=plan.retrieve.retrive_next_sibling, max_depth=depth, kv_loc_plan=kv_plan)
kv_indices, kv_indptr, qo_indptr, mask = vi.generate_attn_arg_prefill(
    req_pool_indices=rpi, paged_kernel_lens=prefix, paged_kernel_lens_sum=int(prefix.sum()),
    translator=translator, plan=kv_plan)
OUT["kv_indices"] = kv_indices.tolist()
OUT["kv_indptr"] = kv_indptr.tolist()
OUT["qo_indptr"] = qo_indptr.tolist()
OUT["mask"] = mask.int().tolist()
OUT["parents"] = plan.tree.parents.tolist()
OUT["req_to_token"] = req_to_token.tolist()
OUT["num_tokens_per_req"] = vi.num_tokens_per_req
OUT["tree"] = [vi.max_tree_depth, vi.tree_topk, vi.topk, vi.spec_input_type.name]
"""


def test_verify_input_attention_args_match_an_independent_construction(sglang_overlay, tmp_path):
    out = run_sglang(ATTN_ARGS, tmp_path, sglang_overlay, triton_interpret=True)
    prefix, rpi, W = [5, 2, 9], [2, 0, 3], 9
    rtt = out["req_to_token"]
    # kv indices: each request's prefix slots, then its W tree slots, from req_to_token
    want_idx, want_indptr = [], [0]
    for r, p in zip(rpi, prefix, strict=True):
        want_idx += rtt[r][: p + W]
        want_indptr.append(want_indptr[-1] + p + W)
    assert out["kv_indices"][: want_indptr[-1]] == want_idx
    assert out["kv_indptr"] == want_indptr
    assert out["qo_indptr"] == [0, W, 2 * W, 3 * W]
    # FULL_MASK: per request W rows of (prefix + W): the prefix visible, then the tree's
    # ancestors-or-self (padding nodes see the prefix and themselves)
    want_mask = []
    for b, p in enumerate(prefix):
        anc = ancestors_or_self(out["parents"][b])
        for i in range(W):
            want_mask += [1] * p + [1 if j in anc[i] else 0 for j in range(W)]
    assert out["mask"][: len(want_mask)] == want_mask
    assert len(out["mask"]) >= len(want_mask)
    assert out["num_tokens_per_req"] == W
    assert out["tree"][:3] == [5, -1, 1]  # accept width = depth + 1; irregular tree
    assert out["tree"][3] == "DFLASH_VERIFY"


def test_the_ct200_launch_line_parses_with_sglangs_own_parser(sglang_overlay, tmp_path):
    """The unit ddtree-ops renders for CT200 (nothing connects anywhere), fed to 0.5.23's parser
    with the patch set: a flag it rejects would only show once CT200 had stopped DFlash."""
    text = units.render_unit(load_inventory(REPO / "inventory" / "ct200.yaml").host("ct200"))
    line = next(ln for ln in units._logical_lines(text) if ln.startswith("ExecStart="))
    argv = shlex.split(line[len("ExecStart="):])
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    args = argv[3:]
    for flag in ("--model-path", "--speculative-draft-model-path"):  # local stand-ins for the weights
        args[args.index(flag) + 1] = "@MODEL@"
    code = (
        "from sglang.srt.server_args import prepare_server_args\n"
        f"args = [MODEL if a == '@MODEL@' else a for a in json.loads({json.dumps(json.dumps(args))})]\n"
        "try:\n"
        "    a = prepare_server_args(args)\n"
        "    OUT['parsed'] = [a.speculative_algorithm, a.speculative_ddtree_budget,\n"
        "                     a.speculative_ddtree_topk_cap, a.tp_size, a.attention_backend, a.page_size]\n"
        "except SystemExit as e:\n"
        "    OUT['parsed'] = 'argparse exit %s' % e.code\n"
    )
    out = run_sglang(code, tmp_path, sglang_overlay)
    assert out["parsed"] == ["DFLASH", 16, 4, 8, "triton", 1]
