"""The engine's per-step paths: a decode step of the benchmark model (the yardstick every other
budget is a share of), the scheduler planning one step, and page allocator cycles."""

from __future__ import annotations

import pytest
import torch

from pdkv.engine.params import SamplingParams
from pdkv.engine.request import Request, RequestStatus
from pdkv.engine.scheduler import Scheduler
from pdkv.errors import PageStateError
from pdkv.kv import PageAllocator

BATCH = 64  # running requests in the step every budget is measured against
PAGE = 16
PROMPT = 32  # short prompts keep the untimed prefill of BATCH requests quick on 2 cores
DECODE_ROUNDS = 5


@pytest.fixture(scope="module")
def bench_engine(tmp_path_factory, bench_threads):
    """The 57M-parameter Llama of `python -m pdkv.bench engine` (hidden 512, 8 layers, 8 heads /
    2 KV heads, vocab 32000, float32), with room for BATCH requests."""
    from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig
    from pdkv.engine import LLMEngine
    from pdkv.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("bench57m") / "m", hidden_size=512, num_layers=8,
                           num_heads=8, num_kv_heads=2, intermediate_size=1536, vocab_size=32000,
                           max_position_embeddings=4096, seed=0)
    torch.set_num_threads(bench_threads)
    pages = BATCH * -(-(PROMPT + 64) // PAGE) + 8
    return LLMEngine(ModelConfig(path=str(path)), KVCacheConfig(page_size=PAGE, num_pages=pages),
                     SchedulerConfig(max_num_batched_tokens=BATCH * PROMPT, chunk_size=PROMPT,
                                     max_num_seqs=BATCH), num_threads=bench_threads)


@pytest.mark.parametrize("batch,rounds", [(1, 20), (BATCH, DECODE_ROUNDS)], ids=["b1", f"b{BATCH}"])
def test_decode_step(benchmark, bench_engine, batch, rounds):
    """One engine.step() with ``batch`` running requests, each decoding one token (prefill done
    before timing). Correct: every step emits one token per request, and the first and last
    requests' tokens equal the same prompts run alone (as tests/engine/test_batching.py checks).
    B=64 is the step the per-step budgets are shares of; B=1 the strictest yardstick for the
    per-request paths."""
    engine = bench_engine
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32000, (PROMPT,), generator=g).tolist() for _ in range(batch)]
    new = 2 + rounds + 2
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"d{i}", p, params)
    first = set()
    while len(first) < batch:  # prefill: every request has its first token
        first.update(o.request_id for o in engine.step())
    outs = []
    benchmark.pedantic(lambda: outs.append(engine.step()), rounds=rounds, iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(batch=batch, prompt_len=PROMPT, threads=torch.get_num_threads())
    for step in outs:
        assert sorted(len(o.new_token_ids) for o in step) == [1] * batch
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o.output_token_ids
    assert sorted(final) == sorted(f"d{i}" for i in range(batch))
    assert all(len(t) == new for t in final.values())
    for i in sorted({0, batch - 1}):
        [alone] = engine.generate([prompts[i]], params)
        assert alone.output_token_ids == final[f"d{i}"], f"request {i}: batched tokens differ from alone"
    assert engine.allocator.num_free == engine.allocator.num_total


# ---- scheduler -----------------------------------------------------------------------------

NUM_CHUNKS, CHUNK = 3, 128


def _step_state() -> Scheduler:
    """BATCH running requests each one token from its next decode (a quarter of them at a page
    boundary, so the step allocates pages) and NUM_CHUNKS long prompts waiting to prefill."""
    a = PageAllocator(4096)
    s = Scheduler(a, PAGE, max_num_batched_tokens=BATCH + NUM_CHUNKS * CHUNK, chunk_size=CHUNK,
                  max_num_seqs=BATCH + NUM_CHUNKS)
    for i in range(BATCH):
        out_len = 17 if i % 4 == 0 else 5 + i % 7  # 144 tokens computed: the next opens page 10
        r = Request(f"r{i}", list(range(1, 129)), SamplingParams(max_tokens=64), detok=None)
        r.output_token_ids = [7] * out_len
        r.num_computed_tokens = r.num_tokens - 1
        r.pages = a.allocate(s.pages_for(r.num_computed_tokens))
        r.status = RequestStatus.RUNNING
        s.running.append(r)
    for i in range(NUM_CHUNKS):
        s.add(Request(f"w{i}", list(range(1, 1001)), SamplingParams(max_tokens=16), detok=None))
    return s


def test_scheduler_plans_a_step(benchmark, budget):
    """Scheduler.schedule() of BATCH decodes plus NUM_CHUNKS prefill chunks; state rebuilt before
    every round (untimed). Correct: the test_allocator invariants plus the exact plan."""
    s, out = benchmark.pedantic(lambda s: (s, s.schedule()), setup=lambda: ((_step_state(),), {}),
                                rounds=300, iterations=1, warmup_rounds=5)
    budget(unit="one step planned", per_step=1, budget_pct=1)
    assert not out.preempted and out.num_tokens == BATCH + NUM_CHUNKS * CHUNK <= s.budget
    decodes, chunks = out.seqs[:BATCH], out.seqs[BATCH:]
    assert all(len(q.token_ids) == 1 and q.sample for q in decodes)
    assert [(q.request.request_id, len(q.token_ids), q.start_pos, q.sample) for q in chunks] == [
        (f"w{i}", CHUNK, 0, False) for i in range(NUM_CHUNKS)]
    # every request held 9 pages; a quarter opened a 10th; each chunk took CHUNK // PAGE
    assert s.allocator.num_used == BATCH * 9 + BATCH // 4 + NUM_CHUNKS * CHUNK // PAGE
    pages = [p for q in s.running + list(s.waiting) for p in q.pages]
    assert len(pages) == len(set(pages)) == s.allocator.num_used, "a page is owned twice or leaked"
    for q in out.seqs:
        assert len(q.request.pages) * PAGE >= q.start_pos + len(q.token_ids)


# ---- page allocator ----------------------------------------------------------------------------

def test_allocator_cycle(benchmark, budget):
    """One step's worth of allocator traffic on a half-full, fragmented pool: BATCH requests grow
    by one page each, a remote prefill reserves 256 pinned pages (a 4,096-token prompt), then
    everything is unpinned and freed. Correct: the test_allocator invariants."""
    a = PageAllocator(8192)
    held = a.allocate(4096)
    a.free(held[::2])  # fragment the free list
    held = held[1::2]
    start = a.num_free

    def cycle():
        grown = [a.allocate(1) for _ in range(BATCH)]
        remote = a.allocate(256, pinned=True)
        flat = [p for g in grown for p in g]
        a.pin(flat)
        a.unpin(flat)
        a.unpin(remote)
        a.free(flat)
        a.free(remote)
        return flat, remote

    flat, remote = benchmark(cycle)
    budget(unit=f"{BATCH} grows + 256-page reservation", per_step=1, budget_pct=1)
    assert len(set(flat) | set(remote)) == BATCH + 256, "a page was handed out twice"
    assert not (set(flat) | set(remote)) & set(held), "a held page was handed out"
    assert a.num_free == start
    with pytest.raises(PageStateError):
        a.free(remote[:1])  # already free: a double free is caught


# ---- prefix cache ----------------------------------------------------------------------------

def test_prefix_cache_lookup(benchmark, budget):
    """A new 4,096-token request looked up against a cache holding 256 published pages of an
    earlier conversation turn (16 tokens a page): chained hashes of its 255 full pages (fresh
    each round: a new request has no memo) and the longest match. Correct: exactly the shared
    prefix's pages, in order, and nothing taken (a peek)."""
    from pdkv.kv.prefix_cache import PrefixCache, cache_salt

    a = PageAllocator(1024)
    cache = PrefixCache(a, PAGE, cache_salt("bench", "float32", PAGE))
    g = torch.Generator().manual_seed(0)
    turn = torch.randint(0, 32000, (256 * PAGE,), generator=g).tolist()
    pages = a.allocate(256)
    for p, h in zip(pages, cache.hashes(turn, [], len(turn))):
        assert cache.publish(p, h)
    shared = 200 * PAGE  # the new request shares 200 pages, then diverges
    prompt = turn[:shared] + torch.randint(0, 32000, (4096 - shared,), generator=g).tolist()

    def lookup():
        return cache.match(cache.hashes(prompt, [], len(prompt) - 1))

    got = benchmark(lookup)
    budget(unit="one 4,096-token request's lookup", per_step=1 / 64, budget_pct=1, per_step_b1=1)
    assert got == pages[:200], "the longest cached chain is the shared prefix's pages, in order"
    assert a.num_used == 256, "a lookup takes no reference"
