"""Integration against the real sglang 0.5.23 source with the patch set applied.

Runs in the interpreter of .venv-sglang (built by scripts/setup-sglang-venv):
sglang installed --no-deps plus its light deps, torch CPU-capable, no GPU.
Skipped with a reason when that venv is absent, unless DDTREE_OPS_STRICT=1.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
VENV = pathlib.Path(os.environ.get("DDTREE_SGLANG_VENV", REPO / ".venv-sglang"))
PY = VENV / "bin" / "python"

pytestmark = pytest.mark.sglang


def _need_venv():
    if not PY.exists():
        msg = f"{VENV} absent: run scripts/setup-sglang-venv"
        if os.environ.get("DDTREE_OPS_STRICT") == "1":
            pytest.fail(msg + " (DDTREE_OPS_STRICT=1)")
        pytest.skip(msg)


def _run(code: str, tmp_path) -> dict:
    _need_venv()
    cfg = tmp_path / "model"
    cfg.mkdir(exist_ok=True)
    (cfg / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "block_size": 16}))
    script = "import json, sys\nMODEL = %r\nOUT = {}\n" % str(cfg) + textwrap.dedent(code) + \
        "\nprint('@@RESULT@@' + json.dumps(OUT))\n"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([str(PY), "-c", script], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("@@RESULT@@")][-1]
    return json.loads(line[len("@@RESULT@@"):])


def test_patched_sglang_end_to_end_cpu(tmp_path):
    out = _run(
        """
        import glob, os, hashlib
        import sglang.srt.speculative as spec_pkg
        from sglang.srt.server_args import prepare_server_args
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from sglang.srt.speculative import ddtree_utils, ddtree_worker, ddtree_args
        import torch
        OUT["modules"] = sorted(os.path.basename(p) for p in glob.glob(os.path.join(list(spec_pkg.__path__)[0], "ddtree*.py")))
        base = ["--model-path", MODEL, "--device", "cuda", "--speculative-draft-model-path", MODEL]
        a = prepare_server_args(base + ["--speculative-algorithm", "DDTREE",
            "--speculative-ddtree-budget", "32", "--speculative-ddtree-topk-cap", "8",
            "--speculative-ddtree-debug-metrics"])
        OUT["parsed"] = [a.speculative_algorithm, a.speculative_ddtree_budget,
                         a.speculative_ddtree_topk_cap, a.speculative_ddtree_debug_metrics]
        d = prepare_server_args(base + ["--speculative-algorithm", "ddtree"])
        OUT["defaults"] = [d.speculative_algorithm, d.speculative_ddtree_budget, d.speculative_ddtree_topk_cap]
        plain = prepare_server_args(base + ["--speculative-algorithm", "DFLASH"])
        OUT["plain"] = [plain.speculative_algorithm, plain.speculative_ddtree_budget]
        algo = SpeculativeAlgorithm.from_string("DDTREE")
        OUT["algo"] = [algo.name, algo.is_dflash()]
        cls = algo.create_worker(a)
        from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
        OUT["worker"] = [cls.__name__, issubclass(cls, DFlashWorkerV2)]
        OUT["plain_worker"] = algo.create_worker(plain).__name__
        bad = {}
        for extra in (["--speculative-ddtree-budget", "0"],
                      ["--speculative-ddtree-budget", "8", "--speculative-ddtree-topk-cap", "9"],
                      ["--speculative-ddtree-budget", "8", "--speculative-ddtree-topk-cap", "0"]):
            try:
                prepare_server_args(base + ["--speculative-algorithm", "DDTREE"] + extra)
                bad[" ".join(extra)] = "accepted"
            except ValueError as e:
                bad[" ".join(extra)] = str(e)
        try:
            prepare_server_args(base + ["--speculative-algorithm", "EAGLE", "--speculative-ddtree-budget", "8"])
            bad["eagle"] = "accepted"
        except ValueError as e:
            bad["eagle"] = str(e)
        try:
            prepare_server_args(base + ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "x"])
            bad["nonint"] = "accepted"
        except SystemExit as e:
            bad["nonint"] = "argparse exit %s" % e.code
        OUT["bad"] = bad
        OUT["max_width"] = algo.resolve_max_speculative_num_draft_tokens(
            type("C", (), {"speculative_num_draft_tokens": 16, "speculative_adaptive": False,
                           "speculative_ddtree_budget": 32})())
        # the patched modules work inside the real package
        cfg = ddtree_worker.DDTreeConfig(8, 3)
        plan = ddtree_worker.plan_ddtree_step(torch.randn(2, 4, 50), torch.tensor([1, 2]), torch.tensor([5, 9]), cfg)
        OUT["plan"] = list(plan.tree.parents.shape)
        # 1.1.0: the tree-verify flag, the verify input class, EAGLE's helpers
        tv = prepare_server_args(base + ["--speculative-algorithm", "DDTREE",
            "--speculative-ddtree-budget", "8", "--speculative-ddtree-tree-verify"])
        OUT["tree_flag"] = [tv.speculative_ddtree_tree_verify, a.speculative_ddtree_tree_verify]
        try:
            prepare_server_args(base + ["--speculative-algorithm", "DFLASH", "--speculative-ddtree-tree-verify"])
            bad["tree_flag_dflash"] = "accepted"
        except ValueError as e:
            bad["tree_flag_dflash"] = str(e)
        from sglang.srt.speculative import ddtree_verify as dv
        from sglang.srt.speculative.dflash_info import DFlashVerifyInput
        from sglang.srt.speculative.spec_info import SpecInputType
        from sglang.srt.speculative.eagle_worker_common import _compact_accept_to_front
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        VI = cls.DDTreeVerifyInput
        g = torch.Generator().manual_seed(0)
        p = dv.ddtree_prepare_verify(torch.randn(2, 4, 50, generator=g), torch.tensor([1, 2]),
                                     torch.tensor([5, 9]), 8, 3, seq_lens_sum=14)
        vi = VI(draft_token=p.draft_token, positions=p.positions, draft_token_num=p.width,
                custom_mask=p.custom_mask, capture_hidden_mode=CaptureHiddenMode.FULL)
        OUT["verify_input"] = [issubclass(VI, DFlashVerifyInput), vi.spec_input_type == SpecInputType.DFLASH_VERIFY,
                               vi.num_tokens_per_req, vi.topk, int(vi.custom_mask.numel())]
        logits = torch.randn(18, 50, generator=g)
        pr, ai, an = dv.ddtree_accept(logits, p)
        x = torch.randn(18, 7, generator=g)
        OUT["compact_eq_eagle"] = bool(torch.equal(
            dv.compact_to_front(x, ai, 2, 9), _compact_accept_to_front(x, ai, 2, num_draft_tokens=9)))
        OUT["blockers_default"] = ddtree_worker.tree_verify_blockers(
            enabled=False, attn_backend="FlashAttentionBackend", page_size=1, head_tp_size=1,
            attn_dp=False, compact_draft_cache=False, mamba=False, selector=False, domino=False,
            simulate_acc=False, ragged_verify=False)
        import sglang.srt.layers.attention.flashinfer_backend as fib
        import sglang.srt.layers.attention.triton_backend as trb
        OUT["mask_backends_exist"] = [hasattr(fib, "FlashInferAttnBackend"), hasattr(trb, "TritonAttnBackend")]
        """,
        tmp_path,
    )
    assert out["modules"] == ["ddtree_args.py", "ddtree_utils.py", "ddtree_verify.py", "ddtree_worker.py"]
    assert out["parsed"] == ["DFLASH", 32, 8, True]
    assert out["defaults"] == ["DFLASH", 64, 64]
    assert out["plain"] == ["DFLASH", None]
    assert out["algo"] == ["DFLASH", True]
    assert out["worker"] == ["DDTreeWorkerV2", True]
    assert out["plain_worker"] == "DFlashWorkerV2"
    bad = out["bad"]
    assert "must be >= 1" in bad["--speculative-ddtree-budget 0"]
    assert "1 <= topk_cap <= budget" in bad["--speculative-ddtree-budget 8 --speculative-ddtree-topk-cap 9"]
    assert "1 <= topk_cap <= budget" in bad["--speculative-ddtree-budget 8 --speculative-ddtree-topk-cap 0"]
    assert "require --speculative-algorithm DDTREE" in bad["eagle"]
    assert bad["nonint"] == "argparse exit 2"
    assert out["max_width"] == 33
    assert out["plan"] == [2, 9]
    assert out["tree_flag"] == [True, False]
    assert "require --speculative-algorithm DDTREE" in bad["tree_flag_dflash"]
    # N = 9 nodes per request; FULL_MASK = 9*(5+9) + 9*(9+9)
    assert out["verify_input"] == [True, True, 9, 1, 9 * 14 + 9 * 18]
    assert out["compact_eq_eagle"] is True
    assert "--speculative-ddtree-tree-verify is off" in out["blockers_default"]
    assert any("FlashAttentionBackend" in r for r in out["blockers_default"])
    assert out["mask_backends_exist"] == [True, True]
