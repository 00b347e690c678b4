"""Finding 2 as a property: over random interleavings of PREFILL (duplicates included), batches
queued and completed, CANCEL, FAIL, engine completions and peer death, the prefill node's job
table ends empty and every source page is back — a duplicate never touches the first job.

The driver below does what pdkv/disagg/prefill.py does with the table (add at PREFILL, pages
taken at admission and returned when the table reports the job finished); no threads."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.disagg.jobs import DuplicateJob, Job, JobEnd, JobState, JobTable

POOL, PAGES_PER_JOB, REQS = 64, 3, 6

op = st.one_of(
    st.tuples(st.just("prefill"), st.integers(0, REQS - 1)),
    st.tuples(st.just("queue"), st.integers(0, REQS - 1), st.integers(1, 3)),
    st.tuples(st.just("batch_done"), st.integers(0, REQS - 1), st.booleans()),
    st.tuples(st.sampled_from(["cancel", "fail", "prefilled"]), st.integers(0, REQS - 1)),
    st.tuples(st.just("peer_death")),
)


class Driver:
    def __init__(self):
        self.t, self.free, self.tags = JobTable(), set(range(POOL)), iter(range(1, 10**6))
        self.held: dict[int, set[int]] = {}  # id(job) -> its source pages
        self.live: dict[str, Job] = {}
        self.answers: list[dict] = []

    def _finished(self, job):
        if job is not None:
            assert job.state == JobState.FINISHED and job.outstanding == 0
            self.free |= self.held.pop(id(job))
            self.live.pop(job.req, None)
            self.answers.append(job.answer().to_wire())

    def prefill(self, r):
        req = f"r{r}"
        job = Job(f"n:{req}", req, SimpleNamespace(dead=False), [1, 2, 3], np.arange(3, dtype=np.int64), 7, 0,
                  next(self.tags), 0.0)
        first = self.live.get(req)
        snapshot = None if first is None else (first.state, first.outstanding, first.tag)
        try:
            self.t.add(job)
        except DuplicateJob as e:
            assert first is not None and f"'{req}'" in str(e)
            assert self.t.get(job.key) is first and (first.state, first.outstanding, first.tag) == snapshot
            return
        # (no assertion on ``first`` here: a table that wrongly accepted a duplicate shows as lost pages)
        pages = {self.free.pop() for _ in range(PAGES_PER_JOB)}
        self.held[id(job)], self.live[req] = pages, job

    def queue(self, r, n):
        job = self.live.get(f"r{r}")
        if job is not None and job.state == JobState.COMPUTING:  # only the engine queues, while computing
            self.t.queued(job, n)

    def batch_done(self, r, error):
        job = self.live.get(f"r{r}")
        if job is not None and job.outstanding > 0:
            self._finished(self.t.batch_done(job.tag, 1, int(error), -5 if error else 0, 64))

    def end(self, r, how):
        job = self.live.get(f"r{r}")
        if job is not None:
            self._finished(self.t.engine_done(job.key, how))

    def peer_death(self):
        """The link's jobs are aborted; the transport fails every pending write of it."""
        for job in list(self.live.values()):
            self._finished(self.t.engine_done(job.key, JobEnd.CANCELLED))
            while job.outstanding > 0:
                self._finished(self.t.batch_done(job.tag, 1, 1, -104, 0))

    def drain(self):
        for job in list(self.live.values()):
            self._finished(self.t.engine_done(job.key, JobEnd.PREFILLED))
            while job.outstanding > 0:
                self._finished(self.t.batch_done(job.tag, 1, 0, 0, 64))


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=60))
def test_pool_returns_to_its_start_whatever_the_interleaving(ops):
    d = Driver()
    for o in ops:
        kind = o[0]
        if kind == "prefill":
            d.prefill(o[1])
        elif kind == "queue":
            d.queue(o[1], o[2])
        elif kind == "batch_done":
            d.batch_done(o[1], o[2])
        elif kind == "peer_death":
            d.peer_death()
        else:
            d.end(o[1], {"cancel": JobEnd.CANCELLED, "fail": JobEnd.FAILED, "prefilled": JobEnd.PREFILLED}[kind])
        assert len(d.free) + sum(len(p) for p in d.held.values()) == POOL  # no page lost on the way
    d.drain()
    assert len(d.t) == 0 and not d.t.by_tag and d.free == set(range(POOL)) and not d.held


def test_a_duplicate_leaves_the_first_job_alone():
    d = Driver()
    d.prefill(0)
    d.queue(0, 2)
    first = d.live["r0"]
    d.prefill(0)
    assert d.t.get("n:r0") is first and first.outstanding == 2 and len(d.t) == 1
    d.drain()
    assert d.free == set(range(POOL)) and [a["type"] for a in d.answers] == ["DONE_AT"]
