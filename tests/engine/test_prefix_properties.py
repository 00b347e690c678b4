"""Prefix cache invariants under random sequences (hypothesis), no model needed.

A shadow "KV" stands in for the model: writing position i of a request stores the tuple of its
tokens [0, i] there (what the real KV at i depends on). Hand-made outputs drive the scheduler,
allocator and prefix cache through arrivals (local, remote, prefill-only; sharing prefixes),
aborts, finishes, preemptions and evictions under memory pressure, and remote landings. Checked:
- every position a forward pass reads holds exactly that request's prefix (a wrong match, an
  evicted page still in use, or a remote page matched before it landed would break it);
- a write never lands in a published page or one that another request holds;
- the allocator evicts only pages nobody holds, and only when no plain free page is left;
- a pinned page (a remote writer may still fill it) is never in the cache's index;
- at the end every page is free or cached-evictable with reference count 0, unpinned.
"""

from __future__ import annotations

from hypothesis import event, given, settings, target
from hypothesis import strategies as st

from pdkv.engine.params import SamplingParams
from pdkv.engine.request import Request, RequestStatus
from pdkv.engine.scheduler import Scheduler
from pdkv.kv import PageAllocator
from pdkv.kv.prefix_cache import PrefixCache

BASES = [[(7 * i + 3 * b) % 11 + 1 for i in range(40)] for b in range(3)]

# Prompts are a shared base's first 0..14 tokens plus up to 3 own ones, or ("repeat") an earlier
# request's prompt and outputs (a conversation's next turn, or the same prompt again): shared
# prefixes of every length (none, part of a page, whole pages, whole prompts) in a pool small
# enough to evict.
EVENT = st.tuples(st.sampled_from(["add", "add", "repeat", "add_remote", "add_remote", "add_prefill", "abort", "land", "release"]
                                  + ["step"] * 8),
                  st.integers(0, 2), st.integers(0, 14), st.lists(st.integers(1, 11), max_size=3),
                  st.integers(1, 4), st.booleans())


def _next_token(tokens: list[int]) -> int:
    return hash(tuple(tokens)) % 11 + 1  # a deterministic "greedy model": same sequence, same token


class Shadow:
    """The stand-in for the KV cache: kv[page][slot] = the prefix whose KV it holds."""

    def __init__(self, a: PageAllocator, cache: PrefixCache, page_size: int):
        self.a, self.cache, self.P = a, cache, page_size
        self.kv = [[None] * page_size for _ in range(a.num_total)]
        evicted = self.on_evict = a.on_evict  # the cache's own

        def on_evict(p: int) -> None:
            assert a.refcount(p) == 0, f"evicted page {p} is in use"
            assert not a._free, "a cached page was evicted while plain free pages were left"
            evicted(p)
        a.on_evict = on_evict

    def write(self, req: Request, start: int, n: int) -> None:
        tokens = req.prompt_token_ids + req.output_token_ids
        for pos in range(start, start + n):
            page = req.pages[pos // self.P]
            assert not self.a.is_cached(page), f"{req.request_id} writes position {pos} into published page {page}"
            assert self.a.refcount(page) == 1, f"{req.request_id} writes into page {page} that others hold"
            self.kv[page][pos % self.P] = tuple(tokens[:pos + 1])

    def check_reads(self, req: Request, end: int) -> None:
        tokens = req.prompt_token_ids + req.output_token_ids
        for pos in range(end):
            got = self.kv[req.pages[pos // self.P]][pos % self.P]
            assert got == tuple(tokens[:pos + 1]), f"{req.request_id} reads wrong KV at position {pos}"


@settings(max_examples=100, deadline=None)
@given(num_pages=st.integers(4, 24), page_size=st.sampled_from([1, 2, 4]), budget=st.integers(2, 24),
       chunk=st.integers(1, 16), events=st.lists(EVENT, min_size=30, max_size=80))
def test_prefix_cache_invariants(num_pages, page_size, budget, chunk, events):
    a = PageAllocator(num_pages)
    cache = PrefixCache(a, page_size, b"salt")
    s = Scheduler(a, page_size, budget, chunk, max_num_seqs=6, prefix_cache=cache)
    shadow = Shadow(a, cache, page_size)
    live: dict[str, Request] = {}
    held: list[list[int]] = []  # prefill-only pages kept after the last chunk until "release"
    seen: list[Request] = []
    for i, (ev, base, plen, suffix, mtok, reuse) in enumerate(events):
        prompt = BASES[base][:plen] + suffix
        if ev == "repeat" and seen:
            old = seen[plen % len(seen)]
            prompt = old.prompt_token_ids + old.output_token_ids[:len(suffix)]
            ev = "add"
        if not prompt or s.pages_for(len(prompt) + mtok) > num_pages:
            continue  # the engine's validation refuses these
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=mtok), detok=None)
        seen.append(r)
        if ev == "add":
            s.add(r)
            live[r.request_id] = r
        elif ev in ("add_remote", "add_prefill"):
            if ev == "add_remote" and len(prompt) < 2:
                continue
            cached = s.cached_prefix(r) if reuse else 0
            free = a.num_free
            ok = s.add_remote(r, num_cached=cached) if ev == "add_remote" else s.add_prefill(r, cached)
            if not ok:  # not free now: nothing taken (the engine's admission answers "not yet")
                assert a.num_free == free and not r.pages
                continue
            live[r.request_id] = r
        elif ev == "abort" and live:
            s.abort(live.pop(sorted(live)[plen % len(live)]))
        elif ev == "land" and s.remote:
            r = list(s.remote.values())[plen % len(s.remote)]
            for p in r.pages[r.num_cached_tokens // page_size:]:
                assert a.is_pinned(p)
            tokens = r.prompt_token_ids
            for pos in range(r.num_cached_tokens, r.num_cached_tokens + r.num_external_tokens):
                shadow.kv[r.pages[pos // page_size]][pos % page_size] = tuple(tokens[:pos + 1])
            s.remote_ready(r)
        elif ev == "release" and held:
            a.free(held.pop(plen % len(held)))
        elif ev.startswith("step"):
            out = s.schedule()
            for seq in out.seqs:
                assert seq.token_ids, f"{seq.request.request_id} scheduled with nothing to compute"
                shadow.check_reads(seq.request, seq.start_pos)
                shadow.write(seq.request, seq.start_pos, len(seq.token_ids))
            s.update_computed(out)
            for seq in out.seqs:
                r = seq.request
                if r.prefill_only and r.num_computed_tokens == r.num_prompt_tokens:
                    held.append(s.detach(r))
                    r.status = RequestStatus.FINISHED
                    live.pop(r.request_id, None)
                elif seq.sample:
                    r.output_token_ids.append(_next_token(r.prompt_token_ids + r.output_token_ids))
                    if len(r.output_token_ids) >= r.params.max_tokens:
                        s.finish(r, "length")
                        live.pop(r.request_id, None)
        for r in s.remote.values():
            for p in r.pages[r.num_cached_tokens // page_size:]:
                assert cache.hash_of(p) is None, f"page {p} is matched before its remote writes landed"
    for r in list(live.values()):
        s.abort(r)
    for pages in held:
        a.free(pages)
    assert not s.running and not s.waiting and not s.remote
    assert all(a.refcount(p) == 0 and not a.is_pinned(p) for p in range(num_pages))
    assert a.num_free == num_pages and a.num_evictable == len(cache)
    target(float(cache.num_hit_tokens + a.num_evictions), label="hits + evictions")
    event(f"reused cached pages: {cache.num_hit_tokens > 0}")
    event(f"evicted cached pages: {a.num_evictions > 0}")
    a.on_evict = shadow.on_evict  # a flush, not an eviction the allocator needed
    a.evict_all()
    assert len(cache) == 0 and a.num_evictable == 0 and a.num_free == num_pages
