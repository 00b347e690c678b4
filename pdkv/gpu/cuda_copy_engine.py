"""The CUDA copy engine: staging copies on a dedicated copy stream, into a pinned ring.

GPU only; built through :func:`pdkv.gpu.copy_engine.make_copy_engine` or directly, it raises
GPUUnavailable (naming what is missing) where CUDA cannot run. The queues, slots, backpressure
and cancellation are the shared ones of :class:`pdkv.gpu.copy_engine.CopyEngine`; this class
only moves bytes:

- launcher thread: on the copy stream, wait for ``after`` (a ``torch.cuda.Event`` recorded on
  the compute stream after the layer's output projection; None when the caller has already seen
  the layer's counter target on the host, which the counter's system-scope release orders after
  the layer's KV writes), then one ``cudaMemcpyAsync`` per run of adjacent pages
  (``staging.coalesce``), then record a completion event. Several jobs are in flight at once,
  so the copy engine (DMA) stays busy while the host waits.
- waiter thread: ``event.synchronize()`` in launch order; then the notifier frees or readies the
  slot and calls back. A D2H slot is READY only once its bytes are in host memory; an H2D
  callback comes only once the pages are in device memory, before the request may be declared
  complete (kernels issued after the callback see them: the host ordered them after the copy).

The ring must be pinned (``StagingRing(..., pin=True)``): a copy from pageable memory is staged
by the driver through its own buffer and serialises with the host, which defeats the point.
A cancelled copy in flight cannot be recalled: it runs to its end and is reported CANCELLED.
"""

from __future__ import annotations

from pdkv.gpu.copy_engine import CopyEngine, Direction, _Job
from pdkv.gpu.staging import StagingRing, coalesce


class CudaCopyEngine(CopyEngine):
    name = "cuda-copy"

    def __init__(self, ring: StagingRing, device_buffer, max_pending: int = 64, stream=None):
        from pdkv.gpu.guard import require_torch_cuda

        buffers = list(device_buffer) if isinstance(device_buffer, (list, tuple)) else [device_buffer]
        for b in buffers:
            if b.device.type != "cuda":
                raise ValueError(f"CudaCopyEngine: the device buffer is on {b.device}, not a GPU "
                                 "(use CpuCopyEngine, or make_copy_engine)")
        torch = require_torch_cuda("CudaCopyEngine", buffers[0].device.index or 0)
        if not ring.buffer.is_pinned():
            raise ValueError("CudaCopyEngine: the staging ring must be pinned host memory "
                             "(StagingRing(..., pin=True)); pageable copies serialise with the host")
        self.device = buffers[0].device
        self._torch = torch
        # one copy stream per GPU that holds a buffer (tensor parallelism: each rank's cuMem lives
        # on its own GPU; a copy must run on a stream of the device that owns the memory, or it
        # would not be ordered by this stream's events)
        self.streams = {}
        for b in buffers:
            if b.device not in self.streams:
                self.streams[b.device] = (stream if stream is not None and b.device == self.device
                                          else torch.cuda.Stream(device=b.device))
        self.stream = self.streams[self.device]
        super().__init__(ring, device_buffer, max_pending)

    def _launch(self, job: _Job) -> object:
        torch = self._torch
        staged = self.ring.view(job.slot)
        by_device: dict = {}
        for at, s in coalesce(job.spans):
            by_device.setdefault(self.device_buffers[s.buffer].device, []).append((at, s))
        done = []
        for device, runs in by_device.items():
            stream = self.streams[device]
            with torch.cuda.device(device), torch.cuda.stream(stream):
                if job.after is not None:
                    stream.wait_event(job.after)  # the layer's KV writes come first (any device's event)
                for at, s in runs:
                    dev = self.device_buffers[s.buffer][s.offset: s.offset + s.nbytes]
                    host = staged[at: at + s.nbytes]
                    if job.direction is Direction.DEVICE_TO_HOST:
                        host.copy_(dev, non_blocking=True)
                    else:
                        dev.copy_(host, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
                done.append(ev)
        return done

    def _wait(self, job: _Job, done) -> None:
        for ev in done:
            ev.synchronize()  # raises on a sticky CUDA error: that job is FAILED
