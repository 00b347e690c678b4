"""The decode node's coordinator: prefill peers, request slots, the immediate counts.

Per remote request: a slot (a 32-bit immediate never reused, a hidden-state row), PREFILL to a
prefill peer (round robin over the live ones), ``expect(imm, count)``; when the count's
imm_done arrives the KV and hidden state have landed and the engine gets RemoteKVReady. Every other
ending (transfer timeout, client gone, FAIL, peer dead) fails the client at once but returns the
pages only when no write can land any more: after the peer reported how many writes it posted
and exactly those landed, or after the data connection to a dead peer was torn down. A dead
peer is dialled again (doubling backoff up to REDIAL_MAX_S, each failure logged), so a prefill
node restarted on the same address serves again without restarting this node.

A slot's state machine::

    SENT ──count complete──► LANDED (the engine owns the pages now)
      │
      ├──timeout / client gone──► CANCELLING ──CANCEL_ACK / FAIL / DONE_AT──► DRAINING ──posted writes landed──► RELEASED
      └──FAIL──────────────────────────────────────────────────────────────► DRAINING
    (a dead peer: every slot RELEASED at once, after its data connection was torn down)

Threads: everything here runs on the event loop. The engine thread reaches it only through
the decode connector's posts (send_prefill, client_aborted); this object reaches the engine
only through ``commands`` (the engine loop's queue: RemoteKVReady, FailRequest, ReleasePages).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from pdkv.control import ControlChannel, ControlError, HandshakeRefused
from pdkv.disagg import protocol as P
from pdkv.disagg.decode_connector import DecodeConnector, HiddenRows
from pdkv.disagg.sharded import NodeKV, plan_link
from pdkv.disagg.writes import expected_writes
from pdkv.engine.loop import FailRequest, ReleasePages, RemoteKVReady
from pdkv.shard import request_seed

log = logging.getLogger(__name__)
REDIAL_FIRST_S, REDIAL_MAX_S = 0.1, 5.0  # backoff between redials of a dead prefill node (doubling)


@dataclass
class Peer:
    host: str
    port: int
    channel: ControlChannel | None = None
    conn: int = 0
    slots: dict = field(default_factory=dict)  # imm -> Slot
    dead: bool = True
    redial: asyncio.Task | None = None  # dialling it again after it died
    plan: object = None  # pdkv.shard.ShardPlan: the peer's ShardSpec -> ours (set by the handshake)


class SlotState(enum.Enum):
    SENT = "sent"
    LANDED = "landed"
    CANCELLING = "cancelling"
    DRAINING = "draining"
    RELEASED = "released"


@dataclass
class Slot:
    imm: int
    rid: str
    peer: Peer
    num_pages: int
    hidden_row: int
    expected: int
    t_sent: float
    state: SlotState = SlotState.SENT
    all_landed: bool = False  # the count fired (then the messenger dropped the counter)
    nbytes: int = 0  # what the expected writes carry
    timer: asyncio.TimerHandle | None = None


class DecodeCoordinator:
    def __init__(self, cfg, engine, messenger, node_id: int, metrics, commands, keep_hidden: bool = True):
        """``commands``: the engine loop's EngineLoop.put. Installs the decode connector on ``engine``."""
        self.cfg, self.engine, self.m, self.node_id, self.metrics = cfg, engine, messenger, node_id, metrics
        self.commands = commands
        self.mcfg = cfg.messenger
        self.kv = NodeKV(engine, messenger)  # every rank's KV region, registered (one per rank)
        num_rows = max(64, 2 * cfg.scheduler.max_num_seqs)
        hidden = int(engine.loaded.arch.hidden_size)
        self.hidden = torch.zeros(num_rows, hidden, dtype=engine.loaded.dtype)  # [slots, hidden_size]
        self.hidden_nbytes = hidden * self.hidden.element_size()
        self.hidden_key = messenger.register_address(self.hidden.data_ptr(), num_rows * self.hidden_nbytes)
        self.rows = HiddenRows(num_rows)
        self._imms = itertools.count(1)  # NOTE: never reused, so a late write can't count for a new request
        self.slots: dict[int, Slot] = {}
        self.by_rid: dict[str, Slot] = {}
        self.peers = [Peer(*_split(p)) for p in self.mcfg.prefill_peers]
        self._rr = 0
        self.keep_hidden = keep_hidden
        self.hidden_states: dict[str, torch.Tensor] = {}  # rid -> [hidden_size], when keep_hidden
        # exposed transfer = landed (here) - end of the last prefill forward (DONE_AT); either may
        # come first (DONE_AT travels on the control channel, the data on the transport).
        self._landed_at: dict[str, float] = {}
        self._t_end: dict[str, float] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.connector = DecodeConnector(self, self.rows)
        engine.set_connector(self.connector)

    # ---- connections ----------------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.hello = P.make_hello(self.engine, self.node_id, "decode", self.m.transport)
        await asyncio.gather(*(self._connect(p) for p in self.peers))

    async def _connect(self, peer: Peer, once: bool = False) -> None:
        """Dial a prefill peer until connect_timeout_s (``once``: a single try); a refused handshake
        is final and raised."""
        deadline = time.monotonic() + self.mcfg.connect_timeout_s
        while True:
            try:
                ch = await ControlChannel.connect(peer.host, peer.port, self.hello, self.mcfg.connect_timeout_s)
                break
            except ControlError as e:
                if once or isinstance(e, HandshakeRefused) or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        conn = None
        try:
            # HandshakeRefused naming both TP degrees if the shard planner cannot serve the pair
            plan = plan_link(self.kv.spec, "decode", ch.peer.extra)
            conn, info = self.m.prepare(ch.peer.node_id)
            for key in self.kv.keys:
                self.m.grant(key, ch.peer.node_id)
            self.m.grant(self.hidden_key, ch.peer.node_id)
            await ch.send({"type": P.CONNECT, "info": info, "kv_key": self.kv.keys[0], "kv_keys": self.kv.keys,
                           "hidden_key": self.hidden_key})
            msg = await asyncio.wait_for(ch.recv(), self.mcfg.connect_timeout_s)
            if msg["type"] == P.REFUSE:
                raise HandshakeRefused(f"prefill {peer.host}:{peer.port} refused: {msg.get('reason')}")
            if msg["type"] != P.CONNECTED:
                raise ControlError(f"prefill {peer.host}:{peer.port}: expected CONNECTED, got {msg['type']}")
            self.m.complete(conn, msg["info"])
        except BaseException:
            ch.close()  # a half set-up connection must not stay behind (a redial tries again)
            if conn is not None:
                self.m.disconnect(conn)
            raise
        peer.channel, peer.conn, peer.plan, peer.dead = ch, conn, plan, False
        # NOTE: callbacks of this channel only act while it is the peer's current one (after a
        # redial, the old channel's reader and heartbeat must not kill the new connection)
        ch.start_heartbeat(self.mcfg.heartbeat_s, self.mcfg.lease_s,
                           lambda r: peer.channel is ch and self._peer_dead(peer, r))
        self.loop.create_task(self._reader(peer, ch))
        log.info("decode: connected to prefill node %#x at %s:%d", ch.peer.node_id, peer.host, peer.port)

    async def _reader(self, peer: Peer, ch: ControlChannel) -> None:
        try:
            while not peer.dead and peer.channel is ch:
                self._on_message(peer, await ch.recv())
        except ControlError as e:
            if peer.channel is ch:
                self._peer_dead(peer, str(e))

    async def _redial(self, peer: Peer) -> None:
        """Dial a dead prefill peer again (e.g. restarted on the same address) with doubling
        backoff, until it answers or this node stops; each failed try is logged."""
        delay = REDIAL_FIRST_S
        try:
            while not self._stopping and peer.dead:
                await asyncio.sleep(delay)
                try:
                    await self._connect(peer, once=True)
                    log.info("decode: prefill node at %s:%d is back", peer.host, peer.port)
                    return
                except Exception as e:  # noqa: BLE001 - refused, unreachable, broken set-up: try later
                    delay = min(2 * delay, REDIAL_MAX_S)
                    log.warning("decode: redial of prefill node at %s:%d failed (%s); next try in %.1f s",
                                peer.host, peer.port, e, delay)
        finally:
            peer.redial = None

    async def stop(self) -> None:
        self._stopping = True
        self.engine.set_connector(None)
        for peer in self.peers:
            if peer.redial is not None:
                peer.redial.cancel()
            if peer.channel is not None:
                peer.dead = True
                peer.channel.close()

    def can_route(self) -> bool:  # engine thread: a racy read is fine (a dead peer fails the request)
        return any(not p.dead for p in self.peers)

    def post(self, fn, *args) -> None:  # from the engine thread
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    # ---- requests (loop thread) ------------------------------------------------------------
    def send_prefill(self, rid: str, tokens: list[int], pages: list[int], row: int) -> None:
        """The engine admitted ``rid`` with ``pages`` and hidden-state row ``row`` (the connector)."""
        live = [p for p in self.peers if not p.dead]
        if not live:
            self.rows.give_back(row)
            self.commands(FailRequest(rid, "no prefill node is connected"))
            self.commands(ReleasePages(rid))  # nothing was sent: no write can land
            return
        peer = live[self._rr % len(live)]
        self._rr += 1
        imm = next(self._imms) & 0xFFFFFFFF
        plan, seed = peer.plan, request_seed(rid)
        slot = Slot(imm, rid, peer, len(pages), row,
                    expected_writes(plan, len(pages), self.engine.kv.num_layers), time.perf_counter())
        seg_bytes = sum(seg.length for pair in plan.active_pairs(seed) for seg in pair.segments)
        slot.nbytes = len(pages) * seg_bytes * self.engine.kv.num_layers + self.hidden_nbytes
        self.slots[imm] = slot
        self.by_rid[rid] = slot
        peer.slots[imm] = slot
        self.m.expect(imm, slot.expected)
        slot.timer = self.loop.call_later(self.mcfg.transfer_timeout_s, self._timeout, slot)
        self._send(peer, {"type": P.PREFILL, "req": rid, "tokens": tokens, "pages": pages, "imm": imm,
                          "hidden_off": slot.hidden_row * self.hidden_nbytes, "expected": slot.expected,
                          "seed": seed})

    def _send(self, peer: Peer, msg: dict) -> None:
        async def send():
            try:
                await peer.channel.send(msg)
            except ControlError as e:
                self._peer_dead(peer, str(e))
        self.loop.create_task(send())

    def on_event(self, ev) -> None:
        if ev.kind == "error":
            log.warning("decode: messenger error from peer %#x: %s", ev.peer, ev.reason)
            return
        if ev.kind != "imm_done":
            return
        slot = self.slots.get(ev.imm)
        if slot is None:
            return
        if slot.state == SlotState.SENT:
            self._landed(slot)
        elif slot.state == SlotState.DRAINING:
            self._free(slot, release=True)
        else:  # cancelling: every expected write landed; the ack will find the counter gone
            slot.all_landed = True

    def _landed(self, slot: Slot) -> None:
        """Every expected write of ``slot`` landed: the request is ready to decode."""
        slot.state = SlotState.LANDED
        now = time.perf_counter()
        self.metrics.ttft_transfer.observe(now - slot.t_sent)
        self.metrics.kv_bytes.inc(slot.nbytes)
        self._exposed(slot.rid, landed=time.time())
        if self.keep_hidden:  # the last few, for tests and debugging (bounded)
            self.hidden_states[slot.rid] = self.hidden[slot.hidden_row].clone()
            while len(self.hidden_states) > 256:
                self.hidden_states.pop(next(iter(self.hidden_states)))
        # NOTE: the row goes back before RemoteKVReady, which makes the engine retry admission
        self._free(slot, release=False)  # the engine owns the pages now
        self.commands(RemoteKVReady(slot.rid))

    def _exposed(self, rid: str, landed: float | None = None, t_end: float | None = None) -> None:
        landed = landed if landed is not None else self._landed_at.pop(rid, None)
        t_end = t_end if t_end is not None else self._t_end.pop(rid, None)
        if landed is not None and t_end is not None:
            self.metrics.exposed_transfer.observe(max(0.0, landed - t_end))
            return
        pending = self._landed_at if landed is not None else self._t_end
        pending[rid] = landed if landed is not None else t_end
        while len(pending) > 1024:  # the other half never came (a failed request): forget the oldest
            pending.pop(next(iter(pending)))

    def client_aborted(self, rid: str) -> None:
        """The engine quarantined rid's pages because its client left."""
        slot = self.by_rid.get(rid)
        if slot is None:  # it had landed: nothing is in flight
            self.commands(ReleasePages(rid))
        elif slot.state == SlotState.SENT:
            self.metrics.failed("cancelled")
            self._cancel(slot)

    def _timeout(self, slot: Slot) -> None:
        if slot.state != SlotState.SENT:
            return
        self.metrics.failed("timeout")
        self.commands(FailRequest(slot.rid, f"KV transfer from the prefill node timed out after "
                                                  f"{self.mcfg.transfer_timeout_s} s (messenger.transfer_timeout_s)"))
        self._cancel(slot)

    def _cancel(self, slot: Slot) -> None:
        slot.state = SlotState.CANCELLING
        self._send(slot.peer, {"type": P.CANCEL, "req": slot.rid})

    def _on_message(self, peer: Peer, msg: dict) -> None:
        kind, rid = msg["type"], msg.get("req")
        slot = self.by_rid.get(rid)
        if kind == P.DONE_AT and msg.get("t_end") is not None:
            self._exposed(rid, t_end=float(msg["t_end"]))
        if slot is None or slot.peer is not peer:
            return
        for ev in self.m.drain():  # completions already counted come first: the count is the truth
            self.on_event(ev)
        slot = self.by_rid.get(rid)
        if slot is None:
            return
        if kind == P.FAIL and slot.state == SlotState.SENT:
            got = self.m.forget(slot.imm)
            if got >= slot.expected:  # e.g. a write that landed but completed with an error locally
                self._landed(slot)
                return
            self.metrics.failed("prefill_failed")
            self.commands(FailRequest(rid, f"the prefill node failed the request: {msg.get('reason')}"))
            self._drain(slot, int(msg.get("posted", 0)), got)
        elif kind in (P.FAIL, P.CANCEL_ACK) or (kind == P.DONE_AT and slot.state == SlotState.CANCELLING):
            self._drain(slot, int(msg.get("posted", 0)))

    def _drain(self, slot: Slot, posted: int, got: int | None = None) -> None:
        """The peer posts nothing more for slot: release once exactly ``posted`` writes landed.
        ``got``: what forget() already returned, if the caller took the counter down."""
        got = self.m.forget(slot.imm) + (got or 0)
        if slot.all_landed or got >= posted:
            self._free(slot, release=True)
        else:
            slot.state = SlotState.DRAINING
            self.m.expect(slot.imm, posted - got)

    def _peer_dead(self, peer: Peer, reason: str) -> None:
        if peer.dead and peer.channel is None:
            return
        was_dead, peer.dead = peer.dead, True
        if peer.channel is not None:
            peer.channel.close()
            peer.channel = None
        if was_dead and not peer.slots:
            return
        log.warning("decode: prefill node at %s:%d is gone (%s); failing %d request(s)", peer.host, peer.port,
                    reason, len(peer.slots))
        try:
            self.m.disconnect(peer.conn)  # joins its receive threads: no write of it lands after this
        except Exception as e:  # noqa: BLE001
            log.warning("decode: disconnect failed: %s", e)
        for slot in list(peer.slots.values()):
            if slot.state == SlotState.SENT:
                self.metrics.failed("peer_dead")
                self.commands(FailRequest(slot.rid, f"the prefill node died during the KV transfer ({reason})"))
            self.m.forget(slot.imm)
            self._free(slot, release=True)
        if not self._stopping and peer.redial is None:
            peer.redial = self.loop.create_task(self._redial(peer))

    def _free(self, slot: Slot, release: bool) -> None:
        if slot.timer is not None:
            slot.timer.cancel()
        self.slots.pop(slot.imm, None)
        if self.by_rid.get(slot.rid) is slot:
            del self.by_rid[slot.rid]
        slot.peer.slots.pop(slot.imm, None)
        slot.state = SlotState.RELEASED if release else slot.state
        self.rows.give_back(slot.hidden_row)
        self.m.forget(slot.imm)  # no counter outlives its slot (a no-op when it fired or was dropped)
        if release:
            self.commands(ReleasePages(slot.rid))


def _split(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    return host, int(port)
