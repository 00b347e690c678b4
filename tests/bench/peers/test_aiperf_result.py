"""Reading AIPerf's profile_export_aiperf.json (a real AIPerf 0.13 output, trimmed)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdkv.bench.peers.drive import AiperfError, Shape, aiperf_command, parse_aiperf

SAMPLE = Path(__file__).parent / "data" / "aiperf_0.13_profile_export_aiperf.json"


def test_parses_throughput_and_p50s_in_seconds():
    n = parse_aiperf(SAMPLE)
    raw = json.loads(SAMPLE.read_text())
    assert n.output_tok_s == pytest.approx(274.1349736228555)
    assert n.ttft_p50_s == pytest.approx(raw["time_to_first_token"]["p50"] / 1e3)
    assert n.itl_p50_s == pytest.approx(0.006189244287401574)
    assert (n.num_requests, n.num_errors) == (22, 0)


def test_errors_counted_from_the_error_summary(tmp_path):
    raw = json.loads(SAMPLE.read_text())
    raw["error_summary"] = [{"error_details": {"code": 500, "message": "boom"}, "count": 3},
                            {"error_details": {"code": 400, "message": "bad"}, "count": 1}]
    f = tmp_path / "p.json"
    f.write_text(json.dumps(raw))
    n = parse_aiperf(f)
    assert (n.num_requests, n.num_errors) == (26, 4)


@pytest.mark.parametrize("content,match", [("not json", "cannot read"), ('{"request_count": {}}', "no output_token")])
def test_not_an_aiperf_result_is_refused_by_name(tmp_path, content, match):
    f = tmp_path / "p.json"
    f.write_text(content)
    with pytest.raises(AiperfError, match=match):
        parse_aiperf(f)


def test_unknown_unit_is_refused(tmp_path):
    raw = json.loads(SAMPLE.read_text())
    raw["time_to_first_token"]["unit"] = "fortnights"
    f = tmp_path / "p.json"
    f.write_text(json.dumps(raw))
    with pytest.raises(AiperfError, match="time_to_first_token is in 'fortnights'"):
        parse_aiperf(f)


def test_command_asks_for_the_documented_workload(tmp_path):
    cmd = aiperf_command("aiperf", "http://127.0.0.1:1", "m", "/tok", 8, Shape(512, 128, 30.0), tmp_path)
    text = " ".join(cmd)
    for part in ("--endpoint-type completions", "--streaming", "--concurrency 8", "--extra-inputs ignore_eos:true",
                 "--use-server-token-count", "--isl 512", "--osl 128", "--benchmark-duration 30"):
        assert part in text
