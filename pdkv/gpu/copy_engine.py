"""The copy engine: KV pages between device memory and the staging ring, asynchronously.

Two directions (see pdkv.gpu.staging for the ring and the packing of spans in a slot):

- **device to host** (prefill node, transports without GPUDirect): when a layer's counter target
  is reached, ``copy_out(request_id, spans, on_done, after=event)`` copies that layer's pages
  into a free slot, ordered after ``after`` (CUDA: an event recorded on the compute stream after
  the layer's output projection). ``on_done(CopyResult)`` then says DONE with the slot: the
  poller posts the writes from ``ring.address + slot.offset`` and, once they have completed,
  calls ``release(slot)``.
- **host to device** (decode node): ``reserve(request_id, nbytes)`` gives a landing zone (the
  decode side tells the prefill node to write there); when the request's write count is complete,
  ``copy_in(slot, spans, on_done)`` copies it into the KV pages, and ``on_done`` comes before the
  request may be declared complete. The engine frees an H2D slot itself when its copy ends.

Every result is a :class:`CopyResult` with a :class:`CopyStatus`; a failure is one request's
(``FAILED`` with the reason: the caller fails that request and quarantines its pages as for a
transfer failure), never an exception in the caller's thread. Callbacks run on the engine's
notifier thread, in completion order; they must not block (``release`` and ``cancel`` never do).

**Backpressure, bounded, without deadlock** (the rule the wiring must keep):

1. Staging memory is the ring, allocated once (``num_slots x slot_nbytes``).
2. ``copy_out`` never blocks (it is called from the forward pass): without a free slot the job
   waits in a FIFO of at most ``max_pending`` jobs; beyond that it fails at once (FAILED, "staging
   queue full"). The KV pages it would copy stay valid meanwhile: a prefill node frees a
   request's pages only after all its writes have completed.
3. Every held slot is freed without needing another slot or the model thread: a READY slot by
   the transport completing that slot's writes, an H2D slot by the end of its copy. So no cycle.
4. ``reserve`` returns None when no slot is free (or a D2H job is waiting for one); the decode
   side keeps the request waiting for staging instead of sending it to a prefill node.
5. A job must fit one slot: ``split_spans(layer_spans, ring.slot_nbytes)`` cuts a layer into jobs.

**Cancellation** (``cancel(request_id)``): queued jobs end CANCELLED at once; a copy in flight is
stopped between spans (CPU) or runs to its end (CUDA: a DMA cannot be recalled), then ends
CANCELLED and frees its slot. A CANCELLED H2D copy may have written some of the pages: quarantine
them. READY slots and reserved landing zones are not touched: a posted or incoming write may
still use them, so the caller releases them once the peer has quiesced.

**Wiring** (pdkv/disagg/staged_prefill.py, staged_decode.py; docs/GPU.md). Prefill: in the
runner's layer hook (after the counter bump) a CUDA event, and ``copy_out`` of the layer's pages of
every request in the step, cut to fit a slot; ``on_done`` queues the slot's writes with a counter
target already reached and the slot is released by the last of their batch completions;
FAILED/CANCELLED fail the request like a transfer failure. Decode: ``reserve`` a slot per page
before PREFILL (None: the request waits), PREFILL carries the slots, and when the request's count
completes (grants revoked) ``copy_in`` each slot into its pages; the request is complete in the
last ``on_done``.

Implementations: ``CpuCopyEngine`` (pdkv.gpu.cpu_copy_engine: copies on a worker thread, with a
fault-injection hook for delays and failures) and ``CudaCopyEngine`` (pdkv.gpu.cuda_copy_engine:
copy stream, events, pinned ring). Both share this class's queues, threads and state machine;
:func:`make_copy_engine` picks one for a device buffer.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from pdkv.gpu.staging import (CopyResult, CopyStatus, Direction, Span, StagingRing, StagingSlot,  # noqa: F401
                               SlotState)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Job:
    id: int
    request_id: str
    direction: Direction
    spans: tuple[Span, ...]
    nbytes: int
    on_done: Callable[[CopyResult], None]
    after: object = None
    tag: object = None
    slot: StagingSlot | None = None
    cancelled: bool = False
    status: CopyStatus | None = None  # set when the job ends without running
    error: str = ""
    handle: object = field(default=None, repr=False)


class CopyEngine:
    """Queues, slots, threads and cancellation; subclasses move the bytes (``_launch``/``_wait``)."""

    name = "base"

    def __init__(self, ring: StagingRing, device_buffer, max_pending: int = 64):
        if max_pending < 0:
            raise ValueError(f"{type(self).__name__}: max_pending must be >= 0, got {max_pending}")
        # one tensor, or one per tensor-parallel rank (a Span's ``buffer`` says which)
        buffers = list(device_buffer) if isinstance(device_buffer, (list, tuple)) else [device_buffer]
        for b in buffers:
            if b.dim() != 1 or b.element_size() != 1:
                raise ValueError(f"{type(self).__name__}: device_buffer must be a flat uint8 tensor (the KV "
                                 f"buffer as bytes), got {b.dtype} {tuple(b.shape)}")
        if not buffers:
            raise ValueError(f"{type(self).__name__}: device_buffer is an empty list")
        self.ring, self.max_pending = ring, max_pending
        self.device_buffers, self.device_buffer = buffers, buffers[0]
        self._device_nbytes = [b.numel() for b in buffers]
        self._lock = threading.Lock()
        self._pending: deque[_Job] = deque()  # D2H jobs waiting for a slot (FIFO)
        self._jobs: dict[str, set[_Job]] = {}  # request -> its jobs that have not ended
        self._busy: set[int] = set()  # slots a job copies into or out of: not releasable
        # Three threads, so no stage waits behind another: the launcher starts copies (CUDA: enqueues
        # them on the copy stream), the waiter waits for them in launch order, the notifier frees
        # slots and runs callbacks (also at once for jobs that end without running).
        self._launchq: queue.SimpleQueue = queue.SimpleQueue()  # jobs with a slot, to launch
        self._waitq: queue.SimpleQueue = queue.SimpleQueue()  # launched jobs
        self._resultq: queue.SimpleQueue = queue.SimpleQueue()  # ended jobs
        self._ids = itertools.count(1)
        self._closed = False
        self._threads = [threading.Thread(target=fn, name=f"pdkv-{self.name}-{fn.__name__[1:]}", daemon=True)
                         for fn in (self._launcher, self._waiter, self._notifier)]
        for t in self._threads:
            t.start()

    # ---- the interface ----------------------------------------------------------------------
    def copy_out(self, request_id: str, spans, on_done, after=None, tag=None) -> None:
        """Device-to-host: copy ``spans`` of the device buffer into a slot; never blocks."""
        job = self._job(request_id, Direction.DEVICE_TO_HOST, spans, on_done, after, tag)
        with self._lock:
            self._check_open()
            self._jobs.setdefault(request_id, set()).add(job)
            job.slot = self.ring.take(request_id) if not self._pending else None
            if job.slot is not None:
                self._busy.add(job.slot.index)
            else:
                if len(self._pending) >= self.max_pending:
                    self._end_now(job, CopyStatus.FAILED, f"staging queue full: {len(self._pending)} "
                                  f"copies wait for one of {self.ring.num_slots} staging slots")
                    return
                self._pending.append(job)
                return
        self._launchq.put(job)

    def reserve(self, request_id: str, nbytes: int) -> StagingSlot | None:
        """Host-to-device landing zone of ``nbytes``; None when the ring is full (backpressure)."""
        if not 0 < nbytes <= self.ring.slot_nbytes:
            raise ValueError(f"reserve({request_id!r}): {nbytes} bytes, a staging slot holds 1..{self.ring.slot_nbytes}")
        with self._lock:
            self._check_open()
            return None if self._pending else self.ring.take(request_id)

    def copy_in(self, slot: StagingSlot, request_id: str, spans, on_done, tag=None) -> None:
        """Host-to-device: copy the packed bytes of ``slot`` to ``spans``; the slot is freed after."""
        job = self._job(request_id, Direction.HOST_TO_DEVICE, spans, on_done, None, tag)
        with self._lock:
            self._check_open()
            if self.ring.state(slot) is not SlotState.HELD or slot.index in self._busy:
                raise ValueError(f"copy_in({request_id!r}): staging slot {slot.index} is not a reserved, "
                                 "idle landing zone")
            self._busy.add(slot.index)
            job.slot = slot
            self._jobs.setdefault(request_id, set()).add(job)
        self._launchq.put(job)

    def release(self, slot: StagingSlot) -> None:
        """Free a READY slot (its writes completed) or an unused landing zone; wakes a waiting job."""
        with self._lock:
            if slot.index in self._busy and self.ring.state(slot) is SlotState.HELD:
                raise ValueError(f"staging slot {slot.index} is still being copied; it is freed when the copy ends")
            self.ring.give_back(slot)
        self._promote()

    def cancel(self, request_id: str) -> int:
        """Cancel the request's jobs that have not ended; returns how many."""
        with self._lock:
            jobs = list(self._jobs.get(request_id, ()))
            for job in jobs:
                job.cancelled = True
                if job in self._pending:
                    self._pending.remove(job)
                    self._end_now(job, CopyStatus.CANCELLED, "cancelled before a staging slot was free")
        return len(jobs)

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def num_jobs(self) -> int:
        """Jobs not yet ended (pending, copying, or waiting for their callback)."""
        with self._lock:
            return sum(len(j) for j in self._jobs.values())

    def close(self, timeout: float = 30.0) -> None:
        """Cancel everything queued, let copies in flight end, stop the threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for job in list(self._pending):
                job.cancelled = True
                self._end_now(job, CopyStatus.CANCELLED, "copy engine closed")
            self._pending.clear()
        self._launchq.put(None)
        for t in self._threads:
            t.join(timeout)

    # ---- for implementations ----------------------------------------------------------------
    def _launch(self, job: _Job) -> object:
        """Start the copy (launcher thread); returns a handle for _wait. Raise to fail the job."""
        raise NotImplementedError

    def _wait(self, job: _Job, handle) -> None:
        """Wait for the copy to end (waiter thread). Raise to fail the job."""
        raise NotImplementedError

    # ---- machinery ---------------------------------------------------------------------------
    def _job(self, request_id, direction, spans, on_done, after, tag) -> _Job:
        spans = tuple(spans)
        nbytes = sum(s.nbytes for s in spans)
        if not spans or nbytes > self.ring.slot_nbytes:
            raise ValueError(f"{direction.value} copy for {request_id!r}: {len(spans)} span(s) of {nbytes} bytes; "
                             f"a job needs 1.. spans within one staging slot ({self.ring.slot_nbytes} bytes; "
                             "cut larger transfers with split_spans)")
        for s in spans:
            if not 0 <= s.buffer < len(self._device_nbytes):
                raise ValueError(f"{direction.value} copy for {request_id!r}: {s} names device buffer "
                                 f"{s.buffer}; this engine has {len(self._device_nbytes)}")
            size = self._device_nbytes[s.buffer]
            if s.nbytes < 1 or s.offset < 0 or s.offset + s.nbytes > size:
                raise ValueError(f"{direction.value} copy for {request_id!r}: {s} is outside the device "
                                 f"buffer of {size} bytes")
        return _Job(next(self._ids), request_id, direction, spans, nbytes, on_done, after, tag)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")

    def _end_now(self, job: _Job, status: CopyStatus, error: str) -> None:
        """A job that ends without running (under the lock): its callback comes at once."""
        job.status, job.error = status, error
        self._resultq.put(job)

    def _promote(self) -> None:
        """Give freed slots to waiting jobs, first come first served."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                slot = self.ring.take(self._pending[0].request_id)
                if slot is None:
                    return
                job = self._pending.popleft()
                job.slot = slot
                self._busy.add(slot.index)
            self._launchq.put(job)

    def _launcher(self) -> None:
        while (job := self._launchq.get()) is not None:
            if job.cancelled:
                job.status, job.error = CopyStatus.CANCELLED, "cancelled before the copy started"
                self._resultq.put(job)
                continue
            try:
                job.handle = self._launch(job)
            except Exception as e:  # noqa: BLE001 - one request's copy failed, not the engine
                job.status, job.error = CopyStatus.FAILED, f"{type(e).__name__}: {e}"
                self._resultq.put(job)
                continue
            self._waitq.put(job)
        self._waitq.put(None)

    def _waiter(self) -> None:
        while (job := self._waitq.get()) is not None:
            try:
                self._wait(job, job.handle)
                job.status = CopyStatus.CANCELLED if job.cancelled else CopyStatus.DONE
                if job.cancelled:
                    job.error = "cancelled while copying"
            except Exception as e:  # noqa: BLE001
                job.status, job.error = CopyStatus.FAILED, f"{type(e).__name__}: {e}"
            self._resultq.put(job)
        self._resultq.put(None)

    def _notifier(self) -> None:
        while (job := self._resultq.get()) is not None:
            try:
                self._finish(job)
            except Exception:  # noqa: BLE001 - a bookkeeping bug must not stop every later callback
                log.exception("copy engine: finishing %r failed", job.request_id)

    def _finish(self, job: _Job) -> None:
        keep = job.status is CopyStatus.DONE and job.direction is Direction.DEVICE_TO_HOST
        if job.slot is not None:
            with self._lock:
                self._busy.discard(job.slot.index)
                if keep:
                    self.ring.mark_ready(job.slot)
                else:
                    self.ring.give_back(job.slot)
        with self._lock:
            jobs = self._jobs.get(job.request_id)
            if jobs is not None:
                jobs.discard(job)
                if not jobs:
                    del self._jobs[job.request_id]
        if job.status is CopyStatus.FAILED:
            job.error = f"{job.direction.value} staging copy for request {job.request_id!r} failed: {job.error}"
        result = CopyResult(job.request_id, job.direction, job.status, job.slot if keep else None,
                            job.spans, job.nbytes, job.error, job.tag)
        try:
            job.on_done(result)
        except Exception:  # noqa: BLE001 - a caller's bug must not stop every later copy
            log.exception("copy engine: on_done for %r raised", job.request_id)
        if not keep:
            self._promote()


def make_copy_engine(ring: StagingRing, device_buffer, max_pending: int = 64) -> CopyEngine:
    """The engine for ``device_buffer``'s device (a tensor, or a list of them, one per rank): CUDA
    copies for GPU memory, else CPU copies."""
    first = device_buffer[0] if isinstance(device_buffer, (list, tuple)) else device_buffer
    if first.device.type == "cuda":
        from pdkv.gpu.cuda_copy_engine import CudaCopyEngine

        return CudaCopyEngine(ring, device_buffer, max_pending)
    from pdkv.gpu.cpu_copy_engine import CpuCopyEngine

    return CpuCopyEngine(ring, device_buffer, max_pending)
