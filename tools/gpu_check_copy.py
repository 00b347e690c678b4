"""GPU checks of the staging copy engine and of the memory bandwidths it is judged against.

Shared by tools/gpu_check.py (and usable from a GPU test). Each check raises AssertionError with
what went wrong, or returns ``(one-line summary, data dict for the JSON report)``.

- :func:`measure_pinned_d2h` / :func:`measure_device_bandwidth`: the baselines -- one large
  device-to-pinned-host copy (what a copy engine can reach over PCIe/C2C), and a device-to-device
  copy (read + write bytes / time: the HBM bandwidth a decode step's weight reads are bounded by).
- :func:`check_copy_engine`: ``CudaCopyEngine`` moves random scattered pages both ways byte-exact
  (device -> staging slots -> compared with the device bytes; staging -> device pages), then moves
  ``total_mib`` of layer-sized jobs device-to-host through the ring, slots released as soon as the
  callback has them, and reports the rate as a fraction of the pinned baseline (a ring
  that keeps the link busy reaches >= 0.8 of it), for contiguous layers and for scattered pages.
"""

from __future__ import annotations

import random
import threading
import time


def timed_seconds(torch, fn, reps: int) -> float:
    """Seconds per call of fn() on the current stream, measured with CUDA events after a warm-up."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def measure_pinned_d2h(torch, device: int, nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes/s of one large device-to-pinned-host copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return nbytes / timed_seconds(torch, lambda: dst.copy_(src, non_blocking=True), reps)


def measure_device_bandwidth(torch, device: int, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Bytes/s of HBM traffic in a device-to-device copy (each byte read once and written once)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    b = torch.empty_like(a)
    return 2 * nbytes / timed_seconds(torch, lambda: b.copy_(a), reps)


class _Sink:
    """on_done for the bandwidth runs: release each READY slot at once, count the ends."""

    def __init__(self, engine, expected: int):
        self.engine, self.expected, self.errors = engine, expected, []
        self.count, self.done = 0, threading.Event()

    def __call__(self, r) -> None:
        if r.slot is not None:
            self.engine.release(r.slot)
        if r.status.value != "done":
            self.errors.append(f"{r.request_id}: {r.status.value} {r.error}")
        self.count += 1
        if self.count == self.expected:
            self.done.set()


def _exact(torch, engine, dev, rng: random.Random, page: int, num_jobs: int) -> int:
    """Scattered random pages both ways, compared byte for byte; returns bytes checked."""
    from pdkv.gpu.copy_engine import CopyStatus
    from pdkv.gpu.staging import Span, packed_offsets

    num_pages, per_slot = dev.numel() // page, engine.ring.slot_nbytes // page
    results, checked = [], 0
    lock, finished = threading.Lock(), threading.Event()

    def collect(r):
        with lock:
            staged = engine.ring.view(r.slot, r.nbytes).clone() if r.slot is not None else None
            results.append((r, staged))
            if r.slot is not None:
                engine.release(r.slot)
            if len(results) == num_jobs:
                finished.set()

    jobs = {}
    for i in range(num_jobs):
        spans = tuple(Span(p * page, page) for p in rng.sample(range(num_pages), rng.randint(1, per_slot)))
        jobs[f"d2h{i}"] = spans
        engine.copy_out(f"d2h{i}", spans, collect)
    assert finished.wait(120), f"only {len(results)} of {num_jobs} device-to-host copies ended in 120 s"
    for r, staged in results:
        assert r.status is CopyStatus.DONE, f"{r.request_id}: {r.status.value} {r.error}"
        want = torch.cat([dev[s.offset: s.offset + s.nbytes] for s in jobs[r.request_id]]).cpu()
        assert torch.equal(staged, want), f"{r.request_id}: staged bytes differ from the device pages"
        checked += r.nbytes
    for i in range(num_jobs // 4):  # host to device: land random bytes, copy in, compare on the GPU
        spans = tuple(Span(p * page, page) for p in rng.sample(range(num_pages), rng.randint(1, per_slot)))
        slot = engine.reserve(f"h2d{i}", len(spans) * page)
        assert slot is not None, "no landing zone free with every slot released"
        landed = torch.randint(0, 256, (len(spans) * page,), dtype=torch.uint8)
        engine.ring.view(slot, landed.numel()).copy_(landed)
        ended = threading.Event()
        out = []
        engine.copy_in(slot, f"h2d{i}", spans, lambda r: (out.append(r), ended.set()))
        assert ended.wait(60) and out[0].status is CopyStatus.DONE, f"h2d{i}: {out and out[0]}"
        for at, s in zip(packed_offsets(spans), spans):
            assert torch.equal(dev[s.offset: s.offset + s.nbytes].cpu(), landed[at: at + s.nbytes]), f"h2d{i}"
        checked += landed.numel()
    return checked


def _stream_rate(engine, jobs: list, timeout: float = 120.0) -> float:
    """Bytes/s of pushing every job (a tuple of spans) device-to-host through the ring."""
    sink = _Sink(engine, len(jobs))
    total = sum(s.nbytes for spans in jobs for s in spans)
    t0 = time.perf_counter()
    for i, spans in enumerate(jobs):
        engine.copy_out(f"bw{i}", spans, sink)
    assert sink.done.wait(timeout), f"only {sink.count} of {len(jobs)} copies ended in {timeout} s"
    rate = total / (time.perf_counter() - t0)
    assert not sink.errors, sink.errors[:3]
    return rate


def check_copy_engine(device: int = 0, total_mib: int = 1024, num_slots: int = 8, slot_mib: int = 16,
                      page_kib: int = 64) -> tuple[str, dict]:
    from pdkv.gpu.cuda_copy_engine import CudaCopyEngine
    from pdkv.gpu.guard import require_torch_cuda
    from pdkv.gpu.staging import Span, StagingRing

    torch = require_torch_cuda("check_copy_engine", device)
    page, slot = page_kib << 10, slot_mib << 20
    dev = torch.randint(0, 256, (total_mib << 20,), dtype=torch.uint8, device=f"cuda:{device}")
    engine = CudaCopyEngine(StagingRing(num_slots, slot, pin=True), dev)
    try:
        checked = _exact(torch, engine, dev, random.Random(13), page, num_jobs=64)
        baseline = measure_pinned_d2h(torch, device, slot * num_slots)
        per_slot = slot // page
        layers = [tuple(Span(j * slot + k * page, page) for k in range(per_slot)) for j in range(dev.numel() // slot)]
        contiguous = _stream_rate(engine, layers)  # adjacent pages: coalesced into one copy per job
        order = list(range(dev.numel() // page))
        random.Random(14).shuffle(order)
        scattered_jobs = [tuple(Span(p * page, page) for p in order[i:i + per_slot])
                          for i in range(0, len(order), per_slot)]
        scattered = _stream_rate(engine, scattered_jobs)  # one cudaMemcpyAsync per page
        leaked = engine.ring.owners()
        assert not leaked and engine.num_jobs() == 0, f"slots not freed after the runs: {leaked}"
    finally:
        engine.close()
    data = {"bytes_checked": checked, "pinned_d2h_GBps": baseline / 1e9, "staged_contiguous_GBps": contiguous / 1e9,
            "staged_scattered_GBps": scattered / 1e9, "contiguous_ratio": contiguous / baseline,
            "scattered_ratio": scattered / baseline, "ring": f"{num_slots} x {slot_mib} MiB pinned",
            "page_kib": page_kib, "moved_mib": total_mib}
    return (f"{checked >> 20} MiB byte-exact both ways; D2H staging {contiguous / 1e9:.1f} GB/s contiguous "
            f"({data['contiguous_ratio']:.0%} of the {baseline / 1e9:.1f} GB/s pinned copy; >= 80% keeps the link busy), "
            f"{scattered / 1e9:.1f} GB/s for scattered {page_kib} KiB pages ({data['scattered_ratio']:.0%})"), data


def bench_cpu(total_mib: int = 256, num_slots: int = 8, slot_mib: int = 4, page_kib: int = 64) -> dict:
    """The CPU engine's streaming rate against plain torch copies of the same slot-sized chunks
    (same run, same sizes: the ratio is what the engine's queues and threads cost)."""
    import torch

    from pdkv.gpu.cpu_copy_engine import CpuCopyEngine
    from pdkv.gpu.staging import Span, StagingRing

    page, slot = page_kib << 10, slot_mib << 20
    dev = torch.randint(0, 256, (total_mib << 20,), dtype=torch.uint8)
    host = torch.empty(num_slots * slot, dtype=torch.uint8)  # the ring's footprint, slot by slot
    engine = CpuCopyEngine(StagingRing(num_slots, slot), dev)
    per_slot = slot // page
    layers = [tuple(Span(j * slot + k * page, page) for k in range(per_slot)) for j in range(dev.numel() // slot)]
    plain, staged = [], []
    try:
        for _ in range(7):  # alternate the two, best of each: the machine is shared and noisy
            t0 = time.perf_counter()
            for j in range(dev.numel() // slot):
                k = j % num_slots
                host[k * slot: (k + 1) * slot].copy_(dev[j * slot: (j + 1) * slot])
            plain.append(dev.numel() / (time.perf_counter() - t0))
            staged.append(_stream_rate(engine, layers))
    finally:
        engine.close()
    baseline, rate = max(plain), max(staged)
    return {"memcpy_GBps": baseline / 1e9, "staged_GBps": rate / 1e9, "ratio": rate / baseline}


if __name__ == "__main__":
    import json
    import sys

    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    print(json.dumps(bench_cpu(mib), indent=1))
