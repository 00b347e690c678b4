"""What the proposers with their own paged KV cache share (draft.py, mtp.py): a page allocator
over that cache, one state per request (its ``pages``, whatever else the proposer keeps), the
disaggregated hand-off hook, and freeing a request's pages when it leaves."""

from __future__ import annotations

from pdkv.engine.request import Request
from pdkv.kv import KVCache, PageAllocator


class PagedProposer:
    def __init__(self, kv: KVCache):
        self.kv = kv
        self.allocator = PageAllocator(kv.num_pages)
        self.states: dict = {}  # request id -> the proposer's state (has ``pages``)
        # Disaggregated decode (pdkv/disagg/spec_handoff.py): handoff(req) -> (pages, num_tokens,
        # extra) | None, the proposer's KV of req's first prompt positions, computed remotely
        self.handoff = None

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.kv.page_size)

    def _grow_to(self, st, num_tokens: int) -> bool:
        """Gives ``st`` the pages ``num_tokens`` positions need; False (nothing taken) if not free."""
        need = self._pages_for(num_tokens) - len(st.pages)
        if need > 0:
            if not self.allocator.can_allocate(need):
                return False
            st.pages.extend(self.allocator.allocate(need))
        return True

    def finished(self, req: Request) -> None:
        st = self.states.pop(req.request_id, None)
        if st is not None:
            self.allocator.free(st.pages)

    @property
    def num_pages_used(self) -> int:
        return self.allocator.num_used
