"""The prefill node's coordinator: the job table's driver between decode nodes, messenger and engine.

Per request (a PREFILL from a decode node): a Job in the table (pdkv/disagg/jobs.py) and an
AddRequest to the engine loop; the engine computes the prompt in chunks while the prefill
connector (pdkv/disagg/prefill_connector.py) queues each chunk's complete pages layer by layer
and, after the last chunk, the final hidden state. The request's source pages are released
only when every one of its writes completed locally (batch_done), then DONE_AT / CANCEL_ACK /
FAIL goes back (``Job.answer``). Decode nodes connect through the control listener in
prefill_links.py (bounded, authenticated, handshaken); each connected one is a ``Link``.

Threads: this object lives on the asyncio loop (control, messenger events); the engine thread
runs pdkv.engine.loop.EngineLoop with this object as its LoopEvents (whose methods only post
back here) and the connector. The two share the job table (``outstanding`` under its lock);
commands go to the engine through ``commands`` (EngineLoop.put) only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time

import numpy as np

from pdkv.control import ControlError
from pdkv.disagg.ratelog import RateLimitedLog
from pdkv.disagg import messages as M
from pdkv.disagg import protocol as P
from pdkv.disagg.dp_prefill import DPPrefillConnector
from pdkv.disagg.jobs import DuplicateJob, Job, JobEnd, JobTable
from pdkv.disagg.kv_share import KVShare, handoff
from pdkv.disagg.load import PrefillLoad, measure_load
from pdkv.disagg.prefill_connector import PrefillConnector
from pdkv.disagg.prefill_memory import PrefillMemory
from pdkv.disagg import prompt_logprobs as PL
from pdkv.disagg.prefill_links import DecodeLinks, Link
from pdkv.disagg.sharded import dp_size, hello_rank_nics
from pdkv.disagg.staged_prefill import build_sender
from pdkv.engine import SamplingParams
from pdkv.engine.loop import AbortRequest, AddRequest, EngineLoop, LoopEvents, ReleasePages, Wake
from pdkv.gpu.staging import CopyStatus

log = logging.getLogger(__name__)
PREFILL_PARAMS = SamplingParams(max_tokens=1)  # never sampled: a prefill-only request


class PrefillCoordinator(LoopEvents):
    def __init__(self, cfg, engine, messenger, node_id: int, engine_loop: EngineLoop, metrics=None,
                 engine_stats=None, secret: bytes | None = None):
        """``engine_loop``: the server's (not started yet): this object attaches as its front-end;
        ``engine_stats(stats)``: where the engine's stats go (the server's gauges), or None;
        ``secret``: the cluster secret every decode node must prove (pdkv/auth.py), or None."""
        self.cfg, self.engine, self.m, self.node_id, self.metrics = cfg, engine, messenger, node_id, metrics
        self.mcfg = cfg.messenger
        # what the writes read from: KV regions, hidden staging rows, the layer counter, the hand-off
        self.memory = mem = PrefillMemory(cfg, engine, messenger)
        self.mode, self.kv, self.handoff, self.spec = mem.mode, mem.kv, mem.handoff, mem.spec
        self.staging, self.hidden_nbytes, self.counter, self.watch = (mem.staging, mem.hidden_nbytes, mem.counter,
                                                                      mem.watch)
        self.jobs = JobTable()
        self._tags = itertools.count(1)
        self.staged = (build_sender(cfg, self.mode, messenger, self.kv, self.jobs, self.watch, self._post,
                                    self._copy_ended, metrics) if self.mode.staged else None)
        # disagg.kv_handoff share: KV computed into the decode node's pages (pdkv/disagg/kv_share.py)
        self.share = (KVShare(messenger, self.kv, engine.kv.page_size, cfg.disagg.kv_handoff == "share")
                      if handoff(cfg) == "share" and mem.kv.dp is None else None)
        self.connector = PrefillConnector(self.jobs, messenger, self.kv, self.counter, self.watch, self.staging,
                                          mem.staging_keys, self.mcfg.layerwise,
                                          engine.kv.page_size, metrics,
                                          staged=self.staged, spec=self.spec, share=self.share)
        # a DP group's front hands each rank's chunks to the connector (pdkv/disagg/dp_prefill.py)
        engine.set_connector(self.connector if mem.kv.dp is None
                             else DPPrefillConnector(self.connector, messenger, engine))
        self._broken = False  # the engine can run no further step (a DP group lost a rank)
        self._engine_stats = engine_stats
        # the engine's last stats (engine thread after each step), for the load report; before its
        # first step the engine thread is not running yet, so reading them here is safe
        self.last_stats: dict | None = engine.stats()
        engine_loop.attach(self)
        self.commands = engine_loop.put
        self.staging.on_free = lambda: self.commands(Wake())  # a request waiting for a row may fit
        self.loop: asyncio.AbstractEventLoop | None = None
        self.listener = DecodeLinks(self.mcfg, messenger, self.kv.spec, self.hidden_nbytes, self.spec is not None,
                                    secret, lambda link, msg: self._on_message(link, msg),
                                    lambda link, reason: self._peer_dead(link, reason),
                                    lambda link: self.load_report(link), kv_dp=self.kv.dp)  # looked up per call
        self.links = self.listener.links  # the decode nodes connected now
        self._rlog = RateLimitedLog(log)

    def _copy_ended(self, job: Job, status, error: str) -> None:
        """One staging copy of ``job`` ended (event loop). A copy cancelled because the job was
        cancelled is no error; any other copy that moved nothing fails the request."""
        if status is CopyStatus.CANCELLED and (job.end is JobEnd.CANCELLED or job.link.dead):
            error = ""
        elif status is not CopyStatus.DONE and not error:
            error = f"staging copy {status.value}"
        done = self.jobs.copy_ended(job, error)
        if done is not None:
            self._finished(done)

    # ---- start / stop (loop thread) ---------------------------------------------------------
    async def start(self) -> int:
        """Start the control listener (the server starts the engine thread); returns the port."""
        self.loop = asyncio.get_running_loop()
        self.hello = P.make_hello(self.engine, self.node_id, "prefill", self.m.transport, self.cfg.speculative,
                                  hello_rank_nics(self.m), tls_data=self.cfg.messenger.tls_data)  # which NICs carry each rank's pages
        self.port = await self.listener.start(self.hello)
        return self.port

    def set_draining(self, draining: bool = True) -> None:
        """This node drains (or is ready again): every connected decode node is told at once
        (DRAINING), and every one that connects later on its new link, so the decode nodes stop
        choosing it with static peers too (no etcd record to watch). Its jobs go on."""
        self.listener.draining = draining
        for link in list(self.links):
            self._send(link, M.Draining(draining).to_wire())

    def close(self) -> None:
        """Take no more work, before the engine loop stops: the listener closes and every link
        goes (each decode node fails its requests as transient, as for a dead peer)."""
        self.listener.close()
        for link in list(self.links):
            self._peer_dead(link, "prefill node shutting down")

    async def stop(self) -> None:
        """After the engine loop stopped (it freed every page)."""
        self.close()  # a no-op after the first
        self.engine.set_connector(None)
        if self.staged is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.staged.copy.close)
        self.listener.shutdown()

    # ---- control (loop thread) --------------------------------------------------------------
    def _on_message(self, link: Link, msg: dict) -> None:
        try:
            kind = M.message_class(msg, M.TO_PREFILL)
        except M.MessageError as e:
            self._rlog.warning(f"unexpected:{str(msg.get('type'))[:40]}", "prefill: ignoring a control message "
                               "from node %#x: %s", link.channel.peer.node_id, e)
            return
        if kind is M.Prefill:
            self._on_prefill(link, msg)
        elif kind is M.Cancel:
            try:
                cancel = M.Cancel.parse(msg)
            except M.MessageError as e:
                self._rlog.warning("malformed_cancel", "prefill: ignoring a malformed CANCEL: %s", e)
                return
            job = link.jobs.get(cancel.req)
            if job is None:  # finished already: nothing of it is in flight
                self._send(link, M.CancelAck(cancel.req, 0).to_wire())
            else:
                job.reason = "cancelled by the decode node"
                self.commands(AbortRequest(job.key))
        else:
            self._rlog.warning(f"unexpected:{kind.TYPE}", "prefill: ignoring unexpected control message %s",
                               kind.TYPE)

    def load_report(self, link: Link) -> PrefillLoad:
        """What the next heartbeat on ``link`` tells its decode node (pdkv/disagg/load.py)."""
        return measure_load(self.jobs, self.last_stats, link.num_prefills)

    def _on_prefill(self, link: Link, msg: dict) -> None:
        """A new job, or FAIL naming what was wrong (a duplicate id, a malformed field): a
        refused PREFILL touches nothing, in particular not a job with the same id."""
        link.num_prefills += 1  # refused ones too: the decode node counted each one it sent
        try:
            p = M.Prefill.parse(msg, self._limits(link))
        except M.MessageError as e:
            self._rlog.warning("malformed", "prefill: refusing a malformed PREFILL from node %#x: %s",
                               link.channel.peer.node_id, e)
            self._send(link, M.Fail(M.Prefill.request_id(msg), f"malformed PREFILL: {e}", 0).to_wire())
            return
        if p.prompt_logprobs is not None and self.kv.dp is not None:  # a rank would need the last token
            self._send(link, M.Fail(p.req, "prompt logprobs (echo with logprobs) are not computed by a prefill "
                                           "DP-EP group (parallel.dp)", 0).to_wire())
            return
        job = Job(f"{link.channel.peer.node_id:x}:{p.req}", p.req, link, list(p.tokens),
                  np.asarray(p.pages, dtype=np.int64), p.imm, p.hidden_off, next(self._tags), time.perf_counter(),
                  p.seed, skip=p.cached // self.engine.kv.page_size, dst_keys=p.dst_keys)
        if self.spec is not None:
            job.next_token, job.spec_keys = p.next_token, p.spec_dst_keys
            job.spec_pages = np.asarray(p.spec_pages, dtype=np.int64)
        params = PREFILL_PARAMS
        if p.prompt_logprobs is not None:  # the forward records them (log_softmax of its rows: nothing sampled)
            job.prompt_logprobs, job.last_token = p.prompt_logprobs, p.last_token
            params = dataclasses.replace(PREFILL_PARAMS, prompt_logprobs=p.prompt_logprobs)
        try:
            self.jobs.add(job)
        except DuplicateJob as e:
            self._rlog.warning("duplicate", "prefill: refusing a duplicate PREFILL for %r (still in flight)", p.req)
            self._send(link, M.Fail(p.req, e.args[0], 0, duplicate=True).to_wire())
            return
        link.jobs[job.req] = job
        # the decode node's order, where this node schedules by priority too (under fcfs a
        # non-zero priority would be refused: the decode node's policy is not this node's)
        priority = p.priority if self.cfg.scheduler.policy == "priority" else 0
        self.commands(AddRequest(job.key, job.tokens, params, job.arrival, priority))

    def _limits(self, link: Link) -> M.PrefillLimits:
        """What a PREFILL on ``link`` is checked against (its decode node's pool and plan, this
        node's page size, prompt-logprobs bound and speculative hand-off)."""
        return M.PrefillLimits(link.channel.peer.extra.get("num_pages"), self.engine.kv.page_size,
                               link.plan.decode.tp, link.dst.num_layers,
                               self.cfg.server.max_prompt_logprobs_tokens,
                               self.handoff.get("method") if self.spec is not None else None,
                               link.spec_num_pages, link.spec_dst.num_layers if link.spec_dst is not None else 0,
                               dp_size(link.channel.peer.extra))

    def _send(self, link: Link, wire: dict) -> None:
        """``wire``: a message's to_wire() (pdkv/disagg/messages.py)."""
        if link.dead:
            return

        async def send():
            try:
                await link.channel.send(wire)
            except ControlError as e:
                self._peer_dead(link, str(e))
        self.loop.create_task(send())

    def _peer_dead(self, link: Link, reason: str) -> None:
        if link.dead:
            return
        link.dead = True
        (log.warning if link.jobs else log.info)("prefill: decode node %#x is gone (%s): dropping its %d "
                                                 "request(s)", link.channel.peer.node_id, reason, len(link.jobs))
        link.channel.close()
        # Its pending writes end with errors (batch_done status < 0), so every job quiesces.
        try:
            self.m.disconnect(link.conn)
        except Exception as e:  # noqa: BLE001
            log.warning("prefill: disconnect failed: %s", e)
        for job in list(link.jobs.values()):
            self.commands(AbortRequest(job.key))
        if link in self.links:
            self.links.remove(link)

    # ---- messenger events (loop thread) -----------------------------------------------------
    def on_event(self, ev) -> None:
        if ev.kind != "batch_done":
            if ev.kind == "error":  # e.g. a decode node that left; its control channel says so too
                log.info("prefill: messenger event from peer %#x: %s", ev.peer, ev.reason)
            return
        tag = ev.tag if self.staged is None else self.staged.batch_done(ev.tag)  # a slot's batch: its job's tag
        job = self.jobs.batch_done(tag, ev.count, ev.num_errors, ev.status, ev.bytes, ev.reason)
        if job is not None:
            self._finished(job)

    def _engine_broken(self, reason: str) -> None:
        """The engine can run no further step (a DP group lost a rank; its jobs have failed):
        this node takes no more decode nodes and drops the ones it has, so each gives its
        requests in transfer to another prefill node or computes them itself
        (disagg.prefill_retries, disagg.local_fallback) instead of waiting for them here."""
        log.error("prefill: the engine failed (%s): dropping %d decode node(s), taking no more", reason,
                  len(self.links))
        self.listener.close()
        for link in list(self.links):
            self._peer_dead(link, f"the prefill node's engine failed: {reason}")

    def _send_prompt_logprobs(self, key: str, logprobs: list) -> None:
        job = self.jobs.get(key)
        if job is not None and job.prompt_logprobs is not None and len(logprobs) == len(job.tokens):
            self._send(job.link, PL.encode(job.req, logprobs))  # messages.PromptLogprobs on the wire

    def _engine_done(self, key: str, end: JobEnd, reason: str = "", t_end: float | None = None) -> None:
        if self.staged is not None and end is not JobEnd.PREFILLED:
            self.staged.copy.cancel(key)  # its queued copies end at once (a copy in flight, when it ends)
        job = self.jobs.engine_done(key, end, reason, t_end)
        if job is not None:
            self._finished(job)

    def _finished(self, job: Job) -> None:
        """Every write of ``job`` completed locally: its pages may be reused, the answer goes back."""
        link = job.link
        link.jobs.pop(job.req, None)
        if job.staging is not None:
            # NOTE: the row goes back before ReleasePages, which makes the engine retry admission
            self.staging.give_back(job.staging)
        if self.metrics is not None:  # counted before the pages go back: a full pool means counted
            self.metrics.kv_bytes.inc(job.num_bytes)
            self.metrics.transferred(job.num_pages_sent, job.skip, job.num_ok)
            if job.t_first is not None:
                self.metrics.transfer_time.observe(time.perf_counter() - job.t_first)
        if self.share is not None:  # its pages are this node's own again before they go back
            self.share.end(job)
        self.commands(ReleasePages(job.key))
        msg = job.answer()
        if isinstance(msg, M.Fail) and self.metrics is not None:
            self.metrics.failed("write_error" if job.write_errors else "prefill_failed")
        self._send(link, msg.to_wire())

    # ---- engine thread (LoopEvents): post back to the loop, never wait ----------------------
    def on_step(self, step_start: float, outputs) -> None:
        # NOTE: DONE_AT's t_end is the end of the forward pass, not this later moment: posting
        # the hidden-state write releases the GIL, and in a process shared with other Python
        # threads getting it back can take milliseconds, which would hide transfer time.
        t_end = self.connector.t_forward_end or time.time()
        if not self._broken and not getattr(self.engine, "healthy", True):
            # before the failed jobs' FAILs: the links go first, so the decode nodes retry them
            self._broken = True
            self._post(self._engine_broken, str(self.engine.error))
        for out in outputs:
            if out.finish_reason == "prefilled":
                if out.prompt_logprobs is not None:  # before DONE_AT, which waits for the writes
                    self._post(self._send_prompt_logprobs, out.request_id, out.prompt_logprobs)
                self._post(self._engine_done, out.request_id, JobEnd.PREFILLED, "", t_end)
            elif out.finish_reason == "error":
                self._post(self._engine_done, out.request_id, JobEnd.FAILED, "the prefill forward pass failed")
        self.on_commands_applied()

    def on_failed(self, request_id: str, error) -> None:
        self._post(self._engine_done, request_id, JobEnd.FAILED, f"prefill node cannot take the request: {error}")

    def on_aborted(self, request_id: str) -> None:
        self._post(self._engine_done, request_id, JobEnd.CANCELLED)

    def on_commands_applied(self) -> None:
        stats = self.engine.stats()
        self.last_stats = stats  # NOTE: one reference swap: the loop's load report reads it unlocked
        if self._engine_stats is not None:
            self._engine_stats(stats)

    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # loop closed: shutting down
