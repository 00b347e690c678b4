"""The scheduler's side of the prefix cache (pdkv/kv/prefix_cache.py): which leading pages of a
request are cached, taking them, giving them back, and publishing the pages a request completed.

A mixin of ``Scheduler`` (pdkv/engine/scheduler.py), which owns ``allocator``, ``page_size`` and
``cache`` (None: no prefix cache); kept on the scheduler itself so every caller and every
deliberately broken variant (tools/mutants_catalog.py) sees one object. The scheduler sees
request ids, token counts and page ids, never tensors.
"""

from __future__ import annotations

from pdkv.engine.request import Request
from pdkv.kv.allocator import PageAllocator
from pdkv.kv.prefix_cache import PrefixCache


class PrefixReuse:
    """Cached full pages into a request (``_take_cached``, ``_reuse``), back out (``_unreuse``), and a
    request's completed full pages into the cache (``publish``)."""

    allocator: PageAllocator
    page_size: int
    cache: PrefixCache | None

    def cached_prefix(self, req: Request) -> int:
        """Leading tokens of ``req`` whose KV the cache holds now, in whole pages and at most
        ``num_tokens - 1`` (its last token is always computed); a peek, nothing is taken."""
        if self.cache is None:
            return 0
        return len(self.cache.match(self._hashes(req, req.num_tokens - 1))) * self.page_size

    def _hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        if len(req.page_hashes) >= num_tokens // self.page_size:
            return req.page_hashes[:num_tokens // self.page_size]
        return self.cache.hashes(req.prompt_token_ids + req.output_token_ids, req.page_hashes, num_tokens)

    def _take_cached(self, req: Request, num_tokens: int) -> list[int]:
        """References to the cached pages of ``req``'s first ``num_tokens`` tokens (a multiple of
        the page size the caller just found with ``cached_prefix``)."""
        if num_tokens <= 0:
            return []
        if num_tokens % self.page_size or num_tokens > self.cached_prefix(req):
            raise ValueError(f"request {req.request_id!r}: {num_tokens} tokens are not a cached prefix "
                             f"(cached: {self.cached_prefix(req)}, page size {self.page_size})")
        return self.cache.acquire(self._hashes(req, num_tokens))

    def _reuse(self, req: Request) -> None:
        """A local request about to be scheduled with no pages takes its longest cached chain."""
        pages = self.cache.acquire(self._hashes(req, req.num_tokens - 1))
        req.pages = pages
        req.num_computed_tokens = req.num_cached_tokens = len(pages) * self.page_size
        req.num_published_pages = len(pages)

    def _unreuse(self, req: Request) -> None:
        self.allocator.free(req.pages)  # back to the LRU pool, contents kept
        req.pages, req.num_computed_tokens, req.num_published_pages = [], 0, 0

    def publish(self, req: Request) -> None:
        """Publishes every full page of ``req`` whose KV is complete (positions below
        ``num_computed_tokens``: computed by a finished forward pass, or landed)."""
        if self.cache is None:
            return
        # NOTE: only committed tokens: a verification step computes KV for draft tokens too
        # (speculative decoding); a page still holding drafts is neither final nor hashable.
        full = min(min(req.num_computed_tokens, req.num_tokens) // self.page_size, len(req.pages))
        if full <= req.num_published_pages:
            return
        hashes = self._hashes(req, full * self.page_size)
        for k in range(req.num_published_pages, full):
            self.cache.publish(req.pages[k], hashes[k])
        req.num_published_pages = full
