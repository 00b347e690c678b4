"""The staging copy engine: bytes, backpressure, failures, cancellation, and no leaked slot.

Every test that needs no fault injection runs against each implementation that works here: the
CPU engine always, the CUDA engine (device buffer in GPU memory, pinned ring) where a GPU is
usable. Delays, blocked copies and failures come from the CPU engine's fault-injection hook.
"""

from __future__ import annotations

import queue
import random
import threading
import time

import pytest
import torch

from pdkv.gpu import gpu_unavailable_reason
from pdkv.gpu.copy_engine import CopyResult, CopyStatus, Direction
from pdkv.gpu.cpu_copy_engine import CpuCopyEngine
from pdkv.gpu.staging import Span, StagingRing, SlotState, coalesce, packed_offsets, split_spans

PAGE = 4096
NUM_PAGES = 64
_GPU = gpu_unavailable_reason()


def _engine(kind: str, num_slots: int, slot_pages: int, max_pending: int = 64, inject=None):
    """(engine, device buffer) of NUM_PAGES random pages."""
    gen = torch.Generator().manual_seed(num_slots * 1000 + slot_pages)
    host = torch.randint(0, 256, (NUM_PAGES * PAGE,), dtype=torch.uint8, generator=gen)
    if kind == "cpu":
        ring = StagingRing(num_slots, slot_pages * PAGE)
        return CpuCopyEngine(ring, host, max_pending, inject=inject), host
    from pdkv.gpu.cuda_copy_engine import CudaCopyEngine

    dev = host.to("cuda:0")
    return CudaCopyEngine(StagingRing(num_slots, slot_pages * PAGE, pin=True), dev, max_pending), dev


KINDS = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(_GPU is not None, reason=f"no usable GPU: {_GPU}"))]


class Results:
    """Collects on_done results (the completion thread) for the test thread."""

    def __init__(self, engine=None, release: bool = False):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.engine, self.release, self.staged = engine, release, {}

    def __call__(self, r: CopyResult) -> None:
        if r.slot is not None:  # a READY slot: what the poller would post from
            self.staged[r.tag] = self.engine.ring.view(r.slot, r.nbytes).clone()
            if self.release:
                self.engine.release(r.slot)
        self.q.put(r)

    def get(self, n: int, timeout: float = 30.0) -> list[CopyResult]:
        return [self.q.get(timeout=timeout) for _ in range(n)]


def _pages(rng: random.Random, n: int) -> tuple[Span, ...]:
    return tuple(Span(p * PAGE, PAGE) for p in rng.sample(range(NUM_PAGES), n))


def _expected(buf: torch.Tensor, spans) -> torch.Tensor:
    return torch.cat([buf[s.offset: s.offset + s.nbytes].cpu() for s in spans])


def _assert_no_leak(engine) -> None:
    assert engine.ring.owners() == {} and engine.ring.num_free == engine.ring.num_slots
    assert engine.num_pending == 0 and engine.num_jobs() == 0


@pytest.mark.parametrize("kind", KINDS)
def test_device_to_host_moves_random_pages_byte_exact(kind):
    rng = random.Random(1)
    engine, buf = _engine(kind, num_slots=3, slot_pages=8)
    got = Results(engine, release=True)
    jobs = {f"r{i}": _pages(rng, rng.randint(1, 8)) for i in range(40)}
    for rid, spans in jobs.items():
        engine.copy_out(rid, spans, got, tag=rid)  # 40 jobs, 3 slots: most wait their turn
    results = got.get(len(jobs))
    assert all(r.status is CopyStatus.DONE and r.direction is Direction.DEVICE_TO_HOST for r in results)
    for rid, spans in jobs.items():
        assert torch.equal(got.staged[rid], _expected(buf, spans)), rid
    engine.close()
    _assert_no_leak(engine)


def test_random_delays_keep_the_bytes_and_the_order_of_each_request():
    rng = random.Random(2)

    def slow(result: CopyResult, span: int) -> None:  # fault injection: copies of random speed
        time.sleep(rng.random() * 0.003)

    engine, buf = _engine("cpu", num_slots=2, slot_pages=4, inject=slow)
    got = Results(engine, release=True)
    jobs = [(f"req{i % 5}", f"req{i % 5}/{i}", _pages(rng, rng.randint(1, 4))) for i in range(30)]
    for rid, tag, spans in jobs:
        engine.copy_out(rid, spans, got, tag=tag)
    results = got.get(len(jobs))
    assert [r.tag for r in results] == [tag for _, tag, _ in jobs]  # FIFO: layers leave in order
    for _, tag, spans in jobs:
        assert torch.equal(got.staged[tag], _expected(buf, spans)), tag
    engine.close()
    _assert_no_leak(engine)


@pytest.mark.parametrize("kind", KINDS)
def test_host_to_device_lands_the_staged_bytes_in_the_pages(kind):
    rng = random.Random(3)
    engine, buf = _engine(kind, num_slots=2, slot_pages=6)
    got = Results(engine)
    want = buf.clone()
    for i in range(12):
        spans = _pages(rng, rng.randint(1, 6))
        slot = engine.reserve(f"d{i}", len(spans) * PAGE)
        assert slot is not None
        landed = torch.randint(0, 256, (len(spans) * PAGE,), dtype=torch.uint8)
        engine.ring.view(slot, landed.numel()).copy_(landed)  # what the remote writes put there
        for at, s in zip(packed_offsets(spans), spans):
            want[s.offset: s.offset + s.nbytes] = landed[at: at + s.nbytes].to(want.device)
        engine.copy_in(slot, f"d{i}", spans, got)
        r, = got.get(1)  # one at a time: later requests overwrite pages of earlier ones
        assert r.status is CopyStatus.DONE and r.slot is None  # the engine freed the slot itself
    assert torch.equal(buf.cpu(), want.cpu())
    engine.close()
    _assert_no_leak(engine)


def _gate():
    """Fault injection: copies block before their first span until the gate opens."""
    gate, started = threading.Event(), queue.SimpleQueue()
    hold_spans: list[tuple[object, int]] = []

    def hold(result: CopyResult, span: int) -> None:
        hold_spans.append((result.tag, span))
        if span == 0:
            started.put(result.request_id)
            assert gate.wait(30), "the test never opened the gate"
    hold.spans = hold_spans
    return gate, started, hold


def test_a_full_ring_queues_copies_without_blocking_and_bounds_the_queue():
    gate, started, hold = _gate()
    engine, buf = _engine("cpu", num_slots=2, slot_pages=2, max_pending=3, inject=hold)
    got = Results(engine)
    rng = random.Random(4)
    spans = {f"r{i}": _pages(rng, 2) for i in range(6)}
    t0 = time.monotonic()
    for i in range(5):
        engine.copy_out(f"r{i}", spans[f"r{i}"], got, tag=f"r{i}")  # returns at once: the forward pass goes on
    assert started.get(timeout=10) == "r0"
    assert engine.ring.num_free == 0 and engine.num_pending == 3
    assert engine.reserve("late", PAGE) is None  # a landing zone waits too: backpressure
    engine.copy_out("r5", spans["r5"], got, tag="r5")  # the queue is full: this one fails at once
    refused, = got.get(1)
    assert refused.request_id == "r5" and refused.status is CopyStatus.FAILED
    assert "staging queue full: 3 copies wait for one of 2 staging slots" in refused.error
    assert time.monotonic() - t0 < 10  # nothing above waited for a copy
    gate.set()
    done = got.get(2)
    assert [r.tag for r in done] == ["r0", "r1"] and engine.num_pending == 3  # slots still READY
    for r in done:
        engine.release(r.slot)  # the poller's writes completed: the waiting copies start
    more = got.get(2)
    assert [r.tag for r in more] == ["r2", "r3"]
    for r in more:
        engine.release(r.slot)
    last, = got.get(1)
    engine.release(last.slot)
    for tag in ("r0", "r1", "r2", "r3", "r4"):
        assert torch.equal(got.staged[tag], _expected(buf, spans[tag]))
    engine.close()
    _assert_no_leak(engine)


def test_a_copy_failure_fails_only_its_request_and_frees_the_slot():
    def fail_bad(result: CopyResult, span: int) -> None:  # fault injection: a failing copy
        if result.request_id == "bad" and span == 1:
            raise RuntimeError("injected: CUDA_ERROR_ILLEGAL_ADDRESS")

    engine, buf = _engine("cpu", num_slots=1, slot_pages=4, inject=fail_bad)
    got = Results(engine, release=True)
    rng = random.Random(5)
    jobs = [("ok1", _pages(rng, 3)), ("bad", _pages(rng, 3)), ("ok2", _pages(rng, 2))]
    for rid, spans in jobs:
        engine.copy_out(rid, spans, got, tag=rid)
    results = {r.request_id: r for r in got.get(3)}
    bad = results["bad"]
    assert bad.status is CopyStatus.FAILED and bad.slot is None
    assert bad.error == ("device-to-host staging copy for request 'bad' failed: "
                         "RuntimeError: injected: CUDA_ERROR_ILLEGAL_ADDRESS")
    for rid, spans in (jobs[0], jobs[2]):
        assert results[rid].status is CopyStatus.DONE and torch.equal(got.staged[rid], _expected(buf, spans))
    engine.close()
    _assert_no_leak(engine)


def test_cancel_mid_copy_stops_the_copy_and_its_queued_jobs_and_frees_the_slot():
    gate, started, hold = _gate()
    engine, buf = _engine("cpu", num_slots=1, slot_pages=4, inject=hold)
    got = Results(engine, release=True)
    rng = random.Random(6)
    engine.copy_out("victim", _pages(rng, 3), got, tag="v0")  # copying (held at its first span)
    engine.copy_out("victim", _pages(rng, 3), got, tag="v1")  # waiting for the slot
    other = _pages(rng, 2)
    engine.copy_out("other", other, got, tag="o")
    assert started.get(timeout=10) == "victim"
    assert engine.cancel("victim") == 2
    queued, = got.get(1)  # the queued job ends at once, without a slot
    assert queued.tag == "v1" and queued.status is CopyStatus.CANCELLED
    gate.set()
    mid, after = got.get(2)
    assert mid.tag == "v0" and mid.status is CopyStatus.CANCELLED and mid.slot is None
    assert mid.error == "cancelled while copying"
    assert [sp for tag, sp in hold.spans if tag == "v0"] == [0]  # stopped before its second span
    assert after.tag == "o" and after.status is CopyStatus.DONE and torch.equal(got.staged["o"], _expected(buf, other))
    assert engine.cancel("victim") == 0
    engine.close()
    _assert_no_leak(engine)


def test_cancelling_a_host_to_device_copy_reports_it_and_frees_the_slot():
    gate, started, hold = _gate()
    engine, buf = _engine("cpu", num_slots=1, slot_pages=2, inject=hold)
    got = Results(engine)
    slot = engine.reserve("d", 2 * PAGE)
    engine.copy_in(slot, "d", (Span(0, PAGE), Span(5 * PAGE, PAGE)), got)
    started.get(timeout=10)
    with pytest.raises(ValueError, match="still being copied"):
        engine.release(slot)  # the engine frees it when the copy ends, never under it
    with pytest.raises(ValueError, match="not a reserved, idle landing zone"):
        engine.copy_in(slot, "d", (Span(0, PAGE),), got)
    assert engine.cancel("d") == 1
    gate.set()
    r, = got.get(1)
    assert r.status is CopyStatus.CANCELLED and r.direction is Direction.HOST_TO_DEVICE
    engine.close()
    _assert_no_leak(engine)


def test_slots_are_released_once_and_only_by_their_holder():
    engine, _ = _engine("cpu", num_slots=2, slot_pages=1)
    slot = engine.reserve("a", PAGE)
    assert engine.ring.state(slot) is SlotState.HELD and engine.ring.owners() == {slot.index: (SlotState.HELD, "a")}
    engine.release(slot)  # a landing zone that was never used
    with pytest.raises(ValueError, match="released twice"):
        engine.release(slot)
    again = engine.reserve("b", PAGE)
    assert again.index == slot.index and again.generation == slot.generation + 1
    with pytest.raises(ValueError, match="released twice"):
        engine.release(slot)  # the stale handle cannot free b's slot
    with pytest.raises(ValueError, match="not a slot of this ring"):
        engine.release(type(slot)(7, 7 * PAGE, PAGE, 1))
    engine.release(again)
    engine.close()
    _assert_no_leak(engine)


def test_bad_jobs_are_refused_before_they_take_anything():
    engine, _ = _engine("cpu", num_slots=1, slot_pages=2)
    got = Results(engine)
    with pytest.raises(ValueError, match="outside the device buffer of 262144 bytes"):
        engine.copy_out("x", (Span(NUM_PAGES * PAGE - 10, 20),), got)
    with pytest.raises(ValueError, match="within one staging slot .8192 bytes; cut larger transfers with split_spans"):
        engine.copy_out("x", tuple(Span(p * PAGE, PAGE) for p in range(3)), got)
    with pytest.raises(ValueError, match="a staging slot holds 1..8192"):
        engine.reserve("x", 9000)
    with pytest.raises(ValueError, match="is not a reserved, idle landing zone"):
        engine.copy_in(type(engine.reserve("y", 1))(0, 0, 2 * PAGE, 99), "y", (Span(0, 1),), got)
    with pytest.raises(ValueError, match="device_buffer must be a flat uint8 tensor"):
        CpuCopyEngine(StagingRing(1, 8), torch.zeros(4, dtype=torch.float32))
    engine.close()
    with pytest.raises(RuntimeError, match="CpuCopyEngine is closed"):
        engine.copy_out("z", (Span(0, 1),), got)


def test_close_cancels_waiting_copies_and_a_failing_callback_does_not_stop_the_engine():
    gate, started, hold = _gate()
    engine, buf = _engine("cpu", num_slots=1, slot_pages=1, inject=hold)
    seen: queue.SimpleQueue = queue.SimpleQueue()

    def bad_callback(r: CopyResult) -> None:
        seen.put(r)
        if r.slot is not None:
            engine.release(r.slot)
        raise RuntimeError("a caller's bug")

    for i in range(3):
        engine.copy_out(f"r{i}", (Span(i * PAGE, PAGE),), bad_callback)
    started.get(timeout=10)
    gate.set()
    assert seen.get(timeout=10).status is CopyStatus.DONE  # r0; its callback raised
    assert seen.get(timeout=10).status is CopyStatus.DONE  # r1 still ran
    seen.get(timeout=10)
    engine.close()
    _assert_no_leak(engine)


def test_spans_are_packed_coalesced_and_split_to_slots():
    spans = [Span(0, 4), Span(4, 4), Span(16, 4), Span(20, 2), Span(8, 4)]
    assert packed_offsets(spans) == [0, 4, 8, 12, 14]
    assert coalesce(spans) == [(0, Span(0, 8)), (8, Span(16, 6)), (14, Span(8, 4))]
    assert split_spans(spans, 8) == [(Span(0, 4), Span(4, 4)), (Span(16, 4), Span(20, 2)), (Span(8, 4),)]
    with pytest.raises(ValueError, match="a span of 4 bytes does not fit a staging slot of 3 bytes"):
        split_spans(spans, 3)
    rng = random.Random(7)
    for _ in range(50):
        spans = [Span(rng.randrange(0, 1000), rng.randint(1, 9)) for _ in range(rng.randint(1, 20))]
        jobs = split_spans(spans, 16)
        assert [s for j in jobs for s in j] == spans and all(sum(s.nbytes for s in j) <= 16 for j in jobs)
        for job in jobs:
            runs = coalesce(job)
            assert sum(r.nbytes for _, r in runs) == sum(s.nbytes for s in job)


def test_make_copy_engine_picks_the_cpu_engine_for_host_memory_and_cuda_refuses_it():
    from pdkv.gpu.copy_engine import make_copy_engine
    from pdkv.gpu.cuda_copy_engine import CudaCopyEngine

    ring, buf = StagingRing(2, PAGE), torch.zeros(4 * PAGE, dtype=torch.uint8)
    engine = make_copy_engine(ring, buf)
    assert isinstance(engine, CpuCopyEngine)
    engine.close()
    with pytest.raises(ValueError, match="the device buffer is on cpu, not a GPU"):
        CudaCopyEngine(ring, buf)


class FakeCudaTorch:
    """Fault-injection stand-in for ``torch`` inside CudaCopyEngine on a CPU machine: streams and
    events that record what was asked of them (copies then run at once, on the CPU)."""

    def __init__(self):
        import contextlib

        self.log: list[tuple] = []
        fake = self

        class Event:
            def record(self, stream):
                fake.log.append(("record", stream))

            def synchronize(self):
                fake.log.append(("synchronize",))

        class Stream:
            def wait_event(self, event):
                fake.log.append(("wait_event", event))

        self.cuda = type("cuda", (), {"Event": Event, "Stream": Stream,
                                      "device": staticmethod(lambda d: contextlib.nullcontext()),
                                      "stream": staticmethod(lambda s: contextlib.nullcontext())})
        self.stream = Stream()


def test_the_cuda_engine_orders_after_the_event_coalesces_and_waits_per_job():
    from pdkv.gpu.copy_engine import CopyEngine
    from pdkv.gpu.cuda_copy_engine import CudaCopyEngine

    fake = FakeCudaTorch()
    engine = CudaCopyEngine.__new__(CudaCopyEngine)  # skip the GPU checks of __init__
    engine._torch, engine.stream, engine.device = fake, fake.stream, "cuda:0"
    buf = torch.randint(0, 256, (NUM_PAGES * PAGE,), dtype=torch.uint8)
    engine.streams = {buf.device: fake.stream}  # one copy stream per device that holds a buffer
    CopyEngine.__init__(engine, StagingRing(2, 4 * PAGE), buf)
    got = Results(engine, release=True)
    after = object()  # the compute stream's event
    spans = (Span(3 * PAGE, PAGE), Span(4 * PAGE, PAGE), Span(9 * PAGE, PAGE))  # pages 3-4 adjacent
    engine.copy_out("r", spans, got, after=after, tag="r")
    r, = got.get(1)
    assert r.status is CopyStatus.DONE and torch.equal(got.staged["r"], _expected(buf, spans))
    assert fake.log == [("wait_event", after), ("record", fake.stream), ("synchronize",)]
    slot = engine.reserve("d", 2 * PAGE)
    engine.ring.view(slot, 2 * PAGE).fill_(7)
    engine.copy_in(slot, "d", (Span(0, PAGE), Span(PAGE, PAGE)), got)
    assert got.get(1)[0].status is CopyStatus.DONE and bool((buf[: 2 * PAGE] == 7).all())
    assert ("wait_event", None) not in fake.log[3:] and fake.log[3:] == [("record", fake.stream), ("synchronize",)]
    engine.close()
    _assert_no_leak(engine)
