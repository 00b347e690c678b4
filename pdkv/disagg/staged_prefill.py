"""Prefill node, staged: a layer's pages go through the copy engine into a staging slot, and
their writes leave from the slot (pdkv/disagg/staged.py says when a node stages).

Per forward pass (engine thread): ``plan`` files each chunk's complete pages (as the direct
path's writes.plan_batch computes them) in ``before_forward``; ``layer_done(l, after)`` runs
in the runner's layer hook right after the counter bump, and hands layer l's pages of every
planned chunk to the copy engine, cut into jobs that fit a slot, ordered after ``after`` (a CUDA
event recorded on the compute stream after the layer's output projection; None on the CPU).
Layer-wise as on the direct path: the copy of layer l runs while later layers compute.

When a copy is done (the engine's notifier thread) its writes are queued from the slot with a
counter target already reached, so the poller posts them at once; the slot goes back to the
ring when the last of its batches completed (``batch_done``, event loop), so a held slot is
freed by the transport alone (the copy engine's no-deadlock rule 3).

Accounting: each copy job counts as one outstanding batch of its job from the moment it is
handed over until it ended (the coordinator's ``copy_ended``), and its write batches are added
before the copy's count is taken off: a job never looks drained while a copy or a write of it
is in flight, so its source pages stay until nothing reads them. A copy that FAILED (or was
refused: staging queue full) fails the request like a failed write: FAIL with ``posted``, and
the decode node quarantines the pages until exactly those writes landed.

NICs: the ring is registered once, on every NIC; rank p's pages leave it through rank p's NIC
(the seed's pick among them, pdkv.shard.pick_nic), named by the ring's key on that NIC
(``ring_keys[p]``) -- the NIC a direct send of rank p's pages takes (pdkv/disagg/writes.py).

Write tags: a slot's batches carry their own tag (``TAG_BASE + n``), mapped back to the job's
tag by ``batch_done``.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass

import numpy as np

from pdkv.disagg.grants import on_nic
from pdkv.disagg.staged import make_copy_engine, make_ring, prefill_ring_shape, region_buffers
from pdkv.disagg.writes import dst_groups, dst_split
from pdkv.gpu.staging import CopyStatus, Span
from pdkv.messenger import rank_keys

log = logging.getLogger("pdkv.disagg.prefill")
TAG_BASE = 1 << 62  # slot tags; job tags count up from 1 and never get here


def build_sender(cfg, mode, messenger, kv, jobs, watch: int, post, copy_ended, metrics=None) -> "StagedSender":
    """The prefill node's ring (registered once), its copy engine over every rank's KV buffer
    (``kv``: the node's unregistered NodeKV), and the sender that writes from it."""
    num_slots, slot_nbytes = prefill_ring_shape(cfg, kv.geometry.page_nbytes, len(kv.regions))
    ring = make_ring(num_slots, slot_nbytes, mode)
    ring_key = messenger.register_address(ring.address, ring.nbytes)
    copy = make_copy_engine(mode, ring, region_buffers(kv.regions), cfg.messenger.staging_max_pending)
    log.info("prefill: KV staged through %d slot(s) of %d KiB (%s)", num_slots, slot_nbytes >> 10, copy.name)
    if metrics is not None:
        metrics.staging_slots.set_function(lambda: ring.num_slots - ring.num_free)
        metrics.staging_waiting.set_function(lambda: copy.num_pending)
    ring_keys = [rank_keys(messenger, ring_key, p) for p in range(len(kv.regions))]
    return StagedSender(copy, ring_keys, messenger, jobs, kv.geometry, watch, post, copy_ended)


@dataclass(frozen=True)
class Piece:
    """One copy job: pages ``src_pages`` of ``layer`` from each rank in ``ranks``, packed rank by rank."""

    job: object  # pdkv.disagg.jobs.Job
    layer: int
    ranks: tuple[int, ...]
    dst_pages: np.ndarray  # int64 [k]: the decode node's page ids for the k pages


class StagedSender:
    def __init__(self, copy, ring_keys: list, messenger, jobs, src, watch: int, post, copy_ended):
        """``copy``: the copy engine (pdkv.gpu.copy_engine) over every rank's KV buffer;
        ``ring_keys``: per rank, its ring's key with ``messenger`` on the rank's NIC (a tuple: on
        each of its NICs, the request's seed picks one); ``src``: this node's Geometry;
        ``post(fn, *args)``: runs fn on the event loop; ``copy_ended(job, status, error)``: the
        coordinator's, run there once per copy job."""
        self.copy, self.ring_keys, self.m, self.jobs, self.src = copy, ring_keys, messenger, jobs, src
        self.watch, self.post, self.copy_ended = watch, post, copy_ended
        self._step: list = []  # (job, ChunkWrites) of the forward pass in progress
        self._tags = itertools.count(1)
        self._lock = threading.Lock()
        self._slots: dict[int, list] = {}  # slot tag -> [StagingSlot, batches not yet done, job]

    # ---- engine thread ----------------------------------------------------------------------
    def plan(self, job, chunk) -> None:
        self._step.append((job, chunk))

    def clear(self) -> None:
        self._step = []

    def layer_done(self, layer: int, after=None) -> None:
        """Layer ``layer`` of the forward pass is computed: copy its pages out (never blocks)."""
        for job, chunk in self._step:
            if job.link.dead:
                continue
            ranks = tuple(sorted({p.prefill_rank for p in job.link.plan.active_pairs(job.seed)}))
            per = max(1, self.copy.ring.slot_nbytes // (len(ranks) * self.src.page_nbytes))
            for start in range(0, len(chunk.src_pages), per):
                src = chunk.src_pages[start:start + per]
                spans = tuple(Span(layer * self.src.layer_nbytes + int(p) * self.src.page_nbytes,
                                   self.src.page_nbytes, r) for r in ranks for p in src)
                piece = Piece(job, layer, ranks, chunk.dst_pages[start:start + per])
                self.jobs.queued(job, 1)  # the copy is outstanding until copy_ended
                try:
                    self.copy.copy_out(job.key, spans, self._copied, after=after, tag=piece)
                except Exception as e:  # noqa: BLE001 - a closed engine: this request fails, not the step
                    self.jobs.queued(job, -1)
                    job.write_failed(f"staging copy refused: {e}")

    # ---- copy engine's notifier thread ------------------------------------------------------
    def _copied(self, result) -> None:
        piece = result.tag
        error = result.error
        if result.status is CopyStatus.DONE:
            error = self._queue_from(piece, result.slot)
        self.post(self.copy_ended, piece.job, result.status, error)

    def _queue_from(self, piece: Piece, slot) -> str:
        """Queue the writes of a READY slot; '' or why they could not all be queued."""
        job, link = piece.job, piece.job.link
        if link.dead:
            self.copy.release(slot)
            return "the decode node is gone"
        k, page = len(piece.dst_pages), self.src.page_nbytes
        rkeys = link.kv_rkeys if job.dst_keys is None else job.dst_keys  # per-range keys (grants.py)
        split = dst_split(rkeys, piece.dst_pages)
        batches = [(pair, seg, rkey, pos) for pair in link.plan.active_pairs(job.seed)
                   for rkey, pos in dst_groups(rkeys, split, pair.decode_rank, piece.layer) for seg in pair.segments]
        tag = TAG_BASE + next(self._tags)
        with self._lock:
            self._slots[tag] = [slot, len(batches), job]
        self.jobs.queued(job, len(batches))  # NOTE: before the copy's own count is taken off
        src_pages = np.arange(k, dtype=np.int64)
        num_queued = num_writes = 0
        try:
            for pair, seg, rkey, pos in batches:
                block = piece.ranks.index(pair.prefill_rank) * k * page  # rank p's pages in the slot
                sp, dp = (src_pages, piece.dst_pages) if pos is None else (src_pages[pos], piece.dst_pages[pos])
                lkey = on_nic(self.ring_keys[pair.prefill_rank], job.seed, pair.prefill_rank)
                self.m.queue_pages(self.watch, 0, link.conn, lkey, rkey,
                                   sp, dp, seg_len=seg.length, src_page_stride=page,
                                   dst_page_stride=link.dst.page_nbytes,
                                   src_off=slot.offset + block + seg.src_offset,
                                   dst_off=piece.layer * link.dst.layer_nbytes + seg.dst_offset,
                                   imm=job.imm, tag=tag)
                num_queued += 1
                num_writes += len(sp)
        except Exception as e:  # noqa: BLE001 - e.g. the connection was dropped meanwhile
            missing = len(batches) - num_queued
            self.jobs.queued(job, -missing)
            for _ in range(missing):
                self._batch_ended(tag)
            return f"queueing staged page writes failed after {num_queued} batch(es): {e}"
        finally:
            with self.jobs.lock:
                job.num_writes += num_writes
        return ""

    # ---- event loop -------------------------------------------------------------------------
    def batch_done(self, tag: int) -> int:
        """The job tag a completed batch counts for; a slot's last batch gives the slot back."""
        if tag < TAG_BASE:
            return tag
        job = self._batch_ended(tag)
        return tag if job is None else job.tag

    def _batch_ended(self, tag: int):
        with self._lock:
            entry = self._slots.get(tag)
            if entry is None:
                return None
            entry[1] -= 1
            done = entry[1] == 0
            if done:
                del self._slots[tag]
        if done:
            self.copy.release(entry[0])
        return entry[2]

    def num_slots_in_use(self) -> int:
        with self._lock:
            return len(self._slots)
