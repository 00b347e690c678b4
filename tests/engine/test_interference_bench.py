"""The interference benchmark's in-process driver and per-part clock on the tiny model: what it
reports must be what ran (a number nobody checks is not a measurement)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdkv.bench._steps import PARTS, PartClock, percentile
from pdkv.bench.interference import run_one, summarize
from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig


def test_run_one_records_every_token_and_times_the_parts_that_ran(tiny_model_dir):
    from pdkv.engine import LLMEngine

    engine = LLMEngine(ModelConfig(path=str(tiny_model_dir)), KVCacheConfig(page_size=16, num_pages=64, prefix_caching=False),
                       SchedulerConfig(max_num_seqs=4), num_threads=1)
    clock = PartClock()
    clock.install(engine)
    a = SimpleNamespace(stream_tokens=8, long_new_tokens=2, first_arrival=2, arrive_every_tokens=3,
                        arrival_gap_s=0.0)
    streams = [[5, 6, 7], [8, 9, 10, 11]]
    prompts = [list(range(3, 83)), list(range(90, 170))]  # 80 tokens each
    # chunks of 40: the later chunk is longer than the torch backend's batched path takes
    # (MULTI_QUERY_MAX), so it reads its cached pages in the per-chunk path timed as attn.cached
    runs = {c: run_one(engine, clock, c, c + 4, prompts, streams, a) for c in (80, 40)}

    assert runs[80]["outputs"] == runs[40]["outputs"]  # chunking never changes tokens
    for chunk, r in runs.items():
        assert len(r["itl"]) == len(streams) * (a.stream_tokens - 1)
        assert len(r["ttft"]) == len(prompts) and min(r["ttft"]) > 0
        prefill = [s for s in r["steps"] if s["prefill_tokens"]]
        assert len(prefill) == len(prompts) * -(-80 // chunk)  # 1 step per prompt whole, 2 chunked
        for s in r["steps"]:
            assert set(s["parts"]) == set(PARTS) and s["parts"]["book"] >= 0
            assert sum(s["parts"].values()) == pytest.approx(s["ms"])
        later = [s for s in prefill if not s["first_chunk"]]
        # Only a later chunk reads cached pages; only a step with decodes attends for them.
        assert all(s["parts"]["attn.cached"] > 0 for s in later) and (chunk == 80) == (not later)
        assert all(s["parts"]["attn.cached"] == 0 for s in prefill if s["first_chunk"])
        assert all(s["parts"]["attn.decode"] > 0 for s in r["steps"] if s["decodes"])
        summary = summarize(r, chunk, 80)
        assert summary["itl_max"] == max(r["itl"]) and summary["num_prefill_steps"] == len(prefill)
    assert engine.allocator.num_free == engine.allocator.num_total  # every request finished


def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0 and percentile(xs, 50) == 3.0
    assert percentile(xs, 99) == pytest.approx(4.96) and percentile([], 50) != percentile([], 50)  # nan
