"""Start-up phases read from SGLang's own log lines (ddtree_ops/startup.py)."""

from ddtree_ops.gates.startup import Phase, PhaseTracker, phase_of_line

LOAD = "[2026-11-30 10:00:01 TP0] Load weight begin. avail mem=94.50 GB"
# SGLang 0.5.23's own lines (model_runner_components/cuda_graph_setup.py, as the stand-in logs them)
CAPTURE = ("[2026-11-30 10:09:00 TP0] Capture target verify CUDA graph begin. backend=full, num_tokens_per_req=17, "
           "avail mem=24.50 GB")
CAPTURED = ("[2026-11-30 10:11:00 TP0] Capture target verify CUDA graph end. bs=[1, 2, 4, 8], elapsed=120.00 s, "
            "mem usage=0.85 GB, avail mem=23.65 GB.")
DRAFT_CAPTURE = "[2026-11-30 10:11:01 TP0] Capture draft decode CUDA graph begin. backend=full, avail mem=23.60 GB"
UVICORN = "INFO:     Application startup complete."


def ended(transitions):
    return [(str(t.ended), round(t.seconds, 1)) for t in transitions]


def test_each_marker_line_names_its_phase_and_other_lines_none():
    assert [phase_of_line(x) for x in (LOAD, CAPTURE, CAPTURED, DRAFT_CAPTURE, UVICORN, "Loading 45%")] == [
        Phase.WEIGHTS, Phase.CUDA_GRAPHS, None, Phase.CUDA_GRAPHS, Phase.WARMUP, None]


def test_phases_end_in_order_with_the_time_spent_in_each():
    t = PhaseTracker()
    assert ended(t.update(["server_args=..."], 1.0)) == []
    assert ended(t.update(["server_args=...", LOAD], 2.0)) == [("starting", 2.0)]
    assert ended(t.update([LOAD, "Loading safetensors 99%"], 500.0)) == []
    assert t.phase is Phase.WEIGHTS and t.in_phase(500.0) == 498.0
    assert ended(t.update([CAPTURE], 540.0)) == [("weights", 538.0)]
    assert ended(t.update([CAPTURED, DRAFT_CAPTURE], 600.0)) == []  # one capture ended, the next began
    assert ended(t.update([DRAFT_CAPTURE, UVICORN], 660.0)) == [("cuda graphs", 120.0)]
    assert ended(t.finish(700.0)) == [("warm-up", 40.0)]


def test_a_phase_whose_line_scrolled_out_of_the_tail_is_not_forgotten_nor_undone():
    t = PhaseTracker()
    t.update([CAPTURE], 10.0)
    assert ended(t.update(["Loading safetensors 10%", LOAD], 20.0)) == []  # an older line again: no step back
    assert t.phase is Phase.CUDA_GRAPHS


def test_phases_passed_between_two_polls_end_at_once():
    t = PhaseTracker()
    assert ended(t.update([LOAD, CAPTURE, CAPTURED, UVICORN], 3.0)) == [("starting", 3.0), ("weights", 0.0),
                                                                        ("cuda graphs", 0.0)]
    assert t.phase is Phase.WARMUP


def test_the_previous_servers_lines_name_no_phase_of_the_new_one():
    t = PhaseTracker(old_lines=frozenset([LOAD, CAPTURE, CAPTURED, UVICORN]))
    assert ended(t.update([LOAD, CAPTURE, CAPTURED, UVICORN, "server_args=..."], 1.0)) == []
    assert t.phase is Phase.STARTING


def test_http_answering_means_warm_up_even_without_a_line():
    t = PhaseTracker()
    t.update([LOAD], 1.0)
    assert ended(t.update([], 5.0, http_up=True)) == [("weights", 4.0), ("cuda graphs", 0.0)]
    assert t.phase is Phase.WARMUP
