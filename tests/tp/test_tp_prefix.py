"""Prefix caching under tensor parallelism: every rank's pages are reused together (the ranks
attend over the page ids rank 0 schedules), so TP2 with caching gives TP1-without-caching's
greedy tokens for prompts sharing prefixes."""

from __future__ import annotations

from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig
from pdkv.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_tp2_with_prefix_caching_matches_tp1_without(tp, llama_pair):
    from pdkv.engine import LLMEngine

    _, two = llama_pair
    off = LLMEngine(ModelConfig(path=str(tp.model_dir("llama", 2))),
                    KVCacheConfig(page_size=4, num_pages=96, prefix_caching=False),  # conftest's KV and SCHED
                    SchedulerConfig(max_num_batched_tokens=24, chunk_size=8, max_num_seqs=4))
    base = list(range(5, 40))
    prompts = [base[:30], base[:30], base[:13] + [3, 4, 5], base[:2] + [9] * 10, base[:32], base[:32]]
    hits = two.stats()["prefix_cache_hits"]
    got = [two.generate([p], GREEDY)[0].output_token_ids for p in prompts]  # one after another
    assert got == [off.generate([p], GREEDY)[0].output_token_ids for p in prompts]
    assert two.stats()["prefix_cache_hits"] - hits >= 28 + 12 + 28
    assert two.allocator.num_free == two.allocator.num_total
