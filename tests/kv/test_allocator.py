"""The page allocator under random sequences (hypothesis) and the KV cache's memory layout, no
model needed: no page is handed out twice, every page comes back, the free count returns to
its start; a cache over a caller's buffer puts each page where page_offset says."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.errors import OutOfPages, PageStateError
from pdkv.kv import KVCache, PageAllocator

OPS = st.lists(st.tuples(st.sampled_from(["alloc", "alloc_pinned", "free_one", "abort", "share"]),
                         st.integers(0, 12), st.integers(0, 1000)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(num_pages=st.integers(1, 40), ops=OPS)
def test_allocator_random_sequences(num_pages, ops):
    a = PageAllocator(num_pages)
    owners: list[list[int]] = []  # each owner holds one reference to each of its pages
    for op, n, pick in ops:
        if op.startswith("alloc"):
            before = a.num_free
            if n > before:
                with pytest.raises(OutOfPages):
                    a.allocate(n)
                assert a.num_free == before  # a refused allocation changes nothing
                continue
            pages = a.allocate(n, pinned=op == "alloc_pinned")
            held = {p for o in owners for p in o}
            assert len(set(pages)) == n and not held & set(pages), "a page was handed out twice"
            owners.append(pages)
        elif owners:
            owner = owners[pick % len(owners)]
            if op == "share":
                a.incref(owner)
                owners.append(list(owner))
            elif op == "free_one" and owner:
                page = owner.pop(pick % len(owner))
                if a.is_pinned(page) and a.refcount(page) == 1:
                    with pytest.raises(PageStateError):
                        a.free([page])
                    a.unpin([page])
                a.free([page])
            elif op == "abort":
                owners.remove(owner)
                a.unpin([p for p in owner if a.refcount(p) == 1])
                a.free(owner)
        assert a.num_free + len({p for o in owners for p in o}) == num_pages
    for owner in owners:
        a.unpin([p for p in owner if a.refcount(p) == 1])
        a.free(owner)
    assert a.num_free == num_pages
    with pytest.raises(PageStateError):  # nothing left to free: a double free is caught
        a.free([0])


def test_double_free_is_refused_and_changes_nothing():
    a = PageAllocator(4)
    pages = a.allocate(2)
    a.free(pages)
    with pytest.raises(PageStateError, match="double free"):
        a.free(pages)
    with pytest.raises(PageStateError):
        a.free([3, 3])
    assert a.num_free == 4



def test_kv_cache_over_a_caller_buffer():
    import torch

    kv = KVCache(num_layers=3, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    assert kv.layer(0).shape == (5, 2, 2, 4, 8) and kv.page_nbytes == 2 * 2 * 4 * 8 * 4
    buf = torch.zeros(kv.nbytes + 7, dtype=torch.uint8)
    kv = KVCache(3, 5, 4, 2, 8, torch.float32, layout="NHD", buffer=buf)
    assert kv.layer(1).shape == (5, 2, 4, 2, 8)
    kv.layer(2)[3].fill_(1.0)
    base = buf.data_ptr()
    assert kv.data_ptr(2) == base + kv.page_offset(2, 0)
    start = kv.page_offset(2, 3)
    assert buf[start:start + kv.page_nbytes].view(torch.float32).eq(1.0).all()
    assert buf[:start].eq(0).all() and buf[start + kv.page_nbytes:].eq(0).all()
    with pytest.raises(ValueError, match="buffer holds"):
        KVCache(3, 5, 4, 2, 8, torch.float32, buffer=bytearray(100))
    with pytest.raises(ValueError, match="layout"):
        KVCache(3, 5, 4, 2, 8, torch.float32, layout="HDN")
