"""The prefill side's KV connector: a forward pass's layout in, page writes out (engine thread).

- ``admission``: every request of a prefill node is prefill-only (all its pages up front, never
  sampled, pages held after the last chunk until the job's writes are done);
- ``admit``: reserves the job's hidden-state staging row (no row free: the request waits);
- ``before_forward``: each chunk's complete pages (writes.plan_batch), queued layer by layer on
  the layer counter; the C poller posts layer l once the counter passed it;
- ``after_layer``: bumps the layer counter (after each layer's o_proj);
- ``after_forward``: stamps the end of the forward (DONE_AT's t_end), runs the speculative
  hand-off over the chunks (pdkv/disagg/spec_handoff.py) and sends each finished prompt's last
  hidden-state row (with o_{n-2} for mtp) to its decode slot.
"""

from __future__ import annotations

import time


from pdkv.disagg.jobs import JobTable
from pdkv.disagg.rows import StagingRows
from pdkv.disagg.writes import QueueError, batches_per_layer, plan_batch, queue_chunk
from pdkv.engine.connector import Admission, ForwardBatch, KVConnector

PREFILL_ONLY = Admission(prefill_only=True)


class PrefillConnector(KVConnector):
    def __init__(self, jobs: JobTable, messenger, kv, counter, watch: int, staging: StagingRows,
                 staging_key: int, layerwise: bool, page_size: int, metrics=None, spec=None):
        """``kv``: the node's pdkv.disagg.sharded.NodeKV; ``counter``/``watch``: the layer
        counter and its messenger watch (pdkv.gpu.layer_counter); ``spec``: the speculative
        hand-off's pdkv.disagg.spec_handoff.PrefillHandoff (None: no hand-off)."""
        self.spec = spec
        self.jobs, self.m, self.kv, self.counter, self.watch = jobs, messenger, kv, counter, watch
        self.staging, self.staging_key = staging, staging_key
        self.layerwise, self.page_size, self.metrics = layerwise, page_size, metrics
        self.src = kv.geometry
        self._issued = 0  # bumps issued so far (on a GPU the host value may lag behind them)
        self._step_end = 0
        self.t_forward_end: float | None = None  # time.time() when the last forward returned
        self.after_layer = self._bump

    def admission(self, req) -> Admission:
        return PREFILL_ONLY

    def admit(self, req) -> bool:
        job = self.jobs.get(req.request_id)
        if job is None or job.staging is not None:
            return True
        job.staging = self.staging.take()
        return job.staging is not None

    def _bump(self, layer: int | None = None) -> None:
        self._issued += 1
        self.counter.bump()

    def before_forward(self, batch: ForwardBatch) -> None:
        """Queue each prefill chunk's complete pages on the layer counter."""
        self.t_forward_end = None
        # NOTE: from the bumps issued, not counter.value(): on a GPU the kernels of the previous
        # step may not have reached host memory yet, the targets must not depend on that.
        base = self._issued
        # after-forward mode: one extra bump when the forward returned (see writes.py)
        self._step_end = base + self.src.num_layers + (0 if self.layerwise else 1)
        for e in batch.entries:
            job = self.jobs.get(e.request_id)
            if job is not None and job.t_first is None and e.prefill_only:
                job.t_first = time.perf_counter()
                if self.metrics is not None:
                    self.metrics.queue_prefill.observe(job.t_first - job.arrival)

        def dst_of(rid):
            job = self.jobs.get(rid)
            return None if job is None or job.link.dead else job.dst_pages

        for chunk in plan_batch(batch, self.page_size, dst_of):
            job = self.jobs.get(chunk.request_id)
            link = job.link
            n = self.src.num_layers * batches_per_layer(link.plan, job.seed)
            self.jobs.queued(job, n)
            try:
                _, writes = queue_chunk(self.m, watch=self.watch, base=base, layerwise=self.layerwise,
                                        conn=link.conn, lkeys=self.kv.keys, rkeys=link.kv_rkeys,
                                        src=self.src, dst=link.dst, plan=link.plan, seed=job.seed,
                                        src_pages=chunk.src_pages, dst_pages=chunk.dst_pages, imm=job.imm,
                                        tag=job.tag)
            except QueueError as e:  # e.g. the peer's connection was dropped meanwhile
                self.jobs.queued(job, -(n - e.num_batches))  # only the batches that were queued complete
                job.write_failed(str(e))
                continue
            job.num_writes += writes

    def after_forward(self, batch: ForwardBatch, hidden) -> None:
        """The last prompt row of each finished prefill goes to its decode slot.
        hidden: [num_tokens, hidden_size], rows in ``batch`` order (None: the forward raised)."""
        self.t_forward_end = time.time()
        if hidden is None:
            # The forward stopped bumping mid-way: finish the count so the batches queued for
            # this step still post (and complete) instead of waiting forever.
            while self._issued < self._step_end:
                self._bump()
            return
        if not self.layerwise:
            self._bump()  # the forward pass is over: release the after-forward batches
        # the proposer (MTP layer, draft model) over the chunks, its pages queued like more
        # layers; for mtp o_{n-2} of each last chunk
        mtp_last = self.spec.after_forward(batch, hidden, self.jobs, self._issued) if self.spec is not None else {}
        H = hidden.shape[-1]
        for e in batch.entries:
            if not e.prefill_only or not e.is_last_chunk:
                continue
            job = self.jobs.get(e.request_id)
            if job is None or job.link.dead or job.staging is None:
                continue
            self.staging.buffer[job.staging, :H].copy_(hidden[e.row + e.num_tokens - 1])
            if e.request_id in mtp_last:  # the row is [h_{n-2} ; o_{n-2}] with the MTP hand-off
                self.staging.buffer[job.staging, H:].copy_(mtp_last[e.request_id])
            nbytes = self.staging.row_nbytes
            self.jobs.queued(job, 1)
            try:
                self.m.write(job.link.conn, self.staging_key, job.staging * nbytes, job.link.hidden_rkey,
                             job.hidden_off, nbytes, imm=job.imm, tag=job.tag)
            except Exception as e:  # noqa: BLE001
                self.jobs.queued(job, -1)
                job.write_failed(f"hidden-state write failed: {e}")
                continue
            job.num_writes += 1
