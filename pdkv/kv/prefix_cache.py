"""Automatic prefix caching: full KV pages found again by a hash of everything before them.

Page ``k`` of a token sequence (tokens [k*P, (k+1)*P)) is named by::

    h[k] = blake2b(h[k-1] || tokens of page k)        h[-1] = salt

so equal hashes mean equal tokens *and* equal everything before them: the page's KV is the same.
The salt folds in what else changes KV contents (the model's fingerprint, dtype, page size; see
``cache_salt``), so hashes can also be compared across nodes serving the same model. Only full
pages get a hash; a partly filled last page is never shared.

The index maps hash -> page for pages whose contents are complete (``publish``). Pages no request
holds stay in the allocator's LRU pool (pdkv/kv/allocator.py) and keep their entry until the
allocator needs the space and evicts them (``on_evict`` drops the entry first). ``match`` walks a
request's hashes from the start and stops at the first miss: the longest cached chain.

Invariants the engine keeps (tests/engine/test_prefix_cache.py checks them):
- a published page is immutable: a request reuses at most the pages strictly before the page
  holding its last known token (it always computes that token, and only writes positions at or
  after its computed count, so it never writes a shared page);
- a page is published only once its KV is complete: computed by a finished forward pass, or for
  remote KV, after every write landed (``LLMEngine.remote_kv_ready``); a pinned page (a remote
  writer may still fill it) can never be marked cached (the allocator refuses);
- one page per hash: a second request that computed the same page meanwhile keeps its copy
  private (it is freed, not cached, when the request ends).

What the disaggregated roles use (pdkv/disagg's connectors do; PREFILL carries ``cached``):
- decode node: before ``KVConnector.admission(req)`` the engine sets ``req.num_cached_tokens`` to
  the prompt tokens this node already holds (whole pages, at most all but the last token). A
  connector that returns ``Admission(num_external_tokens=n - 1 - req.num_cached_tokens,
  reuse_cached=True)`` gets the cached pages (shared, unpinned) followed by pinned pages for the
  rest: PREFILL names the skip (``req.num_cached_tokens``) and only the pages
  ``req.pages[req.num_cached_tokens // page_size:]`` are written. When their writes landed, ``remote_kv_ready``
  publishes them: that is the one step that makes remotely written pages visible.
- prefill node: ``Admission(prefill_only=True, reuse_cached=True)`` takes its
  own cached prefix and computes only the rest; the reused pages are ``req.pages[:n // P]`` and
  the connector must still send those the decode node lacks (they are never in a computed chunk).
- routing: ``LLMEngine.cached_prefix_tokens(prompt)`` peeks at how much of a prompt a node
  holds; the chained hashes are salted by model, dtype and page size only, so equal prompts hash
  equally on every node serving the same checkpoint.
Without ``reuse_cached=True`` a request with external KV or prefill-only reuses nothing (today's
connectors), but its complete pages are still published.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence

from pdkv.kv.allocator import PageAllocator


def cache_salt(model_fingerprint: str, dtype: str, page_size: int) -> bytes:
    """The chain's root: pages of different models, dtypes or page sizes never match."""
    key = json.dumps({"model": model_fingerprint, "dtype": dtype, "page_size": page_size}, sort_keys=True)
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def chain_hashes(token_ids: Sequence[int], page_size: int, salt: bytes, hashes: list[bytes],
                 num_pages: int) -> list[bytes]:
    """Extends ``hashes`` (the first pages' hashes, memoized by the caller) to the first
    ``num_pages`` full pages of ``token_ids`` and returns it."""
    parent = hashes[-1] if hashes else salt
    for k in range(len(hashes), num_pages):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("l", token_ids[k * page_size:(k + 1) * page_size]).tobytes())
        parent = h.digest()
        hashes.append(parent)
    return hashes


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, salt: bytes):
        self.allocator, self.page_size, self.salt = allocator, page_size, salt
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        allocator.on_evict = self._evicted
        # vLLM's counting: per lookup, the request's tokens and the tokens found cached.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_queries = 0

    def __len__(self) -> int:
        return len(self._page_of)

    def hashes(self, token_ids: Sequence[int], memo: list[bytes], num_tokens: int) -> list[bytes]:
        """The chained hashes of the full pages among the first ``num_tokens`` tokens."""
        return chain_hashes(token_ids, self.page_size, self.salt, memo, num_tokens // self.page_size)

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """Pages of the longest cached chain of ``hashes`` (a peek: no reference is taken)."""
        pages = []
        for h in hashes:
            p = self._page_of.get(h)
            if p is None:
                break
            pages.append(p)
        return pages

    def acquire(self, hashes: Sequence[bytes]) -> list[int]:
        """``match`` and take one reference to each page (an evictable one leaves the LRU pool)."""
        pages = self.match(hashes)
        self.allocator.incref(pages)
        return pages

    def publish(self, page: int, h: bytes) -> bool:
        """Makes ``page`` (complete, held by the caller) findable by ``h``. False: another page
        already holds these contents (this one stays private) or it is already published."""
        if h in self._page_of or page in self._hash_of:
            return False
        self.allocator.mark_cached(page)  # refuses a pinned page
        self._page_of[h] = page
        self._hash_of[page] = h
        return True

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queries += 1
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def hash_of(self, page: int) -> bytes | None:
        return self._hash_of.get(page)

    def _evicted(self, page: int) -> None:
        h = self._hash_of.pop(page, None)
        if h is not None:
            del self._page_of[h]
