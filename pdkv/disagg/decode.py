"""The decode node's coordinator: prefill peers, request slots, the immediate counts.

Per remote request: a slot (a 32-bit immediate never reused, a hidden-state row), PREFILL to the
prefill peer the chooser picked by load and prefix affinity (pdkv/disagg/choice.py; whether the
prompt is prefilled remotely at all is its ``decide``, at admission), ``expect(imm, count)``; when the count's
imm_done arrives the KV and hidden state have landed and the engine gets RemoteKVReady. Every other
ending (transfer timeout, client gone, FAIL, peer dead) fails the client at once but returns the
pages only when no write can land any more: after the peer reported how many writes it posted
and exactly those landed, or after the data connection to a dead peer was torn down: every
ending is the request's one Reservation.release (pdkv/disagg/reservation.py). Dialling,
the handshake and redialling a dead peer live in peers.py; granting a request's pages and
sending its PREFILL in decode_send.py.

The slot's state machine is drawn in decode_slots.py.

Threads: everything here runs on the event loop, except making a request's grants (on verbs an
MR registration per range): one grant thread, before its PREFILL leaves (decode_send.py). The
engine thread reaches it only through
the decode connector's posts (send_prefill, client_aborted); this object reaches the engine
only through ``commands`` (the engine loop's queue: RemoteKVReady, FailRequest, ReleasePages).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from pdkv.control import ControlError
from pdkv.disagg import messages as M
from pdkv.disagg import protocol as P
from pdkv.disagg.decode_connector import DecodeConnector
from pdkv.disagg.decode_memory import DecodeMemory
from pdkv.disagg.decode_send import PrefillSender
from pdkv.disagg.decode_slots import Slot, SlotState
from pdkv.disagg.dp_decode import DPDecodeConnector
from pdkv.disagg.peers import Peer, PrefillPeers
from pdkv.fleet.admission import TTFTEstimator
from pdkv.transports import Capability
from pdkv.disagg.ratelog import RateLimitedLog
from pdkv.disagg.sharded import hello_rank_nics
from pdkv.disagg.staged_decode import CopyIn
from pdkv.engine.loop import FailRequest, PrefillHere, ReleasePages, RemoteKVReady

log = logging.getLogger(__name__)


class DecodeCoordinator(PrefillSender):
    def __init__(self, cfg, engine, messenger, node_id: int, metrics, commands, secret: bytes | None = None):
        """``commands``: the engine loop's EngineLoop.put. Installs the decode connector on ``engine``."""
        self.cfg, self.engine, self.m, self.node_id, self.metrics = cfg, engine, messenger, node_id, metrics
        self.commands = commands
        self.mcfg = cfg.messenger
        # what prefill nodes may write on this node: KV (or landing slots), hidden rows, grants
        # NOTE: through self.commands, looked up per call (tests observe the coordinator's commands)
        self.memory = mem = DecodeMemory(cfg, engine, messenger, metrics, lambda cmd: self.commands(cmd))
        self.mode, self.landing, self.kv, self.handoff = mem.mode, mem.landing, mem.kv, mem.handoff
        self.hidden, self.hidden_size, self.hidden_nbytes, self.hidden_key = (mem.hidden, mem.hidden_size,
                                                                               mem.hidden_nbytes, mem.hidden_key)
        self.rows, self.grants, self.spec, self.spec_grants = mem.rows, mem.grants, mem.spec, mem.spec_grants
        self._aborted: set[str] = set()  # staged: clients gone while their landing slots were copied in
        self._copy_lps: dict[str, list] = {}  # staged: prompt logprobs of requests being copied in
        self._imms = itertools.count(1)  # NOTE: never reused, so a late write can't count for a new request
        self.slots: dict[int, Slot] = {}
        self.by_rid: dict[str, Slot] = {}
        # NOTE: grants are made in one thread, never on the event loop (verbs: an MR per range;
        # shm: a round trip to the peer), but where they are entries in our own table (tcp)
        self.instant_grants = Capability.INSTANT_GRANTS in messenger.capabilities
        self._grant_pool = ThreadPoolExecutor(1, thread_name_prefix="pdkv-decode-grant")
        self._granting: dict[str, bool] = {}  # rid -> its client left while the grant thread ran
        # rid -> its client left while its reservation was reset for another prefill node
        self._resending: dict[str, bool] = {}
        self.links = PrefillPeers(self.mcfg, messenger, self.kv, self.hidden_key, self._on_message, self._peer_dead,
                                  secret, cfg.disagg, engine.kv.page_size,
                                  spec_key=self.spec.key if self.spec is not None else None)
        self.chooser = self.links.chooser
        self.ttft = TTFTEstimator(cfg.server.ttft_slo_ms, cfg.server.admission)  # server.admission shed
        # called with (rid, its landed hidden row [hidden_size], a view valid during the call) when
        # set: for tests and debugging, costs nothing otherwise
        self.on_landed: Callable[[str, torch.Tensor], None] | None = None
        # exposed transfer = landed (here) - end of the last prefill forward (DONE_AT); either may
        # come first (DONE_AT travels on the control channel, the data on the transport).
        self._landed_at: dict[str, float] = {}
        self._t_end: dict[str, float] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._rlog = RateLimitedLog(log)  # a peer's repeated transport errors, once per interval
        if mem.dp is not None:  # a DP group's front: each rank reserves its own pages (pdkv/dp/remote.py)
            self.connector = DPDecodeConnector(self)
        else:
            self.connector = DecodeConnector(self, self.rows, self.landing, engine.kv.page_size, self.spec)
        engine.set_connector(self.connector)

    @property
    def held(self) -> dict[int, int]:
        """Prefill node id -> ranges granted to it now (messenger.max_grants_per_peer)."""
        return self.memory.held

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.memory.later = self.loop.call_later
        self.hello = P.make_hello(self.engine, self.node_id, "decode", self.m.transport, self.cfg.speculative,
                                  hello_rank_nics(self.m), tls_data=self.mcfg.tls_data)  # which NICs carry each rank's pages
        if self.landing is not None:  # the prefill node writes into landing slots, not KV pages
            self.hello = dataclasses.replace(self.hello, extra={**self.hello.extra, **self.landing.hello_extra()})
        await self.links.start(self.hello)

    def close(self) -> None:
        """Nothing to do before the engine loop stops: the server's front-end aborted its clients'
        requests; the transfers in flight end at ``stop``."""

    async def stop(self) -> None:
        self.engine.set_connector(None)
        await self.links.stop()
        self._grant_pool.shutdown(wait=False, cancel_futures=True)
        # the engine loop stopped first and freed every page: what is left here goes back unsent
        for res in list(self.memory.live.values()):
            res.release(pages=False)
        if self.landing is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.landing.copy.close)

    @property
    def peers(self) -> list[Peer]:
        return self.links.peers

    def can_route(self) -> bool:  # engine thread: a racy read is fine (a dead peer fails the request)
        return self.links.can_route()

    def post(self, fn, *args) -> None:  # from the engine thread
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    # ---- requests (loop thread) ------------------------------------------------------------
    def _send(self, peer: Peer, wire: dict) -> None:
        """``wire``: a message's to_wire() (pdkv/disagg/messages.py)."""
        async def send():
            try:
                await peer.channel.send(wire)
            except ControlError as e:
                self._peer_dead(peer, str(e))
        self.loop.create_task(send())

    def on_event(self, ev) -> None:
        if ev.kind == "error":
            self._rlog.warning(f"messenger:{ev.peer}", "decode: messenger error from peer %#x: %s", ev.peer, ev.reason)
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
        """Every expected write of ``slot`` landed: the request is ready to decode (with echo +
        logprobs once PROMPT_LOGPROBS came too; until then the slot stays SENT, its timer on)."""
        if slot.want_logprobs is not None and slot.logprobs is None:
            slot.all_landed = slot.kv_landed = True  # the messenger dropped the counter
            return
        slot.state = SlotState.LANDED
        now = time.perf_counter()
        self.metrics.ttft_transfer.observe(now - slot.t_sent)
        self.ttft.observe(slot.num_pages * self.engine.kv.page_size, now - slot.t_sent)
        self.metrics.kv_bytes.inc(slot.nbytes)
        self.metrics.transferred(slot.num_pages, slot.skip, slot.expected)
        self._exposed(slot.rid, landed=time.time())
        if self.on_landed is not None:
            self.on_landed(slot.rid, self.hidden[slot.hidden_row, :self.hidden_size])
        if self.spec is not None:  # NOTE: a copy: the row goes to another request once the grants are gone
            tail = self.hidden[slot.hidden_row, self.hidden_size:]
            self.spec.landed(slot.rid, tail.clone() if tail.numel() else None)
        # the engine owns the pages once the grants are gone (RemoteKVReady after the revoke;
        # staged: after the landing slots were copied into the pages, which starts after the revoke)
        then = RemoteKVReady(slot.rid, slot.logprobs)
        if self.landing is not None:
            self.landing.mark_landed(slot.rid)  # a client leaving from now on waits for the copy-in
            then = CopyIn(slot.rid, slot.kv_pages)
            if slot.logprobs is not None:  # they go with RemoteKVReady after the copy-in
                self._copy_lps[slot.rid] = slot.logprobs
        self._free(slot, release=False, then=then)

    def _copied_in(self, rid: str, error: str) -> None:
        """Staged: every landing slot of ``rid`` was copied into its pages, or a copy failed or
        was cancelled (event loop). No copy can touch the pages any more."""
        lps = self._copy_lps.pop(rid, None)
        if rid in self._aborted:  # the client left meanwhile: the engine quarantined the pages
            self._aborted.discard(rid)
            self.commands(ReleasePages(rid))
        elif error:
            self.metrics.failed("staging_copy")
            self.commands(FailRequest(rid, f"copying the KV from staging into its pages failed: {error}"))
            self.commands(ReleasePages(rid))  # the copy ended: nothing writes them any more
        else:
            self.commands(RemoteKVReady(rid, lps))

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
        if rid in self._granting:  # its grants are being made: _granted revokes them, nothing is sent
            self.metrics.failed("cancelled")
            self._granting[rid] = True
            return
        if rid in self._resending:  # its dead peer's grants are being revoked: nothing is sent again
            self.metrics.failed("cancelled")
            self._resending[rid] = True
            return
        slot = self.by_rid.get(rid)
        if slot is None and self.landing is not None and self.landing.copying(rid):
            self._aborted.add(rid)  # its landing slots are (about to be) copied into the pages: wait for that
            self.landing.cancel(rid)
        elif slot is None:  # it had landed: nothing is in flight
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
        self._bound(slot)
        self._send(slot.peer, M.Cancel(slot.rid).to_wire())

    def _on_message(self, peer: Peer, raw: dict) -> None:
        try:
            kind = M.message_class(raw, M.TO_DECODE)
            # PROMPT_LOGPROBS is checked against what its slot asked, below
            msg = kind.parse(raw) if kind is not M.PromptLogprobs else None
            if isinstance(msg, M.Draining):  # about the peer: the chooser skips it while draining
                self.links.set_draining(peer.host, peer.port, msg.draining)
                return
            rid = msg.req if msg is not None else M.request_id(raw)
        except M.MessageError as e:
            self._rlog.warning(f"bad_message:{peer.host}:{peer.port}", "decode: ignoring a control message from "
                               "prefill node at %s:%d: %s", peer.host, peer.port, e)
            return
        slot = self.by_rid.get(rid)
        if isinstance(msg, M.DoneAt) and msg.t_end is not None:
            self._exposed(rid, t_end=msg.t_end)
        if slot is None or slot.peer is not peer:
            return
        if isinstance(msg, M.Fail) and msg.duplicate:
            # NOTE: the peer refused a second PREFILL of rid and kept the first job: its writes may
            # still land, so this must not end the slot (only the first job's answer does)
            log.warning("decode: prefill node at %s:%d refused a duplicate PREFILL of %s", peer.host, peer.port, rid)
            return
        for ev in self.m.drain():  # completions already counted come first: the count is the truth
            self.on_event(ev)
        slot = self.by_rid.get(rid)
        if slot is None:
            return
        if kind is M.PromptLogprobs:
            self._prompt_logprobs(slot, raw)
        elif isinstance(msg, M.Fail) and slot.state == SlotState.SENT:
            got = self.m.forget(slot.imm)
            # e.g. a write that landed but completed with an error locally (with echo + logprobs,
            # only if PROMPT_LOGPROBS came before the FAIL: they are needed too)
            if got >= slot.expected and (slot.want_logprobs is None or slot.logprobs is not None):
                self._landed(slot)
                return
            self.metrics.failed("prefill_failed")
            self.chooser.failed(peer)
            self.commands(FailRequest(rid, f"the prefill node failed the request: {msg.reason}"))
            self._drain(slot, msg.posted, got)
        elif isinstance(msg, (M.Fail, M.CancelAck)) or (isinstance(msg, M.DoneAt)
                                                       and slot.state == SlotState.CANCELLING):
            self._drain(slot, msg.posted)

    def _prompt_logprobs(self, slot: Slot, msg: dict) -> None:
        """PROMPT_LOGPROBS for ``slot``: checked against what was asked, then the decode may start
        (if the KV landed already). A malformed one fails the request naming what was wrong."""
        if slot.state != SlotState.SENT or slot.want_logprobs is None or slot.logprobs is not None:
            self._rlog.warning("unasked_lps", "decode: ignoring PROMPT_LOGPROBS for %s (not asked for, or "
                               "twice)", slot.rid)
            return
        try:
            slot.logprobs = list(M.PromptLogprobs.parse(msg, list(slot.prompt), slot.want_logprobs).logprobs)
        except M.MessageError as e:
            self._rlog.warning("bad_lps", "decode: refusing PROMPT_LOGPROBS for %s: %s", slot.rid, e)
            self.metrics.failed("prefill_failed")
            self.commands(FailRequest(slot.rid, f"the prefill node sent malformed prompt logprobs: {e}"))
            self._cancel(slot)
            return
        if slot.kv_landed:
            self._landed(slot)

    def _drain(self, slot: Slot, posted: int, got: int | None = None) -> None:
        """The peer posts nothing more for slot: release once exactly ``posted`` writes landed.
        ``got``: what forget() already returned, if the caller took the counter down."""
        got = self.m.forget(slot.imm) + (got or 0)
        if slot.all_landed or got >= posted:
            self._free(slot, release=True)
        else:
            if slot.state is not SlotState.CANCELLING:  # FAIL{posted}: the request ends here
                self._bound(slot)
            slot.state = SlotState.DRAINING
            self.m.expect(slot.imm, posted - got)

    def _bound(self, slot: Slot) -> None:
        """slot's request ended: its grants outlive it by one lease at most (a peer that keeps
        heartbeating but never answers CANCEL, or whose posted writes never land)."""
        if slot.timer is not None:
            slot.timer.cancel()
        slot.timer = self.loop.call_later(self.mcfg.lease_s, self._lease_over, slot)

    def _lease_over(self, slot: Slot) -> None:
        if self.slots.get(slot.imm) is not slot or slot.state not in (SlotState.CANCELLING, SlotState.DRAINING):
            return
        self._rlog.warning(f"unanswered:{slot.peer.host}:{slot.peer.port}", "decode: prefill node at %s:%d "
                           "left %s %s for %.1f s (messenger.lease_s): its grants are revoked (later writes "
                           "are refused) and the pages return", slot.peer.host, slot.peer.port, slot.rid,
                           "unanswered" if slot.state is SlotState.CANCELLING else "short of its posted writes",
                           self.mcfg.lease_s)
        self._free(slot, release=True)  # NOTE: the revoke fences every write; the pages go back after it

    def _peer_dead(self, peer: Peer, reason: str) -> None:
        if peer.dead and peer.channel is None:
            return
        was_dead, peer.dead = peer.dead, True
        self.chooser.failed(peer)  # once back, it is tried last for a while
        stall = peer.channel.own_stall() if peer.channel is not None else None
        if stall is not None:
            reason = (f"this decode node was frozen for {stall:.1f} s, longer than the {self.mcfg.lease_s} s lease "
                      f"(messenger.lease_s), so the prefill node gave it up: {reason}")
        if peer.channel is not None:
            peer.channel.close()
            peer.channel = None
        if was_dead and not peer.slots:
            return
        log.warning("decode: prefill node at %s:%d is gone (%s); %d request(s) in transfer go to another "
                    "prefill node (disagg.prefill_retries %d) or fail", peer.host, peer.port, reason,
                    len(peer.slots), self.cfg.disagg.prefill_retries)
        try:
            self.m.disconnect(peer.conn)  # joins its receive threads: no write of it lands after this
        except Exception as e:  # noqa: BLE001
            log.warning("decode: disconnect failed: %s", e)
        for slot in list(peer.slots.values()):
            if slot.state == SlotState.SENT and self._retry(slot, "peer_dead"):
                continue  # its PREFILL goes to another prefill node
            if slot.state == SlotState.SENT:
                self.metrics.failed("peer_dead")
                what = "the KV transfer was cut" if stall is not None else "the prefill node died during the KV transfer"
                # NOTE: transient, not the client's doing: 503 + Retry-After, as with no prefill node
                self.commands(FailRequest(slot.rid, f"{what} ({reason}); retry shortly", 503, 2))
            self.m.forget(slot.imm)
            self._free(slot, release=True)
        self.links.redial(peer)

    def _retry(self, slot: Slot, cause: str) -> bool:
        """``slot``'s prefill node died before every write landed (its data connection is torn
        down, or it never got the PREFILL): unless the request used its disagg.prefill_retries,
        the slot ends without its reservation, which is reset (the dead node's grants revoked;
        the row, landing slots and pages kept) and then granted to another live prefill node,
        with a new slot and a new immediate (a stale count cannot reach it); with no other node
        live and disagg.local_fallback, it is released (the row and landing slots back) and the
        engine computes the prompt here into the pages it holds. False: the caller fails the
        request as before."""
        if slot.res.resets >= self.cfg.disagg.prefill_retries:
            return False
        # no other prefill node live: computed here when conditional disaggregation allows it
        # (with a speculative hand-off the proposer's KV would have to be made here too: not done)
        here = not any(p is not slot.peer for p in self.links.live())
        if here and not (self.cfg.disagg.local_fallback and self.spec is None):
            return False
        if slot.timer is not None:
            slot.timer.cancel()
        self.slots.pop(slot.imm, None)
        if self.by_rid.get(slot.rid) is slot:
            del self.by_rid[slot.rid]
        slot.peer.slots.pop(slot.imm, None)
        slot.state = SlotState.RELEASED
        self.m.forget(slot.imm)
        self._resending[slot.rid] = False
        self.metrics.retried(cause, "local" if here else "remote")
        if here:  # the row and landing slots go back once the grants are gone; the pages stay the engine's
            log.info("decode: prefilling %s here (%s; no other prefill node is live)", slot.rid, cause)
            slot.res.release(pages=False, then=lambda: self._prefill_here(slot.rid))
            return True
        log.info("decode: sending %s's PREFILL to another prefill node (%s, try %d of %d)", slot.rid, cause,
                 slot.res.resets + 1, self.cfg.disagg.prefill_retries)
        slot.res.reset(lambda: self._resend(slot))
        return True

    def _prefill_here(self, rid: str) -> None:
        """The dead node's grants of ``rid`` are revoked: its prompt is computed here (the
        engine unpins its pages), unless its client left meanwhile (then they go back)."""
        self.commands(ReleasePages(rid) if self._resending.pop(rid, False) else PrefillHere(rid))

    def _resend(self, slot: Slot) -> None:
        """The dead node's grants of ``slot`` are revoked: grant and send its PREFILL again (the
        chooser picks among the live nodes; none left: a 503), unless its client left meanwhile."""
        if self._resending.pop(slot.rid, False):  # the engine quarantined its pages: they go back
            slot.res.release(pages=True)
            return
        tokens, cached, ask = slot.job
        self.send_prefill(slot.rid, list(tokens), list(slot.kv_pages), slot.res.row, None, cached, ask, res=slot.res)

    def _free(self, slot: Slot, release: bool, then=None) -> None:
        """The slot ends: no write of it can land any more. Its reservation is released: the
        grants revoked, then its row and (``release``) its pages go back, then ``then``
        (RemoteKVReady, or with staging the copy-in)."""
        if slot.timer is not None:
            slot.timer.cancel()
        self.slots.pop(slot.imm, None)
        if self.by_rid.get(slot.rid) is slot:
            del self.by_rid[slot.rid]
        slot.peer.slots.pop(slot.imm, None)
        slot.state = SlotState.RELEASED if release else slot.state
        self.m.forget(slot.imm)  # no counter outlives its slot (a no-op when it fired or was dropped)
        if isinstance(then, CopyIn):
            slot.res.landed = True  # the copy-in gives the landing slots back
            slot.res.release(release, lambda: self._copy_in(then))
        else:
            slot.res.release(release, (lambda: self.commands(then)) if then is not None else None)

    def _copy_in(self, c: CopyIn) -> None:
        """Staged: the grants are gone, the landing slots go into the pages (unless the client
        left before the copy began: then they go back and so do the pages)."""
        if c.rid in self._aborted:
            self._aborted.discard(c.rid)
            self.landing.release(c.rid)
            self.commands(ReleasePages(c.rid))
        else:
            self.landing.copy_in(c.rid, c.pages, lambda rid, err: self.post(self._copied_in, rid, err))
