"""Every SGLang 0.5.23 server option and request parameter under DDTREE, against the real source.

One `.venv-sglang` subprocess with the patch set laid over the pristine wheel (each import of
sglang costs seconds) collects the evidence; the tests below judge it:

- the real parser (`prepare_server_args`) refuses every option `ddtree_args` refuses, with a
  message that names it and says what to do, while the same arguments without it parse, and
  with DFLASH the same options still parse (the refusals are DDTREE's only);
- the real `validate_dflash_request` on real `Req` objects refuses the request parameters the
  tree step does not apply, leaves every other request alone, and answers exactly as the
  pristine function under DFLASH; the message becomes the client's 400 abort;
- the evidence behind the penalty refusals: the penalizers see no committed token in
  DFlash-family decode (call sites in the source, and the real penalizer's arithmetic);
- the classification in `ddtree_option_table` covers every option of the real parser and every
  field of the real request structs, once, and the README section names every entry.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re

import ddtree_option_table as table
import pytest

from sglang_env import PATCH_DIR, VENV, run_sglang

pytestmark = pytest.mark.sglang

README = PATCH_DIR / "README.md"
SECTION = "## Every option and request parameter"
NEXT_SECTION = "## Attention backends: which, and how checked"
REFUSED_HEADING = "### Refused when the arguments are parsed"

# dest -> (the offending arguments, arguments the case needs beside them, what the message names).
PARSE_CASES = {
    "attention_backend": (["--attention-backend", "fa3"], [], "attention backend 'fa3'"),
    "prefill_attention_backend": (["--prefill-attention-backend", "fa3"], ["--attention-backend", "triton"],
                                  "attention backend 'fa3'"),
    "decode_attention_backend": (["--decode-attention-backend", "flashinfer"],
                                 ["--attention-backend", "triton", "--speculative-attention-mode", "decode"],
                                 "attention backend 'flashinfer'"),
    "page_size": (["--page-size", "16"], [], "--page-size 16"),
    "speculative_accept_threshold_single": (["--speculative-accept-threshold-single", "0.5"], [],
                                            "--speculative-accept-threshold-single"),
    "speculative_accept_threshold_acc": (["--speculative-accept-threshold-acc", "0.5"], [],
                                         "--speculative-accept-threshold-acc"),
    "speculative_use_rejection_sampling": (["--speculative-use-rejection-sampling"], [],
                                           "--speculative-use-rejection-sampling"),
    "speculative_use_block_verification": (["--speculative-use-block-verification"], [],
                                           "--speculative-use-block-verification"),
    "speculative_adaptive": (["--speculative-adaptive"], [], "--speculative-adaptive"),
    "speculative_draft_window_size": (["--speculative-draft-window-size", "512"], [],
                                      "--speculative-draft-window-size"),
    "enable_nvidia_megakernel": (["--enable-nvidia-megakernel"], [], "--enable-nvidia-megakernel"),
    # the deprecated spelling reaches the same dest
    "enable_amd_monokernel": (["--monokernel-backend", "amd"], [], "--enable-amd-monokernel"),
    "enable_mis": (["--enable-mis"], [], "--enable-mis"),
    "enable_return_routed_experts": (["--enable-return-routed-experts"], [], "--enable-return-routed-experts"),
    "enable_return_indexer_topk": (["--enable-return-indexer-topk"], [], "--enable-return-indexer-topk"),
    "enable_return_aux_hidden_states": (["--enable-return-aux-hidden-states"], [],
                                        "--enable-return-aux-hidden-states"),
    "enable_watermark": (["--enable-watermark"], [], "--enable-watermark"),
    "enable_two_batch_overlap": (["--enable-two-batch-overlap"], [], "--enable-two-batch-overlap"),
    "dllm_algorithm": (["--dllm-algorithm", "LowConfidence"], [], "--dllm-algorithm"),
    "ep_join_mode": (["--elastic-ep-join-mode", "scale"], ["--elastic-ep-backend", "mooncake"],
                     "--elastic-ep-join-mode scale"),
    "max_ep_size": (["--max-ep-size", "16"], ["--elastic-ep-backend", "mooncake", "--tp-size", "8"],
                    "--max-ep-size"),
    "dcp_size": (["--dcp-size", "2"], ["--tp-size", "2"], "--dcp-size 2"),
    "attn_cp_size": (["--attn-cp-size", "2"], ["--tp-size", "2"], "--attn-cp-size 2"),
    "enable_prefill_cp": (["--enable-prefill-cp"], [], "--enable-prefill-cp"),
    "cp_strategy": (["--cp-strategy", "zigzag"], [], "--cp-strategy"),
    "enable_cp_decode_attn_tp": (["--enable-cp-decode-attn-tp"], [], "--enable-cp-decode-attn-tp"),
    "enable_dsa_cache_layer_split": (["--enable-dsa-cache-layer-split"], [], "--enable-dsa-cache-layer-split"),
    "enable_kv_cache_sharding": (["--enable-kv-cache-sharding"], [], "--enable-kv-cache-sharding"),
    "attn_dp_size": (["--attn-dp-size", "2"], ["--tp-size", "2"], "--attn-dp-size"),
    "enable_dp_attention": (["--enable-dp-attention"], ["--dp-size", "2", "--tp-size", "2"],
                            "--enable-dp-attention"),
    "dwdp_size": (["--dwdp-size", "2"], ["--tp-size", "2"], "--dwdp-size 2"),
    "pp_size": (["--pp-size", "2"], [], "--pp-size 2"),
    # the base line says --device cuda; the later flag wins
    "device": (["--device", "cpu"], [], "--device cpu"),
    "disaggregation_mode": (["--disaggregation-mode", "decode"], [], "--disaggregation-mode decode"),
    "decoupled_spec_role": (["--decoupled-spec-role", "verifier"], [], "--decoupled-spec-role"),
    "enable_pdmux": (["--enable-pdmux"], [], "--enable-pdmux"),
    "enable_lora": (["--enable-lora"], [], "--enable-lora"),
    "lora_paths": (["--lora-paths", "a=/nonexistent"], [], "--lora-paths"),
}
SAYS_WHAT_TO_DO = ("use ", "drop", "serve", "leave")

# name -> (SamplingParams kwargs, Req kwargs, what the DDTREE message must name; () : admitted)
REQUEST_CASES = {
    "plain": ({}, {}, ()),
    "sampled": ({"temperature": 0.7, "top_p": 0.9, "top_k": 20, "logit_bias": {"3": 1.0}, "sampling_seed": 7},
                {}, ()),
    "grammar": ({"json_schema": '{"type": "object"}'}, {}, ()),
    "logprobs": ({}, {"return_logprob": True, "top_logprobs_num": 3, "token_ids_logprob": [4]}, ()),
    # "@Name": SGLang's own processor class of that name, serialized as a client sends it (make_req)
    "custom_logit_processor": ({}, {"custom_logit_processor": "@DisallowedTokensLogitsProcessor"}, ()),
    "history_logit_processor": ({}, {"custom_logit_processor": "@Qwen3ThinkingBudgetLogitProcessor"},
                                ("custom_logit_processor Qwen3ThinkingBudgetLogitProcessor", "'__req__'",
                                 "its own path")),
    "unloadable_logit_processor": ({}, {"custom_logit_processor": "{}"},
                                   ("custom_logit_processor: it could not be loaded",)),
    "sampling_mask": ({"top_k": 4}, {"return_sampling_mask": True}, ()),
    "neutral_penalties": ({"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                           "repetition_penalty": 1.0, "min_new_tokens": 0}, {}, ()),
    "min_p": ({"min_p": 0.05}, {}, ("min_p=0.05",)),
    "frequency_penalty": ({"frequency_penalty": 0.5}, {}, ("frequency_penalty=0.5",)),
    "presence_penalty": ({"presence_penalty": -0.5}, {}, ("presence_penalty=-0.5",)),
    "repetition_penalty": ({"repetition_penalty": 1.2}, {}, ("repetition_penalty=1.2",)),
    "min_new_tokens": ({"min_new_tokens": 4}, {}, ("min_new_tokens=4",)),
    "hidden_states": ({}, {"return_hidden_states": True}, ("return_hidden_states",)),
    "two_at_once": ({"min_p": 0.1, "repetition_penalty": 1.1}, {}, ("min_p=0.1", "repetition_penalty=1.1")),
}

EVIDENCE = r'''
import dataclasses, importlib.util, sys, sysconfig, types
from array import array
import msgspec
import torch
from sglang.srt import runtime_context as rc
from sglang.srt.arg_groups.overrides import resolved_view
from sglang.srt.managers import io_struct
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling import penaltylib
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, prepare_server_args
from sglang.srt.speculative.ddtree_args import tree_verify_refusals
from sglang.srt.speculative.dflash_utils import validate_dflash_request

base = ["--model-path", MODEL, "--device", "cuda", "--speculative-draft-model-path", MODEL]
D = ["--speculative-algorithm", "DDTREE"]

def parse(args):
    try:
        prepare_server_args(base + args)
    except ValueError as e:
        return str(e)
    except SystemExit as e:
        return "argparse exit %s" % e.code
    return "ok"

import argparse
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
flags = {}
for action in parser._actions:
    flags.setdefault(action.dest, []).extend(action.option_strings)
OUT["flags"] = flags
OUT["fields"] = {
    "sampling_params": [f.name for f in msgspec.structs.fields(SamplingParams)],
    "scheduler_request": [f.name for f in msgspec.structs.fields(io_struct.TokenizedGenerateReqInput)],
    "generate": [f.name for f in dataclasses.fields(io_struct.GenerateReqInput)],
}

controls = {}  # many cases share a control line; each parse costs tens of ms
OUT["cases"] = {}
for dest, (bad, support, _) in PARSE_CASES.items():
    if tuple(support) not in controls:
        controls[tuple(support)] = parse(D + support)
    OUT["cases"][dest] = {"ddtree": parse(D + support + bad), "control": controls[tuple(support)]}
OUT["dflash_with_all"] = parse(["--speculative-algorithm", "DFLASH"]
                               + [a for bad, support, _ in PARSE_CASES.values() for a in support + bad])
open("cp.yaml", "w").write("attn-cp-size: 2\ntp-size: 2\n")
OUT["config_file"] = parse(D + ["--config", "cp.yaml"])

OUT["resolved"] = {}
for name, extra in {"default": [], "deterministic": ["--enable-deterministic-inference"]}.items():
    a = prepare_server_args(base + D + extra)
    a.resolve_once()
    v = resolved_view(a)
    OUT["resolved"][name] = [v.speculative_algorithm, v.speculative_ddtree_budget, v.attention_backend,
                             v.page_size, bool(v.enable_deterministic_inference), tree_verify_refusals(v)]

tokenizer = types.SimpleNamespace(encode=lambda s, add_special_tokens=False: [1])

from sglang.srt.sampling import custom_logit_processor as clp

def make_req(sp_kwargs, req_kwargs):
    processor = req_kwargs.get("custom_logit_processor") or ""
    if processor.startswith("@"):
        req_kwargs = {**req_kwargs, "custom_logit_processor": getattr(clp, processor[1:]).to_str()}
    sp = SamplingParams(**sp_kwargs)
    sp.normalize(tokenizer)
    return Req("r", "", array("q", [5, 6, 7]), sp, eos_token_ids={2}, vocab_size=1000, **req_kwargs)

path = sysconfig.get_paths()["purelib"] + "/sglang/srt/speculative/dflash_utils.py"
spec = importlib.util.spec_from_file_location("pristine_dflash_utils", path)
pristine = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = pristine  # its dataclasses look their module up
spec.loader.exec_module(pristine)

OUT["requests"] = {}
for algo in ("DDTREE", "DFLASH"):
    rc.publish(prepare_server_args(base + ["--speculative-algorithm", algo]), role="scheduler")
    for name, (sp_kwargs, req_kwargs, _) in REQUEST_CASES.items():
        for overlap in (True, False):
            key = f"{name}/{algo}/{'overlap' if overlap else 'sync'}"
            OUT["requests"][key] = [validate_dflash_request(make_req(sp_kwargs, req_kwargs), overlap),
                                    pristine.validate_dflash_request(make_req(sp_kwargs, req_kwargs), overlap)]
    if algo == "DDTREE":
        req = make_req({"min_p": 0.2}, {})
        with rc.get_parallel().override(tp_rank=0):  # the scheduler of TP rank 0 logs it
            req.set_finish_with_abort(validate_dflash_request(req, True))
        OUT["abort"] = req.to_finish.to_json()

class Batch:  # what the orchestrator reads of a ScheduleBatch (it keeps a weakref)
    device = "cpu"

def penalty_req(**kw):
    return types.SimpleNamespace(sampling_params=SamplingParams(**kw), eos_token_ids={2},
                                 tokenizer=types.SimpleNamespace(additional_stop_token_ids=None, eos_token_id=2))

batch = Batch()
batch.reqs = [penalty_req(min_new_tokens=2), penalty_req(frequency_penalty=0.5), penalty_req(repetition_penalty=1.5)]
orch = penaltylib.BatchedPenalizerOrchestrator(
    vocab_size=8, batch=batch,
    penalizers={penaltylib.BatchedFrequencyPenalizer, penaltylib.BatchedMinNewTokensPenalizer,
                penaltylib.BatchedPresencePenalizer, penaltylib.BatchedRepetitionPenalizer})
info = types.SimpleNamespace(penalizer_orchestrator=orch, temperatures=torch.ones(3, 1), vocab_size=8)

def accumulated():
    SamplingBatchInfo.update_penalties(info)  # what copy_for_forward hands eagle_sample
    return [info.acc_additive_penalties.tolist(), info.acc_scaling_penalties.tolist()]

OUT["penalties"] = {"never_fed": [accumulated(), accumulated()]}
for _ in range(2):  # the non-speculative decode path: one committed token 5 per step
    orch.cumulate_output_tokens(torch.tensor([5, 5, 5]))
OUT["penalties"]["fed_twice"] = accumulated()
'''


@pytest.fixture(scope="module")
def evidence(tmp_path_factory, sglang_overlay):  # noqa: F811
    code = (f"PARSE_CASES = {PARSE_CASES!r}\nREQUEST_CASES = {REQUEST_CASES!r}\n" + EVIDENCE)
    return run_sglang(code, tmp_path_factory.mktemp("options"), sglang_overlay)


# -- parse-time refusals ---------------------------------------------------------------------------

def test_each_refusal_names_its_option_and_the_rest_parses(evidence):
    for dest, (_, _, needle) in PARSE_CASES.items():
        got = evidence["cases"][dest]
        assert got["control"] == "ok", (dest, got["control"])
        assert "--speculative-algorithm DDTREE" in got["ddtree"] and "cannot run with" in got["ddtree"], (dest, got)
        assert needle in got["ddtree"], (dest, needle, got["ddtree"])
        assert any(w in got["ddtree"] for w in SAYS_WHAT_TO_DO), (dest, got["ddtree"])


def test_every_refused_option_has_a_parse_case():
    refused = {dest for dest, (verdict, _, _) in table.OPTIONS.items() if verdict == table.REFUSED}
    assert refused <= set(PARSE_CASES), sorted(refused - set(PARSE_CASES))
    # a case whose option the table calls served would contradict it
    for dest in PARSE_CASES:
        assert table.OPTIONS[dest][0] in (table.REFUSED, table.DEFAULTED), dest


def test_the_refusals_leave_dflash_alone(evidence):
    """Every refused option together still parses with --speculative-algorithm DFLASH: the checks
    run under DDTREE only (0.5.23's own resolution decides for DFLASH, later)."""
    assert evidence["dflash_with_all"] == "ok", evidence["dflash_with_all"]


def test_options_from_a_config_file_are_refused_too(evidence):
    assert "--attn-cp-size 2" in evidence["config_file"], evidence["config_file"]


def test_resolution_keeps_the_tree_verify_defaults(evidence):
    """0.5.23's resolution pipeline (run as a launcher runs it) keeps what DDTREE picked, also
    with deterministic inference (which would pick fa3 or flashinfer if the backend were unset),
    and the resolved record passes the same checks."""
    assert evidence["resolved"]["default"] == ["DFLASH", 64, "triton", 1, False, []]
    assert evidence["resolved"]["deterministic"] == ["DFLASH", 64, "triton", 1, True, []]


# -- per-request refusals ----------------------------------------------------------------------------

def test_requests_the_tree_step_cannot_serve_are_refused_at_admission(evidence):
    for name, (_, _, needles) in REQUEST_CASES.items():
        for overlap in ("overlap", "sync"):
            got, _ = evidence["requests"][f"{name}/DDTREE/{overlap}"]
            if not needles:
                assert got is None, (name, overlap, got)
            else:
                assert got.startswith("DDTREE speculative decoding cannot serve this request: "), got
                assert all(n in got for n in needles) and "Drop these parameters" in got, (name, got)


def test_other_algorithms_answer_exactly_as_upstream(evidence):
    """Under DFLASH the patched function returns what the pristine one does, for every case
    (min_p and penalties pass, hidden states are refused only with overlap, as upstream)."""
    for name in REQUEST_CASES:
        for overlap in ("overlap", "sync"):
            patched, pristine = evidence["requests"][f"{name}/DFLASH/{overlap}"]
            assert patched == pristine, (name, overlap, patched, pristine)
    assert evidence["requests"]["min_p/DFLASH/overlap"] == [None, None]
    assert evidence["requests"]["hidden_states/DFLASH/overlap"][0] is not None
    assert evidence["requests"]["hidden_states/DFLASH/sync"][0] is None


def test_a_refusal_reaches_the_client_as_a_400(evidence):
    abort = evidence["abort"]
    assert abort["type"] == "abort" and abort["status_code"] == 400 and abort["err_type"] == "BadRequestError"
    assert "min_p=0.2" in abort["message"]


def _site_sglang() -> pathlib.Path:
    return next((VENV / "lib").glob("python3*/site-packages/sglang"))


def test_the_scheduler_turns_the_message_into_an_abort():
    """The admission call site of 0.5.23 (Scheduler._handle_generate_request): a message from
    validate_dflash_request aborts the request instead of queueing it for decode."""
    src = (_site_sglang() / "srt/managers/scheduler.py").read_text()
    pattern = (r"if self\.spec_algorithm\.is_dflash_family\(\):\s+"
               r"error_msg = validate_dflash_request\(req, self\.enable_overlap\)\s+"
               r"if error_msg is not None:\s+req\.set_finish_with_abort\(error_msg\)")
    assert re.search(pattern, src)
    assert not re.search(pattern, src.replace("set_finish_with_abort(error_msg)", "pass"))


# -- why the penalties are refused ---------------------------------------------------------------------

def _functions_calling(tree: ast.AST, names: set) -> set:
    found = set()

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
            if isinstance(child, ast.Call):
                fn = child.func
                called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
                if called in names:
                    found.add(scope)
            visit(child, inner)

    visit(tree, "")
    return found


def _callers_of_the_penalizer_feed(roots) -> set:
    feed = {"cumulate_output_tokens", "cumulate_penalty_output_tokens"}
    callers = set()
    for root, prefix in roots:
        for path in root.rglob("*.py"):
            text = path.read_text(errors="ignore")
            if "cumulate_output_tokens(" in text or "cumulate_penalty_output_tokens(" in text:
                rel = f"{prefix}{path.relative_to(root).with_suffix('')}".replace("/", ".")
                callers |= {f"{rel}:{fn}" for fn in _functions_calling(ast.parse(text), feed)}
    return {c for c in callers if ".penaltylib." not in c}


def test_dflash_family_decode_never_feeds_the_penalizers():
    """Only the non-speculative decode prep and EAGLE's feed the penalizers committed tokens, and
    the non-speculative one returns first for any speculative batch; DFLASH (and so DDTREE)
    prepares its decode in DFlashDraftInputV2.prepare_for_decode. If this changes, revisit the
    per-request refusal of penalties and min_new_tokens."""
    roots = [(_site_sglang(), "sglang/"), (PATCH_DIR / "files" / "sglang", "sglang/")]
    assert _callers_of_the_penalizer_feed(roots) == {
        "sglang.srt.managers.schedule_batch:ScheduleBatch.cumulate_penalty_output_tokens",
        "sglang.srt.managers.schedule_batch:ScheduleBatch.prepare_for_decode",
        "sglang.srt.speculative.eagle_utils:eagle_prepare_for_decode",
    }
    src = (_site_sglang() / "srt/managers/schedule_batch.py").read_text()
    body = src[src.index("    def prepare_for_decode(self):"):]
    spec_return = body.index("spec_prepare_for_decode(self)\n            return")
    assert spec_return < body.index("self.cumulate_penalty_output_tokens()")
    utils = (_site_sglang() / "srt/speculative/spec_utils.py").read_text()
    route = utils[utils.index("def spec_prepare_for_decode"):utils.index("def get_plan_stream")]
    assert route.index("is_dflash_family()") < route.index("batch.spec_info.prepare_for_decode(batch)") \
        < route.index("eagle_prepare_for_decode(batch)")


def test_the_penalty_check_sees_a_new_feed(tmp_path):
    """Control: a DFlash decode prep that fed the penalizers would be found."""
    fake = tmp_path / "srt" / "speculative"
    fake.mkdir(parents=True)
    (fake / "dflash_info_v2.py").write_text(
        "class DFlashDraftInputV2:\n    def prepare_for_decode(self, batch):\n"
        "        batch.cumulate_penalty_output_tokens()\n")
    assert _callers_of_the_penalizer_feed([(tmp_path, "sglang/")]) == {
        "sglang.srt.speculative.dflash_info_v2:DFlashDraftInputV2.prepare_for_decode"}


def test_unfed_penalizers_do_nothing_but_ban_eos_forever(evidence):
    """What eagle_sample adds to the tree rows when the penalizers never see a committed token:
    min_new_tokens=2 keeps EOS (id 2) at -inf step after step, frequency and repetition stay
    neutral; fed two tokens (the non-speculative path) the ban lifts and the penalties act."""
    inf = float("-inf")
    never = evidence["penalties"]["never_fed"]
    assert never[0] == never[1]
    additive, scaling = never[0]
    assert additive[0][2] == inf and additive[1] == [0.0] * 8 and scaling[2] == [1.0] * 8
    fed_add, fed_scale = evidence["penalties"]["fed_twice"]
    assert fed_add[0][2] == 0.0 and fed_add[1][5] == -1.0 and fed_scale[2][5] == 1.5


def test_the_tree_step_samples_without_min_p():
    """eagle_sample (the tree acceptance) applies penalties, logit_bias, temperature, top-k and
    top-p, and never reads min_p."""
    src = (_site_sglang() / "srt/speculative/eagle_utils.py").read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "eagle_sample")
    body = ast.get_source_segment(src, fn)
    for used in ("acc_additive_penalties", "acc_scaling_penalties", "logit_bias", "temperatures", "top_ks", "top_ps"):
        assert used in body, used
    assert "min_p" not in body
    worker = (PATCH_DIR / "files/sglang/srt/speculative/ddtree_worker.py").read_text()
    assert "eagle_sample(" in worker


# -- the classification is complete -------------------------------------------------------------------

def test_every_option_of_the_real_parser_is_classified_once(evidence):
    untouched = table.untouched_dests()
    twice = sorted(d for d, groups in untouched.items() if len(groups) > 1 or d in table.OPTIONS)
    assert not twice, twice
    parser = set(evidence["flags"])
    classified = set(table.OPTIONS) | set(untouched)
    assert not parser - classified, f"unclassified options: {sorted(parser - classified)}"
    assert not classified - parser, f"options 0.5.23 does not have: {sorted(classified - parser)}"
    assert len(parser) > 500


def test_every_request_field_is_classified(evidence):
    fields = evidence["fields"]
    assert set(fields["sampling_params"]) == set(table.SAMPLING_PARAMS)
    assert set(fields["scheduler_request"]) == set(table.SCHEDULER_REQUEST)
    generate = set(fields["generate"])
    assert not set(table.GENERATE_ONLY) & set(table.SCHEDULER_REQUEST)
    assert generate - set(table.SCHEDULER_REQUEST) == set(table.GENERATE_ONLY)


def test_the_completeness_check_catches_a_missing_option(evidence):
    """Control: a parser with one more option than the table is caught."""
    parser = set(evidence["flags"]) | {"an_option_added_upstream"}
    assert parser - (set(table.OPTIONS) | set(table.untouched_dests())) == {"an_option_added_upstream"}


def test_every_verdict_is_one_the_table_defines():
    option_verdicts = {table.REFUSED, table.DEFAULTED, table.SERVED, table.NO_EFFECT}
    request_verdicts = {table.SERVED, table.REFUSED_REQUEST, table.REFUSED_BY_SGLANG, table.NO_EFFECT}
    assert {v for v, _, _ in table.OPTIONS.values()} <= option_verdicts
    for part in (table.SAMPLING_PARAMS, table.SCHEDULER_REQUEST, table.GENERATE_ONLY):
        assert {v for v, _, _ in part.values()} <= request_verdicts
    refused = {n for n, (v, _, _) in table.SAMPLING_PARAMS.items() if v == table.REFUSED_REQUEST}
    assert refused == {"min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens"}


# -- the README says it -----------------------------------------------------------------------------------

def _section() -> str:
    text = README.read_text()
    start = text.index(SECTION)
    assert start < text.index(NEXT_SECTION), "the section goes just before the attention backends"
    return text[start:text.index(NEXT_SECTION)]


def _unnamed(section: str, flags: dict) -> list:
    return sorted(d for d, fs in flags.items() if not any(f"`{f}`" in section for f in fs))


def test_the_readme_names_every_option_and_request_field(evidence):
    section = _section()
    assert not _unnamed(section, evidence["flags"])
    fields = set(table.SAMPLING_PARAMS) | set(table.SCHEDULER_REQUEST) | set(table.GENERATE_ONLY)
    assert not sorted(f for f in fields if f"`{f}`" not in section)
    refused_part = section[section.index(REFUSED_HEADING):]
    refused_part = refused_part[:refused_part.index("\n### ", 1)]
    refused = {d: evidence["flags"][d] for d, (v, _, _) in table.OPTIONS.items() if v == table.REFUSED}
    assert not _unnamed(refused_part, refused)


def test_the_readme_check_catches_an_unnamed_option(evidence):
    section = _section().replace("`--dcp-size`", "--dcp-size")
    assert _unnamed(section, evidence["flags"]) == ["dcp_size"]


def test_the_table_loads_as_plain_data():
    assert json.loads(json.dumps(table.OPTIONS)) and json.loads(json.dumps(table.UNTOUCHED))
