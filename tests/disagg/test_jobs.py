"""The prefill node's job table and write planner on their own: no threads, no sockets, no model."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pdkv.disagg import protocol as P
from pdkv.disagg.jobs import Job, JobEnd, JobState, JobTable
from pdkv.disagg.writes import plan_batch
from pdkv.engine.connector import BatchEntry, ForwardBatch
from pdkv.engine.params import SamplingParams
from pdkv.engine.request import Request


def _job(key="n:r1", tag=1, num_pages=3):
    return Job(key, key.split(":")[1], SimpleNamespace(dead=False), list(range(10)),
               np.arange(100, 100 + num_pages, dtype=np.int64), imm=7, hidden_off=0, tag=tag, arrival=0.0)


def test_a_job_finishes_only_when_the_engine_is_done_and_every_batch_completed():
    t = JobTable()
    job = _job()
    t.add(job)
    t.queued(job, 3)
    assert t.batch_done(1, count=2, num_errors=0, status=0, nbytes=64) is None  # 2 batches left
    assert t.engine_done("n:r1", JobEnd.PREFILLED, t_end=5.0) is None  # still one outstanding
    assert job.state == JobState.DRAINING and len(t) == 1
    assert t.batch_done(1, count=2, num_errors=0, status=0, nbytes=64) is None
    assert t.batch_done(1, count=1, num_errors=0, status=0, nbytes=32) is job  # the last one
    assert job.state == JobState.FINISHED and len(t) == 0 and t.get("n:r1") is None
    assert job.answer().to_wire() == {"type": P.DONE_AT, "req": "r1", "t_end": 5.0, "posted": 5, "bytes": 160}
    # late events for a finished job change nothing
    assert t.batch_done(1, count=1, num_errors=0, status=0, nbytes=1) is None
    assert t.engine_done("n:r1", JobEnd.CANCELLED) is None


def test_the_first_engine_report_counts_and_nothing_outstanding_finishes_at_once():
    t = JobTable()
    job = _job()
    t.add(job)
    assert t.engine_done("n:r1", JobEnd.CANCELLED, "cancelled by the decode node") is job
    assert job.answer().to_wire() == {"type": P.CANCEL_ACK, "req": "r1", "posted": 0}
    other = _job("n:r2", tag=2)
    t.add(other)
    t.engine_done("n:r2", JobEnd.PREFILLED)
    assert other.end == JobEnd.PREFILLED  # the later CANCELLED report is ignored
    assert t.engine_done("n:r2", JobEnd.CANCELLED) is None


def test_failed_writes_turn_done_into_fail_and_report_only_what_completed():
    t = JobTable()
    job = _job()
    t.add(job)
    t.queued(job, 2)
    t.batch_done(1, count=4, num_errors=1, status=-5, nbytes=0, reason="peer reset")
    t.engine_done("n:r1", JobEnd.PREFILLED, t_end=1.0)
    assert t.batch_done(1, count=4, num_errors=0, status=0, nbytes=64) is job
    msg = job.answer().to_wire()
    assert msg["type"] == P.FAIL and msg["posted"] == 7 and "1 page write(s) failed: peer reset" in msg["reason"]


def test_queue_error_gives_back_the_batches_that_were_never_queued():
    t = JobTable()
    job = _job()
    t.add(job)
    t.queued(job, 8)
    t.queued(job, -5)  # only 3 of 8 were queued before the connection dropped
    job.write_failed("queueing failed")
    t.engine_done("n:r1", JobEnd.PREFILLED)
    for _ in range(2):
        assert t.batch_done(1, 1, 0, 0, 8) is None
    assert t.batch_done(1, 1, 0, 0, 8) is job and job.answer().to_wire()["type"] == P.FAIL


def _entry(rid, prompt_len, start, n, row, pages, prefill_only=True):
    req = Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=1), None)
    req.pages, req.prefill_only = pages, prefill_only
    return BatchEntry(req, start, n, row, sample=False)


@pytest.mark.parametrize("chunks", [[10], [4, 4, 2], [3, 5, 2], [1] * 10])
def test_plan_batch_sends_every_page_exactly_once_whatever_the_chunking(chunks):
    page_size, prompt_len = 4, sum(chunks)
    pages = [11, 12, 13]  # 10 tokens -> 3 pages, the last one partial
    dst = np.array([21, 22, 23], dtype=np.int64)
    sent, start = [], 0
    for n in chunks:
        batch = ForwardBatch((_entry("a", prompt_len, start, n, 0, pages),), n)
        for w in plan_batch(batch, page_size, lambda rid: dst):
            assert w.request_id == "a" and list(w.dst_pages) == [p + 10 for p in w.src_pages]
            sent += list(w.src_pages)
        start += n
    assert sent == pages


def test_plan_batch_skips_sampled_rows_and_unknown_or_dead_destinations():
    dst = np.array([5, 6], dtype=np.int64)
    batch = ForwardBatch((_entry("decode", 9, 8, 1, 0, [1, 2, 3], prefill_only=False),
                          _entry("gone", 8, 0, 8, 1, [4, 5]),
                          _entry("live", 8, 0, 8, 9, [7, 8])), 17)
    plan = plan_batch(batch, 4, lambda rid: dst if rid == "live" else None)
    assert [(w.request_id, list(w.src_pages), list(w.dst_pages)) for w in plan] == [("live", [7, 8], [5, 6])]


@pytest.mark.parametrize("chunks", [[2], [1, 1], [2, 2, 3]])
@pytest.mark.parametrize("skip", [0, 1, 2, 3])
@pytest.mark.parametrize("reused", [0, 4, 8])
def test_plan_batch_sends_only_the_pages_the_destination_lacks(chunks, skip, reused):
    """Prefix caching on both sides: the destination holds the first ``skip`` pages (its list
    starts at page ``skip``), this node reused its first ``reused`` tokens (never computed).
    Every page in [skip, pages) goes exactly once, to its own destination page, whichever side
    holds more: the reused ones the destination lacks go with the first chunk."""
    page_size = 4
    prompt_len = max(reused + sum(chunks), 4 * skip + 1)
    chunks = chunks + [prompt_len - reused - sum(chunks)] if prompt_len > reused + sum(chunks) else chunks
    pages = list(range(11, 11 + -(-prompt_len // page_size)))
    dst = np.arange(21 + skip, 21 + len(pages), dtype=np.int64)  # dst[i] is the destination of page skip + i
    sent, start = [], reused
    for n in chunks:
        e = _entry("a", prompt_len, start, n, 0, pages)
        e.request.num_cached_tokens = reused
        for w in plan_batch(ForwardBatch((e,), n), page_size, lambda rid: dst, lambda rid: skip):
            assert list(w.dst_pages) == [p + 10 for p in w.src_pages]
            sent += list(w.src_pages)
        start += n
    assert sent == pages[skip:], (prompt_len, chunks)
