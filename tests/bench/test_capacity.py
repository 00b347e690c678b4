"""bench capacity on the shipped tiny model: the curves it writes are what the planner reads."""

import json

import pytest

from pdkv.bench import capacity
from pdkv.planner.capacity import load_capacities


@pytest.mark.slow  # builds the engine: ~10 s of CPU
def test_capacity_writes_curves_the_planner_reads(tmp_path, capsys):
    out = tmp_path / "cap.json"
    rc = capacity.main(["--prompt-len", "64", "--prefill-concurrency", "1,2", "--decode-streams", "1,4",
                        "--new-tokens", "6", "--repeats", "1", "--ttft-ms", "600000", "--itl-ms", "600000",
                        "-o", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert [p["concurrency"] for p in d["prefill"]["points"]] == [1, 2]
    assert [p["streams"] for p in d["decode"]["points"]] == [1, 4]
    assert all(p["tokens_per_s"] > 0 and p["ttft_ms"] > 0 for p in d["prefill"]["points"])
    lat = [p["itl_ms"] for p in d["decode"]["points"]]
    assert lat == sorted(lat) and lat[0] > 0  # made monotone: more streams never read as faster
    caps = load_capacities(out)
    assert d["at_slo"]["prefill_tokens_per_s"] == round(caps.prefill_tokens_per_s(600000), 1)
    assert d["at_slo"]["decode_streams"] == 4  # an SLO past every point: the last one
    assert "load average" in d["source"]

