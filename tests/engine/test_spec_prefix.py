"""Speculative decoding with the prefix cache on: a verification step computes KV for draft
tokens, so the cache must publish only pages whose tokens are committed. A later request sharing
a spec-decoded request's prompt and output (a conversation's next turn) must see exactly the KV
plain decoding would have left, and every page must come back."""

from __future__ import annotations

import torch

from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from pdkv.engine import LLMEngine, SamplingParams


def _engine(path, spec, prefix_caching):
    # page_size 4: drafts (k = 4) straddle page boundaries in almost every verification step
    return LLMEngine(ModelConfig(path=str(path)), KVCacheConfig(page_size=4, num_pages=512,
                                                                prefix_caching=prefix_caching),
                     SchedulerConfig(), speculative=spec)


def _turns(engine, prompts, n=24):
    """Each prompt, then its 'next turn': prompt + its greedy output + the prompt again."""
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    first = engine.generate(prompts, params)
    follow = [p + o.output_token_ids + p for p, o in zip(prompts, first)]
    second = engine.generate(follow, params)
    return [o.output_token_ids for o in first], [o.output_token_ids for o in second]


def test_spec_decoded_pages_in_the_cache_equal_plain_decoding(tiny_model_dir):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (9, 22, 37)]
    want = _turns(_engine(tiny_model_dir, None, prefix_caching=False), prompts)
    cached = _engine(tiny_model_dir, None, prefix_caching=True)
    assert _turns(cached, prompts) == want
    eng = _engine(tiny_model_dir, SpeculativeConfig(method="ngram", num_tokens=4), prefix_caching=True)
    assert _turns(eng, prompts) == want
    s = eng.stats()
    assert s["spec_num_draft_tokens"] > 0  # the tiny model loops: ngram drafts, some rejected
    assert s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"]
    # the second turns reused exactly the pages plain decoding would have cached: a page hashed
    # while it still held drafts would have hashed the wrong tokens and broken the chain
    assert s["prefix_cache_hits"] == cached.stats()["prefix_cache_hits"] > 0
    assert eng.allocator.num_free == eng.allocator.num_total
