"""CPU tests of the two GPU scripts: bench/gpu_kernels.py and
bench/gpu_server_check.py.

* gpu_kernels.py runs end to end in ``--cpu-smoke`` mode in a subprocess: the
  CPU parts must really compute (builder checks, the published test vector on
  the reference, eager timings with the heap baseline, the random-tree harness)
  and the CUDA-graph and kernel parts must say ``skipped: no CUDA``. Its
  comparison logic is also run with stand-in "kernels" (the reference itself:
  equal; a perturbed copy: caught).
* gpu_server_check.py: model builders (configs + safetensors, shapes derived
  here independently; transformers loads them when it is installed), command
  lines per mode, the chi-square helpers on synthetic data with fixed seeds,
  the greedy comparison, and the whole orchestration against a stand-in
  ``sglang.launch_server`` (a loopback HTTP server) -- once faithful, once with
  a biased DDTREE sampler that the distribution check must catch.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import random
import subprocess
import sys
import textwrap

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
PATCHES = REPO / "patches"
VENV_PY = REPO / ".venv" / "bin" / "python"
PY = str(VENV_PY) if VENV_PY.exists() else sys.executable


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gk():
    return _load("gpu_kernels")


@pytest.fixture(scope="module")
def gsc():
    return _load("gpu_server_check")


# ---------------------------------------------------------------------------
# gpu_kernels.py
# ---------------------------------------------------------------------------


def _paths_under(root: pathlib.Path) -> set:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _env_writing_bytecode() -> dict:
    """This environment as it would be without the suite's PYTHONDONTWRITEBYTECODE=1."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The smoke run, in an environment that writes bytecode; also returns every path that
    appeared under patches/ meanwhile."""
    out = tmp_path_factory.mktemp("gk_smoke")
    before = _paths_under(PATCHES)
    r = subprocess.run(
        [PY, str(BENCH / "gpu_kernels.py"), "--cpu-smoke", "--out", str(out),
         "--carry", str(out / "no_carry")],
        capture_output=True, text=True, timeout=240, cwd=REPO, check=False, env=_env_writing_bytecode(),
    )
    new_under_patches = sorted(_paths_under(PATCHES) - before)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((out / "gpu_kernels.json").read_text())
    return doc, (out / "gpu_kernels.md").read_text(), r.stdout, new_under_patches


def test_smoke_leaves_nothing_under_patches_even_when_bytecode_is_on(smoke):
    assert smoke[3] == []


def test_the_patches_check_notices_a_stray_bytecode_file(tmp_path):
    # the loading gpu_kernels.py does (a module by file path), without its dont_write_bytecode
    mod = tmp_path / "files" / "sglang" / "srt" / "speculative" / "ddtree_utils.py"
    mod.parent.mkdir(parents=True)
    mod.write_text("X = 1\n")
    before = _paths_under(tmp_path / "files")
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('m', sys.argv[1]); "
            "s.loader.exec_module(importlib.util.module_from_spec(s))")
    subprocess.run([PY, "-c", code, str(mod)], check=True, timeout=60, env=_env_writing_bytecode())
    new = sorted(_paths_under(tmp_path / "files") - before)
    assert any(p.endswith(".pyc") for p in new), new


def test_smoke_meta_and_files(smoke):
    doc, md, stdout, _ = smoke
    meta = doc["meta"]
    assert meta["mode"] == "cpu-smoke"
    assert meta["gpu"] is None
    assert meta["torch"] == torch.__version__
    assert "triton" in meta
    assert "skipped: no CUDA" in md
    assert "| timing | ok |" in md
    assert "wrote" in stdout


def test_smoke_cpu_parts_computed(smoke):
    steps = smoke[0]["steps"]
    b = steps["builder_eager"]
    assert b["status"] == "ok" and b["checks"] and all(b["checks"].values())
    assert sum(b["draft_nodes_per_request"]) > 0
    tv = steps["reference_test_vector"]
    assert tv["status"] == "ok" and len(tv["reference"]) == 5
    assert all(r["match"] for r in tv["reference"])
    assert tv["kernel_status"] == "skipped: no CUDA"
    a = steps["accept_kernels"]  # on a CPU: the commit's torch path only, said so
    assert a["status"] == "ok" and a["triton"] is False and "torch path" in a["summary"], a
    assert [c["commit_equal"] for c in a["checks"]] == [True] * 3
    t = steps["timing"]
    assert t["status"] == "ok" and len(t["rows"]) >= 1
    for row in t["rows"]:
        assert "cpu" in row["clock"].lower()
        for k in ("ddtree_topk_build_retrieve_ms", "ddtree_build_retrieve_ms", "topk_only_ms",
                  "heap_d2h_ms", "heap_host_ms", "heap_total_ms"):
            assert isinstance(row[k], (int, float)) and row[k] > 0, (k, row)
        # a ratio kept to 2 decimals: a load spike in the ddtree timing can round it to 0.0
        assert isinstance(row["heap_over_ddtree"], (int, float)) and row["heap_over_ddtree"] >= 0, row
        assert math.isclose(row["heap_total_ms"],
                            row["topk_only_ms"] + row["heap_d2h_ms"] + row["heap_host_ms"], abs_tol=1e-3)
    for name in ("kernel_sampling_vs_reference", "kernel_greedy_vs_reference"):
        s = steps[name]
        assert s["status"] == "ok" and s["requests"] > 0 and s["cases"] > 0
        assert s["harness_invariant_violations"] == []
        assert s["kernel_comparison"] == "skipped: no CUDA"
    assert steps["kernel_greedy_vs_reference"]["accepted_draft_tokens_total"] > 0


def test_smoke_gpu_parts_skipped(smoke):
    steps = smoke[0]["steps"]
    for name in ("graph_capture", "kernel_build", "kernel_test_vector"):
        assert steps[name]["status"] == "skipped", name
        assert steps[name]["reason"] == "skipped: no CUDA", name
    assert steps["kernel_build"]["carry_missing"]  # the carry given does not exist


def test_the_smoke_runs_the_tree_step_unit_past_its_graphs_inside_a_checked_region(smoke):
    for name in ("tree_step_unit_b16", "tree_step_unit_b64"):
        step = smoke[0]["steps"][name]
        assert step["status"] == "ok", step
        assert any(c["graph_bs"] is None for c in step["checks"]), step["checks"]  # bs 11, eager
        assert all(all(c["equal"].values()) for c in step["checks"]), step["checks"]


def test_a_checked_region_refuses_each_host_read_and_runs_device_work(gk):
    t = torch.arange(6)
    reads = {"int()": lambda: int(t.sum()), "item": lambda: t.sum().item(), "tolist": t.tolist,
             "bool()": lambda: bool(t[0]), "nonzero": t.nonzero, "a mask index": lambda: t[t > 2],
             "equal": lambda: torch.equal(t, t), "cpu": t.cpu, "numpy": t.numpy}
    for name, read in reads.items():
        with pytest.raises(gk.HostReadError), gk.sync_checked(cuda=False):
            read()
            pytest.fail(f"{name} read a value inside the region")
    with gk.sync_checked(cuda=False):  # work that stays on the device passes
        y = torch.topk(t.float() * 2, 3).indices + t[torch.tensor([1, 2])].sum()
    assert y.tolist() == [8, 7, 6]


def test_the_tree_step_units_over_size_mask_is_sized_before_its_checked_region(gk):
    """2.1's helper read the device lengths inside the region (a false failure on the GPU at
    batch 11, above the largest graph); the size now comes from a host copy taken before."""
    from sglang.srt.speculative import ddtree_step

    W, bs = 17, 3
    runner = ddtree_step.DDTreeStepRunner(budget=W - 1, topk_cap=4, draft_len=5, device="cpu")
    gen = torch.Generator().manual_seed(0)
    top_lp, top_ids = torch.topk(torch.log_softmax(torch.randn(bs, 5, 64, generator=gen), -1), 4, dim=-1)
    args = (top_lp, top_ids, torch.ones(bs, dtype=torch.long), torch.ones(bs),
            torch.randint(0, 64, (bs,), generator=gen), torch.tensor([5, 9, 2]))

    def old_helper():
        return int(W * args[5].sum()) + args[0].shape[0] * W * W

    with pytest.raises(gk.HostReadError), gk.sync_checked(cuda=False):
        runner.run(*args, mask_numel=old_helper)
    numel = gk.oversize_mask_numel(args[5].tolist(), W)
    assert numel == old_helper()
    with gk.sync_checked(cuda=False):
        _, mask = runner.run(*args, mask_numel=lambda: numel)
    assert mask.numel() == numel


def test_compare_logic_with_standin_kernels(gk):
    cpu = torch.device("cpu")
    specs = gk.random_case_specs(10, seed=3, big_vocab=gk.VOCAB, smoke=True)
    ref = gk.du.tree_speculative_sampling_reference

    ok = gk.step_random_compare(cpu, ref, None, specs, 5, "sampling")
    assert ok["status"] == "ok" and ok["requests_equal"] == ok["requests"] > 0

    def off_by_one(**kw):  # a "kernel" that miscounts one request
        ref(**kw)
        kw["accept_token_num"][0] += 1

    bad = gk.step_random_compare(cpu, off_by_one, None, specs, 5, "sampling")
    assert bad["status"] == "failed" and bad["mismatches"]
    assert bad["requests_equal"] < bad["requests"]

    def greedy(*a):
        gk.du.verify_tree_greedy_reference(*a)

    g = gk.step_random_compare(cpu, None, greedy, specs, 5, "greedy")
    assert g["status"] == "ok" and g["requests_equal"] == g["requests"]

    tv = gk.step_test_vector(cpu, ref, trials=3, seed=1)
    assert tv["status"] == "ok" and all(r["match"] for r in tv["kernel"])


def test_smoke_tree_attention_steps_run_the_harness(smoke):
    steps = smoke[0]["steps"]
    names = [n for n in steps if n.startswith("tree_attention_")]
    assert names == ["tree_attention_mla_w9", "tree_attention_mha_gqa_w9"]
    for name in names:
        s = steps[name]
        assert s["status"] == "ok", (name, s)
        assert s["kernel"].startswith("torch emulation") and s["graph_replays_kind"].startswith("eager stand-in")
        assert all(c["ok"] for c in s["controls"].values()), s["controls"]
        assert s["graph_replays"][0]["graph_bs"] > s["graph_replays"][0]["raw_bs"]  # a padded replay
        assert s["eager_fresh_mask"]["bs"] > max(s["config"]["capture_bs"])  # above the graph batch


def _chain_kernel(gk):
    """A kernel that ignores the tree: it reads a causal chain in every window."""

    def run(*args, **kwargs):
        args = list(args)
        kvp, mip, w = args[7], args[11], args[12]
        seq = kvp[1:] - kvp[:-1]
        chain = torch.zeros(int(mip[-1]), dtype=torch.bool)
        gk.du.ddtree_write_window_mask(chain, torch.ones(w, w, dtype=torch.bool).tril().expand(len(seq), w, w), seq)
        args[9] = chain
        gk.emulated_extend_attention(*args, **kwargs)

    return run


def test_tree_attention_harness_catches_kernels_that_misread_the_mask(gk):
    cpu = torch.device("cpu")
    cfg = gk.tree_attention_configs(smoke=True)[1]
    ok = gk.step_tree_attention(cfg, cpu, (gk.emulated_extend_attention, "emulation", None), 3)
    assert ok["status"] == "ok", ok["summary"]

    def prefix_reader(*args, **kwargs):  # reads the stale prefix columns
        gk.emulated_extend_attention(*args, **{**kwargs, "skip_prefix_custom_mask": False})

    for fn in (prefix_reader, _chain_kernel(gk)):
        bad = gk.step_tree_attention(cfg, cpu, (fn, "broken", None), 3)
        assert bad["status"] == "failed" and not bad["eager_buffer_mask"]["ok"], bad["summary"]
        assert not all(r["ok"] for r in bad["graph_replays"])


ATTENTION_IMPORTS = {
    "score_mod.py": "import triton\n",
    "decode_attention.py": ("from sglang.kernels.ops.attention.score_mod import unpack_aux_tensors\n"
                            "from sglang.srt.environ import envs\n"
                            "from sglang.srt.utils import get_device_core_count, is_hip\n"),
    "extend_attention.py": ("from sglang.kernels.ops.attention.decode_attention import _extract_kv_strides\n"
                            "from sglang.srt.utils import is_cuda, is_gfx95_supported\n"),
}


def test_attention_loader_refuses_files_it_cannot_stand_in_for(gk, tmp_path):
    folder = tmp_path / "sglang_py" / "attention"
    folder.mkdir(parents=True)
    for name, text in ATTENTION_IMPORTS.items():
        (folder / name).write_text(text)
    gk.check_attention_imports(folder)  # the imports 0.5.23's files make: all stood in for
    with open(folder / "extend_attention.py", "a") as f:
        f.write("from sglang.srt.layers.dp_attention import get_attention_tp_size\n")
    with pytest.raises(RuntimeError, match="does not stand in for"):
        gk.check_attention_imports(folder)
    (folder / "score_mod.py").unlink()
    with pytest.raises(FileNotFoundError, match="score_mod.py"):
        gk.load_extend_attention(tmp_path)


def test_kernel_wrapper_source_matches_sglang(gk):
    src = gk.wrapper_source(["/x/speculative/sampling.cuh"],
                            [("sample", "tree_speculative_sampling_target_only<4, true>")])
    assert src.splitlines()[:5] == list(gk.FFI_INCLUDES)
    assert '#include "/x/speculative/sampling.cuh"' in src
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(sample, (tree_speculative_sampling_target_only<4, true>));" in src
    assert [w[0] for w in gk.TREE_WRAPPERS] == [
        "build_tree_kernel_efficient", "verify_tree_greedy", "reconstruct_indices_from_tree_mask"]


# ---------------------------------------------------------------------------
# gpu_server_check.py: models
# ---------------------------------------------------------------------------

TINY_LLAMA = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
TINY_DSV3 = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
             "num_hidden_layers": 3, "num_attention_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
             "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4,
             "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1}
TINY_DRAFT = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "intermediate_size": 96, "block_size": 8}


@pytest.fixture(scope="module")
def tiny_models(gsc, tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return gsc.build_models(root, ("llama", "dsv3"), seed=0, llama=gsc.LlamaSpec(**TINY_LLAMA),
                            dsv3=gsc.DeepseekV3Spec(**TINY_DSV3), draft=gsc.DraftSpec(**TINY_DRAFT))


def _llama_expected(c):
    h, i, v, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    exp = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        exp.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)})
    return exp


def _dsv3_expected(c):
    h, v, nh = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    nope, rope, vd = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    qr, kvr, mi, e = c["q_lora_rank"], c["kv_lora_rank"], c["moe_intermediate_size"], c["n_routed_experts"]
    exp = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        exp.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_a_proj.weight": (qr, h), p + "self_attn.q_a_layernorm.weight": (qr,),
                    p + "self_attn.q_b_proj.weight": (nh * (nope + rope), qr),
                    p + "self_attn.kv_a_proj_with_mqa.weight": (kvr + rope, h),
                    p + "self_attn.kv_a_layernorm.weight": (kvr,),
                    p + "self_attn.kv_b_proj.weight": (nh * (nope + vd), kvr),
                    p + "self_attn.o_proj.weight": (h, nh * vd)})
        if n < c["first_k_dense_replace"]:
            i = c["intermediate_size"]
            exp.update({p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                        p + "mlp.down_proj.weight": (h, i)})
            continue
        exp.update({p + "mlp.gate.weight": (e, h), p + "mlp.gate.e_score_correction_bias": (e,),
                    p + "mlp.shared_experts.gate_proj.weight": (mi, h),
                    p + "mlp.shared_experts.up_proj.weight": (mi, h),
                    p + "mlp.shared_experts.down_proj.weight": (h, mi)})
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            exp.update({q + "gate_proj.weight": (mi, h), q + "up_proj.weight": (mi, h),
                        q + "down_proj.weight": (h, mi)})
    return exp


def _draft_expected(c, hidden, k_ctx):
    hd, i = c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    exp = {"norm.weight": (hidden,), "hidden_norm.weight": (hidden,), "fc.weight": (hidden, k_ctx * hidden)}
    for n in range(c["num_hidden_layers"]):
        p = f"layers.{n}."
        exp.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                    p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                    p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (i, hidden), p + "mlp.up_proj.weight": (i, hidden),
                    p + "mlp.down_proj.weight": (hidden, i)})
    return exp


def test_model_files_and_shapes(gsc, tiny_models):
    for name, expected_fn in (("llama", _llama_expected), ("dsv3", _dsv3_expected)):
        m = tiny_models[name]
        cfg = json.loads((m.target / "config.json").read_text())
        assert cfg == m.target_config
        assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "dsv3": "DeepseekV3ForCausalLM"}[name]]
        assert m.attention_backend == "triton"
        r = gsc.check_model_files(m.target, expected_fn(cfg))
        assert r == {"missing": [], "unexpected": [], "wrong_shape": {}}, (name, r)
        d = json.loads((m.draft / "config.json").read_text())
        dc = d["dflash_config"]
        assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
        assert d["hidden_size"] == cfg["hidden_size"] and d["vocab_size"] == cfg["vocab_size"]
        assert dc["block_size"] == d["block_size"] == TINY_DRAFT["block_size"]
        assert dc["num_target_layers"] == cfg["num_hidden_layers"]
        assert dc["mask_token_id"] == cfg["vocab_size"] - 1
        ids = dc["target_layer_ids"]
        assert ids and all(0 <= i < cfg["num_hidden_layers"] - 1 for i in ids)
        r = gsc.check_model_files(m.draft, _draft_expected(TINY_DRAFT, cfg["hidden_size"], len(ids)))
        assert r == {"missing": [], "unexpected": [], "wrong_shape": {}}, (name, r)
    dsv3 = tiny_models["dsv3"].target_config
    for k in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
              "n_routed_experts", "topk_method", "scoring_func"):
        assert dsv3[k] is not None


def test_embedding_design_gives_peaked_context_dependent_logits(gsc):
    w = gsc.llama_weights(gsc.llama_config(gsc.LlamaSpec(**TINY_LLAMA)), seed=0)
    emb, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    x = emb / emb.pow(2).mean(dim=-1, keepdim=True).sqrt()  # RMSNorm of the embeddings
    logits = x @ head.T
    assert 2.0 < float(logits.std(dim=-1).mean()) < 6.0
    assert torch.unique(logits.argmax(dim=-1)).numel() > 5  # depends on the token
    assert float(torch.softmax(logits, -1).max(dim=-1).values.mean()) > 0.1  # peaked


def test_transformers_instantiates_the_models(gsc, tiny_models):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    for name in ("llama", "dsv3"):
        r = gsc.transformers_check(tiny_models[name].target)
        assert r["status"] == "ok", r
        assert r["missing_keys"] == [] and r["unexpected_keys"] == []
        d = gsc.transformers_check(tiny_models[name].draft)
        assert d["status"] == "ok" and d["config_class"] == "Qwen3Config"


def test_draft_config_rejects_bad_layer_ids(gsc):
    cfg = gsc.llama_config(gsc.LlamaSpec(**TINY_LLAMA))
    with pytest.raises(ValueError):
        gsc.dflash_draft_config(cfg, gsc.DraftSpec(), target_layer_ids=[cfg["num_hidden_layers"] - 1])
    assert gsc.default_target_layer_ids(4) == [1, 2]
    assert gsc.default_target_layer_ids(2) == [0]


# ---------------------------------------------------------------------------
# gpu_server_check.py: command lines
# ---------------------------------------------------------------------------


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_command_lines(gsc, tiny_models):
    m = tiny_models["dsv3"]
    opts = gsc.ServerOptions(python="/venv/bin/python", budget=48, topk_cap=6, block_size=16,
                             extra_args=("--log-level", "warning"))
    cmds = {mode: gsc.server_command(mode, m, 31234, opts) for mode in gsc.MODES}
    for cmd in cmds.values():
        assert cmd[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
        assert _flag(cmd, "--model-path") == str(m.target)
        assert _flag(cmd, "--host") == "127.0.0.1" and _flag(cmd, "--port") == "31234"
        assert "--skip-tokenizer-init" in cmd
        assert _flag(cmd, "--attention-backend") == "triton"
        assert _flag(cmd, "--page-size") == "1"
        assert "--disable-cuda-graph" not in cmd and "--disable-decode-cuda-graph" not in cmd
        assert _flag(cmd, "--cuda-graph-max-bs-decode") == "8"  # CT200's graphs; batches up to 48
        assert _flag(cmd, "--max-running-requests") == "48"
        assert "--tp-size" not in cmd
        assert cmd[-2:] == ["--log-level", "warning"]
    assert not any(a.startswith("--speculative") for a in cmds["nospec"])
    d = cmds["dflash"]
    assert _flag(d, "--speculative-algorithm") == "DFLASH"
    assert _flag(d, "--speculative-draft-model-path") == str(m.draft)
    assert _flag(d, "--speculative-num-draft-tokens") == "16"
    assert not any("ddtree" in a for a in d)
    t = cmds["ddtree"]
    assert _flag(t, "--speculative-algorithm") == "DDTREE"
    assert _flag(t, "--speculative-ddtree-budget") == "48"
    assert _flag(t, "--speculative-ddtree-topk-cap") == "6"
    assert _flag(t, "--speculative-draft-model-path") == str(m.draft)
    tp2 = gsc.server_command("ddtree", m, 1, gsc.ServerOptions(tp=2))
    assert _flag(tp2, "--tp-size") == "2"
    assert _flag(tp2, "--speculative-ddtree-budget") == "16" and _flag(tp2, "--speculative-ddtree-topk-cap") == "4"
    extra = gsc.server_command("ddtree", m, 1, gsc.ServerOptions(ddtree_extra_args=("--x-flag",)))
    assert "--x-flag" in extra and "--x-flag" not in gsc.server_command(
        "dflash", m, 1, gsc.ServerOptions(ddtree_extra_args=("--x-flag",)))
    with pytest.raises(ValueError):
        gsc.server_command("eagle", m, 1, opts)


# ---------------------------------------------------------------------------
# gpu_server_check.py: statistics
# ---------------------------------------------------------------------------


def test_chi2_sf_matches_scipy(gsc):
    stats = pytest.importorskip("scipy.stats")
    for dof in (1, 2, 3, 7, 30, 200):
        for x in (0.01, 0.5, 1.0, dof * 0.5, float(dof), dof + 3.0, 2.0 * dof + 10, 5.0 * dof + 40):
            assert math.isclose(gsc.chi2_sf(x, dof), stats.chi2.sf(x, dof), rel_tol=1e-7, abs_tol=1e-14)


def _draw(rng, probs, n):
    cats = list(probs)
    return rng.choices(cats, weights=[probs[c] for c in cats], k=n)


def test_chi_square_accepts_right_and_rejects_wrong(gsc):
    target = {3: 0.4, 7: 0.25, 11: 0.2, 12: 0.1, 40: 0.03, 41: 0.015, 42: 0.005}
    # a duplicate-sibling style bias: token 3 drawn too often
    wrong = dict(target)
    wrong[3], wrong[7] = 0.5, 0.15
    for seed in (0, 1, 2):
        rng = random.Random(seed)
        a, b, c = _draw(rng, target, 3000), _draw(rng, target, 3000), _draw(rng, wrong, 3000)
        assert gsc.chi_square_two_sample(a, b)["p_value"] > 1e-3
        assert gsc.chi_square_two_sample(a, c)["p_value"] < 1e-8
        assert gsc.chi_square_goodness(b, target)["p_value"] > 1e-3
        assert gsc.chi_square_goodness(c, target)["p_value"] < 1e-8
    assert gsc.chi_square_goodness([3, 3, 99], target)["p_value"] == 0.0  # impossible token


def test_chi_square_pools_rare_cells_and_handles_degenerate(gsc):
    rng = random.Random(5)
    a = _draw(rng, {1: 0.9, 2: 0.1}, 500) + list(range(100, 110))  # 10 singletons
    b = _draw(rng, {1: 0.9, 2: 0.1}, 500) + list(range(200, 210))
    r = gsc.chi_square_two_sample(a, b)
    assert r["cells"] == 3 and r["dof"] == 2 and r["p_value"] > 1e-3
    d = gsc.chi_square_two_sample([5] * 50, [5] * 70)
    assert d["degenerate"] and d["p_value"] == 1.0
    counts = gsc.chi_square_two_sample({1: 300, 2: 200}, {1: 290, 2: 210})
    assert counts["n_a"] == 500 and counts["n_b"] == 500


def test_compare_token_lists(gsc):
    ref = [[5, 6, 7], [1, 2, 3], [9, 9, 9], [4, 4]]
    got = [[5, 6, 7], [1, 2, 8], [9, 8, 9], [4, 4]]
    gaps = [[1.0] * 3, [1.0, 1.0, 0.01], [1.0, 2.0, 1.0], None]
    r = gsc.compare_token_lists(ref, got, gaps, tie_tol=0.05)
    assert r["equal"] == 2 and not r["ok"]
    assert [x["request"] for x in r["near_ties"]] == [1]
    assert [(x["request"], x["first_divergence"]) for x in r["mismatches"]] == [(2, 1)]
    assert gsc.compare_token_lists(ref, got)["mismatches"][0]["ref_top2_gap"] is None
    assert gsc.compare_token_lists(ref[:1], got[:1])["ok"]
    ns = {"greedy_top2_gaps": [[0.5, 0.5, 0.01]], "greedy_sequential": [[1, 2, 3]]}
    assert gsc.prefix_gaps(ns, [[1, 9, 3]]) == [[0.5, 0.5]]  # valid up to the divergence


def test_sampled_tests_on_synthetic_outputs(gsc):
    rng = random.Random(11)
    p = {3: 0.5, 4: 0.3, 5: 0.2}
    q = {3: 0.7, 4: 0.2, 5: 0.1}

    def outs(n, later=p, deep=None, positions=8):
        """Position 0 from p, then ``later``; from position 5 on ``deep`` (when given)."""
        rows = []
        for _ in range(n):
            o = [rng.choices(list(p), weights=list(p.values()))[0]]
            for j in range(1, positions):
                d = deep if deep is not None and j >= 5 else later
                o.append(rng.choices(list(d), weights=list(d.values()))[0])
            rows.append(o)
        return rows

    ref = {"sampled": [{"outputs": outs(1500)}, {"outputs": outs(1500)}]}
    same = {"sampled": [{"outputs": outs(1500)}, {"outputs": outs(1500)}]}
    biased = {"sampled": [{"outputs": outs(1500, later=q)}, {"outputs": outs(1500)}]}
    ok = gsc.sampled_tests(ref, same, 1e-3)
    assert ok["ok"] and len(ok["tests"]) == 2 * (8 + 1)  # positions 0-7 and the pair, per prompt
    bad = gsc.sampled_tests(ref, biased, 1e-3)
    assert not bad["ok"] and bad["min_p"] < 1e-10
    flagged = {(t["prompt"], t["statistic"]) for t in bad["tests"] if t["p_value"] < bad["bonferroni_threshold"]}
    assert (0, "pos1") in flagged and (0, "pos0") not in flagged
    # a bias only deep in the tree (positions 5 on) is caught too, where positions 1-2 saw none
    deep = gsc.sampled_tests(ref, {"sampled": [{"outputs": outs(1500, deep=q)}, {"outputs": outs(1500)}]}, 1e-3)
    flagged = {t["statistic"] for t in deep["tests"] if t["p_value"] < deep["bonferroni_threshold"]}
    assert not deep["ok"] and "pos6" in flagged and not {"pos1", "pos2"} & flagged, flagged


# ---------------------------------------------------------------------------
# gpu_server_check.py: the orchestration against a stand-in server
# ---------------------------------------------------------------------------

FAKE_SERVER = r'''
"""Stand-in for `python -m sglang.launch_server` (tests only): loopback HTTP,
deterministic greedy outputs, sampled outputs from a fixed distribution drawn
by request counter (so the multiset of samples does not depend on timing)."""
import argparse, json, os, random, signal, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--model-path"); ap.add_argument("--host"); ap.add_argument("--port", type=int)
ap.add_argument("--speculative-algorithm", default=None)
ap.add_argument("--speculative-ddtree-budget", type=int, default=None)
args, _ = ap.parse_known_args()
vocab = json.load(open(os.path.join(args.model_path, "config.json")))["vocab_size"]
algo = args.speculative_algorithm
bug = os.environ.get("FAKE_SGLANG_BUG", "")
ready_at = time.time() + 0.5
lock = threading.Lock()
counter = [0]
SUPPORT = [5, 6, 7, 8, 9]

def weights(prev, pos):
    w = [1.0, 2.0, 3.0, 4.0, 5.0]
    r = prev % 5
    w = w[r:] + w[:r]
    if bug == "sampling" and algo == "DDTREE" and pos >= 1:
        w[0] *= 4.0
    return w

def one(ids, sp, want_lp):
    n = int(sp["max_new_tokens"])
    greedy = float(sp.get("temperature", 1.0)) == 0.0
    if not greedy:
        with lock:
            c = counter[0]; counter[0] += 1
        rng = random.Random(f"{algo}-{c}")
    out, prev = [], ids[-1]
    for i in range(n):
        if greedy:
            t = (prev * 31 + 7) % (vocab - 4) + 3
            if bug == "greedy" and algo == "DDTREE" and i == 3:
                t = t % (vocab - 4) + 4
        else:
            t = rng.choices(SUPPORT, weights=weights(prev, i))[0]
        out.append(t); prev = t
    meta = {"completion_tokens": n}
    if want_lp:
        meta["output_top_logprobs"] = [[[-0.1, t, None], [-3.0, 3, None]] for t in out]
    if algo:
        meta["spec_accept_length"] = 2.5
    return {"output_ids": out, "meta_info": meta}

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, code, obj=None):
        body = b"" if obj is None else json.dumps(obj).encode()
        self.send_response(code); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        if self.path == "/ready":
            return self._send(200 if time.time() > ready_at else 503)
        if self.path == "/server_info":
            return self._send(200, {"internal_states": [{"avg_spec_accept_length": 2.5 if algo else None}],
                                    "speculative_algorithm": "DFLASH" if algo else None,
                                    "speculative_ddtree_budget": args.speculative_ddtree_budget,
                                    "attention_backend": "triton"})
        self._send(404)
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids, sp = req["input_ids"], req["sampling_params"]
        lp = bool(req.get("return_logprob"))
        if ids and isinstance(ids[0], list):
            return self._send(200, [one(x, sp, lp) for x in ids])
        self._send(200, one(ids, sp, lp))

if bug == "crash" and algo == "DDTREE":
    print("stand-in: refusing to start", flush=True)
    sys.exit(5)
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
ThreadingHTTPServer((args.host, args.port), H).serve_forever()
'''


@pytest.fixture(scope="module")
def fake_sglang(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_sglang")
    pkg = root / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('__version__ = "0.0.0-standin"\n')
    (pkg / "launch_server.py").write_text(textwrap.dedent(FAKE_SERVER))
    return root


def _run_main(gsc, tmp_path, fake_root, monkeypatch, bug="", extra=()):
    monkeypatch.setenv("PYTHONPATH", str(fake_root))
    monkeypatch.setenv("FAKE_SGLANG_BUG", bug)
    rc = gsc.main(["--out", str(tmp_path), "--work-dir", str(tmp_path / "work"), "--targets", "llama",
                   "--python", sys.executable, "--skip-gpu-check", "--num-greedy", "8", "--num-samples", "400",
                   "--perf-requests", "2", "--perf-tokens", "16", "--startup-timeout", "60",
                   "--request-timeout", "60", *extra])
    doc = json.loads((tmp_path / "gpu_server_check.json").read_text())
    return rc, doc, {(r["mode"], r["check"]): r for r in doc["checks"]}


def test_orchestration_against_standin_server(gsc, tmp_path, fake_sglang, monkeypatch, capsys):
    rc, doc, checks = _run_main(gsc, tmp_path, fake_sglang, monkeypatch)
    assert doc["meta"]["sglang"] == "0.0.0-standin"
    for mode in gsc.MODES:
        assert checks[(mode, "server")]["status"] == "ok"
        assert checks[(mode, "concurrent_vs_sequential")]["status"] == "ok"
        assert "SIGTERM" in doc["raw"][f"llama/{mode}"]["stopped"]
    for mode in ("dflash", "ddtree"):
        assert checks[(mode, "greedy_vs_nospec")]["status"] == "ok"
        assert checks[(mode, "sampled_distribution")]["status"] == "ok"
    assert checks[("ddtree", "greedy_vs_dflash")]["status"] == "ok"
    assert checks[("ddtree", "ddtree_active")]["status"] == "ok"
    assert checks[("all", "throughput")]["status"] == "measured"
    assert rc == 0, [r for r in doc["checks"] if r["status"] == "failed"]
    out = capsys.readouterr().out
    assert "checks that RAN" in out and "did NOT run" in out
    md = (tmp_path / "gpu_server_check.md").read_text()
    assert "sampled_distribution" in md and "--speculative-ddtree-budget" in md


def test_orchestration_catches_a_biased_sampler(gsc, tmp_path, fake_sglang, monkeypatch):
    rc, _, checks = _run_main(gsc, tmp_path, fake_sglang, monkeypatch, bug="sampling")
    assert rc == 1
    assert checks[("ddtree", "sampled_distribution")]["status"] == "failed"
    assert checks[("dflash", "sampled_distribution")]["status"] == "ok"
    assert checks[("ddtree", "greedy_vs_nospec")]["status"] == "ok"


def test_orchestration_records_a_server_that_dies(gsc, tmp_path, fake_sglang, monkeypatch):
    rc, doc, checks = _run_main(gsc, tmp_path, fake_sglang, monkeypatch, bug="crash",
                                extra=("--modes", "nospec,ddtree"))
    assert rc == 1
    dead = checks[("ddtree", "server")]
    assert dead["status"] == "failed" and "phase startup" in dead["detail"] and "ServerDied" in dead["detail"]
    assert "refusing to start" in doc["raw"]["llama/ddtree"]["error"]  # the log tail comes along
    assert checks[("nospec", "server")]["status"] == "ok"
    assert ("ddtree", "sampled_distribution") not in checks


def test_no_gpu_means_not_run(gsc, tmp_path, monkeypatch):
    monkeypatch.setattr(gsc, "gpu_available", lambda tp=1: (False, "none here"))
    rc = gsc.main(["--out", str(tmp_path), "--work-dir", str(tmp_path / "work"), "--targets", "llama",
                   "--python", sys.executable])
    doc = json.loads((tmp_path / "gpu_server_check.json").read_text())
    assert rc == 2
    not_run = [r for r in doc["checks"] if r["status"] == "not run" and "no GPU" in r["detail"]]
    assert len(not_run) == len(gsc.MODES)
    assert set(doc["meta"]["commands"]) == {f"llama/{m}" for m in gsc.MODES}


def test_tp_needs_as_many_visible_gpus(gsc, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Some GPU")
    assert gsc.gpu_available(1) == (True, "Some GPU")
    assert gsc.gpu_available(2) == (False, "1 GPU(s) visible, --tp 2 needs 2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert gsc.gpu_available(2) == (True, "2 x Some GPU")


@pytest.mark.sandbox  # starts and stops a server process group
def test_server_stop_is_bounded_and_by_group(gsc, tmp_path):
    port = gsc.free_port()
    script = tmp_path / "sleepy.py"
    script.write_text("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n")
    srv = gsc.Server([sys.executable, str(script)], tmp_path / "s.log", "127.0.0.1", port)
    srv.start()
    with pytest.raises(TimeoutError):
        srv.wait_ready(1.0)
    how = srv.stop(grace_s=1.0)
    assert "SIGKILL" in how and srv.proc.poll() is not None
    dead = gsc.Server([sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path / "d.log", "127.0.0.1", port)
    dead.start()
    with pytest.raises(gsc.ServerDied):
        dead.wait_ready(20.0)
    assert "rc=3" in dead.stop()
    assert os.path.exists(tmp_path / "d.log")
