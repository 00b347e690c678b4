"""The plan of writes: which pages of a prefill chunk leave, and the per-layer batches that carry them.

A prefill request's prompt (the decode node's prompt minus its last token) is computed in
chunks. A page is sent once it is COMPLETE: after the chunk that fills it, or, for the prompt's
final partial page, after the last chunk. So each page goes exactly once per layer whatever the
chunking, and the decode side's expected count is a function of the page count alone:

    expected = sum(writes_per_page) (shard plan, all decode ranks) x num_pages x num_layers
               + 1 (the hidden state)

Layer-wise: layer ``l`` of a forward pass that starts with the layer counter at ``base`` is
queued with target ``base + l + 1``; the C poller posts it as soon as the model runner's hook has
bumped the counter past that layer's o_proj, while later layers still compute. With
``layerwise=False`` every layer is queued at ``base + num_layers + 1``: the prefill coordinator
bumps the counter once more when the forward pass has returned (the baseline "send after the
forward" the layer-wise mode is measured against).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdkv.shard import ShardPlan, pick_nic


@dataclass(frozen=True)
class ChunkWrites:
    """The pages one forward pass's chunk of a request completes, on both sides."""

    request_id: str
    src_pages: np.ndarray  # int64 [n]: this node's page ids
    dst_pages: np.ndarray  # int64 [n]: the decode node's page ids


def plan_batch(batch, page_size: int, dst_pages_of) -> list[ChunkWrites]:
    """The page writes a forward pass's layout (a pdkv.engine.ForwardBatch) makes due: for each
    prefill-only entry whose destination ``dst_pages_of(request_id)`` is known (None: skip it),
    the pages its chunk completes. Pure: no messenger, no threads."""
    out = []
    for e in batch.entries:
        if not e.prefill_only:
            continue
        dst = dst_pages_of(e.request_id)
        if dst is None:
            continue
        idx = pages_to_send(e.start, e.num_tokens, page_size, e.is_last_chunk)
        if len(idx):
            out.append(ChunkWrites(e.request_id, np.asarray(e.page_ids[idx.start:idx.stop], dtype=np.int64),
                                   dst[idx.start:idx.stop]))
    return out


def pages_to_send(start: int, num_tokens: int, page_size: int, is_last: bool) -> range:
    """Indices (into the request's page list) of the pages this chunk completes.

    Chunk = prompt tokens [start, start + num_tokens). Pages before ``start // page_size`` were
    complete (and sent) earlier; the page holding ``start`` was partial or empty before."""
    end = start + num_tokens
    stop = end // page_size + (1 if is_last and end % page_size else 0)
    return range(start // page_size, stop)


@dataclass(frozen=True)
class Geometry:
    """Byte layout of one side's KV buffer (one registered region, layer after layer)."""

    num_layers: int
    page_nbytes: int  # one page of one layer
    layer_nbytes: int  # all pages of one layer

    @classmethod
    def of(cls, kv) -> "Geometry":
        return cls(kv.num_layers, kv.page_nbytes, kv.layer_nbytes)


def expected_writes(plan: ShardPlan, num_pages: int, num_layers: int) -> int:
    """What the decode node counts for one request: page writes to all its ranks plus one
    hidden-state write (rank 0's). Every write carries the request's immediate."""
    return plan.expected_writes_total(num_pages, num_layers) + 1


class QueueError(RuntimeError):
    """Queueing failed part-way (e.g. the connection was dropped): ``num_batches`` were queued
    before it and will complete (batch_done) on their own."""

    def __init__(self, num_batches: int, cause: Exception):
        super().__init__(f"queueing page writes failed after {num_batches} batch(es): {cause}")
        self.num_batches = num_batches


def queue_chunk(messenger, *, watch: int, base: int, layerwise: bool, conn: int, lkeys: list[int],
                rkeys: list[int], src: Geometry, dst: Geometry, plan: ShardPlan, seed: int,
                src_pages: np.ndarray, dst_pages: np.ndarray, imm: int, tag: int) -> tuple[int, int]:
    """Queue one chunk's page writes, layer by layer, on the counter ``watch``.

    For each (prefill rank p, decode rank d) pair of the request's replica assignment
    (``plan.active_pairs(seed)``), each of the pair's segments is one batch: every page of the
    chunk, from region ``lkeys[p]`` (this node's rank p; a tuple: its key on each of its NICs, one
    picked per request by ``pick_nic(seed, p, ...)``) to region ``rkeys[d]`` (the decode
    node's rank d). Every rank's page p of layer l sits at the same offset of its own region
    (all ranks have the same pages and shapes), so ``src``/``dst`` describe every region.
    src_pages, dst_pages: int64 [n] page ids on each side. Returns (batches queued, writes)."""
    if len(src_pages) == 0:
        return 0, 0
    pairs = plan.active_pairs(seed)
    num_batches = num_writes = 0
    for layer in range(src.num_layers):
        target = base + layer + 1 if layerwise else base + src.num_layers + 1
        for pair in pairs:
            lkey, rkey = lkeys[pair.prefill_rank], rkeys[pair.decode_rank]
            if not isinstance(lkey, int):  # the rank's key on each of its NICs: the seed picks one
                lkey = lkey[pick_nic(seed, pair.prefill_rank, len(lkey))]
            for seg in pair.segments:
                try:
                    messenger.queue_pages(watch, target, conn, lkey, rkey, src_pages, dst_pages,
                                          seg_len=seg.length, src_page_stride=src.page_nbytes,
                                          dst_page_stride=dst.page_nbytes,
                                          src_off=layer * src.layer_nbytes + seg.src_offset,
                                          dst_off=layer * dst.layer_nbytes + seg.dst_offset, imm=imm, tag=tag)
                except Exception as e:  # noqa: BLE001
                    raise QueueError(num_batches, e) from e
                num_batches += 1
                num_writes += len(src_pages)
    return num_batches, num_writes


def batches_per_layer(plan: ShardPlan, seed: int) -> int:
    """How many batches queue_chunk queues per layer for the request with ``seed``."""
    return sum(len(pair.segments) for pair in plan.active_pairs(seed))
