"""Page allocator with reference counts and a pinned (non-evictable) flag.

A page is free when its reference count is 0. ``allocate`` hands out free pages with count 1;
``incref`` lets a second owner share a page (prefix sharing, a prefill and its transfer);
``free`` drops one reference and returns the page to the free list when the count reaches 0.

NOTE: a page is handed out at most once while in use, and freed exactly once: freeing a page whose
count is already 0 raises PageStateError instead of corrupting the free list.
NOTE: a pinned page is one a remote writer will fill; the scheduler never evicts the request that
holds it, and it must be unpinned before its last reference is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable

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

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_total - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int, pinned: bool = False) -> list[int]:
        """Returns ``n`` pages with reference count 1, or raises OutOfPages and allocates nothing."""
        if n < 0:
            raise ValueError(f"allocate: n must be >= 0, got {n}")
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} of {self.num_total} are free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
            self._pinned[p] = pinned
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise PageStateError(f"incref of free page {p}")
            self._refs[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drops one reference from each page; checks all pages before changing any."""
        pages = list(pages)
        seen: dict[int, int] = {}
        for p in pages:
            seen[p] = seen.get(p, 0) + 1
            if not 0 <= p < self.num_total or self._refs[p] < seen[p]:
                raise PageStateError(f"free of page {p} that is not allocated (double free)")
            if self._pinned[p] and self._refs[p] == seen[p]:
                raise PageStateError(f"free of pinned page {p}: unpin it first")
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def pin(self, pages: Iterable[int]) -> None:
        for p in pages:
            self._check_owned(p)
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
