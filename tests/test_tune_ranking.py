"""`ddtree-ops tune`'s judgement from recorded measurements (gates/tune_ranking.py) and its plan
(fleet/tune_plan.py): when to stop repeating, who wins, by how much, and which config is picked."""

from __future__ import annotations

import pytest

from ddtree_ops.errors import InputError
from ddtree_ops.fleet.tune_plan import DFLASH, TuneConfig, assign, grid, parse_float_list, parse_int_list
from ddtree_ops.gates.tune_ranking import (
    Objective,
    RepeatRule,
    gain,
    half_range,
    pick,
    stop_repeating,
    summarise,
    winners,
)
from ddtree_ops.gates.workload import Measurement


def m(tps: float, *, accept: float | None = 2.0, ttft99: float = 0.05, itl99: float = 0.01, errors: int = 0):
    """A measurement of 10 s with `tps` output tok/s."""
    return Measurement(requests=20, errors=errors, output_tokens=int(tps * 10), wall_s=10.0, ttft_p50_s=0.03,
                       ttft_p99_s=ttft99, itl_p50_s=0.005, itl_p99_s=itl99, accept_length=accept)


def row(config: str, c: int, t: float, tps: float, spread: float = 0.01, *, status: str = "ok",
        inventory: bool = False, **kw):
    kind = "dflash" if config == "DFlash" else "ddtree"
    b, k = (None, None) if kind == "dflash" else map(int, config.split("/"))
    return {"config": config, "kind": kind, "budget": b, "topk_cap": k, "inventory": inventory, "host": "h1",
            "concurrency": c, "temperature": t, "workload": f"c{c} T{t:g}", "status": status, "reason": None,
            "tok_s": tps if status == "ok" else None, "tok_s_spread": spread, "repeats": 3,
            "accept_length": 2.0, "ttft_p99_s": kw.get("ttft99", 0.05), "itl_p99_s": kw.get("itl99", 0.01)}


# --------------------------------------------------------------------------- the stopping rule


def test_two_steady_repeats_are_enough_one_never_is():
    rule = RepeatRule(min_repeats=2, max_repeats=5, max_spread=0.03)
    assert not stop_repeating([], rule)
    assert not stop_repeating([100.0], rule)
    assert stop_repeating([100.0, 102.0], rule)  # half-range 1 %


def test_an_unsteady_row_is_measured_again_up_to_the_maximum():
    rule = RepeatRule(min_repeats=2, max_repeats=4, max_spread=0.03)
    assert not stop_repeating([100.0, 120.0], rule)  # ±9 %
    assert not stop_repeating([100.0, 120.0, 110.0], rule)
    assert stop_repeating([100.0, 120.0, 110.0, 105.0], rule)  # the maximum, steady or not


def test_half_range_is_relative_to_the_mean():
    assert half_range([90.0, 110.0]) == pytest.approx(0.1)
    assert half_range([5.0]) is None


def test_summarise_takes_means_and_the_worst_tail():
    fig = summarise([m(100.0, ttft99=0.05), m(110.0, ttft99=0.09, errors=1)])
    assert fig["tok_s"] == pytest.approx(105.0)
    assert fig["tok_s_spread"] == pytest.approx(5 / 105)
    assert fig["ttft_p99_s"] == 0.09  # a tail bound must hold in every repeat
    assert fig["repeats"] == 2 and fig["errors"] == 1 and fig["error_rate"] == pytest.approx(1 / 40)


# --------------------------------------------------------------------------- winners


def test_each_workload_gets_its_own_winner_with_gains_over_dflash_and_the_inventory():
    rows = [row("DFlash", 1, 0, 100.0), row("4/1", 1, 0, 150.0, inventory=True), row("32/4", 1, 0, 200.0),
            row("DFlash", 8, 0, 500.0), row("4/1", 8, 0, 700.0, inventory=True), row("32/4", 8, 0, 600.0)]
    ws = {w.workload: w for w in winners(rows)}
    assert ws["c1 T0"].row["config"] == "32/4" and ws["c8 T0"].row["config"] == "4/1"
    g = ws["c1 T0"].vs_dflash
    assert g.ratio == pytest.approx(2.0)
    assert g.low == pytest.approx(200 * 0.99 / (100 * 1.01)) and g.high == pytest.approx(200 * 1.01 / (100 * 0.99))
    assert ws["c1 T0"].vs_inventory.ratio == pytest.approx(200 / 150)
    assert ws["c8 T0"].vs_inventory is None  # the inventory's config is the winner
    assert "already wins" in ws["c8 T0"].as_dict()["note"]
    assert all(w.ranked for w in ws.values())


def test_a_winner_within_the_runner_ups_noise_is_not_ranked_and_says_so():
    rows = [row("8/4", 1, 0, 200.0, spread=0.03), row("16/4", 1, 0, 204.0, spread=0.03)]
    (w,) = winners(rows)
    assert w.row["config"] == "16/4"
    assert not w.ranked
    assert "within noise of 8/4" in w.as_dict()["note"]


def test_failed_rows_never_win_and_a_workload_with_none_ok_has_no_winner():
    rows = [row("32/4", 1, 0, 0.0, status="failed"), row("8/4", 1, 0, 150.0),
            row("32/4", 8, 0, 0.0, status="failed")]
    ws = winners(rows)
    assert ws[0].row["config"] == "8/4"
    assert ws[1].row is None and ws[1].as_dict()["note"] == "no config measured"


def test_a_latency_bound_excludes_the_fastest_config_that_breaks_it():
    rows = [row("32/4", 1, 0, 300.0, ttft99=0.4), row("8/4", 1, 0, 250.0, ttft99=0.1)]
    assert winners(rows)[0].row["config"] == "32/4"
    bounded = Objective(ttft_p99_max_s=0.2)
    assert winners(rows, bounded)[0].row["config"] == "8/4"
    assert bounded.violation(rows[0]) == "TTFT p99 400.0 ms over the bound 200.0 ms"
    assert winners(rows, Objective(itl_p99_max_s=0.001))[0].row is None


def test_equal_throughput_goes_to_the_smaller_tree():
    rows = [row("32/4", 1, 0, 200.0), row("8/2", 1, 0, 200.0)]
    assert winners(rows)[0].row["config"] == "8/2"


def test_gain_needs_a_measured_reference():
    assert gain(row("8/4", 1, 0, 100.0), None) is None
    assert gain(row("8/4", 1, 0, 100.0), row("DFlash", 1, 0, 0.0, status="failed")) is None


# --------------------------------------------------------------------------- the pick


def test_the_pick_is_the_best_geometric_mean_over_workloads_among_trees_ok_everywhere():
    rows = [row("DFlash", 1, 0, 999.0), row("DFlash", 8, 0, 999.0),  # DFlash is the control, never picked
            row("32/4", 1, 0, 200.0), row("32/4", 8, 0, 500.0),  # 1.0 and 0.714: 0.845
            row("8/4", 1, 0, 180.0), row("8/4", 8, 0, 700.0),  # 0.9 and 1.0: 0.949
            row("4/1", 1, 0, 150.0)]  # missing at c8: not a candidate
    p = pick(rows)
    assert p["config"] == "8/4" and (p["budget"], p["topk_cap"]) == (8, 4)
    assert p["score"] == pytest.approx((0.9 * 1.0) ** 0.5, abs=1e-4)


def test_no_pick_when_no_tree_is_ok_in_every_workload():
    rows = [row("32/4", 1, 0, 200.0), row("8/4", 8, 0, 700.0), row("DFlash", 1, 0, 1.0), row("DFlash", 8, 0, 1.0)]
    assert pick(rows) is None


# --------------------------------------------------------------------------- the plan


def test_the_grid_holds_dflash_every_cap_up_to_its_budget_and_the_inventory_config():
    configs = grid((4, 2), (1, 4), (16, 4))
    assert [c.label for c in configs] == ["DFlash", "2/1", "4/1", "4/4", "16/4"]
    assert [c.inventory for c in configs] == [False, False, False, False, True]
    inside = grid((4,), (1, 4), (4, 4))
    assert [c.label for c in inside if c.inventory] == ["4/4"] and len(inside) == 3


def test_configs_are_spread_evenly_and_dflash_goes_to_a_host_on_its_original_files():
    configs = [DFLASH] + [TuneConfig(b, 1) for b in (2, 4, 8, 16, 32)]
    plans = assign(configs, ["a", "b"], on_original=["b"])
    by = {p.host: p for p in plans}
    assert by["b"].configs[0] is DFLASH  # first: measured as it runs, before any restart
    assert sorted(p.deploys for p in plans) == [2, 3]  # ceil(5 / 2)
    assert sorted(c.label for p in plans for c in p.configs) == sorted(c.label for c in configs)


def test_the_dflash_host_gets_fewer_deploys_but_never_more_than_its_share():
    two = assign([DFLASH, TuneConfig(4, 1), TuneConfig(8, 1)], ["a", "b"], on_original=["a"])
    assert [[c.label for c in p.configs] for p in two] == [["DFlash", "8/1"], ["4/1"]]
    seven = assign([DFLASH] + [TuneConfig(b, 1) for b in (2, 4, 8, 16, 32, 64, 128)], ["a", "b"], on_original=["a"])
    assert [len(p.configs) for p in seven] == [4, 4] and [p.deploys for p in seven] == [3, 4]


def test_without_a_host_on_its_original_files_dflash_is_left_out_of_the_plan():
    plans = assign([DFLASH, TuneConfig(4, 1)], ["a"], on_original=[])
    assert [c.label for c in plans[0].configs] == ["4/1"]


@pytest.mark.parametrize("text, message", [
    ("4,x", "--budgets: 'x' is not a whole number"),
    ("0,4", "--budgets: 0 is out of range 1..1024"),
    ("", "--budgets: '' is not a whole number"),
])
def test_a_bad_list_names_its_flag(text, message):
    with pytest.raises(InputError, match=message):
        parse_int_list(text, "--budgets", 1, 1024)


def test_lists_are_sorted_and_deduplicated():
    assert parse_int_list("16, 4,16", "--budgets", 1, 1024) == (4, 16)
    assert parse_float_list("0.7,0", "--temperatures", 0, 2) == (0.0, 0.7)
    with pytest.raises(InputError, match="--temperatures: nan is out of range"):
        parse_float_list("nan", "--temperatures", 0, 2)
