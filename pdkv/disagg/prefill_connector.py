"""The prefill side's KV connector: a forward pass's layout in, page writes out (engine thread).

- ``admission``: every request of a prefill node is prefill-only (all its pages up front, never
  sampled, pages held after the last chunk until the job's writes are done) and reuses this
  node's own cached prefix (computed once, its pages still sent to the decode node from
  PREFILL's ``cached`` on: see writes.py);
- ``admit``: reserves the job's hidden-state staging row (no row free: NOT_YET, the request waits);
- ``before_forward``: each chunk's complete pages (writes.plan_batch), queued layer by layer on
  the layer counter; the C poller posts layer l once the counter passed it;
- ``after_layer``: bumps the layer counter (after each layer's o_proj);
- ``after_forward``: stamps the end of the forward (DONE_AT's t_end), runs the speculative
  hand-off over the chunks (pdkv/disagg/spec_handoff.py) and sends each finished prompt's last
  hidden-state row (with o_{n-2} for mtp) to its decode slot.
"""

from __future__ import annotations

import time


from pdkv.disagg.grants import on_nic
from pdkv.disagg.jobs import JobTable
from pdkv.disagg.rows import StagingRows
from pdkv.disagg.writes import QueueError, count_batches, plan_batch, queue_chunk
from pdkv.engine.connector import NOT_YET, RESERVE, Admission, Answer, ForwardBatch, KVConnector

PREFILL_ONLY = Admission(prefill_only=True, reuse_cached=True)
PREFILL_ONLY_NO_REUSE = Admission(prefill_only=True)


class PrefillConnector(KVConnector):
    def __init__(self, jobs: JobTable, messenger, kv, counter, watch: int, staging: StagingRows,
                 staging_key, layerwise: bool, page_size: int, metrics=None, staged=None, spec=None,
                 share=None):
        """``kv``: the node's pdkv.disagg.sharded.NodeKV; ``counter``/``watch``: the layer
        counter and its messenger watch (pdkv.gpu.layer_counter); ``staged``: a
        pdkv.disagg.staged_prefill.StagedSender when the pages go through the staging ring;
        ``spec``: the speculative hand-off's pdkv.disagg.spec_handoff.PrefillHandoff (None: no
        hand-off; the config keeps the two apart); ``share``: the shared hand-off's
        pdkv.disagg.kv_share.KVShare (None: the pages are copied); ``staging_key``: the hidden rows' key, or its
        key on each of rank 0's NICs (a tuple: the request's seed picks one, grants.on_nic)."""
        self.spec, self.share = spec, share
        self.jobs, self.m, self.kv, self.counter, self.watch = jobs, messenger, kv, counter, watch
        self.staging, self.staging_key = staging, staging_key
        self.layerwise, self.page_size, self.metrics = layerwise, page_size, metrics
        self.staged = staged
        self.src = kv.geometry
        self._issued = 0  # bumps issued so far (on a GPU the host value may lag behind them)
        self._step_end = 0
        self.t_forward_end: float | None = None  # time.time() when the last forward returned
        self.after_layer = self._bump if staged is None or not layerwise else self._bump_and_stage
        # GPU: the copy of layer l waits on an event recorded on the compute stream after its o_proj
        self._cuda = getattr(counter, "device", "cpu").startswith("cuda")

    def admission(self, req) -> Admission:
        # NOTE: with a speculative hand-off the proposer's KV is computed over every position the
        # prefill node computes: a prefix served from this node's cache would have none
        return PREFILL_ONLY if self.spec is None else PREFILL_ONLY_NO_REUSE

    def admit(self, req) -> Answer:
        job = self.jobs.get(req.request_id)
        if job is not None and job.prompt_logprobs is not None:
            req.prompt_next_token = job.last_token  # its forward over position n-2 scores it
        if job is None or job.staging is not None:
            return RESERVE
        job.staging = self.staging.take()
        return RESERVE if job.staging is not None else NOT_YET

    def _bump(self, layer: int | None = None) -> None:
        self._issued += 1
        self.counter.bump()

    def _bump_and_stage(self, layer: int) -> None:
        """Staged, layer-wise: the counter bump, then layer ``layer``'s pages to the copy engine."""
        self._bump(layer)
        self.staged.layer_done(layer, self._event())

    def _event(self):
        """GPU: an event on the current (compute) stream, after everything issued so far (the
        layer's KV writes and its bump); the copy stream waits on it. CPU: None (done already)."""
        if not self._cuda:
            return None
        import torch  # noqa: PLC0415

        ev = torch.cuda.Event()
        ev.record()
        return ev

    def before_forward(self, batch: ForwardBatch) -> None:
        """Queue each prefill chunk's complete pages on the layer counter."""
        self.t_forward_end = None
        # NOTE: from the bumps issued, not counter.value(): on a GPU the kernels of the previous
        # step may not have reached host memory yet, the targets must not depend on that.
        base = self._issued
        # after-forward mode: one extra bump when the forward returned (see writes.py)
        self._step_end = base + self.src.num_layers + (0 if self.layerwise else 1)
        self.queue_writes(batch, base, self.watch, self.kv.nic_keys)

    def queue_writes(self, batch: ForwardBatch, base: int, watch: int, lkeys) -> None:
        """Each prefill chunk's complete pages, queued on the counter ``watch`` from ``base`` (the
        bumps issued before the forward), read from the regions ``lkeys`` (by prefill rank). A
        DP group's front calls it for each rank's forward, with that rank's counter and pool."""
        for e in batch.entries:
            job = self.jobs.get(e.request_id)
            if job is None or not e.prefill_only:
                continue
            job.num_computed = e.start + e.num_tokens  # what the load report counts as done
            if self.share is not None and job.shared is None:  # before its first chunk computes
                self.share.begin(job, e)
            if job.t_first is None:
                job.t_first = time.perf_counter()
                if self.metrics is not None:
                    self.metrics.queue_prefill.observe(job.t_first - job.arrival)

        def dst_of(rid):
            job = self.jobs.get(rid)
            return None if job is None or job.link.dead else job.dst_pages

        def skip_of(rid):  # the pages the decode node holds already (PREFILL's cached)
            return self.jobs.get(rid).skip

        if self.staged is not None:
            self.staged.clear()
        for chunk in plan_batch(batch, self.page_size, dst_of, skip_of):
            job = self.jobs.get(chunk.request_id)
            link = job.link
            if self.staged is not None:  # copied out layer by layer; the writes leave from the ring
                self.staged.plan(job, chunk)
                job.num_pages_sent += len(chunk.src_pages)  # a failed copy fails the whole job
                continue
            rkeys = link.kv_rkeys if job.dst_keys is None else job.dst_keys  # per-range keys (grants.py)
            n = count_batches(link.plan, job.seed, self.src.num_layers, rkeys, chunk.dst_pages)
            self.jobs.queued(job, n)
            try:
                _, writes = queue_chunk(self.m, watch=watch, base=base, layerwise=self.layerwise,
                                        conn=link.conn, lkeys=lkeys, rkeys=rkeys,
                                        src=self.src, dst=link.dst, plan=link.plan, seed=job.seed,
                                        src_pages=chunk.src_pages, dst_pages=chunk.dst_pages, imm=job.imm,
                                        tag=job.tag)
            except QueueError as e:  # e.g. the peer's connection was dropped meanwhile
                self.jobs.queued(job, -(n - e.num_batches))  # only the batches that were queued complete
                job.write_failed(str(e))
                continue
            job.num_writes += writes
            job.num_pages_sent += len(chunk.src_pages)

    def after_forward(self, batch: ForwardBatch, hidden) -> None:
        """The last prompt row of each finished prefill goes to its decode slot.
        hidden: [num_tokens, hidden_size], rows in ``batch`` order (None: the forward raised)."""
        self.t_forward_end = time.time()
        if hidden is None:
            # The forward stopped bumping mid-way: finish the count so the batches queued for
            # this step still post (and complete) instead of waiting forever.
            while self._issued < self._step_end:
                self._bump()
            if self.staged is not None:
                self.staged.clear()  # layers not reached are not copied (the engine fails the request)
            return
        if not self.layerwise:
            self._bump()  # the forward pass is over: release the after-forward batches
            if self.staged is not None:  # after-forward, staged: every layer is copied now
                after = self._event()
                for layer in range(self.src.num_layers):
                    self.staged.layer_done(layer, after)
        if self.staged is not None:
            self.staged.clear()
        # the proposer (MTP layer, draft model) over the chunks, its pages queued like more
        # layers; for mtp o_{n-2} of each last chunk
        mtp_last = self.spec.after_forward(batch, hidden, self.jobs, self._issued) if self.spec is not None else {}
        self.send_hidden((e.request_id, hidden[e.row + e.num_tokens - 1], mtp_last.get(e.request_id))
                         for e in last_chunks(batch))

    def send_hidden(self, rows) -> None:
        """Each ``(request id, its prompt's last hidden row [H], o_{n-2} [H] or None)`` to its
        decode slot, from the job's staging row (a DP group's front takes the row here: the
        rank that computed the prompt has none of the front's rows)."""
        for rid, h, mtp in rows:
            job = self.jobs.get(rid)
            if job is None or job.link.dead:
                continue
            if job.staging is None:
                job.staging = self.staging.take()
                if job.staging is None:
                    job.write_failed("every hidden-state staging row of this prefill node is in use")
                    continue
            H = h.shape[-1]
            self.staging.buffer[job.staging, :H].copy_(h)
            if mtp is not None:  # the row is [h_{n-2} ; o_{n-2}] with the MTP hand-off
                self.staging.buffer[job.staging, H:].copy_(mtp)
            nbytes = self.staging.row_nbytes
            self.jobs.queued(job, 1)
            hidden_rkey = job.link.hidden_rkey if job.dst_keys is None else job.dst_keys.hidden
            try:
                lkey = on_nic(self.staging_key, job.seed, 0)
                self.m.write(job.link.conn, lkey, job.staging * nbytes, hidden_rkey, job.hidden_off, nbytes,
                             imm=job.imm, tag=job.tag)
            except Exception as e:  # noqa: BLE001
                self.jobs.queued(job, -1)
                job.write_failed(f"hidden-state write failed: {e}")
                continue
            job.num_writes += 1


def last_chunks(batch: ForwardBatch):
    """The entries of ``batch`` that end a prefill-only prompt (its hidden row goes out)."""
    return (e for e in batch.entries if e.prefill_only and e.is_last_chunk)
