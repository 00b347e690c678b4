"""The seed's rule on hand-made numbers: disaggregate only when interference is measured, the
transfer path keeps both SLOs, and the goodput is really better; otherwise chunked or colocated."""
from __future__ import annotations

import pytest

from pdkv.bench.ab.verdict import decide, overall

SLO = {"ttft_s": 1.0, "tpot_s": 0.1}


def run(p50_itl, p99_itl, ttft, goodput, frac, inter=1.0):
    return {"summary": {"all": {"itl_s": {"p50": p50_itl, "p99": p99_itl}, "ttft_s": {"p50": ttft},
                                "goodput_rps": goodput, "goodput_fraction": frac,
                                "interference": {"ratio_mean": inter}}}}


def test_disaggregate_when_interference_is_measured_and_slos_hold():
    v = decide({"colocated": run(0.005, 0.100, 0.05, 1.0, 0.6, 8.0), "chunked": run(0.006, 0.040, 0.08, 1.2, 0.7, 3.0),
                "disagg": run(0.005, 0.010, 0.12, 2.0, 0.95, 1.1)}, SLO)
    assert v["choice"] == "disaggregate" and v["interference"] and v["interference_ratio"] == 8.0
    assert "8.0x (colocated), 3.0x (chunked), 1.1x (disagg)" in v["text"]
    assert v["expectation"]["met"] and abs(v["expectation"]["itl_p99_vs_colocated"] - 0.1) < 1e-9
    assert "p99 ITL is 10.0 ms disaggregated against 100.0 ms (colocated, 0.10x)" in v["text"]
    assert "p50 TTFT is 120.0 ms" in v["text"]


def test_chunked_when_the_transfer_path_breaks_an_slo():
    v = decide({"colocated": run(0.005, 0.100, 0.05, 1.0, 0.6, 8.0), "chunked": run(0.006, 0.040, 0.08, 1.2, 0.7),
                "disagg": run(0.005, 0.010, 0.9, 2.0, 0.5)}, SLO)
    assert v["choice"] == "chunked" and not v["transfer_preserves_slos"]
    assert "only 50% of requests (< 70%)" in v["text"]  # the bar: the best colocated attainment


def test_past_every_slo_disaggregation_must_attain_as_much_as_the_best_colocated():
    over = {"colocated": run(0.02, 1.0, 0.15, 1.69, 0.75, 8.0), "chunked": run(0.03, 0.46, 0.2, 1.08, 0.62, 3.0)}
    v = decide({**over, "disagg": run(0.02, 0.06, 0.21, 1.85, 0.78, 1.2)}, SLO)
    assert v["choice"] == "disaggregate" and v["transfer_preserves_slos"]
    v = decide({**over, "disagg": run(0.02, 0.06, 0.21, 1.85, 0.70, 1.2)}, SLO)
    assert v["choice"] == "colocated" and not v["transfer_preserves_slos"]


def test_colocated_when_there_is_no_interference_to_remove():
    v = decide({"colocated": run(0.005, 0.006, 0.05, 1.3, 1.0, 1.2), "chunked": run(0.006, 0.008, 0.06, 1.2, 1.0),
                "disagg": run(0.006, 0.007, 0.09, 1.3, 1.0)}, SLO)
    assert v["choice"] == "colocated" and not v["interference"] and not v["expectation"]["met"]
    assert "interference is small" in v["text"]


def test_overall_ties_go_to_colocated_serving():
    assert overall([{"choice": "disaggregate"}, {"choice": "chunked"}]) == "chunked"
    assert overall([{"choice": "disaggregate"}, {"choice": "disaggregate"}, {"choice": "colocated"}]) == "disaggregate"


def test_interference_separates_decode_gaps_that_overlap_a_prefill():
    from pdkv.bench.ab.client import RequestResult
    from pdkv.bench.ab.metrics import interference

    # A decodes from t=0.1 every 10 ms, except one 110 ms gap across B's prefill (0.5 -> 0.6)
    times = [0.1 + 0.01 * i for i in range(41)] + [0.6 + 0.01 * i for i in range(1, 20)]
    a = RequestResult("a", "u", 0.0, sent_s=0.0, status="ok", ttft_s=0.1, chunk_s=times, chunk_tokens=[1] * len(times))
    b = RequestResult("b", "u", 0.5, sent_s=0.5, status="ok", ttft_s=0.1, chunk_s=[0.1, 0.11], chunk_tokens=[1, 1])
    i = interference([a, b])
    assert i["itl_during_prefill_s"]["n"] == 1 and i["itl_during_prefill_s"]["mean"] == pytest.approx(0.11)
    assert i["itl_quiet_s"]["mean"] == pytest.approx(0.01) and i["ratio_mean"] == pytest.approx(11.0)
    # a request's own prefill window never counts against its own gaps
    assert interference([a])["itl_during_prefill_s"]["n"] == 0


@pytest.mark.parametrize("disagg_goodput,wins", [(1.04 * 1.2, False), (1.05 * 1.2, False), (1.06 * 1.2, True)])
def test_disaggregation_must_beat_the_best_colocated_goodput_by_the_margin(disagg_goodput, wins):
    """Interference measured and both SLOs kept: the goodput margin (5% over the best colocated
    architecture, here chunked at 1.2 req/s) alone decides; at exactly 5% it is not enough."""
    v = decide({"colocated": run(0.005, 0.100, 0.05, 1.0, 0.9, 8.0), "chunked": run(0.006, 0.040, 0.08, 1.2, 0.9, 3.0),
                "disagg": run(0.005, 0.010, 0.12, disagg_goodput, 0.95, 1.1)}, SLO)
    assert v["disagg_goodput_wins"] is wins and v["interference"] and v["transfer_preserves_slos"]
    assert v["choice"] == ("disaggregate" if wins else "chunked"), v["text"]
    if not wins:
        assert "does not beat chunked's 1.20 by 5%" in v["text"]
