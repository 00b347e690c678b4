"""The prefill node's engine-thread side: the engine loop, admission, and the two listeners that
turn a forward pass into page writes (before it: queue each chunk's pages layer by layer on the
layer counter; after it: send each finished prompt's last hidden-state row).

Mixed into PrefillCoordinator (prefill.py), which owns the state these methods read; everything
here runs on the engine thread and talks to the event loop only through ``_post``.
"""

from __future__ import annotations

import queue
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdkv.disagg.writes import QueueError, batches_per_layer, pages_to_send, queue_chunk
from pdkv.errors import InvalidRequest, OutOfPages

if TYPE_CHECKING:
    from pdkv.disagg.prefill import Job


class PrefillEngineSide:
    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while True:
            cmd = self._commands.get() if not eng.has_work() else self._get_nowait()
            while cmd is not None:
                if cmd[0] == "stop":
                    return
                self._apply(cmd)
                cmd = self._get_nowait()
            if not eng.has_work():
                continue
            self._t_forward_end = None  # stamped by _on_hidden when the forward pass returns
            try:
                outputs = eng.step()
            finally:
                # A forward that raised stopped bumping mid-way: finish the count so queued
                # batches of that step still post (and complete) instead of waiting forever.
                while self._issued < self._step_end:
                    self._bump()
            # NOTE: DONE_AT's t_end is the end of the forward pass, not this later moment: posting
            # the hidden-state write releases the GIL, and in a process shared with other Python
            # threads getting it back can take milliseconds, which would hide transfer time.
            now = self._t_forward_end if self._t_forward_end is not None else time.time()
            for out in outputs:
                if out.finish_reason == "prefilled":
                    self._post(self._computed, out.request_id, "prefilled", "", now)
                elif out.finished:
                    self._post(self._computed, out.request_id, "fail", "the prefill forward pass failed")

    def _bump(self) -> None:
        self._issued += 1
        self.counter.bump()

    def _get_nowait(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _apply(self, cmd) -> None:
        eng = self.engine
        if cmd[0] == "add":
            self._admit(cmd[1])
        elif cmd[0] == "cancel":
            key = cmd[1]
            job = next((j for j in self._admission if j.key == key), None)
            if job is not None:
                self._admission.remove(job)
            eng.abort(key, quarantine=True)  # no-op if already prefilled (pages held anyway)
            self._post(self._computed, key, "cancel")
        elif cmd[0] == "release":
            eng.release(cmd[1])
            while self._admission:
                job = self._admission.popleft()
                if not self._admit(job, requeue=True):
                    break

    def _admit(self, job: Job, requeue: bool = False) -> bool:
        try:
            self.engine.add_prefill_request(job.key, job.tokens)
        except OutOfPages:
            (self._admission.appendleft if requeue else self._admission.append)(job)
            return False
        except InvalidRequest as e:
            self._post(self._computed, job.key, "fail", f"prefill node cannot take the request: {e}")
        return True

    def _on_step(self, chunks) -> None:
        """Before a forward: queue each prefill chunk's complete pages on the layer counter."""
        # NOTE: from the bumps issued, not counter.value(): on a GPU the kernels of the previous
        # step may not have reached host memory yet, the targets must not depend on that.
        base = self._issued
        # after-forward mode: one extra bump when the forward returned (see writes.py)
        self._step_end = base + self.src.num_layers + (0 if self.mcfg.layerwise else 1)
        for ch in chunks:
            job = self.jobs.get(ch.request_id)
            if job is None or not ch.prefill_only or job.link.dead:
                continue
            idx = pages_to_send(ch.start, ch.num_tokens, self.engine.kv.page_size, ch.is_last_chunk)
            if job.t_first is None:
                job.t_first = time.perf_counter()
                if self.metrics is not None:
                    self.metrics.queue_prefill.observe(job.t_first - job.arrival)
            if not len(idx):
                continue
            src = np.asarray(ch.page_ids, dtype=np.int64)[idx.start:idx.stop]
            dst = job.dst_pages[idx.start:idx.stop]
            plan = job.link.plan
            n = self.src.num_layers * batches_per_layer(plan, job.seed)
            with self.lock:
                job.outstanding += n
            try:
                _, writes = queue_chunk(self.m, watch=self.watch, base=base, layerwise=self.mcfg.layerwise,
                                        conn=job.link.conn, lkeys=self.kv.keys, rkeys=job.link.kv_rkeys,
                                        src=self.src, dst=job.link.dst, plan=plan, seed=job.seed,
                                        src_pages=src, dst_pages=dst, imm=job.imm, tag=job.tag)
            except QueueError as e:  # e.g. the peer's connection was dropped meanwhile
                with self.lock:  # only the batches that were queued will complete
                    job.outstanding -= n - e.num_batches
                job.write_errors += 1
                job.error_reason = str(e)
                continue
            job.num_writes += writes

    def _on_hidden(self, seqs, hidden: torch.Tensor) -> None:
        """After a forward: the last prompt row of each finished prefill goes to its decode slot.
        hidden: [num_tokens, hidden_size], rows in ``seqs`` order."""
        self._t_forward_end = time.time()
        if not self.mcfg.layerwise:
            self._bump()  # the forward pass is over: release the after-forward batches
        row = 0
        for s in seqs:
            n = len(s.token_ids)
            row += n
            req = s.request
            if not req.prefill_only or s.start_pos + n != req.num_tokens:
                continue
            job = self.jobs.get(req.request_id)
            if job is None or job.link.dead or not self._free_staging:
                continue  # no staging row: the count will not complete and the decode side times out
            job.staging = self._free_staging.pop()
            self.staging[job.staging].copy_(hidden[row - 1])
            with self.lock:
                job.outstanding += 1
            try:
                self.m.write(job.link.conn, self.staging_key, job.staging * self.hidden_nbytes,
                             job.link.hidden_rkey, job.hidden_off, self.hidden_nbytes, imm=job.imm, tag=job.tag)
            except Exception as e:  # noqa: BLE001
                with self.lock:
                    job.outstanding -= 1
                job.write_errors += 1
                job.error_reason = f"hidden-state write failed: {e}"
                continue
            job.num_writes += 1
