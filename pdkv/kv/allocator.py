"""Page allocator with reference counts, a pinned (non-evictable) flag and an LRU pool of cached
pages.

A page is in one of three states::

    free ──allocate──► in use (refs >= 1) ──free (last ref)──► free         (contents not cached)
                         │        ▲     └─────free (last ref)──► evictable  (contents cached)
               mark_cached        └──────────incref──────────────┘   │
                                                                    ▼ allocate (LRU first)
                                                         evicted (on_evict) → in use

``allocate`` hands out free pages with count 1, and only when none is left evicts the least
recently used cached page (the prefix cache hears it through ``on_evict`` and forgets the page's
hash first). ``incref`` lets a second owner share a page (prefix sharing, a prefill and its
transfer) and takes an evictable page back into use. ``free`` drops one reference; at count 0 a
cached page joins the LRU's tail, any other page the free list. ``num_free`` counts both: an
evictable page is allocatable.

NOTE: a page is handed out at most once while in use, and freed exactly once: freeing a page whose
count is already 0 raises PageStateError instead of corrupting the free list.
NOTE: a pinned page is one a remote writer will fill; the scheduler never evicts the request that
holds it, it must be unpinned before its last reference is dropped, and it can never be marked
cached (a page is visible to the prefix cache only once its writes have landed).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from pdkv.errors import OutOfPages, PageStateError


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"PageAllocator: num_pages must be >= 1, got {num_pages}")
        self.num_total = num_pages
        # Pop from the end: low page ids first, which keeps a small run's pages compact.
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self._pinned = [False] * num_pages
        self._cached = [False] * num_pages  # contents published in the prefix cache
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, refs 0; oldest first
        # Called with a cached page just before it is reused for other contents (set by the
        # prefix cache); it must forget the page, nothing else.
        self.on_evict: Callable[[int], None] | None = None
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages ``allocate`` can hand out: free and evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_total - self.num_free

    @property
    def num_evictable(self) -> int:
        """Pages no request holds whose cached contents are kept until the space is needed."""
        return len(self._evictable)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    def allocate(self, n: int, pinned: bool = False) -> list[int]:
        """Returns ``n`` pages with reference count 1, or raises OutOfPages and allocates nothing.
        Free pages go first; cached pages are evicted (least recently used first) only for the rest."""
        if n < 0:
            raise ValueError(f"allocate: n must be >= 0, got {n}")
        if n > self.num_free:
            raise OutOfPages(f"asked for {n} pages, {self.num_free} of {self.num_total} are free")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.pop()
            else:
                p, _ = self._evictable.popitem(last=False)
                self._uncache(p)
                self.num_evictions += 1
            pages.append(p)
        for p in pages:
            self._refs[p] = 1
            self._pinned[p] = pinned
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """One more reference to each page: in use, or cached and evictable (taken back into use)."""
        pages = list(pages)
        for p in pages:
            if not 0 <= p < self.num_total or (self._refs[p] <= 0 and not self._cached[p]):
                raise PageStateError(f"incref of free page {p}")
        for p in pages:
            if self._refs[p] == 0:
                del self._evictable[p]
            self._refs[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drops one reference from each page; checks all pages before changing any. Pages reaching
        count 0 are queued in reverse order: a request's last pages (the least shared) are
        evicted before its first ones."""
        pages = list(pages)
        seen: dict[int, int] = {}
        for p in pages:
            seen[p] = seen.get(p, 0) + 1
            if not 0 <= p < self.num_total or self._refs[p] < seen[p]:
                raise PageStateError(f"free of page {p} that is not allocated (double free)")
            if self._pinned[p] and self._refs[p] == seen[p]:
                raise PageStateError(f"free of pinned page {p}: unpin it first")
        for p in reversed(pages):
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if self._cached[p]:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    def mark_cached(self, page: int) -> None:
        """The page's contents are complete and published (prefix cache): keep them when it is freed."""
        self._check_owned(page)
        if self._pinned[page]:
            raise PageStateError(f"page {page} is pinned (a remote write may still land): it cannot be cached")
        self._cached[page] = True

    def is_cached(self, page: int) -> bool:
        return self._cached[page]

    def evict_all(self) -> int:
        """Drops every evictable page's cached contents (they become plain free pages); returns how many."""
        n = len(self._evictable)
        while self._evictable:
            p, _ = self._evictable.popitem(last=False)
            self._uncache(p)
            self._free.append(p)
        return n

    def _uncache(self, p: int) -> None:
        self._cached[p] = False
        if self.on_evict is not None:
            self.on_evict(p)

    def pin(self, pages: Iterable[int]) -> None:
        for p in pages:
            self._check_owned(p)
            if self._cached[p]:
                raise PageStateError(f"page {p} is cached (shared, immutable): a remote writer cannot fill it")
            self._pinned[p] = True

    def unpin(self, pages: Iterable[int]) -> None:
        for p in pages:
            self._check_owned(p)
            self._pinned[p] = False

    def is_pinned(self, page: int) -> bool:
        return self._pinned[page]

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def _check_owned(self, p: int) -> None:
        if not 0 <= p < self.num_total or self._refs[p] <= 0:
            raise PageStateError(f"page {p} is not allocated")
