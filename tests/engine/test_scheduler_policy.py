"""The scheduler's policy seam (fcfs, priority) and its one admission path: the waiting order,
the preemption victim, and the connector's typed answer (reserve / not yet / refuse)."""

from __future__ import annotations

import queue
import time

import pytest

from pdkv.config import ConfigError, load_config
from pdkv.engine import SamplingParams
from pdkv.engine.connector import NOT_YET, RESERVE, Admission, Answer, KVConnector
from pdkv.engine.loop import AddRequest, EngineLoop, LoopEvents, Wake
from pdkv.engine.policy import POLICIES, make_policy
from pdkv.engine.request import Request, RequestStatus
from pdkv.engine.scheduler import Scheduler
from pdkv.errors import AdmissionRefused, InvalidRequest
from pdkv.kv import PageAllocator

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def _req(rid, prompt_len, priority=0, max_tokens=20):
    r = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), detok=None)
    r.priority = priority
    return r


def _num_pinned(eng):
    return sum(eng.allocator.is_pinned(p) for p in range(eng.allocator.num_total))


def _local(s):
    def reserve(r):
        s.add(r)
        return RESERVE
    return reserve


def _step(s):
    out = s.schedule()
    s.update_computed(out)
    for seq in out.seqs:
        if seq.sample:
            seq.request.output_token_ids.append(7)
    return out


@pytest.mark.parametrize("policy, order", [("fcfs", ["p2", "p0", "p1", "q0"]),
                                           ("priority", ["p0", "q0", "p1", "p2"])])
def test_waiting_order_follows_the_policy(policy, order):
    """Lower priority first, ties by arrival (p0 before q0); fcfs keeps arrival order whatever the
    priority says. One request runs at a time, so they run in exactly that order."""
    s = Scheduler(PageAllocator(32), 4, 64, 64, max_num_seqs=1, policy=policy)
    for rid, prio in (("p2", 2), ("p0", 0), ("p1", 1), ("q0", 0)):
        s.submit(_req(rid, 4, prio, max_tokens=1))
    assert [r.request_id for r in s.pending] == order
    assert s.admit(_local(s)) == [] and not s.pending
    assert [r.request_id for r in s.waiting] == order
    ran = []
    for _ in range(8):
        out = _step(s)
        for seq in out.seqs:
            ran.append(seq.request.request_id)
            s.finish(seq.request, "length")
    assert ran == order


@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_preemption_victim_is_the_policys(policy):
    """3 pages of 4 tokens. A (priority 5) runs first, alone; B and C (priority 0) join it. When
    B needs a second page none is free: fcfs preempts the newest running request (C), priority
    the lowest-priority one (A), although A was scheduled earlier in the same step: its tokens
    go back to the budget and its seq leaves the batch. Every page stays owned once."""
    a = PageAllocator(3)
    s = Scheduler(a, 4, 64, 64, max_num_seqs=8, policy=policy)
    A, B, C = _req("A", 2, 5), _req("B", 4, 0), _req("C", 4, 0)
    s.submit(A)
    s.admit(_local(s))
    assert [q.request for q in _step(s).seqs] == [A]  # A's prompt: 1 page, 2 slots left
    for r in (B, C):
        s.submit(r)
    s.admit(_local(s))
    step2 = _step(s)
    assert {q.request.request_id for q in step2.seqs} == {"A", "B", "C"} and a.num_free == 0
    out = _step(s)
    if policy == "fcfs":
        assert out.preempted == ["C"] and [q.request for q in out.seqs] == [A, B]
        assert list(s.waiting) == [C]
    else:
        # A first (the victim, though scheduled already), then C: B's neighbour at its own turn
        assert out.preempted == ["A", "C"] and [q.request for q in out.seqs] == [B]
        assert list(s.waiting) == [C, A]  # back in the policy's order: priority 0 before 5
        assert A.pages == [] and A.num_computed_tokens == 0 and A.num_preemptions == 1
    assert out.num_tokens == sum(len(q.token_ids) for q in out.seqs) <= 64
    owned = [p for r in s.running + list(s.waiting) for p in r.pages]
    assert len(owned) == len(set(owned)) == a.num_used


def test_priority_victim_is_the_latest_arrival_among_equals():
    p = make_policy("priority")
    reqs = [_req(r, 4, prio) for r, prio in (("x", 1), ("y", 3), ("z", 3), ("w", 0))]
    for i, r in enumerate(reqs):
        r.arrival, r.seq = 10.0, i  # equal stamps: submission order decides
    assert p.victim(reqs).request_id == "z"
    assert make_policy("fcfs").victim(reqs).request_id == "w"
    with pytest.raises(ValueError, match="scheduler.policy must be one of fcfs, priority, got 'lifo'"):
        make_policy("lifo")


def test_scheduler_policy_in_the_config(tmp_path):
    assert load_config(None, []).scheduler.policy == "fcfs"
    assert load_config(None, ["scheduler.policy=priority"]).scheduler.policy == "priority"
    with pytest.raises(ConfigError, match="scheduler.policy must be one of fcfs, priority, got 'sjf'"):
        load_config(None, ["scheduler.policy=sjf"])


class Gate(KVConnector):
    """Its one resource is shut until ``open``; requests whose prompt starts with 0 are refused
    after their pages were reserved (``external``: pinned pages for remote KV)."""

    def __init__(self, external=False):
        self.open, self.external, self.asked = False, external, []

    def admission(self, req):
        return Admission(num_external_tokens=req.num_prompt_tokens - 1) if self.external else Admission()

    def admit(self, req):
        self.asked.append((req.request_id, len(req.pages)))
        if req.prompt_token_ids[0] == 0:
            return Answer.refuse("prompts starting with token 0 cannot be served here", status=503, retry_after=3)
        return RESERVE if self.open else NOT_YET


@pytest.mark.parametrize("external", [False, True], ids=["local", "remote-kv"])
def test_not_yet_keeps_requests_waiting_in_order_holding_nothing(make_engine, external):
    eng = make_engine(num_pages=32)
    gate = Gate(external)
    eng.set_connector(gate)
    for rid in ("a", "b", "c"):
        eng.add_request(rid, [5, 6, 7, 8], GREEDY)
    # only the head was asked (each time), nothing behind it got ahead, no page is held
    assert [r for r, _ in gate.asked] == ["a", "a", "a"] and eng.num_pending == 3
    assert [r.request_id for r in eng.scheduler.pending] == ["a", "b", "c"]
    assert all(eng.requests[r].status == RequestStatus.PENDING and not eng.requests[r].pages for r in "abc")
    assert eng.allocator.num_free == eng.allocator.num_total and _num_pinned(eng) == 0
    assert not eng.has_work() and eng.step() == []
    st = eng.stats()  # what /metrics and /load report: requests not admitted yet are waiting
    assert (st["num_pending"], st["num_waiting"], st["num_running"]) == (3, 3, 0)
    gate.open = True
    gate.asked.clear()
    assert eng.admit() == [] and eng.num_pending == 0
    assert [r for r, _ in gate.asked] == ["a", "b", "c"]
    want = RequestStatus.WAITING_FOR_REMOTE_KV if external else RequestStatus.WAITING
    assert all(eng.requests[r].status == want for r in "abc")
    for r in "abc":
        eng.abort(r)
    eng.step()
    assert eng.allocator.num_free == eng.allocator.num_total and _num_pinned(eng) == 0


@pytest.mark.parametrize("external", [False, True], ids=["local", "remote-kv"])
def test_a_refusal_fails_the_request_with_the_connectors_error_and_frees_its_pages(make_engine, external):
    eng = make_engine(num_pages=32)
    gate = Gate(external)
    gate.open = True
    eng.set_connector(gate)
    with pytest.raises(AdmissionRefused, match="prompts starting with token 0 cannot be served here") as e:
        eng.add_request("x", [0, 6, 7, 8], GREEDY)
    assert e.value.status == 503 and e.value.retry_after == 3
    assert gate.asked == [("x", 1 if external else 0)]  # its pages were reserved, then given back
    assert "x" not in eng.requests and eng.num_pending == 0
    assert eng.allocator.num_free == eng.allocator.num_total and _num_pinned(eng) == 0
    # Refused later, behind a request that waited: admit() reports it (the loop fails it).
    gate.open = False
    eng.add_request("z", [4, 1, 2], GREEDY)  # waits at the head
    eng.add_request("y", [0, 1, 2], GREEDY)  # behind it: not asked yet, so not refused yet
    assert eng.num_pending == 2
    gate.open = True
    refused = eng.admit()
    assert [(rid, a.reason, a.status) for rid, a in refused] == [
        ("y", "prompts starting with token 0 cannot be served here", 503)]
    assert "y" not in eng.requests and eng.requests["z"].status != RequestStatus.PENDING
    eng.abort("z")
    eng.step()
    assert eng.allocator.num_free == eng.allocator.num_total and _num_pinned(eng) == 0


class Events(LoopEvents):
    def __init__(self):
        self.q = queue.SimpleQueue()

    def on_failed(self, rid, error):
        self.q.put(("failed", rid, str(error)))

    def on_step(self, start, outputs):
        for o in outputs:
            if o.finished:
                self.q.put(("finished", o.request_id, o.finish_reason))

    def next(self):
        return self.q.get(timeout=30)


@pytest.fixture
def loop_of_policy(make_engine):
    loops = []

    def make(connector, policy, **kw):
        eng = make_engine(num_pages=32, policy=policy, **kw)
        eng.set_connector(connector)
        ev = Events()
        loop = EngineLoop(eng, ev)
        loop.start()
        loops.append(loop)
        return eng, loop, ev
    yield make
    for loop in loops:
        loop.stop()


def _open_when_queued(eng, loop, gate, n):
    """Opens ``gate`` once the loop holds ``n`` requests waiting for admission (so the order they
    are admitted in is the scheduler's, not the commands' timing)."""
    deadline = time.monotonic() + 30
    while eng.num_pending < n:
        assert time.monotonic() < deadline, "the loop never queued the requests"
        time.sleep(0.01)
    gate.open = True
    loop.put(Wake())


def test_a_refusal_reaches_the_loops_front_end_and_the_rest_keep_their_order(loop_of_policy):
    gate = Gate()
    eng, loop, ev = loop_of_policy(gate, "fcfs")
    slow = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for rid, first in (("a", 5), ("bad", 0), ("b", 5)):
        loop.put(AddRequest(rid, [first, 6, 7], slow, 0.0))
    _open_when_queued(eng, loop, gate, 3)
    refused = ("failed", "bad", "prompts starting with token 0 cannot be served here")
    assert [ev.next() for _ in range(3)] == [refused, ("finished", "a", "length"), ("finished", "b", "length")]
    assert eng.allocator.num_free == eng.allocator.num_total


def test_priority_policy_runs_urgent_requests_first_through_the_loop(loop_of_policy):
    """One sequence at a time: after the first, waiting requests run lowest priority value first."""
    gate = Gate()
    eng, loop, ev = loop_of_policy(gate, "priority", max_seqs=1)
    p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for i, (rid, prio) in enumerate((("first", 9), ("late", 9), ("urgent", -1), ("mid", 3))):
        loop.put(AddRequest(rid, [5, 6, 7 + i], p, float(i), prio))
    _open_when_queued(eng, loop, gate, 4)
    assert [ev.next()[1] for _ in range(4)] == ["urgent", "mid", "first", "late"]


def test_priority_is_refused_unless_the_policy_is_priority(make_engine):
    fcfs, prio = make_engine(num_pages=32), make_engine(num_pages=32, policy="priority")
    with pytest.raises(InvalidRequest, match="priority 2 needs priority scheduling.*scheduler.policy is fcfs"):
        fcfs.validate_request([5, 6], GREEDY, priority=2)
    with pytest.raises(InvalidRequest, match="priority must be an integer, got '1'"):
        prio.validate_request([5, 6], GREEDY, priority="1")
    with pytest.raises(InvalidRequest, match="priority must be an integer, got True"):
        prio.add_request("t", [5, 6], GREEDY, priority=True)
    fcfs.validate_request([5, 6], GREEDY, priority=0)  # 0 is every request's default: accepted
    prio.validate_request([5, 6], GREEDY, priority=-7)
    with pytest.raises(InvalidRequest):
        fcfs.add_request("x", [5, 6], GREEDY, priority=1)
    assert "x" not in fcfs.requests and fcfs.num_pending == 0
