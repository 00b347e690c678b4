"""The messenger from Python: the Cython boundary of write_pages / queue_pages for 1,024 pages,
expect + delivery of 10,000 immediates through the FAKE transport (in-process, so the numbers
are the core's and the boundary's, not a socket's), and the tcp frame parser in C through its
smallest Python entry point.

Per-step counts are for the benchmark model (8 layers, page 16): one 4,096-token request's KV
is 256 pages x 8 layers = 2,048 page writes (+1 hidden state), queued as 2 calls of 1,024 pages
on the prefill node and counted as 2,049 immediates on the decode node."""

from __future__ import annotations

import select
import time

import numpy as np
import pytest

from pdkv._messenger import Messenger, tcp_frame, tcp_parse_frame

NUM_PAGES, SEG = 1024, 64  # small pages: the fake copies while posting, the boundary is the subject
WRITES_PER_REQUEST = 256 * 8 + 1


@pytest.fixture
def fake_pair():
    a, b = Messenger("fake", 1), Messenger("fake", 2)
    src = np.random.default_rng(0).integers(0, 256, 16 * NUM_PAGES * SEG, dtype=np.uint8)
    dst = np.zeros(16 * NUM_PAGES * SEG, dtype=np.uint8)
    lkey, rkey = a.register(src), b.register(dst)
    b.grant(rkey, 1)
    ca, ia = a.prepare(2)
    cb, ib = b.prepare(1)
    a.complete(ca, ib)
    b.complete(cb, ia)
    yield a, b, ca, lkey, rkey, src, dst
    a.close()
    b.close()


def wait_event(m, kind: str, timeout: float = 10.0):
    """The next event of ``kind`` (others are dropped); a bounded wait, a hang guard only."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in m.drain():
            if e.kind == kind:
                return e
            assert e.kind != "error", e
        select.select([m.fileno()], [], [], 0.05)
    raise AssertionError(f"no {kind} event within {timeout} s")


def pages():
    rng = np.random.default_rng(1)
    return (rng.permutation(16 * NUM_PAGES)[:NUM_PAGES].astype(np.int64),
            rng.permutation(16 * NUM_PAGES)[:NUM_PAGES].astype(np.int64))


def check_landed(src, dst, sp, dp):
    got = dst.reshape(-1, SEG)[dp]
    assert np.array_equal(got, src.reshape(-1, SEG)[sp]), "a page landed in the wrong place"


def test_write_pages_1024(benchmark, budget, fake_pair):
    a, b, ca, lkey, rkey, src, dst = fake_pair
    sp, dp = pages()
    done = []

    def settle():  # untimed: the previous round's batch completed without error
        if done:
            e = wait_event(a, "batch_done")
            assert (e.count, e.num_errors) == (NUM_PAGES, 0), e
        return (), {}

    def post():
        done.append(a.write_pages(ca, lkey, rkey, sp, dp, seg_len=SEG, src_page_stride=SEG,
                                  dst_page_stride=SEG, tag=len(done)))

    benchmark.pedantic(post, setup=settle, rounds=300, iterations=1, warmup_rounds=3)
    settle()
    budget(unit="1,024 page writes posted", per_step=2, budget_pct=1, per_step_b1=2)
    assert set(done) == {NUM_PAGES}
    check_landed(src, dst, sp, dp)


def test_queue_pages_1024(benchmark, budget, fake_pair):
    a, b, ca, lkey, rkey, src, dst = fake_pair
    sp, dp = pages()
    counter = np.ones(1, dtype=np.int64)  # already past the target: the poller posts at once
    watch = a.watch(counter)
    rounds = []

    def settle():
        if rounds:
            e = wait_event(a, "batch_done")
            assert (e.count, e.num_errors) == (NUM_PAGES, 0), e
        return (), {}

    def queue():
        a.queue_pages(watch, 1, ca, lkey, rkey, sp, dp, seg_len=SEG, src_page_stride=SEG,
                      dst_page_stride=SEG, tag=len(rounds))
        rounds.append(1)

    benchmark.pedantic(queue, setup=settle, rounds=300, iterations=1, warmup_rounds=3)
    settle()
    budget(unit="1,024 page writes queued on a counter", per_step=2, budget_pct=1, per_step_b1=2)
    assert a.stats()["queued"] == 0 and a.stats()["posted_batches"] == len(rounds)
    check_landed(src, dst, sp, dp)


NUM_IMMS, IMM_SEG = 10_000, 8


def test_expect_and_10000_immediates(benchmark, budget, fake_pair):
    """expect(imm, 10,000), then 10,000 8-byte writes carrying imm, until the receiver's
    imm_done: the core's immediate counting end to end (a new imm per round)."""
    a, b, ca, lkey, rkey, src, dst = fake_pair
    idx = np.arange(NUM_IMMS, dtype=np.int64)
    imm = [100]
    events = []

    def drain_sender():
        a.drain()
        imm[0] += 1
        return (), {}

    def deliver():
        b.expect(imm[0], NUM_IMMS)
        a.write_pages(ca, lkey, rkey, idx, idx, seg_len=IMM_SEG, src_page_stride=IMM_SEG,
                      dst_page_stride=IMM_SEG, imm=imm[0])
        events.append(wait_event(b, "imm_done"))

    benchmark.pedantic(deliver, setup=drain_sender, rounds=30, iterations=1, warmup_rounds=1)
    budget(unit="10,000 immediates delivered and counted", per_step=WRITES_PER_REQUEST / NUM_IMMS,
           budget_pct=1, per_step_b1=WRITES_PER_REQUEST / NUM_IMMS)
    assert [(e.imm, e.count, e.bytes) for e in events] == [
        (100 + i + 1, NUM_IMMS, NUM_IMMS * IMM_SEG) for i in range(len(events))]
    assert b.forget(imm[0]) == 0  # the counter was removed when it fired: exactly once
    assert np.array_equal(dst[:NUM_IMMS * IMM_SEG], src[:NUM_IMMS * IMM_SEG])


def test_tcp_frame_parse(benchmark, budget):
    """tcp_parse_frame: the C header parser the tcp receiver runs for every write (through
    Python, so this is an upper bound: the receiver thread calls it without the boundary)."""
    raw = tcp_frame(0x1234_5678_9ABC, 1 << 30, 4096, 77)
    f = benchmark(tcp_parse_frame, raw)
    budget(unit="one frame header parsed", per_step=WRITES_PER_REQUEST, budget_pct=1,
           per_step_b1=WRITES_PER_REQUEST)
    assert (f["key"], f["off"], f["len"], f["imm"], f["type"]) == (0x1234_5678_9ABC, 1 << 30, 4096, 77, 1)
    assert tcp_frame(f["key"], f["off"], f["len"], f["imm"]) == raw  # as test_tcp_wire's round trip
