"""The speculative hand-off: what the prefill node computes for the decode node's proposer, so
the decode node drafts from its very first step without prefilling anything itself. The
proposer's own KV (``mtp``: the MTP layer's, ``draft``: the draft model's) streams like more
layers of the target's, inside the same immediate count.

- ``mtp`` (pdkv/engine/spec/mtp.py): the MTP layer's KV at prompt position p needs
  (h_p, t_{p+1}). The prefill node computes h_p for positions 0..n-2 of an n-token prompt (the
  last token is held back) and knows t_{p+1} from the prompt and the held-back token (PREFILL
  ``next_token``). The hidden-state row grows to [h_{n-2} ; o_{n-2}]: o_{n-2} drafts t_n, the
  token after the held-back one, at the decode node's first step.
- ``draft`` (pdkv/engine/spec/draft.py): the draft model prefills the same positions 0..n-2.

After each chunk's forward pass the prefill node runs the proposer over the chunk into its own
proposer cache (page ids = the request's target page ids: nothing to allocate) and queues the
chunk's complete pages into the pages the decode node's ``admit`` reserved in its proposer's
cache (PREFILL ``spec_pages``, one per target page), each under the write key of the range it
was granted in (PREFILL ``spec_runs``/``spec_rkeys``, parsed by pdkv/disagg/range_keys.py: on
verbs every range is an MR of its own, on tcp the keys equal CONNECT's ``spec_key``). Both
sides count, from the shard plans of the target and of the proposer's cache (tensor
parallelism is not supported with speculation: 1:1),

    expected = target writes per page x num_pages x num_layers
               + proposer writes per page x num_pages x proposer layers + 1 (the row)

Decode side (DecodeHandoff): ``reserve`` at admit (none free: the request waits); at landing the
coordinator hands the row's tail over (``landed``, event loop); the proposer adopts pages (and
o_{n-2}) when it first drafts for the request (``take``, engine thread). A request that ends
before its KV landed gives the pages back only once no write can land any more (``release``,
from the connector's ``released``); one that landed but was never drafted for gives them back
when it leaves (``finished``).
"""

from __future__ import annotations

import torch

from pdkv.config import ConfigError
from pdkv.disagg.writes import Geometry, QueueError, count_batches, plan_batch, queue_chunk
from pdkv.shard import ShardPlan, ShardSpec, plan_specs


def row_parts(handoff: dict) -> int:
    """Hidden-size vectors per hidden-state row: h_{n-2}, and o_{n-2} for mtp."""
    return 2 if handoff.get("method") == "mtp" else 1


def handoff_proposer(engine, handoff: dict):
    """The engine's proposer whose KV the hand-off streams (None: no hand-off), checked."""
    if not handoff:
        return None
    proposer = getattr(engine.spec, "proposer", None)
    if proposer is None or not hasattr(proposer, "run_over"):
        raise ConfigError(f"speculative.method {handoff['method']}: the engine has no such proposer")
    if proposer.kv.num_pages < engine.kv.num_pages:  # the prefill side uses the target's page ids
        raise ConfigError(f"speculative.draft_model.num_pages ({proposer.kv.num_pages}) must be at least "
                          f"kv_cache.num_pages ({engine.kv.num_pages}) on a disaggregated node")
    return proposer


def proposer_plan(proposer) -> ShardPlan:
    """The plan of the proposer cache's page writes (TP1 -> TP1: the same geometry both sides,
    which the handshake's equal draft model / MTP layers, dtype, layout and page size imply)."""
    spec = ShardSpec(1, proposer.kv.geometry())
    return plan_specs(spec, spec)


def spec_wire(proposer) -> dict:
    """HELLO ``extra.spec_kv``: the byte layout of this node's proposer cache."""
    kv = proposer.kv
    return {"num_layers": kv.num_layers, "page_nbytes": kv.page_nbytes, "layer_nbytes": kv.layer_nbytes,
            "num_pages": kv.num_pages}


def register(messenger, proposer) -> int:
    kv = proposer.kv
    # NOTE: one region: the layers of a cache made without a buffer are separate tensors
    # unless there is one layer; otherwise the cache was made over one buffer (see KVCache)
    if kv.num_layers > 1 and kv.data_ptr(1) != kv.data_ptr(0) + kv.layer_nbytes:
        raise ConfigError("the proposer's KV cache is not one contiguous region")
    return messenger.register_address(kv.data_ptr(0), kv.nbytes)


def connect_fields(key: int, extra: dict) -> tuple[int, Geometry, int]:
    """CONNECT's ``spec_key`` (checked by pdkv/disagg/messages.py Connect) and the decode node's
    proposer cache layout (HELLO ``extra.spec_kv``): (key, geometry, num_pages); ValueError names
    the bad field."""
    wire = extra.get("spec_kv")
    if not isinstance(wire, dict):
        raise ValueError("the decode node's HELLO has no extra.spec_kv (its proposer cache's layout)")
    for name in ("num_layers", "page_nbytes", "layer_nbytes", "num_pages"):
        v = wire.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"the decode node's HELLO extra.spec_kv.{name} must be a positive integer, got {v!r}")
    return key, Geometry(wire["num_layers"], wire["page_nbytes"], wire["layer_nbytes"]), wire["num_pages"]


class PrefillHandoff:
    """Prefill side: the proposer over each chunk, its pages queued as more layers."""

    def __init__(self, proposer, handoff: dict, messenger, watch: int, page_size: int):
        self.p, self.mtp = proposer, handoff.get("method") == "mtp"
        self.m, self.watch, self.page_size = messenger, watch, page_size
        self.geometry = Geometry.of(proposer.kv)
        self.plan = proposer_plan(proposer)
        self.key = register(messenger, proposer)

    @torch.inference_mode()
    def after_forward(self, batch, hidden, jobs, issued: int) -> dict[str, torch.Tensor]:
        """Runs the proposer over each prefill chunk of ``batch`` whose job carries the hand-off,
        queues the pages the chunk completed (posted at once: the counter is at ``issued``) and
        returns, for mtp, o_{n-2} [H] of each request whose last chunk this was. hidden: [T, H]."""
        items, entries = [], []
        for e in batch.entries:
            job = jobs.get(e.request_id) if e.prefill_only else None
            if job is None or job.spec_pages is None or job.link.dead:
                continue
            if self.mtp:
                ctx = job.tokens + [job.next_token]
                toks = torch.tensor(ctx[e.start + 1:e.start + e.num_tokens + 1], dtype=torch.long)
                items.append((e.page_ids, e.start, toks, hidden[e.row:e.row + e.num_tokens]))
            else:
                items.append((e.page_ids, e.start, job.tokens[e.start:e.start + e.num_tokens]))
            entries.append(e)
        if not items:
            return {}
        outs = self.p.run_over(items)
        last = {e.request_id: o[-1] for e, o in zip(entries, outs) if e.is_last_chunk} if self.mtp else {}
        self._queue(batch, jobs, issued)
        return last

    def _queue(self, batch, jobs, issued: int) -> None:
        def dst_of(rid):
            job = jobs.get(rid)
            return None if job is None or job.spec_pages is None or job.link.dead else job.spec_pages

        src = self.geometry
        for chunk in plan_batch(batch, self.page_size, dst_of):
            job = jobs.get(chunk.request_id)
            link = job.link
            # per-range keys on verbs (each range its own MR, pdkv/disagg/range_keys.py); tcp: uniform
            rkeys = [link.spec_rkey] if job.spec_keys is None else job.spec_keys
            n = count_batches(self.plan, job.seed, src.num_layers, rkeys, chunk.dst_pages)
            jobs.queued(job, n)
            try:
                # after-forward mode with the target already reached: every layer posts at once
                _, writes = queue_chunk(self.m, watch=self.watch, base=issued - src.num_layers - 1, layerwise=False,
                                        conn=link.conn, lkeys=[self.key], rkeys=rkeys, src=src,
                                        dst=link.spec_dst, plan=self.plan, seed=job.seed, src_pages=chunk.src_pages,
                                        dst_pages=chunk.dst_pages, imm=job.imm, tag=job.tag)
            except QueueError as e:
                jobs.queued(job, -(n - e.num_batches))
                job.write_failed(str(e))
                continue
            job.num_writes += writes


class DecodeHandoff:
    """Decode side: the proposer pages a request's transfer fills, from reservation to the proposer."""

    def __init__(self, proposer, messenger):
        self.p = proposer
        self.geometry = Geometry.of(proposer.kv)
        self.plan = proposer_plan(proposer)
        self.key = register(messenger, proposer)
        self._reserved: dict[str, tuple[list[int], int]] = {}  # engine thread: rid -> (pages, positions)
        self._landed: dict[str, torch.Tensor | None] = {}  # written on the event loop, popped on the engine thread
        proposer.handoff = self.take

    def expected_writes(self, num_pages: int, seed: int) -> tuple[int, int]:
        """(writes, bytes) the proposer's pages of one request add to its count."""
        pairs = self.plan.active_pairs(seed)
        per_page = sum(len(pair.segments) for pair in pairs)
        seg_bytes = sum(seg.length for pair in pairs for seg in pair.segments)
        n = num_pages * self.geometry.num_layers
        return n * per_page, n * seg_bytes

    def reserve(self, rid: str, num_tokens: int) -> list[int] | None:
        """Engine thread (admit): pages for positions [0, num_tokens); None: not free."""
        need = -(-num_tokens // self.p.kv.page_size)
        if not self.p.allocator.can_allocate(need):
            return None
        pages = self.p.allocator.allocate(need)
        self._reserved[rid] = (pages, num_tokens)
        return pages

    def landed(self, rid: str, tail: torch.Tensor | None) -> None:
        """Event loop: every write of rid landed; ``tail``: o_{n-2} [H] for mtp (a copy of the row's)."""
        self._landed[rid] = tail

    def take(self, req):
        """Engine thread (the proposer, on its first draft for req): (pages, positions, o | None) or None."""
        if req.request_id not in self._landed:
            return None
        tail = self._landed.pop(req.request_id)
        pages, num_tokens = self._reserved.pop(req.request_id)
        return pages, num_tokens, tail

    def finished(self, rid: str) -> None:
        """Engine thread: rid left the engine. Landed but never drafted for (e.g. max_tokens 1):
        no write can land any more, the pages go back now; not landed: at ``release``."""
        if rid in self._landed:
            self.release(rid)

    def release(self, rid: str) -> None:
        """Engine thread: no write of rid can land any more; pages it did not hand over go back."""
        self._landed.pop(rid, None)
        pages, _ = self._reserved.pop(rid, ([], 0))
        if pages:
            self.p.allocator.free(pages)
