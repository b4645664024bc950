"""The perf gate's settings (config/perfgate_settings.py, config/workload_settings.py): the
inventory's `perf_gate` section parsed into typed settings, every error naming its field, and the
prompts files it may name."""

from __future__ import annotations

import pytest

from ddtree_ops.config.perfgate_settings import PerfGateSettings, Thresholds, parse_perf_gate
from ddtree_ops.config.workload_settings import DEFAULT_PROMPTS, DEFAULT_WORKLOADS, Workload, load_prompts
from ddtree_ops.errors import InputError


def test_no_section_is_disabled_and_a_section_enables_the_gate():
    assert parse_perf_gate(None) == PerfGateSettings(enabled=False)
    on = parse_perf_gate({})
    assert on.enabled and on.compare_peers and on.workload == Workload() and on.thresholds == Thresholds()
    assert on.workloads == DEFAULT_WORKLOADS
    assert parse_perf_gate({"enabled": False}).enabled is False


def test_every_key_reaches_the_settings():
    s = parse_perf_gate({"concurrency": 2, "max_new_tokens": 32, "temperature": 0, "top_p": 1, "duration_s": 5,
                         "min_requests": 3, "request_timeout_s": 9, "compare_peers": False,
                         "thresholds": {"fail_drop": 0.2, "marginal_drop": 0.05, "ttft_p99_fail": 1.0,
                                        "error_rate_fail": 0.05, "itl_floor_s": 0.01}})
    w = s.workload
    assert (w.concurrency, w.max_new_tokens, w.temperature, w.top_p, w.duration_s, w.min_requests,
            w.request_timeout_s) == (2, 32, 0.0, 1.0, 5.0, 3, 9.0)
    assert w.prompts == DEFAULT_PROMPTS and w.prompts_file is None and s.compare_peers is False
    t = s.thresholds
    assert (t.fail_drop, t.marginal_drop, t.ttft_p99_fail, t.error_rate_fail, t.itl_floor_s) == \
        (0.2, 0.05, 1.0, 0.05, 0.01)
    assert t.ttft_p50_fail == Thresholds().ttft_p50_fail  # unnamed keys keep their defaults


@pytest.mark.parametrize("doc, message", [
    ({"thresholds": {"fail_drop": 2}}, "perf_gate.thresholds.fail_drop: must be a number 0..1, got 2"),
    ({"thresholds": {"fail_drop": "0.1"}}, "perf_gate.thresholds.fail_drop: must be a number 0..1, got '0.1'"),
    ({"thresholds": {"marginal_drop": 0.5}}, "perf_gate.thresholds.marginal_drop: must be ≤ fail_drop (0.1)"),
    ({"thresholds": {"ttft_p50_marginal": 0.3}}, "perf_gate.thresholds.ttft_p50_marginal: must be ≤ ttft_p50_fail"),
    ({"thresholds": {"error_rate_marginal": 0.5}}, "perf_gate.thresholds.error_rate_marginal: must be ≤"),
    ({"thresholds": {"fail": 0.1}}, "perf_gate.thresholds.fail: unknown key; allowed: accept_fail_drop"),
    ({"thresholds": [0.1]}, "perf_gate.thresholds: must be a mapping of"),
    ({"concurency": 4}, "perf_gate.concurency: unknown key; allowed: compare_peers, concurrency"),
    ({"concurrency": 0}, "perf_gate.concurrency: must be an integer 1..64, got 0"),
    ({"concurrency": True}, "perf_gate.concurrency: must be an integer 1..64, got True"),
    ({"concurrency": 2.5}, "perf_gate.concurrency: must be an integer"),
    ({"max_new_tokens": 0}, "perf_gate.max_new_tokens: must be an integer 1..4096"),
    ({"temperature": -1}, "perf_gate.temperature: must be a number 0..2"),
    ({"top_p": 0}, "perf_gate.top_p: must be a number > 0 and ≤ 1, got 0"),
    ({"duration_s": 0}, "perf_gate.duration_s: must be a number 1..3600"),
    ({"min_requests": 0}, "perf_gate.min_requests: must be an integer 1..100000"),
    ({"request_timeout_s": None}, "perf_gate.request_timeout_s: must be a number"),
    ({"enabled": "yes"}, "perf_gate.enabled: must be true or false, got 'yes'"),
    ({"compare_peers": 1}, "perf_gate.compare_peers: must be true or false"),
    ({"prompts_file": 5}, "perf_gate.prompts_file: must be a path to a file of prompts, got 5"),
    ([1, 2], "perf_gate: must be a mapping of compare_peers"),
])
def test_errors_name_the_field(doc, message):
    with pytest.raises(InputError) as e:
        parse_perf_gate(doc)
    assert str(e.value).startswith(message), str(e.value)


def test_without_workloads_the_gate_measures_todays_case_and_a_batch_1_greedy_case_with_the_top_level_keys():
    s = parse_perf_gate({"duration_s": 5, "max_new_tokens": 32})
    assert [w.label for w in s.workloads] == ["c4 T0.7 32 tok", "c1 T0 32 tok"]
    assert [(w.concurrency, w.temperature, w.duration_s) for w in s.workloads] == [(4, 0.7, 5.0), (1, 0.0, 5.0)]
    assert s.workload == s.workloads[0]  # the first: for callers that measure one


@pytest.mark.parametrize("doc", [{"concurrency": 2}, {"temperature": 0}, {"concurrency": 4, "temperature": 0.7}])
def test_a_top_level_concurrency_or_temperature_without_workloads_is_the_one_workload_measured(doc):
    """Such an inventory, written before `workloads`, described its one workload: it gates as before."""
    s = parse_perf_gate({"duration_s": 3, **doc})
    assert len(s.workloads) == 1
    assert s.workload == Workload(**{"duration_s": 3.0, **doc})


def test_each_workload_entry_takes_the_top_level_keys_as_its_defaults_and_may_be_named(tmp_path):
    (tmp_path / "p.txt").write_text("only prompt\n")
    s = parse_perf_gate({"concurrency": 8, "duration_s": 7, "min_requests": 2, "prompts_file": "p.txt",
                         "workloads": [{"temperature": 0}, {"name": "long answers", "concurrency": 1,
                                                            "max_new_tokens": 512, "duration_s": 30}]},
                        base_dir=str(tmp_path))
    a, b = s.workloads
    assert (a.concurrency, a.temperature, a.max_new_tokens, a.duration_s, a.min_requests) == (8, 0.0, 64, 7.0, 2)
    assert (b.concurrency, b.temperature, b.max_new_tokens, b.duration_s, b.min_requests) == (1, 0.7, 512, 30.0, 2)
    assert (a.label, b.label) == ("c8 T0", "long answers")
    assert a.prompts == b.prompts == ("only prompt",)  # the prompts file is every workload's


@pytest.mark.parametrize("workloads, message", [
    ([], "perf_gate.workloads: must be a non-empty list of workloads"),
    ({"concurrency": 1}, "perf_gate.workloads: must be a non-empty list of workloads"),
    ([{"concurrency": 1}, {"concurrency": 0}], "perf_gate.workloads[1].concurrency: must be an integer 1..64, got 0"),
    ([{"temperature": 3}], "perf_gate.workloads[0].temperature: must be a number 0..2"),
    ([{}, None], "perf_gate.workloads[1]: must be a mapping of concurrency, duration_s"),
    ([{"enabled": False}], "perf_gate.workloads[0].enabled: unknown key; allowed: concurrency"),
    ([{"name": ""}], "perf_gate.workloads[0].name: must be a short name"),
    ([{"name": 5}], "perf_gate.workloads[0].name: must be a short name"),
    ([{"concurrency": 1}, {"concurrency": 1, "duration_s": 60}],
     "perf_gate.workloads[1]: the same case as workloads[0] (c1 T0.7: concurrency, max_new_tokens, temperature and "
     "top_p alike)"),
    ([{"name": "a"}, {"name": "a", "concurrency": 1}], "perf_gate.workloads[1].name: 'a' is the name of workloads[0]"),
])
def test_a_bad_workloads_list_is_refused_naming_the_entry(workloads, message):
    with pytest.raises(InputError) as e:
        parse_perf_gate({"workloads": workloads})
    assert str(e.value).startswith(message), str(e.value)


def test_the_label_says_the_case_and_only_what_differs_from_the_defaults():
    assert Workload().label == "c4 T0.7"
    assert Workload(concurrency=1, temperature=0.0, top_p=0.5).label == "c1 T0"  # greedy ignores top_p
    assert Workload(top_p=0.95, max_new_tokens=256).label == "c4 T0.7 256 tok p0.95"
    assert Workload(name="batch-1 greedy", concurrency=1).label == "batch-1 greedy"


def test_errors_name_where_the_section_is():
    with pytest.raises(InputError, match=r"^inventory.yml: all.vars.perf_gate.thresholds.itl_p99_fail: "):
        parse_perf_gate({"thresholds": {"itl_p99_fail": -1}}, "inventory.yml: all.vars.perf_gate")


def test_prompts_files_one_per_line_or_jsonl(tmp_path):
    (tmp_path / "p.txt").write_text("first prompt\n\n  \nsecond {not json}\r\nthird\n")
    (tmp_path / "p.jsonl").write_text('{"text": "alpha", "id": 1}\n\n{"text": "beta"}\n')
    s = parse_perf_gate({"prompts_file": "p.txt"}, base_dir=str(tmp_path))  # relative: the inventory's folder
    assert s.workload.prompts == ("first prompt", "second {not json}", "third")
    assert s.workload.prompts_file == str(tmp_path / "p.txt")
    s = parse_perf_gate({"prompts_file": str(tmp_path / "p.jsonl")}, base_dir="/elsewhere")
    assert s.workload.prompts == ("alpha", "beta")
    assert s.workload.request_body(3) == {"text": "beta", "stream": True, "sampling_params": {
        "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 64}}


@pytest.mark.parametrize("name, content, message", [
    ("missing.txt", None, "missing.txt: cannot read: No such file or directory"),
    ("empty.txt", b"\n \n", "empty.txt: no prompts (one prompt per line)"),
    ("bad.jsonl", b'{"text": "a"}\n{"text": \n', "bad.jsonl line 2: not JSON"),
    ("notext.jsonl", b'{"text": "a"}\n\n{"prompt": "b"}\n', 'notext.jsonl line 3: needs a JSON object with a '
                                                             'non-empty string "text"'),
    ("latin1.txt", "café\n".encode("latin-1"), "latin1.txt: not UTF-8 (byte 3)"),
])
def test_bad_prompts_files_are_refused_naming_the_line(tmp_path, name, content, message):
    if content is not None:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(InputError) as e:
        parse_perf_gate({"prompts_file": name}, base_dir=str(tmp_path))
    assert str(e.value).startswith("perf_gate.prompts_file: " + str(tmp_path)) and message in str(e.value)


def test_too_long_a_prompt_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("ddtree_ops.config.workload_settings.PROMPT_MAX_CHARS", 10)
    (tmp_path / "p.txt").write_text("short\n" + "x" * 11 + "\n")
    with pytest.raises(InputError, match=r"p.txt line 2: prompt longer than 10 characters"):
        load_prompts(str(tmp_path / "p.txt"))
