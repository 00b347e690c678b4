"""Scheduling must not change answers: chunk sizes, batch composition, KV layout, page size,
a full cache (waiting and preemption with recompute), a caller-provided KV buffer."""

from __future__ import annotations

import pytest
import torch

from pdkv.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _prompts(n, lens=(3, 9, 21, 40, 70)):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 500, (lens[i % len(lens)] + i,), generator=g).tolist() for i in range(n)]


class _Reference(dict):
    """prompt → tokens of that prompt run alone (whole-prompt prefill, page 16, HND)."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine

    def __missing__(self, prompt):
        self[prompt] = self.engine.generate([list(prompt)], GREEDY)[0].output_token_ids
        return self[prompt]


@pytest.fixture(scope="module")
def reference(base_engine):
    return _Reference(base_engine)


def _check(engine, reference, prompts):
    outs = engine.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.output_token_ids == reference[tuple(p)]
        assert o.finish_reason == "length"
    assert engine.allocator.num_free == engine.allocator.num_total
    assert not engine.has_unfinished()


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_chunked_prefill_same_tokens(make_engine, reference, chunk):
    # A small budget makes prefill chunks and decodes share steps.
    _check(make_engine(chunk=chunk, budget=max(chunk, 24)), reference, _prompts(5))


def test_batch_of_16_same_as_alone(base_engine, reference):
    _check(base_engine, reference, _prompts(16))


@pytest.mark.parametrize("layout,page_size", [("NHD", 16), ("HND", 1), ("HND", 64), ("NHD", 1)])
def test_layout_and_page_size_same_tokens(make_engine, reference, layout, page_size):
    _check(make_engine(layout=layout, page_size=page_size, num_pages=4096 // page_size), reference, _prompts(6))


def test_full_cache_waits_and_preempts(make_engine, reference):
    # 8 pages of 16 tokens; 6 requests of up to ~82 tokens each: they cannot all fit at once.
    engine = make_engine(num_pages=8)
    prompts = _prompts(6, lens=(20, 30))
    _check(engine, reference, prompts)
    assert engine.scheduler.num_preemptions > 0


def test_caller_buffer_backs_the_cache(make_engine, reference, tiny_model_dir):
    from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig
    from pdkv.engine import LLMEngine

    # 2 layers x 64 pages x (2 * 2 heads * 16 tokens * 16 dims * 4 bytes)
    buf = bytearray(2 * 64 * 2 * 2 * 16 * 16 * 4)
    engine = LLMEngine(ModelConfig(path=str(tiny_model_dir)), KVCacheConfig(num_pages=64),
                       SchedulerConfig(), kv_buffer=buf)
    _check(engine, reference, _prompts(3))
    assert any(buf), "the forward pass should have written K/V into the caller's buffer"
