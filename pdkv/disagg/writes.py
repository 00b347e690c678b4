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

from pdkv.disagg.range_keys import RangeKeys
from pdkv.shard import ShardPlan, pick_nic


@dataclass(frozen=True)
class ChunkWrites:
    """The pages one forward pass's chunk of a request completes, on both sides."""

    request_id: str
    src_pages: np.ndarray  # int64 [n]: this node's page ids
    dst_pages: np.ndarray  # int64 [n]: the decode node's page ids


def plan_batch(batch, page_size: int, dst_pages_of, skip_of=None) -> list[ChunkWrites]:
    """The page writes a forward pass's layout (a pdkv.engine.ForwardBatch) makes due: for each
    prefill-only entry whose destination ``dst_pages_of(request_id)`` is known (None: skip it),
    the pages its chunk completes. ``skip_of(request_id)``: the leading pages the destination
    already holds (None: 0); ``dst`` then starts at that page. Pure: no messenger, no threads."""
    out = []
    for e in batch.entries:
        if not e.prefill_only:
            continue
        dst = dst_pages_of(e.request_id)
        if dst is None:
            continue
        skip = skip_of(e.request_id) if skip_of is not None else 0
        first = e.start == e.request.num_cached_tokens  # the first chunk after the reused prefix
        idx = pages_to_send(e.start, e.num_tokens, page_size, e.is_last_chunk, skip, first)
        if len(idx):
            out.append(ChunkWrites(e.request_id, np.asarray(e.page_ids[idx.start:idx.stop], dtype=np.int64),
                                   dst[idx.start - skip:idx.stop - skip]))
    return out


def pages_to_send(start: int, num_tokens: int, page_size: int, is_last: bool, skip: int = 0,
                  first: bool = False) -> range:
    """Indices (into the request's page list) of the pages this chunk completes, less the first
    ``skip`` (the destination holds them).

    Chunk = prompt tokens [start, start + num_tokens). Pages before ``start // page_size`` were
    complete (and sent) earlier; the page holding ``start`` was partial or empty before.
    ``first``: the request's first computed chunk, after a prefix it reused (never computed
    here, so never sent by an earlier chunk): its pages from ``skip`` on go now too."""
    end = start + num_tokens
    stop = end // page_size + (1 if is_last and end % page_size else 0)
    lo = skip if first else max(start // page_size, skip)
    return range(lo, max(lo, stop))


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


def dst_split(rkeys, dst_pages: np.ndarray):
    """``rkeys`` is one region key per decode rank, or the request's RangeKeys (one key per
    granted range, pdkv/disagg/range_keys.py): then the chunk's pages split by run (once)."""
    return rkeys.split(dst_pages) if isinstance(rkeys, RangeKeys) else None


def dst_groups(rkeys, split, rank: int, layer: int):
    """(key, positions or None for all) of the writes to decode rank ``rank``'s ``layer``: one
    batch per key."""
    return [(rkeys[rank], None)] if split is None else rkeys.groups(split, rank, layer)


def queue_chunk(messenger, *, watch: int, base: int, layerwise: bool, conn: int, lkeys: list[int],
                rkeys, src: Geometry, dst: Geometry, plan: ShardPlan, seed: int,
                src_pages: np.ndarray, dst_pages: np.ndarray, imm: int, tag: int) -> tuple[int, int]:
    """Queue one chunk's page writes, layer by layer, on the counter ``watch``.

    For each (prefill rank p, decode rank d) pair of the request's replica assignment
    (``plan.active_pairs(seed)``), each of the pair's segments is one batch per destination key:
    the chunk's pages from region ``lkeys[p]`` (this node's rank p; a tuple: its key on each of
    its NICs, one picked per request by ``pick_nic(seed, p, ...)``) to the decode node's rank d,
    under the key ``rkeys`` gives each page (see dst_groups). Every rank's page p of layer l sits
    at the same offset of its own region (all ranks have the same pages and shapes), so
    ``src``/``dst`` describe every region. src_pages, dst_pages: int64 [n] page ids on each side.
    Returns (batches queued, writes); count_batches says beforehand how many batches."""
    if len(src_pages) == 0:
        return 0, 0
    pairs = plan.active_pairs(seed)
    split = dst_split(rkeys, dst_pages)
    num_batches = num_writes = 0
    for layer in range(src.num_layers):
        target = base + layer + 1 if layerwise else base + src.num_layers + 1
        for pair in pairs:
            lkey = lkeys[pair.prefill_rank]
            if not isinstance(lkey, int):  # the rank's key on each of its NICs: the seed picks one
                lkey = lkey[pick_nic(seed, pair.prefill_rank, len(lkey))]
            for rkey, pos in dst_groups(rkeys, split, pair.decode_rank, layer):
                sp, dp = (src_pages, dst_pages) if pos is None else (src_pages[pos], dst_pages[pos])
                for seg in pair.segments:
                    try:
                        messenger.queue_pages(watch, target, conn, lkey, rkey, sp, dp,
                                              seg_len=seg.length, src_page_stride=src.page_nbytes,
                                              dst_page_stride=dst.page_nbytes,
                                              src_off=layer * src.layer_nbytes + seg.src_offset,
                                              dst_off=layer * dst.layer_nbytes + seg.dst_offset, imm=imm, tag=tag)
                    except Exception as e:  # noqa: BLE001
                        raise QueueError(num_batches, e) from e
                    num_batches += 1
                    num_writes += len(sp)
    return num_batches, num_writes


def count_batches(plan: ShardPlan, seed: int, num_layers: int, rkeys, dst_pages: np.ndarray) -> int:
    """How many batches queue_chunk queues for these arguments (0 pages: none)."""
    if len(dst_pages) == 0:
        return 0
    runs = 1 if not isinstance(rkeys, RangeKeys) else len(rkeys.split(dst_pages))  # the same for every (rank, layer)
    return num_layers * runs * batches_per_layer(plan, seed)


def batches_per_layer(plan: ShardPlan, seed: int) -> int:
    """How many batches queue_chunk queues per layer for the request with ``seed``."""
    return sum(len(pair.segments) for pair in plan.active_pairs(seed))
