"""Fixtures for the tensor-parallel tests: tiny real model folders and real engines, TP1 (the
reference, one process) and TP2 (rank 0 here, rank 1 a real follower process over gloo)."""

from __future__ import annotations

import pytest

from pdkv.config import KVCacheConfig, ModelConfig, ParallelConfig, SchedulerConfig

# Small chunks so a prompt takes several steps and steps mix prefill chunks with decodes.
KV = KVCacheConfig(page_size=4, num_pages=96)
SCHED = SchedulerConfig(max_num_batched_tokens=24, chunk_size=8, max_num_seqs=4)
PROMPTS = ["Hello, world! How are you today?",
           "The quick brown fox jumps over the lazy dog. A decode node reserves pages",
           "def forward(self, x):"]


class TPHelpers:
    KV, SCHED, PROMPTS = KV, SCHED, PROMPTS

    def __init__(self, factory):
        self._factory = factory
        self._dirs: dict = {}

    def model_dir(self, arch: str = "llama", num_kv_heads: int = 2, **kw):
        from pdkv.tiny_model import make_tiny_model

        key = (arch, num_kv_heads, tuple(sorted(kw.items())))
        if key not in self._dirs:
            out = self._factory.mktemp(f"tp-{arch}-kv{num_kv_heads}")
            self._dirs[key] = make_tiny_model(out, arch=arch, num_kv_heads=num_kv_heads, seed=1, **kw)
        return self._dirs[key]

    def engine(self, model_dir, tp: int = 1, layout: str = "HND", timeout_s: float = 30.0, **model_kw):
        from pdkv.engine import LLMEngine

        kv = KVCacheConfig(page_size=KV.page_size, num_pages=KV.num_pages, layout=layout)
        return LLMEngine(ModelConfig(path=str(model_dir), **model_kw), kv, SCHED,
                         parallel=ParallelConfig(tp=tp, timeout_s=timeout_s, startup_timeout_s=120.0))


@pytest.fixture(scope="session")
def tp(tmp_path_factory) -> TPHelpers:
    return TPHelpers(tmp_path_factory)


@pytest.fixture(scope="session")
def llama_pair(tp):
    """(TP1 engine, TP2 engine) on the same tiny llama (4 heads, 2 KV heads)."""
    d = tp.model_dir("llama", 2)
    one, two = tp.engine(d, 1), tp.engine(d, 2)
    yield one, two
    two.close()
