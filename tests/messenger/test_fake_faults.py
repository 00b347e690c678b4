"""The FAKE transport's injected faults, seen through the real core: immediate counting,
batch accounting and error reporting under drop / delay / duplicate / corrupt / error / vanish.
In-process: the fake's endpoints are two Messengers of this test."""
from __future__ import annotations

import select
import time

import numpy as np
import pytest

from pdkv._messenger import InvalidRequestError, Messenger, PeerConnectionError

PAGE = 256


@pytest.fixture
def pair():
    a, b = Messenger("fake", 1), Messenger("fake", 2)
    src = np.arange(16 * PAGE, dtype=np.uint8)
    dst = np.zeros(16 * PAGE, dtype=np.uint8)
    lkey, rkey = a.register(src), b.register(dst)
    b.grant(rkey, 1)
    ca, ia = a.prepare(2)
    cb, ib = b.prepare(1)
    a.complete(ca, ib)
    b.complete(cb, ia)
    yield a, b, ca, lkey, rkey, src, dst
    a.close()
    b.close()


def events(m, until=None, timeout=2.0):
    out, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        select.select([m.fileno()], [], [], 0.05)
        out += m.drain()
        if until is not None and until(out):
            break
    return out


def wait_imms(m, n):
    """Until m's poller has counted n immediates (fake writes land at once, counting is async);
    the deadline is a hang guard only."""
    deadline = time.monotonic() + 30
    while m.stats()["imms"] < n and time.monotonic() < deadline:
        time.sleep(0.005)


def post(a, ca, lkey, rkey, n, imm=1, tag=0):
    pages = list(range(n))
    return a.write_pages(ca, lkey, rkey, pages, pages, seg_len=PAGE, src_page_stride=PAGE,
                         dst_page_stride=PAGE, imm=imm, tag=tag)


def test_drop_leaves_the_count_short_and_forget_reports_it(pair):
    a, b, ca, lkey, rkey, src, dst = pair
    a.add_fault("drop", first=2)
    b.expect(1, 4)
    post(a, ca, lkey, rkey, 4)
    done = events(a, lambda e: e)
    assert [(e.kind, e.count, e.num_errors) for e in done] == [("batch_done", 4, 0)]
    wait_imms(b, 3)
    assert not [e for e in events(b, timeout=0.2) if e.kind == "imm_done"]
    assert b.forget(1) == 3  # three landed, one was dropped: the caller times the request out
    assert (dst[2 * PAGE:3 * PAGE] == 0).all() and (dst[3 * PAGE:4 * PAGE] == src[3 * PAGE:4 * PAGE]).all()


def test_delayed_writes_and_early_immediates_count_exactly_once(pair):
    a, b, ca, lkey, rkey, src, dst = pair
    a.add_fault("delay", first=0, count=2, delay_us=2_000_000)
    post(a, ca, lkey, rkey, 6, imm=9)
    wait_imms(b, 4)
    # four arrived before expect, two are still on their way (2 s late: far beyond the wait
    # above, even on a loaded machine)
    assert b.stats()["imms"] == 4
    b.expect(9, 6)
    assert not [e for e in b.drain() if e.kind == "imm_done"]  # four of six: not yet
    evs = events(b, lambda e: any(x.kind == "imm_done" for x in e), timeout=30)
    assert [(e.kind, e.imm, e.count) for e in evs] == [("imm_done", 9, 6)]
    assert (dst[:6 * PAGE] == src[:6 * PAGE]).all()
    assert not events(b, timeout=0.2)


def test_duplicate_is_visible_as_an_overcount(pair):
    a, b, ca, lkey, rkey, src, dst = pair
    a.add_fault("duplicate", first=0)
    post(a, ca, lkey, rkey, 3, imm=4)
    wait_imms(b, 4)
    with pytest.raises(InvalidRequestError, match="more than the 3 expected"):
        b.expect(4, 3)  # four landed for three writes
    # expected before arrival, the counter fires at the count and the extra starts a new one
    b.expect(5, 3)
    a.add_fault("duplicate", first=3)
    post(a, ca, lkey, rkey, 3, imm=5)
    evs = events(b, lambda e: any(x.kind == "imm_done" for x in e))
    assert [(e.kind, e.count) for e in evs] == [("imm_done", 3)]
    assert b.forget(5) == 1


def test_corrupt_header_fails_both_sides_and_drops_the_connection(pair):
    a, b, ca, lkey, rkey, src, dst = pair
    a.add_fault("corrupt", first=1)
    post(a, ca, lkey, rkey, 3, tag=5)
    ea = events(a, lambda e: any(x.kind == "batch_done" for x in e))
    batch = [e for e in ea if e.kind == "batch_done"][0]
    assert batch.num_errors == 2 and batch.status < 0  # the corrupt one and the one after it
    assert any(e.kind == "error" and "corrupted" in e.reason for e in ea)
    eb = events(b, lambda e: e)
    assert any(e.kind == "error" and e.peer == 1 and "corrupted" in e.reason for e in eb)
    assert (dst[PAGE:] == 0).all()
    with pytest.raises(PeerConnectionError):
        post(a, ca, lkey, rkey, 1)


def test_error_completion_is_counted_per_batch(pair):
    a, b, ca, lkey, rkey, src, dst = pair
    a.add_fault("error", first=1, count=2)
    post(a, ca, lkey, rkey, 4, tag=3)
    [batch] = [e for e in events(a, lambda e: e) if e.kind == "batch_done"]
    assert (batch.tag, batch.count, batch.num_errors, batch.status) == (3, 4, 2, -5)
    assert "injected" in batch.reason


def test_vanishing_peer_fails_the_rest_and_tells_the_other_side(pair):
    a, b, ca, lkey, rkey, src, dst = pair
    a.add_fault("vanish", first=2)
    b.expect(1, 4)
    post(a, ca, lkey, rkey, 4, tag=1)
    ea = events(a, lambda e: any(x.kind == "batch_done" for x in e))
    [batch] = [e for e in ea if e.kind == "batch_done"]
    assert batch.num_errors == 2
    assert any(e.kind == "error" and "disappeared" in e.reason for e in ea)
    eb = events(b, lambda e: e)
    assert [e.kind for e in eb] == ["error"] and eb[0].peer == 1
    assert b.forget(1) == 2


def test_deregister_with_a_delayed_write_in_flight_is_busy(pair):
    a, b, ca, lkey, rkey, src, dst = pair
    a.add_fault("delay", first=0, delay_us=200_000)
    post(a, ca, lkey, rkey, 1)
    with pytest.raises(Exception) as ei:
        a.deregister(lkey)
    assert type(ei.value).__name__ == "RegionBusyError" and ei.value.errno == 16
    with pytest.raises(Exception, match="in flight"):
        a.deregister(lkey)  # still busy, and it says why
    events(a, lambda e: e)
    a.deregister(lkey)


def test_events_reach_an_asyncio_loop_through_fileno(pair):
    """The eventfd wakes an event loop (add_reader); drain() in the callback never blocks."""
    import asyncio

    a, b, ca, lkey, rkey, src, dst = pair

    async def scenario():
        loop = asyncio.get_running_loop()
        got: asyncio.Future = loop.create_future()

        def on_ready():
            for e in b.drain():
                if e.kind == "imm_done" and not got.done():
                    got.set_result(e)

        loop.add_reader(b.fileno(), on_ready)
        try:
            b.expect(3, 5)
            await asyncio.sleep(0.05)  # the loop keeps running while nothing has landed
            post(a, ca, lkey, rkey, 5, imm=3)
            return await asyncio.wait_for(got, 5)
        finally:
            loop.remove_reader(b.fileno())

    ev = asyncio.run(scenario())
    assert (ev.imm, ev.count, ev.bytes) == (3, 5, 5 * PAGE)
