"""The A/B harness's client-side numbers on hand-made request results with known answers: TPOT
divides the decode time by the tokens after the first, the TPOT SLO counts in goodput as the
TTFT SLO does, percentiles interpolate linearly (numpy's default), goodput is per request sent."""
from __future__ import annotations

import pytest

from pdkv.bench.ab.client import RequestResult
from pdkv.bench.ab.metrics import SLO, meets, pct, summarize, tpot

SLO_ = SLO(ttft_s=0.5, tpot_s=0.1)


def _req(i, sent, ttft, e2e, tokens, status="ok"):
    return RequestResult(f"r{i}", "u", sent, sent_s=sent, status=status, ttft_s=ttft, e2e_s=e2e,
                         num_tokens=tokens, chunk_s=[ttft + k * (e2e - ttft) / max(1, tokens - 1)
                                                     for k in range(tokens)], chunk_tokens=[1] * tokens)


def test_percentiles_interpolate_between_neighbours():
    xs = [10, 1, 9, 2, 8, 3, 7, 4, 6, 5]  # unsorted on purpose
    assert pct(xs, 50) == pytest.approx(5.5)
    assert pct(xs, 90) == pytest.approx(9.1)
    assert pct(xs, 99) == pytest.approx(9.91)
    assert pct(xs, 0) == 1 and pct(xs, 100) == 10
    assert pct([3.0, 1.0, 2.0], 25) == pytest.approx(1.5)
    assert pct([4.0], 99) == 4.0 and pct([], 50) is None


def test_tpot_divides_by_the_tokens_after_the_first():
    r = _req(0, 0.0, ttft=0.1, e2e=1.0, tokens=10)  # 9 gaps of 0.1 s after the first token
    assert tpot(r) == pytest.approx(0.1)
    assert tpot(_req(1, 0.0, 0.1, 0.5, 1)) is None  # one token: no decode time to divide
    assert tpot(_req(2, 0.0, 0.1, 1.0, 10, status="error")) is None


def test_the_tpot_slo_counts_in_goodput():
    fast = _req(0, 0.0, ttft=0.2, e2e=0.2 + 9 * 0.05, tokens=10)  # TPOT 50 ms
    slow = _req(1, 0.0, ttft=0.2, e2e=0.2 + 9 * 0.15, tokens=10)  # TPOT 150 ms > 100 ms
    late = _req(2, 0.0, ttft=0.7, e2e=0.7 + 9 * 0.05, tokens=10)  # TTFT 700 ms > 500 ms
    assert meets(fast, SLO_) and not meets(slow, SLO_) and not meets(late, SLO_)
    edge = _req(3, 0.0, ttft=0.5, e2e=0.5 + 9 * 0.1, tokens=10)  # both exactly at the SLO
    assert tpot(edge) == pytest.approx(0.1) and meets(edge, SLO(0.5, 0.1 + 1e-12))


def test_summary_of_hand_made_results():
    rs = [_req(0, 0.0, 0.2, 0.65, 10),   # meets both; ends at 0.65
          _req(1, 0.5, 0.2, 1.55, 10),   # TPOT 150 ms: misses; ends at 2.05
          _req(2, 1.0, 0.1, 1.0, 10),    # TPOT 100 ms: meets; ends at 2.0
          _req(3, 1.5, None, None, 0, status="error")]
    lens = {f"r{i}": 100 for i in range(4)}
    s = summarize(rs, lens, {f"r{i}": "short" for i in range(4)}, SLO_)["all"]
    assert s["num_requests"] == 4 and s["num_ok"] == 3 and s["num_failed"] == 1
    assert s["makespan_s"] == pytest.approx(2.05)  # first send (0.0) to last answer (2.05)
    assert s["goodput_rps"] == pytest.approx(2 / 2.05)
    assert s["goodput_fraction"] == pytest.approx(2 / 4)  # of requests sent, failures included
    assert s["request_throughput"] == pytest.approx(3 / 2.05)
    assert s["output_tokens_per_s"] == pytest.approx(30 / 2.05)
    assert s["tpot_s"]["p50"] == pytest.approx(0.1) and s["tpot_s"]["max"] == pytest.approx(0.15)
    assert s["ttft_s"]["p50"] == pytest.approx(0.2) and s["ttft_s"]["n"] == 3
