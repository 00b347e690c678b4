"""Trace reading, selection, scaling and prompt synthesis, without any server."""
from __future__ import annotations

import json

import pytest

from _abrun import AZURE, MOONCAKE
from pdkv.bench.ab.prompts import PromptSynth, request_body
from pdkv.bench.ab.synth import synth_trace
from pdkv.bench.ab.traces import TraceError, read_trace, select
from pdkv.bench.ab.workload import Scaling, build_workload


def test_both_public_formats_read_with_their_units():
    m = read_trace(MOONCAKE)
    assert m.format == "mooncake" and len(m.requests) == 40
    first = json.loads(MOONCAKE.read_text().splitlines()[0])
    assert m.requests[0].input_len == first["input_length"] and m.requests[0].hash_ids == tuple(first["hash_ids"])
    assert m.span_s == pytest.approx((json.loads(MOONCAKE.read_text().splitlines()[-1])["timestamp"]
                                      - first["timestamp"]) / 1000.0)  # milliseconds -> seconds
    a = read_trace(AZURE)
    assert a.format == "azure" and len(a.requests) == 40 and a.requests[0].input_len == 4808
    # 18:17:03.9799600 -> 18:17:38.2643990: the 7-digit fractions are kept
    assert a.span_s == pytest.approx(34.284439, abs=1e-5)


def test_same_hash_id_is_the_same_token_block_so_prefixes_are_really_shared():
    m = read_trace(MOONCAKE)
    s = PromptSynth(3, 512, 10, seed=0)
    reqs = m.requests[:8]
    prompts = [s.prompt(20, r.hash_ids, r.index) for r in reqs]
    assert all(r.hash_ids[0] == 0 for r in reqs)  # this trace opens every request with block 0
    assert len({tuple(p[:10]) for p in prompts}) == 1  # so they share its 10 tokens...
    assert len({tuple(p[10:]) for p in prompts}) == len(prompts)  # ...and differ after it
    again = PromptSynth(3, 512, 10, seed=0).prompt(20, reqs[3].hash_ids, reqs[3].index)
    assert again == prompts[3]
    assert PromptSynth(3, 512, 10, seed=1).prompt(20, reqs[3].hash_ids, 3) != prompts[3]
    a = read_trace(AZURE).requests
    assert s.prompt(15, (), a[0].index)[:10] != s.prompt(15, (), a[1].index)[:10]  # no hash ids: nothing shared
    body = json.loads(request_body("m", prompts[0], 7))
    assert body["max_tokens"] == 7 and body["ignore_eos"] and body["stream"] and body["prompt"] == prompts[0]


def test_rate_and_time_scaling_and_length_scaling():
    m = read_trace(MOONCAKE)
    wl = build_workload(m, Scaling(rate=5.0, length_scale=0.01, output_scale=0.1))
    assert (len(wl.items) - 1) / wl.duration_s == pytest.approx(5.0)
    assert wl.block_tokens == round(512 * 0.01)
    assert [i.prompt_len for i in wl.items] == [max(1, round(r.input_len * 0.01)) for r in m.requests]
    offsets = [i.offset_s for i in wl.items]
    assert offsets == sorted(offsets) and wl.num_ties_spread > 0
    assert len(set(offsets)) == len(offsets)  # ties spread: no burst of identical send times
    raw = build_workload(m, Scaling(time_scale=0.5, spread_ties=False, length_scale=0.01, output_scale=0.1))
    assert raw.items[-1].offset_s == pytest.approx(0.5 * m.span_s) and raw.num_ties_spread == 0


def test_window_and_first_n():
    m = read_trace(MOONCAKE)
    s = select(m, (3.0, 9.0), 5)
    assert len(s.requests) == 5 and s.requests[0].arrival_s == 0.0
    assert all(3.0 <= m.requests[r.index].arrival_s < 9.0 for r in s.requests)
    with pytest.raises(TraceError, match="selects no request"):
        select(m, (1000.0, 2000.0))


def test_synthetic_presets_are_deterministic_poisson():
    a, b = synth_trace("mixed", 400, rate=4.0, seed=3), synth_trace("mixed", 400, rate=4.0, seed=3)
    assert a == b and a != synth_trace("mixed", 400, rate=4.0, seed=4)
    assert (len(a.requests) - 1) / a.span_s == pytest.approx(4.0, rel=0.15)
    longs = sum(r.input_len >= 256 for r in a.requests) / len(a.requests)
    assert 0.15 < longs < 0.35  # mixed: ~25% long prompts
    assert all(r.input_len < 256 for r in synth_trace("short", 100).requests)
    assert min(r.input_len for r in synth_trace("long", 100).requests) >= 256
