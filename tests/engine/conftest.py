"""Fixtures for the engine tests: engines over the session's tiny model, built small."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the tests' helpers (_connectors.py)


@pytest.fixture
def make_engine(tiny_model_dir):
    """make_engine(path=None, page_size=16, num_pages=256, layout="HND", budget=2048, chunk=512,
    max_seqs=64, prefix_caching=True, policy="fcfs", **model_kw) → LLMEngine."""
    from pdkv.engine import LLMEngine

    def make(path=None, page_size=16, num_pages=256, layout="HND", budget=2048, chunk=512, max_seqs=64,
             prefix_caching=True, policy="fcfs", **model_kw):
        return LLMEngine(ModelConfig(path=str(path or tiny_model_dir), **model_kw),
                         KVCacheConfig(page_size=page_size, num_pages=num_pages, layout=layout,
                                       prefix_caching=prefix_caching),
                         SchedulerConfig(max_num_batched_tokens=budget, chunk_size=chunk, max_num_seqs=max_seqs,
                                         policy=policy))
    return make


@pytest.fixture(scope="module")
def base_engine(tiny_model_dir):
    """One shared engine (page 16, 256 pages) for tests that leave it empty when they finish."""
    from pdkv.engine import LLMEngine

    return LLMEngine(ModelConfig(path=str(tiny_model_dir)), KVCacheConfig(page_size=16, num_pages=256),
                     SchedulerConfig())
