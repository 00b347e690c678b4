"""`python -m pdkv.bench transfer --staged`: the staging pipeline of pdkv/disagg/staged*.py end to
end between two processes, against the same transport moving host memory directly (transfer.py's
``bench_pdkv``), in the same run.

Sender (the prefill role): pages live in a "device" buffer (GPU memory with --device cuda; host
memory through the CPU copy engine otherwise); jobs of ``slot // size`` pages are copied into a
ring of slots (``copy_out``), and each READY slot's pages are written from the ring with one
immediate per job; a slot goes back when its writes completed (batch_done).
Receiver (the decode role): the writes of job j land in slot j % R of its own ring; when job j's
count completes its slot is copied into the receiver's device buffer (``copy_in``), and the
sender may reuse that landing slot only after the copy ended (credits over a pipe). The clock
stops when the last copy-in ended: every byte is in device memory on the far side.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import select
import time

import numpy as np

RING = 64 << 20  # each side's staging ring (the roles' default messenger.staging_mib)
SLOT = 1 << 20  # one job (the prefill role's default messenger.staging_slot_kib): SLOT // size pages


def _device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _engine(device: str, nbytes: int, max_pending: int, slot: int):
    import torch

    from pdkv.gpu.copy_engine import make_copy_engine
    from pdkv.gpu.staging import StagingRing

    ring = StagingRing(max(16, RING // slot), slot, pin=device.startswith("cuda"))
    dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return make_copy_engine(ring, dev, max_pending), dev


def _jobs(size: int, n: int, region: int, slot: int) -> list[np.ndarray]:
    """The page numbers (into the device buffer, wrapping) of each job."""
    per = max(1, slot // size)
    pages = np.arange(n, dtype=np.int64) % (region // size)
    return [pages[i:i + per] for i in range(0, n, per)]


def _receiver(conn, transport: str, opts, device: str, region: int, slot: int) -> None:
    from pdkv._messenger import Messenger
    from pdkv.gpu.staging import Span

    m = Messenger(transport, 2, opts)
    copy, _ = _engine(device, region, 0, slot)
    ring = copy.ring
    key = m.register_address(ring.address, ring.nbytes)
    m.grant(key, 1)
    c, info = m.prepare(1)
    conn.send((key, info, ring.num_slots))
    m.complete(c, conn.recv())
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        imm0, size, n = msg
        jobs = _jobs(size, n, region, slot)
        done = queue.SimpleQueue()
        slots = {}
        for j in range(min(len(jobs), ring.num_slots)):  # the first R landing zones
            slots[j] = copy.reserve(f"j{j}", slot)
            m.expect(imm0 + j, len(jobs[j]))
        conn.send(("expecting", {j: s.offset for j, s in slots.items()}))
        ended = 0
        while ended < len(jobs):
            select.select([m.fileno()], [], [], 0.001)
            for ev in m.drain():
                if ev.kind == "error":
                    raise RuntimeError(f"staged receiver: {ev.reason}")
                if ev.kind == "imm_done":
                    j = ev.imm - imm0
                    spans = [Span(int(p) * size, size) for p in jobs[j]]
                    copy.copy_in(slots.pop(j), f"j{j}", spans, lambda r, j=j: done.put(j))
            while True:
                try:
                    j = done.get_nowait()
                except queue.Empty:
                    break
                ended += 1
                nxt = j + ring.num_slots  # a landing zone is free again: the next job may use it
                if nxt < len(jobs):
                    slots[nxt] = copy.reserve(f"j{nxt}", slot)
                    m.expect(imm0 + nxt, len(jobs[nxt]))
                    conn.send(("zone", nxt, slots[nxt].offset))
        conn.send(("done", ended))
    copy.close()
    m.close()
    conn.send("bye")


def bench_staged(sizes: list[int], seconds: float, transport: str, opts, device: str,
                 region: int, num_writes) -> dict[int, tuple[float, float]]:
    """{size: (GB/s, writes/s)} of the staged pipeline, both ends."""
    from pdkv._messenger import Messenger
    from pdkv.gpu.staging import Span

    device = _device(device)
    slot = max(SLOT, max(sizes))  # a page never spans slots (the roles refuse such a config)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, transport, opts, device, region, slot), daemon=True)
    proc.start()
    m = Messenger(transport, 1, opts)
    copy, dev = _engine(device, region, 1 << 20, slot)
    import torch

    dev.copy_(torch.randint(0, 255, (region,), dtype=torch.uint8))
    ring_key = m.register_address(copy.ring.address, copy.ring.nbytes)
    rkey, rinfo, rslots = parent.recv()
    c, info = m.prepare(2)
    m.complete(c, rinfo)
    parent.send(info)
    assert parent.recv() == "ready"
    out, imm0 = {}, 1
    for size in sizes:
        n = num_writes(size, seconds)
        jobs = _jobs(size, n, region, slot)
        parent.send((imm0, size, n))
        what, zones = parent.recv()  # job -> the landing zone (offset in the receiver's ring) it writes to
        assert what == "expecting"
        ready: queue.SimpleQueue = queue.SimpleQueue()
        t0 = time.perf_counter()
        for j, pages in enumerate(jobs):
            copy.copy_out(f"j{j}", [Span(int(p) * size, size) for p in pages], ready.put, tag=j)
        posted, held, result = 0, {}, None
        waiting: dict = {}  # job -> its READY CopyResult (jobs are posted in order)
        while result is None:
            while True:
                try:
                    r = ready.get_nowait()
                except queue.Empty:
                    break
                if r.status.value != "done":
                    raise RuntimeError(f"staged sender: copy of job {r.tag} {r.status.value}: {r.error}")
                waiting[r.tag] = r
            while posted in waiting and posted in zones:
                r = waiting.pop(posted)
                k = len(jobs[posted])
                m.write_pages(c, ring_key, rkey, np.arange(k, dtype=np.int64), np.arange(k, dtype=np.int64),
                              seg_len=size, src_page_stride=size, dst_page_stride=size, src_off=r.slot.offset,
                              dst_off=zones.pop(posted), imm=imm0 + posted, tag=imm0 + posted)
                held[imm0 + posted] = r.slot
                posted += 1
            for ev in m.drain():
                if ev.kind == "batch_done":
                    copy.release(held.pop(ev.tag))
                elif ev.kind == "error":
                    raise RuntimeError(f"staged sender: {ev.reason}")
            while parent.poll():
                msg = parent.recv()
                if msg[0] == "zone":
                    zones[msg[1]] = msg[2]
                else:
                    result = msg
            if result is None:
                select.select([m.fileno(), parent], [], [], 0.0005)
        dt = time.perf_counter() - t0
        while held:  # every write completed locally before the next size reuses the ring
            select.select([m.fileno()], [], [], 0.01)
            for ev in m.drain():
                if ev.kind == "batch_done":
                    copy.release(held.pop(ev.tag))
        out[size] = (n * size / dt / 1e9, n / dt)
        imm0 += len(jobs)
    parent.send(None)
    while parent.recv() != "bye":
        pass
    proc.join(10)
    copy.close()
    m.close()
    return out
