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
        """,
        tmp_path,
    )
    assert out["modules"] == ["ddtree_args.py", "ddtree_utils.py", "ddtree_worker.py"]
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
