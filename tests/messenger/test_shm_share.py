"""Shared hand-off on the shm transport: a writer's own pages made the receiver's granted pages.

``share_pages`` puts the granted memory at the writer's local address, so what the writer
computes there is in the receiver already and the write that follows moves nothing (counted:
``shared_writes``, against ``copied_writes``); unsharing, revoking the grant or the receiver
going away gives the writer its own pages back (their contents from before), and nothing of the
receiver stays mapped in the writer (read from /proc/self/maps).
"""
from __future__ import annotations

import mmap
import os
import time

import numpy as np
import pytest

from pdkv._messenger import InvalidRequestError, Messenger
from pdkv.transports import ShmOptions, TcpOptions

PAGE = os.sysconf("SC_PAGE_SIZE")
SIZE = 16 * PAGE


def _buffer(fill: int) -> tuple[mmap.mmap, np.ndarray]:
    """Page-aligned private memory (as the KV buffer of a node), filled with ``fill``."""
    mm = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(mm, dtype=np.uint8)
    a[:] = fill
    return mm, a


def _wait(m: Messenger, kind: str, timeout: float = 10.0) -> list:
    got, end = [], time.time() + timeout
    while time.time() < end and not any(e.kind == kind for e in got):
        got += m.drain()
        time.sleep(0.01)
    return got


@pytest.fixture
def pair():
    """writer a (its own region: 0xAA), receiver b (region 0x00, shared memory), connected."""
    a, b = Messenger("shm", 11, ShmOptions()), Messenger("shm", 12, ShmOptions())
    mma, src = _buffer(0xAA)
    mmb, dst = _buffer(0)
    lkey, rkey = a.register(src), b.register(dst)
    ca, ia = a.prepare(12)
    cb, ib = b.prepare(11)
    a.complete(ca, ib)
    b.complete(cb, ia)
    yield a, b, ca, lkey, rkey, src, dst
    a.close()
    b.close()  # the mappings go with the arrays (mmap objects closed by GC)


def test_computed_in_place_lands_without_a_copy_and_unshare_gives_own_pages_back(pair):
    a, b, ca, lkey, rkey, src, dst = pair
    b.grant_range(rkey, 11, 4 * PAGE, 4 * PAGE)
    a.share_pages(ca, lkey, 2 * PAGE, rkey, 4 * PAGE, 4 * PAGE)
    assert (src[2 * PAGE:6 * PAGE] == 0).all()  # the receiver's pages, seen through a's address
    src[2 * PAGE:6 * PAGE] = np.arange(4 * PAGE, dtype=np.uint8)  # "computed" by a
    assert (dst[4 * PAGE:8 * PAGE] == np.arange(4 * PAGE, dtype=np.uint8)).all()  # in b at once
    b.expect(9, 2)
    a.write(ca, lkey, 2 * PAGE, rkey, 4 * PAGE, 2 * PAGE, imm=9)  # shared: moves nothing
    a.write(ca, lkey, 0, rkey, 6 * PAGE, PAGE, imm=9)  # a's own page 0: a real copy
    assert any(e.kind == "imm_done" for e in _wait(b, "imm_done"))
    st = a.stats()
    assert (st["shared_writes"], st["copied_writes"], st["copied_bytes"]) == (1, 1, PAGE)
    assert (dst[6 * PAGE:7 * PAGE] == 0xAA).all()  # the copy landed over the shared page
    a.unshare_pages(ca, lkey, 2 * PAGE, 4 * PAGE)
    assert (src[2 * PAGE:6 * PAGE] == 0xAA).all()  # a's own pages, as before sharing
    src[2 * PAGE:6 * PAGE] = 1
    assert dst[4 * PAGE] == 0  # no longer the receiver's
    a.unshare_pages(ca, lkey, 2 * PAGE, 4 * PAGE)  # not shared any more: no error


def test_revoke_ends_the_sharing_and_leaves_nothing_of_the_receiver_mapped(pair):
    a, b, ca, lkey, rkey, src, dst = pair
    before = _mapped_of_b_all()
    b.grant_range(rkey, 11, 0, 8 * PAGE)
    a.share_pages(ca, lkey, 8 * PAGE, rkey, 0, 8 * PAGE)
    assert _mapped_of_b_all() > before
    b.revoke_range(rkey, 11, 0, 8 * PAGE)
    assert (src[8 * PAGE:] == 0xAA).all()  # a's own pages back before revoke returned
    src[8 * PAGE:] = 3
    assert (dst[:8 * PAGE] == 0).all()


def test_receiver_gone_gives_the_pages_back(pair):
    a, b, ca, lkey, rkey, src, dst = pair
    b.grant_range(rkey, 11, 0, 4 * PAGE)
    a.share_pages(ca, lkey, 0, rkey, 0, 4 * PAGE)
    b.close()
    end = time.time() + 10
    while time.time() < end and src[0] != 0xAA:
        time.sleep(0.02)
    assert (src[:4 * PAGE] == 0xAA).all()


def test_refusals_name_what_is_wrong(pair):
    a, b, ca, lkey, rkey, src, dst = pair
    with pytest.raises(InvalidRequestError, match="not granted"):
        a.share_pages(ca, lkey, 0, rkey, 0, PAGE)  # nothing granted
    b.grant_range(rkey, 11, 0, 4 * PAGE)
    with pytest.raises(InvalidRequestError, match="whole pages"):
        a.share_pages(ca, lkey, 100, rkey, 0, PAGE)
    with pytest.raises(Exception, match="outside local region"):
        a.share_pages(ca, lkey, SIZE - PAGE, rkey, 0, 2 * PAGE)  # past the end of a's region
    assert (src == 0xAA).all()
    t = Messenger("tcp", 13, TcpOptions(host="127.0.0.1"))
    try:
        with pytest.raises(InvalidRequestError, match="cannot share pages"):
            t.share_pages(1, 1, 0, 1, 0, PAGE)
    finally:
        t.close()


def _mapped_of_b_all() -> int:
    """Bytes of unnamed /dev/shm files mapped in this process (both messengers live here)."""
    n = 0
    with open("/proc/self/maps") as f:
        for line in f:
            p = line.split(maxsplit=5)
            if len(p) == 6 and p[5].startswith("/dev/shm/#"):
                lo, hi = (int(x, 16) for x in p[0].split("-"))
                n += hi - lo
    return n
