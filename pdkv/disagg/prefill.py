"""The prefill node's coordinator: control listener, engine thread, page writes.

Per request (a PREFILL from a decode node): the engine computes the prompt in chunks; before each
forward the step listener queues that chunk's complete pages layer by layer on the layer counter
(the C poller posts them while later layers compute); after the last chunk the final hidden
state goes to the decode node's slot. The request's source pages are released only when every
one of its writes completed locally (batch_done), then DONE_AT / CANCEL_ACK / FAIL goes back.

Threads: the asyncio loop (control, messenger events) and the engine thread (engine calls, the
step and hidden listeners). They share ``Job.outstanding`` under one lock; everything else moves
through the engine's command queue or ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from pdkv.control import ControlChannel, ControlError
from pdkv.disagg import protocol as P
from pdkv.disagg.prefill_engine import PrefillEngineSide
from pdkv.disagg.sharded import NodeKV, check_keys, plan_link
from pdkv.disagg.writes import Geometry
from pdkv.shard import ShardPlan, request_seed

log = logging.getLogger(__name__)
NUM_HIDDEN_STAGING = 256  # hidden-state rows in flight at once (one per request finishing a prefill)


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


@dataclass
class Job:
    key: str  # engine request id: "<decode node id>:<req>"
    req: str
    link: Link
    tokens: list[int]
    dst_pages: np.ndarray  # int64 [num_pages]
    imm: int
    hidden_off: int
    tag: int
    arrival: float
    seed: int = 0  # replica assignment (pdkv.shard.request_seed of the decode node's request id)
    outstanding: int = 0  # batches queued/posted, not yet batch_done (under Prefill.lock)
    num_writes: int = 0  # queued or posted
    num_ok: int = 0  # completed locally without error: they landed or will land (what CANCEL_ACK reports)
    num_bytes: int = 0
    write_errors: int = 0
    error_reason: str = ""
    computed: str | None = None  # "prefilled" | "cancel" | "fail" once the engine is done with it
    reason: str = ""
    t_first: float | None = None
    t_end: float | None = None
    staging: int | None = None
    finished: bool = False


class PrefillCoordinator(PrefillEngineSide):
    def __init__(self, cfg, engine, messenger, node_id: int, metrics=None):
        from pdkv.gpu.layer_counter import make_layer_counter

        self.cfg, self.engine, self.m, self.node_id, self.metrics = cfg, engine, messenger, node_id, metrics
        self.mcfg = cfg.messenger
        self.kv = NodeKV(engine, messenger)  # every rank's KV region, registered (one per rank)
        self.src = self.kv.geometry
        hidden = int(engine.loaded.arch.hidden_size)
        self.staging = torch.zeros(NUM_HIDDEN_STAGING, hidden, dtype=engine.loaded.dtype)
        self.hidden_nbytes = hidden * self.staging.element_size()
        self.staging_key = messenger.register_address(self.staging.data_ptr(), self.staging.numel() *
                                                      self.staging.element_size())
        self._free_staging = list(range(NUM_HIDDEN_STAGING))
        self.counter = make_layer_counter(torch.device(cfg.model.device))
        self.watch = messenger.watch_address(self.counter.host_address)
        self.lock = threading.Lock()
        self.jobs: dict[str, Job] = {}  # key -> Job (written on the loop, read on the engine thread)
        self._by_tag: dict[int, Job] = {}
        self._tags = itertools.count(1)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._admission: deque[Job] = deque()
        self._step_end = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.links: list[Link] = []
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._run, name="pdkv-prefill-engine", daemon=True)
        self._issued = 0  # bumps issued so far (on a GPU the host value may lag behind them)
        engine.runner.set_layer_hook(lambda layer: self._bump())
        engine.set_step_listener(self._on_step)
        engine.runner.set_hidden_listener(self._on_hidden)

    # ---- start / stop (loop thread) ---------------------------------------------------------
    async def start(self) -> int:
        """Start the engine thread and the control listener; returns the control port."""
        self.loop = asyncio.get_running_loop()
        self.hello = P.make_hello(self.engine, self.node_id, "prefill", self.m.transport)
        self._thread.start()
        self._server = await asyncio.start_server(self._accept, self.mcfg.control_host, self.mcfg.control_port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self.links):
            self._peer_dead(link, "prefill node shutting down")
        self._commands.put(("stop",))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # ---- control (loop thread) --------------------------------------------------------------
    async def _accept(self, reader, writer) -> None:
        try:
            ch = await ControlChannel.accept(reader, writer, self.hello, self.mcfg.connect_timeout_s)
            try:
                plan = plan_link(self.kv.spec, "prefill", ch.peer.extra)
            except ControlError as e:  # HandshakeRefused: the shard planner cannot serve the pair
                await ch.send({"type": P.REFUSE, "reason": str(e)})
                raise
            msg = await ch.recv()
            if msg["type"] != P.CONNECT:
                raise ControlError(f"expected CONNECT after HELLO, got {msg['type']}")
            rkeys = check_keys(plan, msg.get("kv_keys", [msg["kv_key"]]))
            conn, info = self.m.prepare(ch.peer.node_id)
            self.m.complete(conn, msg["info"])
            await ch.send({"type": P.CONNECTED, "info": info})
        except (ControlError, OSError) as e:
            log.warning("prefill: decode node connection refused or broken during set-up: %s", e)
            writer.close()
            return
        ex = ch.peer.extra
        link = Link(ch, conn, rkeys, msg["hidden_key"],
                    Geometry(ex["num_layers"], ex["page_nbytes"], ex["layer_nbytes"]), self.hidden_nbytes, plan)
        self.links.append(link)
        log.info("prefill: decode node %#x connected (prefill tp=%d -> decode tp=%d)", ch.peer.node_id,
                 plan.prefill.tp, plan.decode.tp)
        ch.start_heartbeat(self.mcfg.heartbeat_s, self.mcfg.lease_s, lambda r: self._peer_dead(link, r))
        try:
            while not link.dead:
                self._on_message(link, await ch.recv())
        except ControlError as e:
            self._peer_dead(link, str(e))

    def _on_message(self, link: Link, msg: dict) -> None:
        kind = msg["type"]
        if kind == P.PREFILL:
            job = Job(f"{link.channel.peer.node_id:x}:{msg['req']}", msg["req"], link, list(msg["tokens"]),
                      np.asarray(msg["pages"], dtype=np.int64), int(msg["imm"]), int(msg["hidden_off"]),
                      next(self._tags), time.perf_counter(), int(msg.get("seed", request_seed(msg["req"]))))
            link.jobs[job.req] = job
            self.jobs[job.key] = job
            self._by_tag[job.tag] = job
            self._commands.put(("add", job))
        elif kind == P.CANCEL:
            job = link.jobs.get(msg["req"])
            if job is None:  # finished already: nothing of it is in flight
                self._send(link, {"type": P.CANCEL_ACK, "req": msg["req"], "posted": 0})
            else:
                job.reason = "cancelled by the decode node"
                self._commands.put(("cancel", job.key))
        else:
            log.warning("prefill: ignoring unexpected control message %s", kind)

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
            self._commands.put(("cancel", job.key))
        if link in self.links:
            self.links.remove(link)

    # ---- messenger events (loop thread) -----------------------------------------------------
    def on_event(self, ev) -> None:
        if ev.kind != "batch_done":
            if ev.kind == "error":  # e.g. a decode node that left; its control channel says so too
                log.info("prefill: messenger event from peer %#x: %s", ev.peer, ev.reason)
            return
        job = self._by_tag.get(ev.tag)
        if job is None:
            return
        with self.lock:
            job.outstanding -= 1
        job.num_ok += ev.count - ev.num_errors
        if ev.status != 0 or ev.num_errors:
            job.write_errors += 1
            job.error_reason = ev.reason or f"write failed with status {ev.status}"
        else:
            job.num_bytes += ev.bytes
        self._maybe_finish(job)

    def _computed(self, key: str, how: str, reason: str = "", t_end: float | None = None) -> None:
        job = self.jobs.get(key)
        if job is None or job.computed is not None:
            return
        job.computed, job.t_end = how, t_end
        job.reason = job.reason or reason
        self._maybe_finish(job)

    def _maybe_finish(self, job: Job) -> None:
        with self.lock:
            busy = job.outstanding > 0
        if busy or job.computed is None or job.finished:
            return
        job.finished = True
        self._commands.put(("release", job.key))
        del self.jobs[job.key]
        self._by_tag.pop(job.tag, None)
        link = job.link
        link.jobs.pop(job.req, None)
        if job.staging is not None:
            self._free_staging.append(job.staging)
        # NOTE: a write that failed locally never lands; one that succeeded did or will (tcp: it
        # is in the kernel; verbs: acknowledged), so the decode side waits for exactly these.
        posted = job.num_ok
        if self.metrics is not None:
            self.metrics.kv_bytes.inc(job.num_bytes)
            if job.t_first is not None:
                self.metrics.transfer_time.observe(time.perf_counter() - job.t_first)
        if job.computed == "prefilled" and not job.write_errors:
            self._send(link, {"type": P.DONE_AT, "req": job.req, "t_end": job.t_end, "posted": posted,
                              "bytes": job.num_bytes})
        elif job.computed == "cancel":
            self._send(link, {"type": P.CANCEL_ACK, "req": job.req, "posted": posted})
        else:
            reason = job.reason or (f"{job.write_errors} page write(s) failed: {job.error_reason}"
                                    if job.write_errors else "prefill failed")
            if self.metrics is not None:
                self.metrics.failed("write_error" if job.write_errors else "prefill_failed")
            self._send(link, {"type": P.FAIL, "req": job.req, "reason": reason, "posted": posted})

    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # loop closed: shutting down
