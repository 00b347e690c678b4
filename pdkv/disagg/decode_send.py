"""The decode coordinator's sending side (a mixin of DecodeCoordinator, pdkv/disagg/decode.py):
a request the engine admitted gets its grants, made in the grant thread (on verbs an MR
registration per range, never on the event loop), then its slot and its PREFILL. A client that
leaves while the grants are made, or a peer that dies meanwhile, gets them revoked unsent; the
bounds (messenger.max_grants_per_request, max_grants_per_peer) refuse with a 503 naming them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from pdkv.disagg import messages as M
from pdkv.disagg.decode_connector import RemoteAsk
from pdkv.disagg.decode_slots import Slot
from pdkv.disagg.peers import Peer
from pdkv.disagg.reservation import Reservation
from pdkv.disagg.writes import expected_writes
from pdkv.engine.loop import FailRequest
from pdkv.shard import request_seed

log = logging.getLogger("pdkv.disagg.decode")


@dataclass(frozen=True)
class _Granting:
    """A request whose grants the grant thread is making; its PREFILL leaves once they exist."""
    res: Reservation
    tokens: list
    pages: list
    dst: list
    peer: Peer
    grantee: int
    need: int
    cached: int
    ask: RemoteAsk
    t0: float


class PrefillSender:
    """What DecodeCoordinator sends: grants, slots, PREFILL (event loop, but the grant thread)."""

    def send_prefill(self, rid: str, tokens: list[int], pages: list[int], row: int, peer: Peer | None,
                     cached: int = 0, ask: RemoteAsk | None = None, res: Reservation | None = None) -> None:
        """The engine admitted ``rid`` with hidden-state row ``row``, and the chooser reserved
        ``peer`` for it (the connector; a peer that died since is replaced by another). This node
        holds the KV of ``tokens[:cached]`` already (whole pages of its prefix cache); ``pages``
        are the pages for the rest, the only ones the prefill node is granted and writes (staged:
        it writes the landing slots reserved for them instead); ``ask``: PREFILL's optional
        fields: the speculative hand-off's (spec_pages, next_token), echo + logprobs'
        (prompt_logprobs, last_token, pdkv/disagg/prompt_logprobs.py), or None. From here on
        the request's Reservation holds the row, the landing slots, the grants and the pages
        (``res``: the one a PREFILL sent again keeps, reset: pdkv/disagg/reservation.py)."""
        ask = ask or RemoteAsk()
        if res is None:
            res = self.memory.reserve(rid, row)
            self.memory.live[rid] = res
        dst = pages if self.landing is None else self.landing.slots_of(rid)  # where the writes land
        if peer is None or peer.dead or peer.channel is None:
            if peer is not None:
                self.chooser.unreserve(peer, len(tokens))
            peer = self.chooser.pick(tokens)
        if peer is None:
            self.commands(FailRequest(rid, "no prefill node is connected (the decode node is dialling its "
                                           "prefill peers; retry shortly)", 503, 2))
            res.release(pages=True)  # nothing was sent: no write can land
            return
        need = self.memory.grants_needed(dst, ask.spec_pages, ask.dp_rank)
        if need > self.mcfg.max_grants_per_request:
            self.chooser.unreserve(peer, len(tokens))
            self._refuse(res, f"the request's pages need {need} grants (one per KV rank, layer and run of "
                              f"pages; messenger.max_grants_per_request is {self.mcfg.max_grants_per_request})")
            return
        if not self._has_room(peer, need):  # the chooser's pick holds too many grants: another live one
            self.chooser.unreserve(peer, len(tokens))
            peer = next((p for p in self.links.live() if self._has_room(p, need)), None)
            if peer is None:
                self._refuse(res, f"every prefill node holds too many grants for another {need} "
                                  f"(messenger.max_grants_per_peer {self.mcfg.max_grants_per_peer}); retry shortly", 2)
                return
        grantee = peer.channel.peer.node_id
        self.memory.hold(grantee, need)  # NOTE: before the grant thread runs: later requests count these
        self._granting[rid] = False  # True once the client left while its grants were made
        job = _Granting(res, tokens, pages, dst, peer, grantee, need, cached, ask, time.perf_counter())
        if self.instant_grants:  # table entries (tcp): the grant thread would be a crossing for nothing
            fut = self.loop.create_future()
            try:
                fut.set_result(self.memory.grant(grantee, dst, row, request_seed(rid), ask.spec_pages,
                                                  ask.dp_rank))
            except Exception as e:  # noqa: BLE001 - _granted reports it, as from the grant thread
                fut.set_exception(e)
        else:
            try:  # NOTE: on verbs each range is an MR registration (shm: a round trip): never on the event loop
                fut = self.loop.run_in_executor(self._grant_pool, self.memory.grant, grantee, dst, row,
                                                request_seed(rid), ask.spec_pages, ask.dp_rank)
            except RuntimeError as e:  # the pool is shut down: this node is stopping
                fut = self.loop.create_future()
                fut.set_exception(e)
        fut.add_done_callback(lambda f: self._granted(job, f))  # call_soon: after this returns, as before

    def _granted(self, job: "_Granting", fut) -> None:
        """The grants of ``job`` were made (or failed) in the grant thread: PREFILL goes out,
        unless the client left or the peer died meanwhile (then the grants are revoked first)."""
        res, peer, grantee, ask = job.res, job.peer, job.grantee, job.ask
        rid = res.rid
        aborted = self._granting.pop(rid, False)
        try:
            granted, spec_granted = fut.result()
        except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001 - refused, or stopping: nothing sent
            log.warning("decode: cannot grant %s's pages to the prefill node: %s", rid, e)
            self.memory.hold(grantee, -job.need)
            self.chooser.unreserve(peer, len(job.tokens))
            if not aborted:
                self.commands(FailRequest(rid, f"cannot grant the request's pages to the prefill node: {e}"))
            res.release(pages=True)
            return
        self.memory.hold(grantee, len(granted) + len(spec_granted) - job.need)
        res.granted(grantee, tuple(granted) + tuple(spec_granted))
        self.metrics.grant_time.observe(time.perf_counter() - job.t0)
        self.metrics.grants.inc(len(granted) + len(spec_granted))
        imm = next(self._imms) & 0xFFFFFFFF
        num_layers, plan, seed = self.engine.kv.num_layers, peer.plan, request_seed(rid)
        slot = Slot(imm, res, peer, len(job.pages), expected_writes(plan, len(job.pages), num_layers),
                    time.perf_counter())
        seg_bytes = sum(seg.length for pair in plan.active_pairs(seed) for seg in pair.segments)
        slot.nbytes = len(job.pages) * seg_bytes * num_layers + self.hidden_nbytes
        if ask.spec_pages is not None:  # the proposer's KV streams like more layers (pdkv/disagg/spec_handoff.py)
            writes, nbytes = self.spec.expected_writes(len(ask.spec_pages), seed)
            slot.expected += writes
            slot.nbytes += nbytes
        slot.skip = job.cached // self.engine.kv.page_size
        slot.kv_pages = tuple(job.pages)
        slot.job = (job.tokens, job.cached, ask)
        if ask.prompt_logprobs is not None:
            slot.want_logprobs = ask.prompt_logprobs
            slot.prompt = (*job.tokens, ask.last_token)
        self.slots[imm] = slot
        self.by_rid[rid] = slot
        peer.slots[imm] = slot
        if aborted or peer.dead or peer.channel is None or peer.channel.peer.node_id != grantee:
            self.chooser.unreserve(peer, len(job.tokens))
            if not aborted and self._retry(slot, "granting"):  # nothing was sent: another node
                return
            if not aborted:
                self.metrics.failed("peer_dead")
                self.commands(FailRequest(rid, "the prefill node died while the request's pages were granted "
                                               "to it; retry shortly", 503, 2))
            self._free(slot, release=True)  # nothing was sent: the grants go, then the pages
            return
        self.m.expect(imm, slot.expected)
        slot.timer = self.loop.call_later(self.mcfg.transfer_timeout_s, self._timeout, slot)
        self.chooser.sent(peer, len(job.tokens))
        # the proposer ranges' write keys (spec_runs/spec_rkeys) go with the hand-off's pages
        spec_keys = (self.spec_grants.write_keys(ask.spec_pages, spec_granted, hidden=False)
                     if spec_granted else None)
        self._send(peer, M.Prefill(rid, tuple(job.tokens), tuple(job.dst), imm, slot.hidden_row * self.hidden_nbytes,
                                   seed, job.cached, slot.expected, self.grants.write_keys(job.dst, granted),
                                   ask.spec_pages, ask.next_token, spec_keys, ask.prompt_logprobs,
                                   ask.last_token, _wire_priority(ask.priority), ask.dp_rank).to_wire())

    def _has_room(self, peer: Peer, need: int) -> bool:
        """Whether ``peer`` may hold ``need`` more grant ranges (messenger.max_grants_per_peer)."""
        return (peer.channel is not None
                and self.memory.held.get(peer.channel.peer.node_id, 0) + need <= self.mcfg.max_grants_per_peer)

    def _refuse(self, res: Reservation, reason: str, retry_after: int | None = None) -> None:
        """Nothing was granted or sent: the client gets 503 naming the limit."""
        self._rlog.warning("grant_limit", "decode: refusing %s: %s", res.rid, reason)  # may repeat under load
        self.metrics.failed("grant_limit")
        self.commands(FailRequest(res.rid, reason, 503, retry_after))
        res.release(pages=True)


def _wire_priority(priority: int) -> int:
    """The API takes any integer priority; PREFILL carries 32 bits. Clamping keeps the order of
    every pair of requests except among values beyond 2^31, which no policy tells apart anyway."""
    return max(-M.PRIORITY_TOP, min(M.PRIORITY_TOP - 1, priority))
