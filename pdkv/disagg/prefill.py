"""The prefill node's coordinator: control listener, messenger events, the job table's driver.

Per request (a PREFILL from a decode node): a Job in the table (pdkv/disagg/jobs.py) and an
AddRequest to the engine loop; the engine computes the prompt in chunks while the prefill
connector (pdkv/disagg/prefill_connector.py) queues each chunk's complete pages layer by layer
and, after the last chunk, the final hidden state. The request's source pages are released
only when every one of its writes completed locally (batch_done), then DONE_AT / CANCEL_ACK /
FAIL goes back (``Job.answer``).

Threads: this object lives on the asyncio loop (control, messenger events); the engine thread
runs pdkv.engine.loop.EngineLoop with this object as its LoopEvents (whose methods only post
back here) and the connector. The two share the job table (``outstanding`` under its lock);
commands go to the engine through ``commands`` (EngineLoop.put) only.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from pdkv.control import ControlChannel, ControlError
from pdkv.disagg.ratelog import RateLimitedLog
from pdkv.disagg import protocol as P
from pdkv.disagg.jobs import DuplicateJob, Job, JobEnd, JobTable
from pdkv.disagg.load import PrefillLoad, measure_load
from pdkv.disagg.prefill_connector import PrefillConnector, StagingRows
from pdkv.disagg.range_keys import RangeKeys
from pdkv.disagg.sharded import NodeKV, check_keys, hello_rank_nics, link_pairs, plan_link
from pdkv.disagg.staged import staging_mode
from pdkv.disagg.staged_prefill import build_sender
from pdkv.disagg.spec_handoff import PrefillHandoff, handoff_proposer, row_parts
from pdkv.disagg.spec_handoff import connect_fields as spec_connect_fields, parse_fields as parse_spec_fields
from pdkv.disagg.writes import Geometry
from pdkv.engine import SamplingParams
from pdkv.engine.loop import AbortRequest, AddRequest, EngineLoop, LoopEvents, ReleasePages, Wake
from pdkv.gpu.staging import CopyStatus
from pdkv.messenger import rank_keys
from pdkv.shard import ShardPlan, request_seed
from pdkv.tls import server_context, start_server

log = logging.getLogger(__name__)
NUM_HIDDEN_STAGING = 256  # hidden-state rows in flight at once (one per admitted request)
PREFILL_PARAMS = SamplingParams(max_tokens=1)  # never sampled: a prefill-only request


@dataclass
class Link:
    """One decode node connected to this prefill node."""

    channel: ControlChannel
    conn: int
    kv_rkeys: list[int]  # the decode node's KV region key per decode rank
    hidden_rkey: int
    dst: Geometry
    hidden_nbytes: int
    plan: ShardPlan  # this node's ShardSpec -> the decode node's (agreed in the handshake)
    jobs: dict = field(default_factory=dict)  # req id -> Job
    dead: bool = False
    num_prefills: int = 0  # PREFILLs received on this channel (the load report's ``seen``)
    # the speculative hand-off: the decode node's proposer cache region, its layout and pages
    spec_rkey: int = 0
    spec_dst: Geometry | None = None
    spec_num_pages: int = 0


class PrefillCoordinator(LoopEvents):
    def __init__(self, cfg, engine, messenger, node_id: int, metrics=None, engine_stats=None,
                 secret: bytes | None = None):
        """``engine_stats(stats)``: where the engine's stats go (the server's gauges), or None;
        ``secret``: the cluster secret every decode node must prove (pdkv/auth.py), or None."""
        from pdkv.gpu.layer_counter import make_layer_counter

        self.cfg, self.engine, self.m, self.node_id, self.metrics = cfg, engine, messenger, node_id, metrics
        self.mcfg = cfg.messenger
        self.mode = staging_mode(cfg)  # ConfigError for a combination that cannot work here
        # every rank's KV region, registered (one per rank) unless the pages go through the ring
        self.kv = NodeKV(engine, messenger, register=not self.mode.staged)
        hidden = int(engine.loaded.arch.hidden_size)
        # what this node prepares for its decode nodes' proposers (pdkv/disagg/spec_handoff.py)
        self.handoff = P.spec_handoff(cfg.speculative, engine)
        self.staging = StagingRows(NUM_HIDDEN_STAGING, hidden * row_parts(self.handoff), engine.loaded.dtype)
        self.hidden_nbytes = self.staging.row_nbytes
        buf = self.staging.buffer
        self.staging_key = messenger.register_address(buf.data_ptr(), buf.numel() * buf.element_size())
        self.counter = make_layer_counter(torch.device(cfg.model.device))
        self.watch = messenger.watch_address(self.counter.host_address)
        self.jobs = JobTable()
        self._tags = itertools.count(1)
        self.staged = (build_sender(cfg, self.mode, messenger, self.kv, self.jobs, self.watch, self._post,
                                    self._copy_ended, metrics) if self.mode.staged else None)
        proposer = handoff_proposer(engine, self.handoff)
        self.spec = PrefillHandoff(proposer, self.handoff, messenger, self.watch, engine.kv.page_size) \
            if proposer is not None else None
        # the hidden row leaves through rank 0's NIC the seed picks, as rank 0's pages do
        self.connector = PrefillConnector(self.jobs, messenger, self.kv, self.counter, self.watch, self.staging,
                                          rank_keys(messenger, self.staging_key, 0), self.mcfg.layerwise,
                                          engine.kv.page_size, metrics,
                                          staged=self.staged, spec=self.spec)
        engine.set_connector(self.connector)
        self._engine_stats = engine_stats
        # the engine's last stats (engine thread after each step), for the load report; before its
        # first step the engine thread is not running yet, so reading them here is safe
        self.last_stats: dict | None = engine.stats()
        self.engine_loop = EngineLoop(engine, self, name="pdkv-prefill-engine",
                                      max_waiting=cfg.server.max_waiting_requests)
        self.commands = self.engine_loop.put
        self.staging.on_free = lambda: self.commands(Wake())  # a request waiting for a row may fit
        self.loop: asyncio.AbstractEventLoop | None = None
        self.links: list[Link] = []
        self._server: asyncio.AbstractServer | None = None
        self.secret = secret
        # messenger.tls, or None; a connection is upgraded only after it was counted (see _accept)
        self.tls = server_context(self.mcfg.tls)
        self._by_source: collections.Counter = collections.Counter()  # control connections held per source
        # NOTE: Messenger.complete() connects sockets / QPs and may block for seconds (bounded in C by
        # the transport's connect timeout): never on the event loop, at most max_setups at once.
        self._setups = ThreadPoolExecutor(self.mcfg.max_setups, thread_name_prefix="pdkv-prefill-setup")
        self._setups_busy = 0
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
        """Start the engine thread and the control listener; returns the control port."""
        self.loop = asyncio.get_running_loop()
        self.hello = P.make_hello(self.engine, self.node_id, "prefill", self.m.transport, self.cfg.speculative,
                                  hello_rank_nics(self.m))  # which NICs carry each rank's pages
        self.engine_loop.start()
        self._server = await start_server(self._accept, self.mcfg.control_host, self.mcfg.control_port,
                                          upgrade_later=self.tls is not None)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self.links):
            self._peer_dead(link, "prefill node shutting down")
        await asyncio.get_running_loop().run_in_executor(None, self.engine_loop.stop, 30)
        self.engine.set_connector(None)
        if self.staged is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.staged.copy.close)
        self._setups.shutdown(wait=False, cancel_futures=True)

    def is_alive(self) -> bool:
        return self.engine_loop.is_alive()

    # ---- control (loop thread) --------------------------------------------------------------
    async def _accept(self, reader, writer) -> None:
        """One decode node's control connection: bounded per listener and per source address,
        authenticated and handshaken within messenger.handshake_timeout_s, then served."""
        peername = writer.get_extra_info("peername") or ("?", 0)
        source = peername[0]
        if (sum(self._by_source.values()) >= self.mcfg.max_control_conns
                or self._by_source[source] >= self.mcfg.max_control_per_source):
            self._rlog.warning(f"refuse:{source}", "prefill: refusing a control connection from %s: %d held "
                               "(messenger.max_control_conns %d, max_control_per_source %d)", source,
                               self._by_source[source], self.mcfg.max_control_conns,
                               self.mcfg.max_control_per_source)
            writer.close()
            return
        self._by_source[source] += 1
        try:
            await self._serve(reader, writer, source)
        finally:
            self._by_source[source] -= 1
            if self._by_source[source] <= 0:
                del self._by_source[source]

    async def _serve(self, reader, writer, source: str) -> None:
        timeout = self.mcfg.handshake_timeout_s
        ch = None
        try:
            ch = await ControlChannel.accept(reader, writer, self.hello, timeout, secret=self.secret,
                                             max_frame=self.mcfg.max_frame_bytes, ssl=self.tls)
            try:
                plan = plan_link(self.kv.spec, "prefill", ch.peer.extra)
            except ControlError as e:  # HandshakeRefused: the shard planner cannot serve the pair
                await ch.send({"type": P.REFUSE, "reason": str(e)})
                raise
            try:  # NOTE: a peer that said HELLO but never CONNECTs is dropped after the deadline
                msg = await asyncio.wait_for(ch.recv(), timeout)
            except asyncio.TimeoutError as e:
                raise ControlError(f"no CONNECT within {timeout} s of HELLO (messenger.handshake_timeout_s)") from e
            if msg["type"] != P.CONNECT:
                raise ControlError(f"expected CONNECT after HELLO, got {msg['type']}")
            rkeys, hidden_key, ex, info_in = _connect_fields(plan, msg, ch.peer.extra)
            spec_fields = spec_connect_fields(msg, ch.peer.extra) if self.spec is not None else None
            # QPs only for the (NIC, peer NIC) pairs the plan's writes can use (None: every pair)
            conn, info = self.m.prepare(ch.peer.node_id, ch.token, pairs=link_pairs(plan, "prefill", self.m,
                                                                                    ch.peer.extra))
            try:
                await self._complete(conn, info_in)
            except BaseException:
                self.m.disconnect(conn)
                raise
            await ch.send({"type": P.CONNECTED, "info": info})
        except (ControlError, OSError, ValueError) as e:
            self._rlog.warning(f"setup:{source}", "prefill: decode node connection from %s refused or broken "
                               "during set-up: %s", source, e)
            if ch is not None and isinstance(e, ValueError) and not isinstance(e, ControlError):
                try:
                    await ch.send({"type": P.REFUSE, "reason": str(e)})
                except ControlError:
                    pass
            writer.close()
            return
        link = Link(ch, conn, rkeys, hidden_key,
                    Geometry(ex["num_layers"], ex["page_nbytes"], ex["layer_nbytes"]), self.hidden_nbytes, plan)
        if self.spec is not None:  # the handshake made sure the peer expects the hand-off
            link.spec_rkey, link.spec_dst, link.spec_num_pages = spec_fields
        self.links.append(link)
        log.info("prefill: decode node %#x connected from %s (prefill tp=%d -> decode tp=%d%s)", ch.peer.node_id,
                 source, plan.prefill.tp, plan.decode.tp, ", authenticated" if ch.authenticated else "")
        ch.start_heartbeat(self.mcfg.heartbeat_s, self.mcfg.lease_s, lambda r: self._peer_dead(link, r),
                           payload=lambda: {"load": self.load_report(link).to_wire()})
        try:
            while not link.dead:
                self._on_message(link, await ch.recv())
        except ControlError as e:
            self._peer_dead(link, str(e))

    async def _complete(self, conn: int, info: bytes) -> None:
        """Messenger.complete in a set-up thread (the transport bounds how long it may take)."""
        if self._setups_busy >= self.mcfg.max_setups:
            raise ControlError(f"{self._setups_busy} data-path set-ups already running (messenger.max_setups)")
        self._setups_busy += 1
        try:
            await self.loop.run_in_executor(self._setups, self.m.complete, conn, info)
        finally:
            self._setups_busy -= 1

    def _on_message(self, link: Link, msg: dict) -> None:
        kind = msg["type"]
        if kind == P.PREFILL:
            self._on_prefill(link, msg)
        elif kind == P.CANCEL:
            job = link.jobs.get(msg.get("req"))
            if job is None:  # finished already: nothing of it is in flight
                self._send(link, {"type": P.CANCEL_ACK, "req": msg.get("req"), "posted": 0})
            else:
                job.reason = "cancelled by the decode node"
                self.commands(AbortRequest(job.key))
        else:
            self._rlog.warning(f"unexpected:{kind}", "prefill: ignoring unexpected control message %s", kind)

    def load_report(self, link: Link) -> PrefillLoad:
        """What the next heartbeat on ``link`` tells its decode node (pdkv/disagg/load.py)."""
        return measure_load(self.jobs, self.last_stats, link.num_prefills)

    def _on_prefill(self, link: Link, msg: dict) -> None:
        """A new job, or FAIL naming what was wrong (a duplicate id, a malformed field): a
        refused PREFILL touches nothing, in particular not a job with the same id."""
        link.num_prefills += 1  # refused ones too: the decode node counted each one it sent
        req = msg.get("req")
        try:
            fields = P.parse_prefill(msg, link.channel.peer.extra.get("num_pages"), self.engine.kv.page_size)
            dst_keys = RangeKeys.parse(msg, fields[1], link.plan.decode.tp, link.dst.num_layers)
        except ValueError as e:
            self._rlog.warning("malformed", "prefill: refusing a malformed PREFILL from node %#x: %s",
                               link.channel.peer.node_id, e)
            self._send(link, {"type": P.FAIL, "req": req if isinstance(req, str) else repr(req)[:64],
                              "reason": f"malformed PREFILL: {e}", "posted": 0})
            return
        tokens, pages, imm, hidden_off, seed, cached = fields
        spec = None
        if self.spec is not None:
            try:
                spec = parse_spec_fields(msg, self.handoff, len(pages), link.spec_num_pages)
                # the proposer ranges' write keys (verbs: one MR each; tcp: the region's key)
                spec_keys = RangeKeys.parse(msg, spec[1], 1, link.spec_dst.num_layers, runs_field="spec_runs",
                                            keys_field="spec_rkeys", hidden_field=None)
            except ValueError as e:
                self._send(link, {"type": P.FAIL, "req": req, "reason": f"malformed PREFILL: {e}", "posted": 0})
                return
        job = Job(f"{link.channel.peer.node_id:x}:{req}", req, link, tokens, pages, imm, hidden_off,
                  next(self._tags), time.perf_counter(), seed, skip=cached // self.engine.kv.page_size,
                  dst_keys=dst_keys)
        if spec is not None:
            job.next_token, job.spec_pages = spec
            job.spec_keys = spec_keys
        try:
            self.jobs.add(job)
        except DuplicateJob as e:
            self._rlog.warning("duplicate", "prefill: refusing a duplicate PREFILL for %r (still in flight)", req)
            self._send(link, {"type": P.FAIL, "req": req, "posted": 0, "duplicate": True, "reason": e.args[0]})
            return
        link.jobs[job.req] = job
        self.commands(AddRequest(job.key, job.tokens, PREFILL_PARAMS, job.arrival))

    def _send(self, link: Link, msg: dict) -> None:
        if link.dead:
            return

        async def send():
            try:
                await link.channel.send(msg)
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
        self.commands(ReleasePages(job.key))
        msg = job.answer()
        if msg["type"] == P.FAIL and self.metrics is not None:
            self.metrics.failed("write_error" if job.write_errors else "prefill_failed")
        self._send(link, msg)

    # ---- engine thread (LoopEvents): post back to the loop, never wait ----------------------
    def on_step(self, step_start: float, outputs) -> None:
        # NOTE: DONE_AT's t_end is the end of the forward pass, not this later moment: posting
        # the hidden-state write releases the GIL, and in a process shared with other Python
        # threads getting it back can take milliseconds, which would hide transfer time.
        t_end = self.connector.t_forward_end or time.time()
        for out in outputs:
            if out.finish_reason == "prefilled":
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


def _connect_fields(plan, msg: dict, extra: dict):
    """CONNECT's fields checked (ValueError / ControlError naming the bad one): the decode ranks'
    KV keys, the hidden-state key, the peer's KV geometry from its HELLO, the data-path info."""
    rkeys = check_keys(plan, msg.get("kv_keys", [msg.get("kv_key")]))
    hidden_key, info = msg.get("hidden_key"), msg.get("info")
    if not isinstance(hidden_key, int) or isinstance(hidden_key, bool) or hidden_key < 0:
        raise ValueError(f"CONNECT hidden_key must be a non-negative integer, got {hidden_key!r}")
    if not isinstance(info, bytes):
        raise ValueError("CONNECT info must be bytes")
    for name in ("num_layers", "page_nbytes", "layer_nbytes"):
        v = extra.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"the decode node's HELLO extra.{name} must be a positive integer, got {v!r}")
    return rkeys, hidden_key, extra, info
