"""The CPU copy engine: the staging pipeline's copies done by torch on a worker thread.

It is the stand-in for the CUDA engine wherever the KV cache is host memory (every CPU run and
test), with the same queues, slots, ordering, backpressure and cancellation (pdkv.gpu.copy_engine).
Its ``inject`` hook is fault injection, for tests and benchmarks: called before each span with
the job and the span's index, it may sleep (a slow copy), block (hold a copy mid-way, to cancel
it or to fill the ring) or raise (a failed copy, reported FAILED for that request only).
"""

from __future__ import annotations

from typing import Callable

from pdkv.gpu.copy_engine import CopyEngine, CopyResult, CopyStatus, Direction, _Job
from pdkv.gpu.staging import StagingRing, coalesce, packed_offsets


class CpuCopyEngine(CopyEngine):
    """Copies with torch on the waiter thread, span by span.

    ``inject(result_so_far, span_index)`` is fault injection for tests: it runs before each span
    and may sleep (a slow copy), block (hold a copy mid-way), or raise (a failed copy).
    """

    name = "cpu-copy"

    def __init__(self, ring: StagingRing, device_buffer, max_pending: int = 64,
                 inject: Callable[[CopyResult, int], None] | None = None):
        self._inject = inject
        super().__init__(ring, device_buffer, max_pending)

    def _launch(self, job: _Job) -> object:
        return None  # the copy runs in _wait, on the waiter thread

    def _wait(self, job: _Job, handle) -> None:
        staged = self.ring.view(job.slot)
        # without a hook, adjacent pages move as one copy; with one, span by span (its granularity)
        runs = coalesce(job.spans) if self._inject is None else zip(packed_offsets(job.spans), job.spans)
        for i, (at, s) in enumerate(runs):
            if self._inject is not None:
                self._inject(CopyResult(job.request_id, job.direction, CopyStatus.DONE, job.slot, job.spans,
                                        job.nbytes, tag=job.tag), i)
            if job.cancelled:
                return  # stopped between spans; _waiter reports CANCELLED
            dev = self.device_buffers[s.buffer][s.offset: s.offset + s.nbytes]
            if job.direction is Direction.DEVICE_TO_HOST:
                staged[at: at + s.nbytes].copy_(dev)
            else:
                dev.copy_(staged[at: at + s.nbytes])
