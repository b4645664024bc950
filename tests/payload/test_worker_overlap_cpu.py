"""The real ``DDTreeWorkerV2`` under SGLang 0.5.23's OVERLAP scheduler, on CPU.

0.5.23 runs DFLASH (so DDTREE) with the overlap scheduler by default: no
DFLASH/DDTREE argument hook sets ``disable_overlap_schedule`` (0.5.23 sets it
for CPU/MPS devices, PP, mamba no-buffer caches, dLLM and sparse-head
embeddings only).
Its ``event_loop_overlap`` prepares and launches step N before it processes
step N-1's result: ``prepare_for_decode`` reserves from the host
``kv_committed_len`` that lags the device by one unprocessed commit, the device
lengths and the next root reach the step through the ``FutureMap``
(``on_publish`` -> ``publish`` mid-worker, ``_relay_forward_payload`` ->
``stash``; ``resolve_seq_lens_cpu`` / ``_resolve_spec_extras`` in the next
``run_batch``), and with DDTREE's triton backends the worker gets
``seq_lens_cpu=None`` and only the reservation on the host.

test_worker_chained_cpu runs the chain in the non-overlap order; here
``overlap_harness.run_overlap`` runs 0.5.23's own ``event_loop_overlap`` and the
scheduler functions it calls (see that module for exactly what is real and what
is faked) for STEPS launches over four requests of different prompt lengths,
one of which finishes while its next step is already in flight (the overlap
overshoot, then ``filter_batch``). The toy LM (imported from
test_worker_chained_cpu) reads its context from the real KV pool, so a wrong
length, root, window or KV move in one step changes every later token.

Checked against plain autoregressive greedy decoding of the toy LM: every
committed token (``output_ids`` as the real result processor built them), the KV
at every committed position (read before each result is processed), and per
launch: device lengths = the previous step's published lengths, root = the last
committed token, host lengths exact or a bound of prefix + W, every verify window
inside its request's reservation; and that results are processed one step
late, unchanged. Two main runs: the FutureMap's host mirror off (DDTREE's
triton backends) and on (a backend that needs host lengths); both with the
FutureMap's own CI checks on (shown live by a run they stop). Controls (the
FutureMap checks off, so these checks must catch them), each rejected by the
check named in REJECTED_BY: device lengths not resolved (last step's), host
lengths left at prepare_for_decode's lagged seed, the next root never stashed,
the relay resolve skipped (the carried root, unfiltered after a request left),
and DFlash's own 2 * block reservation (10 slots here: W = 9 fits when nothing
lags, the lag + W does not).
"""

from __future__ import annotations

import pathlib

import pytest
from test_worker_chained_cpu import marker, reference, seq_hash

from sglang_env import run_sglang

pytestmark = pytest.mark.sglang

HERE = pathlib.Path(__file__).resolve().parent

STEPS = 6
PREFIXES = [7, 12, 4, 9]
MAX_NEW = [64, 64, 64, 9]  # o3 finishes after 3 steps, with its 4th in flight
CASE = {"budget": 8, "cap": 3, "block": 5}
RUNS = {
    "overlap": {"needs_cpu_seq_lens": False},
    "overlap_host_mirror": {"needs_cpu_seq_lens": True},
    "stale_seq_lens": {"needs_cpu_seq_lens": False, "mutation": "stale_seq_lens", "debug_future_map": False},
    "lagged_host_lens": {"needs_cpu_seq_lens": False, "mutation": "lagged_host_lens", "debug_future_map": False},
    "no_relay_stash": {"needs_cpu_seq_lens": False, "mutation": "no_relay_stash", "debug_future_map": False},
    "skipped_resolve": {"needs_cpu_seq_lens": False, "mutation": "skipped_resolve", "debug_future_map": False},
    "upstream_reserve": {"needs_cpu_seq_lens": False, "mutation": "upstream_reserve", "debug_future_map": False},
    "ci_checks_live": {"needs_cpu_seq_lens": False, "mutation": "no_relay_stash"},  # FutureMap CI checks on
}
# What each control breaks, as the check that must reject it says.
REJECTED_BY = {
    "stale_seq_lens": "device lengths",
    "lagged_host_lens": "host lengths",
    "no_relay_stash": "roots",
    "skipped_resolve": "roots",
    "upstream_reserve": "verify windows",
}

HARNESS = r'''
sys.path.insert(0, HERE)
import time
T0 = time.time()
import overlap_harness
for name, kw in RUNS.items():
    OUT[name] = overlap_harness.run_overlap(
        model=MODEL, **CASE, prefixes=PREFIXES, max_new_tokens=MAX_NEW, steps=STEPS, **kw)
OUT["mutations"] = list(overlap_harness.MUTATIONS)
OUT["seconds"] = round(time.time() - T0, 1)
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sglang_overlay):  # noqa: F811
    code = (f"HERE = {str(HERE)!r}\nCASE = {CASE!r}\nPREFIXES = {PREFIXES!r}\nMAX_NEW = {MAX_NEW!r}\n"
            f"STEPS = {STEPS}\nRUNS = {RUNS!r}\n" + HARNESS)
    out = run_sglang(code, tmp_path_factory.mktemp("overlap"), sglang_overlay, timeout=300, triton_interpret=True)
    print(f"overlap harness: {out['seconds']} s")
    return out


def ref_seq(log, b, n):
    """The toy LM's greedy sequence of request b, at least n tokens long."""
    prompt = log["prompts"][b]
    return reference(prompt, log["first_roots"][b], max(0, n - len(prompt)))


def check_launches(log) -> None:
    """Per launch, in order: what the scheduler handed the worker (device
    lengths, roots, host lengths, windows) and what the step returned."""
    block, W = CASE["block"], log["W"]
    dev = dict(zip(log["rids"], PREFIXES, strict=True))
    root = dict(zip(log["rids"], log["first_roots"], strict=True))
    for k, launch in enumerate(log["launch"]):
        rids, prefix = launch["rids"], launch["prefix"]
        assert prefix == [dev[r] for r in rids], f"step {k}: device lengths {prefix} != published"
        assert launch["root"] == [root[r] for r in rids], f"step {k}: roots {launch['root']} != last tokens"
        assert launch["window_ok"], f"step {k}: verify windows outside the reservation"
        host = launch["seq_lens_cpu"]
        if host is not None:
            assert host == prefix, f"step {k}: host lengths {host} != device {prefix}"
        assert all(n >= p + W for n, p in zip(launch["nxt_kv_lens_cpu"], prefix, strict=True)), \
            f"step {k}: host reservation {launch['nxt_kv_lens_cpu']} under prefix + W"
        if k >= len(log["returned"]):
            break  # the step raised
        ret, verify, app = log["returned"][k], log["verify"][k], log["append"][k]
        assert verify["prefix"] == prefix and all(h >= p + W for h, p in zip(verify["host"], prefix, strict=True)), \
            f"step {k}: host lengths of the verify {verify['host']} under prefix + W"
        acc = ret["accept_lens"]
        assert all(1 <= a <= block for a in acc) and app["commit_lens"] == acc
        assert app["positions"] == [p + j for p in prefix for j in range(block)], f"step {k}: draft KV positions"
        assert ret["new_seq_lens"] == [p + a for p, a in zip(prefix, acc, strict=True)], f"step {k}: new lengths"
        toks = ret["next_token_ids"]
        assert ret["next_root"] == [toks[i * block + a - 1] for i, a in enumerate(acc)], f"step {k}: next root"
        dev.update(zip(rids, ret["new_seq_lens"], strict=True))
        root.update(zip(rids, ret["next_root"], strict=True))


def check_tokens(log) -> None:
    for b, out in enumerate(log["output_ids"]):
        prompt = log["prompts"][b]
        ref = ref_seq(log, b, len(prompt) + len(out))
        assert out == ref[len(prompt):len(prompt) + len(out)], f"request {b}: committed tokens != greedy reference"


def check_kv(log) -> None:
    """Before each result is processed: the marker of the reference token at
    every position the request is about to commit (token, position, hash)."""
    bad = []
    for n_step, proc in enumerate(log["processed"]):
        for rid, (n, k_rows, v_rows) in proc["kv"].items():
            b = log["rids"].index(rid)
            ref = ref_seq(log, b, n)
            for layer in range(len(k_rows)):
                for q in range(n):
                    k, v = marker(ref[q], q, seq_hash(ref[: q + 1]), layer)
                    if k_rows[layer][q] != k or v_rows[layer][q] != v:
                        bad.append((n_step, rid, layer, q))
    assert not bad, f"{len(bad)} KV rows differ from the greedy reference, first: {bad[:3]}"


def check_all(log) -> None:
    assert log["error"] is None, log["error"]
    assert len(log["launch"]) == STEPS and len(log["processed"]) == STEPS
    check_launches(log)
    check_tokens(log)
    check_kv(log)
    # committed KV = prompt + every output token but the last (the next root)
    lens = zip(log["prompts"], log["output_ids"], strict=True)
    assert log["final_committed"] == [len(p) + len(o) - 1 for p, o in lens]


def expected_order() -> list:
    """event_loop_overlap: step k is prepared and launched before step k-1's
    result is processed; the last result is processed once the batch is parked."""
    order = [["prepare", 0], ["launch", 0]]
    for k in range(1, STEPS):
        order += [["prepare", k], ["launch", k], ["process", k - 1]]
    return order + [["process", STEPS - 1]]


def test_overlap_is_0523s_default_for_ddtree(runs):
    log = runs["overlap"]
    assert log["overlap_default"], "DDTREE (DFLASH) args resolved with disable_overlap_schedule=True"
    # run_batch's overlap branch: the worker is handed FutureMap.publish (and the grammar barrier)
    assert all(launch["kwargs"] == ["grammar_barrier", "on_publish"] for launch in log["launch"])


@pytest.mark.parametrize("name", ["overlap", "overlap_host_mirror"])
def test_overlap_runs_in_the_lagged_order(runs, name):
    """Results are processed one step late, so at every launch after the first
    the host committed lengths lag the device lengths by exactly the previous
    step's accepts, and the worker sees the host mirror only when asked for."""
    log = runs[name]
    assert log["order"] == expected_order()
    lagged = 0
    for k in range(1, STEPS):
        launch, prev = log["launch"][k], log["launch"][k - 1]
        acc = dict(zip(prev["rids"], log["returned"][k - 1]["accept_lens"], strict=True))
        assert launch["committed"] == [p - acc[r] for r, p in zip(launch["rids"], launch["prefix"], strict=True)]
        lagged += sum(c < p for c, p in zip(launch["committed"], launch["prefix"], strict=True))
    assert lagged >= STEPS - 1
    mirrored = [launch["seq_lens_cpu"] is not None for launch in log["launch"]]
    assert mirrored == [RUNS[name]["needs_cpu_seq_lens"]] * STEPS
    assert all(p["copy_done"] and p["result_unchanged"] for p in log["processed"]), \
        "a result changed between its step and its (late) processing"


def test_overlap_scenario_exercises_the_step(runs):
    """The data cover what the checks are for: accepts from 1 to a whole block,
    a non-first sibling accepted (the KV move is not a no-op), and a request that
    finishes while its next step is in flight, then leaves the batch."""
    log = runs["overlap"]
    lens = {a for r in log["returned"] for a in r["accept_lens"]}
    assert 1 in lens and CASE["block"] in lens and len(lens) >= 4, lens
    assert any(i != k for step in log["accepted"] for row in step for k, i in enumerate(row))
    assert len(set(PREFIXES)) == len(PREFIXES)
    rid, out = log["rids"][3], 1
    for n, ret in enumerate(log["returned"]):
        out += dict(zip(log["launch"][n]["rids"], ret["accept_lens"], strict=True))[rid]
        if out >= MAX_NEW[3]:
            break
    assert out >= MAX_NEW[3], f"{rid} never finished"
    assert rid in log["launch"][n + 1]["rids"] and rid not in log["launch"][n + 2]["rids"], "no overshoot step"
    assert log["finished_len"][3] == MAX_NEW[3] and len(log["output_ids"][3]) == out, \
        "the overshoot step's tokens were committed"


@pytest.mark.parametrize("name", ["overlap", "overlap_host_mirror"])
def test_overlap_chain_matches_autoregressive_reference(runs, name):
    check_all(runs[name])


def test_futuremap_ci_checks_are_live_in_the_main_runs(runs):
    """The main runs keep the FutureMap's own consume-once checks on: the same
    skipped stash trips them (a root gathered twice without a stash between)."""
    error = runs["ci_checks_live"]["error"]
    assert error is not None and "_assert_nonneg_and_invalidate" in error, error


@pytest.mark.parametrize("mutation", list(REJECTED_BY))
def test_overlap_faults_are_rejected(runs, mutation):
    assert sorted(runs["mutations"]) == sorted(REJECTED_BY)
    log = runs[mutation]
    with pytest.raises(AssertionError, match=REJECTED_BY[mutation]):
        check_launches(log)
    with pytest.raises(AssertionError):
        check_all(log)
