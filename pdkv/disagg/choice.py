"""Where a decode node prefills each prompt, and on which prefill node (the ``disagg`` config).

``decide`` (engine thread, at admission), in this order::

    uncached part <= local_prefill_max_tokens  -> LOCAL_SHORT      the round trip costs more than the work
    no live prefill node                       -> LOCAL_NO_PEER    (REFUSED_NO_PEER: local_fallback false, a 503)
    every live node's queue >= max_prefill_queue_tokens
                                               -> LOCAL_SATURATED  waiting there costs more than computing here
    otherwise                                  -> REMOTE

The uncached part is the prompt less the leading tokens this node's prefix cache holds (the
engine's peek, ``req.num_cached_tokens``; DecodeConnector passes it): that is all a local
prefill computes, so a 2,000-token prompt with 1,984 tokens cached here is a 16-token prefill,
run here — even while every prefill node is saturated or (strict) none is connected. A prefill
node's queue, by contrast, counts whole prompts: it needs the KV of every position, so this
node's cache does not shorten its work (only its own cache does, which its reports show once
the job's first chunk ran).

``pick`` (engine thread, once the request holds its pages and hidden-state row): the live
node with the shortest queue (ties: the one picked least recently), unsaturated, with room for
the prompt and without a failure in the last ``expiry_s`` first; a
node that prefilled the same leading pages before is taken instead while its queue is within
``affinity_max_extra_tokens`` of that (its prefix cache may hold them). A node's queue is what
its last heartbeat reported (pdkv/disagg/load.py) plus the tokens this node picked it for since:
``reserved`` until the PREFILL leaves, then ``sent`` until a report's ``seen`` covers it (or,
for a node that reports no load, until ``expiry_s``), so a burst between two heartbeats
spreads instead of piling onto the node that looked idle.

Threads: the engine thread decides and picks, the event loop sends, hears reports and sees
peers (re)connect; every ``PeerRoute`` is read and written under ``lock`` only.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pdkv.disagg.load import PrefillLoad

MAX_AFFINITY_ENTRIES = 4096  # prefix keys remembered (least recently used dropped first)


class Where(enum.Enum):
    """A prefill decision (the ``where`` label of pdkv_disagg_prefill_decisions_total)."""

    REMOTE = "remote"
    LOCAL_SHORT = "local_short"
    LOCAL_SATURATED = "local_saturated"
    LOCAL_NO_PEER = "local_no_peer"
    REFUSED_NO_PEER = "refused_no_peer"
    # server.admission shed: the expected TTFT at the least loaded prefill node is over the
    # budget (pdkv/fleet/admission.py): prefilled here, or (local_fallback false) a 503 at once
    LOCAL_SLO = "local_slo"
    REFUSED_SLO = "refused_slo"


@dataclass
class PeerRoute:
    """One prefill peer's queue as this decode node sees it (under PrefillChooser.lock)."""

    report: PrefillLoad | None = None  # its last valid heartbeat load (None: none yet, or a bad one)
    reserved: int = 0  # tokens picked for it whose PREFILL has not left yet
    sent: deque = field(default_factory=deque)  # (seq, tokens, monotonic time) not yet in a report
    num_sent: int = 0  # PREFILLs sent on its current control channel (compared with ``seen``)
    num_routed: int = 0  # PREFILLs sent to it in all
    last_pick: int = 0  # the chooser's pick count when it was last picked (ties go to the oldest)
    failed_at: float = float("-inf")  # monotonic time it last failed a request or died

    def queued(self, now: float, expiry_s: float) -> int:
        while self.sent and now - self.sent[0][2] > expiry_s:  # never reported: forget it eventually
            self.sent.popleft()
        return (self.report.queued_tokens if self.report else 0) + self.reserved + sum(s[1] for s in self.sent)


def prefix_keys(tokens: list[int], page_size: int, num_pages: int) -> list[int]:
    """A chained key per leading full page of ``tokens`` (at most ``num_pages``): key k names
    the first k+1 pages' tokens. In-process only (Python's int/tuple hash is not randomized)."""
    keys, h = [], 0
    for k in range(min(num_pages, len(tokens) // page_size)):
        h = hash((h, tuple(tokens[k * page_size:(k + 1) * page_size])))
        keys.append(h)
    return keys


class PrefillChooser:
    def __init__(self, dcfg, peers: list, page_size: int, expiry_s: float):
        """``dcfg``: the ``disagg`` config section; ``peers``: pdkv.disagg.peers.Peer list (each
        with a ``route`` PeerRoute and a ``dead`` flag); ``expiry_s``: how long a send that no
        report acknowledges still counts (the lease: a silent peer is dead by then)."""
        self.cfg, self.peers, self.page_size, self.expiry_s = dcfg, peers, page_size, expiry_s
        self.lock = threading.Lock()
        self._affinity: OrderedDict[int, int] = OrderedDict()  # prefix key -> index in peers
        self._num_picks = 0

    # ---- engine thread -------------------------------------------------------------------------
    def decide(self, num_prompt_tokens: int, num_cached_tokens: int = 0) -> Where:
        """Where a prompt of ``num_prompt_tokens`` is prefilled, ``num_cached_tokens`` of them
        held by this node's prefix cache."""
        if num_prompt_tokens - num_cached_tokens <= self.cfg.local_prefill_max_tokens or num_prompt_tokens <= 1:
            return Where.LOCAL_SHORT
        # a racy read is fine: a dead peer fails the request; a draining one gets nothing new
        live = [p for p in self.peers if not p.dead and not getattr(p, "draining", False)]
        if not live:
            return Where.LOCAL_NO_PEER if self.cfg.local_fallback else Where.REFUSED_NO_PEER
        bound = self.cfg.max_prefill_queue_tokens
        if bound is not None:
            now = time.monotonic()
            with self.lock:
                if all(p.route.queued(now, self.expiry_s) >= bound for p in live):
                    return Where.LOCAL_SATURATED
        return Where.REMOTE

    def pick(self, tokens: list[int]):
        """The peer to prefill ``tokens`` (what PREFILL carries), reserved for it; None if no
        peer is live. Call ``sent`` when its PREFILL leaves or ``unreserve`` if it does not."""
        n = len(tokens)
        keys = prefix_keys(tokens, self.page_size, self.cfg.affinity_pages)
        bound = self.cfg.max_prefill_queue_tokens
        now = time.monotonic()
        with self.lock:
            live = [i for i, p in enumerate(self.peers) if not p.dead and not getattr(p, "draining", False)]
            if not live:
                return None
            q = {i: self.peers[i].route.queued(now, self.expiry_s) for i in live}

            def rank(i: int) -> tuple:
                route = self.peers[i].route
                no_room = route.report is not None and route.report.free_pages * self.page_size < n
                failed = now - route.failed_at < self.expiry_s  # tried last for a while (it may fail again)
                return bound is not None and q[i] >= bound, no_room, failed, q[i], route.last_pick

            best = min(live, key=rank)
            held = next((self._affinity[k] for k in reversed(keys) if k in self._affinity), None)
            if held in q and rank(held)[:3] == rank(best)[:3] and q[held] <= q[best] + self.cfg.affinity_max_extra_tokens:
                best = held
            for k in keys:
                self._affinity[k] = best
                self._affinity.move_to_end(k)
            while len(self._affinity) > MAX_AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)
            peer = self.peers[best]
            self._num_picks += 1
            peer.route.reserved += n
            peer.route.last_pick = self._num_picks
            return peer

    # ---- event loop ----------------------------------------------------------------------------
    def sent(self, peer, num_tokens: int) -> None:
        """``peer``'s PREFILL of ``num_tokens`` tokens (reserved by ``pick``) left now."""
        with self.lock:
            r = peer.route
            r.reserved = max(0, r.reserved - num_tokens)
            r.num_sent += 1
            r.num_routed += 1
            r.sent.append((r.num_sent, num_tokens, time.monotonic()))

    def unreserve(self, peer, num_tokens: int) -> None:
        """What ``pick`` reserved on ``peer`` is not sent there after all."""
        with self.lock:
            peer.route.reserved = max(0, peer.route.reserved - num_tokens)

    def failed(self, peer) -> None:
        """``peer`` failed a request or died: it is tried last for ``expiry_s``."""
        with self.lock:
            peer.route.failed_at = time.monotonic()

    def report(self, peer, load: PrefillLoad | None) -> None:
        """``peer``'s heartbeat said ``load`` (None: no valid load: it is treated as reporting none)."""
        with self.lock:
            r = peer.route
            r.report = load
            while load is not None and r.sent and r.sent[0][0] <= load.seen:
                r.sent.popleft()

    def connected(self, peer) -> None:
        """``peer`` has a new control channel: its reports count PREFILLs from zero again."""
        with self.lock:
            r = peer.route
            r.report, r.num_sent = None, 0
            r.sent.clear()

    def least_queue(self) -> int:
        """The shortest queue among live peers (tokens; 0 with none): what a new prompt waits for."""
        now = time.monotonic()
        with self.lock:
            qs = [p.route.queued(now, self.expiry_s) for p in self.peers
                  if not p.dead and not getattr(p, "draining", False)]
        return min(qs, default=0)

    def snapshot(self) -> list[dict]:
        """Per peer: its queue as seen here and how many PREFILLs went to it (health, tests)."""
        now = time.monotonic()
        with self.lock:
            return [{"queued_tokens": p.route.queued(now, self.expiry_s), "routed": p.route.num_routed,
                     "reported": p.route.report is not None} for p in self.peers]
