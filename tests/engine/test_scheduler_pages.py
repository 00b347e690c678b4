"""Scheduler page invariants under random sequences (hypothesis), no model needed: every page a
request held is freed exactly once, whatever adds, remote reservations, aborts, preemptions
and finishes happen (the allocator itself is tested in tests/kv)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.engine.connector import NOT_YET, RESERVE
from pdkv.engine.params import SamplingParams
from pdkv.engine.policy import POLICIES
from pdkv.engine.request import Request, RequestStatus
from pdkv.engine.scheduler import Scheduler
from pdkv.kv import PageAllocator

policies = pytest.mark.parametrize("policy", list(POLICIES))


def _req(i, prompt_len, max_tokens, priority=0):
    r = Request(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), detok=None)
    r.priority = priority
    return r


@policies
@settings(max_examples=40, deadline=None)
@given(num_pages=st.integers(4, 24), page_size=st.sampled_from([1, 4, 16]),
       budget=st.integers(1, 64), chunk=st.integers(1, 32),
       events=st.lists(st.tuples(st.sampled_from(["add", "add_remote", "submit_remote", "admit", "abort",
                                                  "ready", "step"]),
                                 st.integers(1, 40), st.integers(1, 10)), max_size=50))
def test_scheduler_frees_every_page_exactly_once(policy, num_pages, page_size, budget, chunk, events):
    """Hand-made model outputs drive the scheduler through adds, remote reservations (direct, or
    queued for admission that answers "not yet" while the pages are not free), aborts,
    preemptions and finishes, under each policy (priorities from the event); the allocator ends
    where it started."""
    a = PageAllocator(num_pages)
    s = Scheduler(a, page_size, budget, chunk, max_num_seqs=8, policy=policy)
    live: dict[str, Request] = {}

    def reserve(r):
        return RESERVE if s.add_remote(r) else NOT_YET
    for i, (ev, plen, mtok) in enumerate(events):
        if s.pages_for(plen + mtok) > num_pages:
            continue  # the engine's validate_request refuses these
        prio = mtok % 3 if policy == "priority" else 0
        if ev == "add":
            live[f"r{i}"] = r = _req(i, plen, mtok, prio)
            s.add(r)
        elif ev == "add_remote" and plen > 1:
            r = _req(i, plen, mtok, prio)
            if s.add_remote(r):
                live[r.request_id] = r
            else:
                assert not r.pages and r.status == RequestStatus.WAITING  # nothing changed
        elif ev == "submit_remote" and plen > 1:
            live[f"r{i}"] = r = _req(i, plen, mtok, prio)
            s.submit(r)
        elif ev == "admit":
            before = list(s.pending)
            assert s.admit(reserve) == []
            assert before[len(before) - len(s.pending):] == list(s.pending)  # the rest waits in order
            assert all(not r.pages and r.status == RequestStatus.PENDING for r in s.pending)
        elif ev == "abort" and live:
            r = live.pop(sorted(live)[plen % len(live)])
            s.abort(r)
            s.abort(r)  # idempotent
        elif ev == "ready":
            for r in list(s.remote.values())[:1]:
                s.remote_ready(r)
        else:
            out = s.schedule()
            assert out.num_tokens <= budget
            pages = [p for q in s.running + list(s.waiting) + list(s.remote.values()) + list(s.pending)
                     for p in q.pages]
            assert len(pages) == len(set(pages)) == a.num_used, "a page is owned twice or leaked"
            s.update_computed(out)
            for seq in out.seqs:
                r = seq.request
                assert len(r.pages) * page_size >= r.num_computed_tokens
                if seq.sample:
                    r.output_token_ids.append(7)
                    if len(r.output_token_ids) >= r.params.max_tokens:
                        s.finish(r, "length")
                        live.pop(r.request_id, None)
    for r in list(live.values()):
        s.abort(r)
    assert a.num_free == num_pages
    assert not s.running and not s.waiting and not s.remote and not s.pending
    assert all(r.status in (RequestStatus.ABORTED, RequestStatus.FINISHED) for r in live.values())


def _stepper(s):
    def step():
        out = s.schedule()
        s.update_computed(out)
        for seq in out.seqs:
            if seq.sample:
                seq.request.output_token_ids.append(7)
                if len(seq.request.output_token_ids) >= seq.request.params.max_tokens:
                    s.finish(seq.request, "length")
        return out
    return step


def test_landed_requests_holding_pages_do_not_wait_behind_a_request_that_cannot_fit():
    """16 pages of 4: two remote requests (3 + 5 pinned pages) land while a local 32-token
    request decodes; its next token needs a ninth page, so it preempts itself and goes back to
    the head of the queue needing 9 pages with only 8 free. Nothing runs, and the 8 held pages
    belong to the landed requests behind it: strict FIFO waited for ever (the decode node's
    60 s hang). They must run first, then everything finishes and every page comes back."""
    a = PageAllocator(16)
    s = Scheduler(a, 4, 64, 64, max_num_seqs=8)
    r13, r21, x = _req(13, 13, 2), _req(21, 21, 2), _req(32, 32, 4)
    s.add_remote(r13)
    s.add_remote(r21)
    s.add(x)
    step = _stepper(s)

    assert [q.request for q in step().seqs] == [x]  # its whole prompt: 8 pages
    s.remote_ready(r13)
    s.remote_ready(r21)
    out = step()
    assert out.preempted == ["r32"] and not out.seqs and list(s.waiting)[:1] == [x]
    for _ in range(20):
        if not step().seqs:
            break
    assert all(r.status == RequestStatus.FINISHED for r in (r13, r21, x)), [r.status for r in (r13, r21, x)]
    assert a.num_free == 16


@pytest.mark.parametrize("last_len", [40, 41], ids=["one-fits", "none-fits"])
def test_landed_requests_holding_every_page_still_finish(last_len):
    """16 pages of 4, four remote requests land holding all 16 (9, 13, 5 and a last one of 40
    or 41 tokens, last in the queue) and nothing runs. 40: its last prompt token fits in its
    pages, so it goes first. 41: every one of them needs one more page (none is free), so
    the last one in the queue gives its pages back and is recomputed. Either way all finish, every page back."""
    a = PageAllocator(16)
    s = Scheduler(a, 4, 64, 64, max_num_seqs=8)
    reqs = [_req(9, 9, 3), _req(13, 13, 3), _req(5, 5, 3), _req(last_len, last_len, 3)]
    for r in reqs:
        s.add_remote(r)
    assert a.num_free == 0
    for r in reqs[3:] + reqs[:3]:  # the long one lands first: landings go to the queue's front
        s.remote_ready(r)
    assert list(s.waiting) == [reqs[2], reqs[1], reqs[0], reqs[3]]
    step = _stepper(s)
    first = step()
    if last_len == 40:
        assert [q.request for q in first.seqs] == [reqs[3]] and reqs[3].num_preemptions == 0
    else:
        # the last in the queue gave its pages back
        assert [r.num_preemptions for r in reqs] == [0, 0, 0, 1] and first.seqs
    for _ in range(60):
        out = step()
        if not out.seqs and not out.preempted:
            break
    assert all(r.status == RequestStatus.FINISHED for r in reqs), [(r.request_id, r.status) for r in reqs]
    assert a.num_free == 16
