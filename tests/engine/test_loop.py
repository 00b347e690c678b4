"""The KV connector's call points and the one engine loop (typed commands, FIFO admission that
waits on any resource), on the tiny model."""

from __future__ import annotations

import queue
import threading

import pytest

from pdkv.engine import KVConnector, SamplingParams
from pdkv.engine.connector import NOT_YET, RESERVE, Admission, Answer
from pdkv.engine.loop import (AbortRequest, AddRequest, EngineFailure, EngineLoop, FailRequest, LoopEvents, Wake,
                              ReleasePages, RemoteKVReady)

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


class Recorder(KVConnector):
    """Records every call; ``free`` is how many requests its (fake) per-request resource admits."""

    def __init__(self, free: int = 100, external: bool = False):
        self.calls, self.free, self.external = [], free, external
        self.after_layer = lambda layer: self.calls.append(("layer", layer))

    def admission(self, req):
        self.calls.append(("admission", req.request_id))
        if req.prompt_token_ids[0] == 0:
            return Answer.refuse("prompts starting with token 0 are refused here")
        return Admission(num_external_tokens=req.num_prompt_tokens - 1) if self.external else Admission()

    def admit(self, req):
        self.calls.append(("admit", req.request_id, len(req.pages)))
        if self.free == 0:
            return NOT_YET
        self.free -= 1
        return RESERVE

    def before_forward(self, batch):
        self.calls.append(("before", tuple((e.request_id, e.start, e.num_tokens, e.row) for e in batch.entries)))

    def after_forward(self, batch, hidden):
        self.calls.append(("after", batch.num_tokens, None if hidden is None else tuple(hidden.shape)))

    def finished(self, req):
        self.free += 1
        self.calls.append(("finished", req.request_id, req.finish_reason))


def test_connector_points_in_order(make_engine):
    eng = make_engine(num_pages=32)
    rec = Recorder()
    eng.set_connector(rec)
    out = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    rid = out[0].request_id
    hidden = eng.loaded.arch.hidden_size
    assert rec.calls == [("admission", rid), ("admit", rid, 0),
                         ("before", ((rid, 0, 3, 0),)), ("layer", 0), ("layer", 1), ("after", 3, (3, hidden)),
                         ("before", ((rid, 3, 1, 0),)), ("layer", 0), ("layer", 1), ("after", 1, (1, hidden)),
                         ("finished", rid, "length")]


def test_a_failed_forward_tells_the_connector_and_frees_everything(make_engine):
    eng = make_engine(num_pages=32)
    rec = Recorder()
    eng.set_connector(rec)

    def boom(layer):
        raise RuntimeError("injected fault")  # FAULT INJECTION
    rec.after_layer = boom
    eng.add_request("x", [5, 6, 7], GREEDY)
    assert [(o.request_id, o.finish_reason) for o in eng.step()] == [("x", "error")]
    assert rec.calls[-2:] == [("after", 3, None), ("finished", "x", "error")]
    assert eng.allocator.num_free == eng.allocator.num_total


class Events(LoopEvents):
    """A front-end that records what it hears (the final outputs of requests it already saw
    fail or abort are ignored, as the server's front-end does)."""

    def __init__(self):
        self.q, self.ended = queue.SimpleQueue(), set()

    def on_failed(self, rid, error):
        self.ended.add(rid)
        self.q.put(("failed", rid, str(error)))

    def on_aborted(self, rid):
        self.ended.add(rid)
        self.q.put(("aborted", rid))

    def on_step(self, start, outputs):
        for o in outputs:
            if o.finished and o.request_id not in self.ended:
                self.q.put(("finished", o.request_id, o.finish_reason))

    def next(self):
        return self.q.get(timeout=30)


@pytest.fixture
def loop_of(make_engine):
    loops = []

    def make(connector, **kw):
        eng = make_engine(**kw)
        eng.set_connector(connector)
        ev = Events()
        loop = EngineLoop(eng, ev)
        loop.start()
        loops.append(loop)
        return eng, loop, ev
    yield make
    for loop in loops:
        loop.stop()


def test_admission_waits_fifo_for_a_connector_resource(loop_of):
    rec = Recorder(free=1)
    eng, loop, ev = loop_of(rec, num_pages=32)
    slow = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for rid in ("a", "b", "c"):
        loop.put(AddRequest(rid, [5, 6, 7], slow, 0.0))
    # one resource: a runs; b and c wait in order, each admitted when the one before finishes
    assert [ev.next() for _ in range(3)] == [("finished", r, "length") for r in ("a", "b", "c")]
    admitted = [c[1] for c in rec.calls if c[0] == "admit"]  # every try, refused ones included
    assert admitted[0] == "a" and set(admitted) == {"a", "b", "c"}
    assert eng.allocator.num_free == eng.allocator.num_total


def test_a_resource_given_back_on_another_thread_wakes_admission(loop_of, monkeypatch):
    """A hidden-state row is given back on the coordinator's event loop, not by a command the
    engine handles: the RowPool's on_free posts Wake, so the waiting request runs at once
    instead of waiting for the loop's safety-net timeout (set to an hour here)."""
    import pdkv.engine.loop as loop_mod
    from pdkv.disagg.rows import RowPool

    monkeypatch.setattr(loop_mod, "ADMISSION_RETRY_S", 3600.0)

    class RowConnector(Recorder):
        def __init__(self, rows):
            super().__init__()
            self.rows, self.held = rows, []

        def admit(self, req):
            row = self.rows.take()
            if row is None:
                return NOT_YET
            self.held.append(row)
            return RESERVE

        def finished(self, req):  # keep the row: "another thread" gives it back below
            pass

    holder = {}
    rows = RowPool(1, on_free=lambda: holder["loop"].put(Wake()))
    conn = RowConnector(rows)
    eng, loop, ev = loop_of(conn, num_pages=32)
    holder["loop"] = loop
    loop.put(AddRequest("a", [5, 6, 7], GREEDY, 0.0))
    assert ev.next() == ("finished", "a", "length")
    loop.put(AddRequest("b", [5, 6, 7], GREEDY, 0.0))  # waits: the only row is still held
    threading.Timer(0.2, rows.give_back, args=(conn.held.pop(),)).start()
    assert ev.next() == ("finished", "b", "length")  # ev.next() gives up after 30 s


def test_refused_and_queued_aborts_reach_the_front_end(loop_of):
    rec = Recorder(free=0)  # nothing can be admitted
    eng, loop, ev = loop_of(rec, num_pages=32)
    loop.put(AddRequest("refused", [0, 1, 2], GREEDY, 0.0))
    assert ev.next() == ("failed", "refused", "prompts starting with token 0 are refused here")
    loop.put(AddRequest("queued", [4, 5], GREEDY, 0.0))
    loop.put(AbortRequest("queued"))
    assert ev.next() == ("aborted", "queued")
    loop.put(AbortRequest("queued"))  # twice: a no-op
    loop.put(AddRequest("late", [4, 5], GREEDY, 0.0))
    rec.free = 1
    loop.put(ReleasePages("nothing-held"))  # any command makes the loop retry admission
    assert ev.next() == ("finished", "late", "length")


def test_remote_kv_commands_quarantine_until_release(loop_of):
    rec = Recorder(external=True)
    eng, loop, ev = loop_of(rec, num_pages=32)
    done = threading.Event()
    loop.put(AddRequest("q", list(range(3, 40)), GREEDY, 0.0))
    loop.put(FailRequest("q", "failed while still queued"))  # same drain: before its admission
    assert ev.next() == ("failed", "q", "failed while still queued")
    loop.put(AddRequest("r", list(range(3, 40)), GREEDY, 0.0))
    loop.put(AddRequest("f", list(range(3, 40)), GREEDY, 0.0))
    while len(eng.requests) != 2:
        done.wait(0.01)
    loop.put(FailRequest("f", "the transfer timed out"))
    assert ev.next() == ("failed", "f", "the transfer timed out")
    loop.put(AbortRequest("r"))  # the client left while its KV was still remote: pages are held
    assert ev.next() == ("aborted", "r")
    while eng.stats()["num_pages_held"] != 6:  # 3 pages each, held for both
        done.wait(0.01)
    loop.put(ReleasePages("f"))
    loop.put(ReleasePages("r"))
    while eng.allocator.num_free != eng.allocator.num_total:
        done.wait(0.01)
    loop.put(AddRequest("ok", list(range(3, 40)), GREEDY, 0.0))
    while not eng.requests.get("ok"):
        done.wait(0.01)
    loop.put(RemoteKVReady("ok"))  # (its pages hold nothing: the tokens do not matter here)
    assert ev.next() == ("finished", "ok", "length")
    assert ("finished", "r", "abort") in rec.calls and ("finished", "f", "error") in rec.calls


def test_stop_fails_what_is_left(loop_of):
    rec = Recorder(free=0)
    eng, loop, ev = loop_of(rec, num_pages=32)
    loop.put(AddRequest("w", [4, 5], GREEDY, 0.0))
    loop.stop()
    assert ev.next() == ("failed", "w", "the engine stopped")
    assert not loop.is_alive() and isinstance(EngineFailure("x"), RuntimeError)


def test_admission_queue_is_bounded_with_a_503(loop_of):
    """Finding 3: beyond max_waiting requests waiting for a resource, one more fails at once with
    a 503 and Retry-After (never a 500, never an unbounded queue)."""
    from pdkv.engine.loop import EngineFailure

    rec = Recorder(free=0)  # nothing can be admitted: everything waits
    eng, loop, ev = loop_of(rec, num_pages=32)
    loop.max_waiting = 2
    failures = {}
    ev.on_failed = lambda rid, err: (failures.__setitem__(rid, err), ev.q.put(("failed", rid, str(err))))
    for rid in ("w1", "w2", "over"):
        loop.put(AddRequest(rid, [4, 5], GREEDY, 0.0))
    assert ev.next()[:2] == ("failed", "over")
    err = failures["over"]
    assert isinstance(err, EngineFailure) and err.status == 503 and err.retry_after == 1
    assert "at capacity" in str(err) and "server.max_waiting_requests" in str(err)
    rec.free = 2
    loop.put(ReleasePages("nothing-held"))
    assert sorted(ev.next()[1] for _ in range(2)) == ["w1", "w2"]  # the two that waited still run
