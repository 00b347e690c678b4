"""The decode node's prefill peers: dial, handshake, heartbeat, reader, redial (event loop).

Handshake per peer: HELLO both ways (pdkv.control), then this node's shard plan for the pair
(HandshakeRefused if the planner cannot serve it), CONNECT with the data-path info and every
rank's KV region key plus the hidden-state key, CONNECTED (or REFUSE) back. A peer that dies is
dialled again with doubling backoff up to REDIAL_MAX_S, each failure logged, so a prefill node
restarted on the same address serves again without restarting this node. What a message or a
death means for the requests is the coordinator's business (``on_message`` / ``on_dead``).
Each peer's heartbeats carry its load (pdkv/disagg/load.py): checked here and handed to the
prefill chooser (pdkv/disagg/choice.py), which says which peer a prompt goes to.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pdkv.control import ControlChannel, ControlError, HandshakeRefused
from pdkv.disagg import messages as M
from pdkv.disagg import protocol as P
from pdkv.disagg.choice import PeerRoute, PrefillChooser
from pdkv.disagg.ratelog import RateLimitedLog
from pdkv.disagg.sharded import link_pairs, plan_link
from pdkv.tls import client_context

log = logging.getLogger("pdkv.disagg.decode")  # the decode node's log, as before the split (filtered on)
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
    route: PeerRoute = field(default_factory=PeerRoute)  # its queue as seen here (the chooser's, under its lock)
    # fleet discovery (pdkv/fleet): draining: chosen for nothing new; gone: its registration
    # ended, never dialled again (the entry stays: the chooser's affinity map holds indices)
    draining: bool = False
    gone: bool = False


class PrefillPeers:
    def __init__(self, mcfg, messenger, kv, hidden_key: int, on_message, on_dead, secret: bytes | None = None,
                 dcfg=None, page_size: int = 16, spec_key: int | None = None):
        """``mcfg``: the messenger config section (prefill_peers, timeouts); ``kv``: the node's
        NodeKV; ``on_message(peer, msg)`` / ``on_dead(peer, reason)``: the coordinator's;
        ``secret``: the cluster secret each prefill peer must prove (pdkv/auth.py), or None;
        ``dcfg``: the ``disagg`` config section (the chooser's policy; None: the defaults);
        ``spec_key``: the proposer cache's region with a speculative hand-off (pdkv/disagg/spec_handoff.py)."""
        from pdkv.config import DisaggConfig  # noqa: PLC0415

        self.mcfg, self.m, self.kv, self.hidden_key = mcfg, messenger, kv, hidden_key
        self.spec_key = spec_key
        self.secret = secret
        self.tls = client_context(mcfg.tls)  # messenger.tls, or None (ConfigError names the field)
        # NOTE: Messenger.complete() may block for seconds (a data address that never answers):
        # it runs here, never on the event loop, one thread per peer at most
        self._setups = ThreadPoolExecutor(max(4, len(mcfg.prefill_peers)), thread_name_prefix="pdkv-decode-setup")
        self._on_message, self._on_dead = on_message, on_dead
        self.peers = [Peer(*split_address(p)) for p in mcfg.prefill_peers]
        self.chooser = PrefillChooser(dcfg or DisaggConfig(), self.peers, page_size, mcfg.lease_s)
        self._rlog = RateLimitedLog(log)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.hello = None
        self._stopping = False

    async def start(self, hello) -> None:
        """Dial every peer (each until connect_timeout_s); a refused handshake is raised."""
        self.loop = asyncio.get_running_loop()
        self.hello = hello
        await asyncio.gather(*(self._connect(p) for p in self.peers))

    async def _connect(self, peer: Peer, once: bool = False) -> None:
        """Dial a prefill peer until connect_timeout_s (``once``: a single try); a refused handshake
        is final and raised."""
        deadline = time.monotonic() + self.mcfg.connect_timeout_s
        while True:
            try:
                ch = await ControlChannel.connect(peer.host, peer.port, self.hello, self.mcfg.handshake_timeout_s,
                                                  secret=self.secret, max_frame=self.mcfg.max_frame_bytes,
                                                  ssl=self.tls)
                break
            except ControlError as e:
                if once or isinstance(e, HandshakeRefused) or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        conn = None
        try:
            # HandshakeRefused naming both TP degrees if the shard planner cannot serve the pair
            # a DP group's layout (a staging ring is never one's)
            dp = getattr(self.kv, "dp", None)
            plan = plan_link(self.kv.spec, "decode", ch.peer.extra, dp)
            # QPs only for the (NIC, peer NIC) pairs the plan's writes can use (None: every pair)
            conn, info = self.m.prepare(ch.peer.node_id, ch.token, pairs=link_pairs(plan, "decode", self.m,
                                                                                    ch.peer.extra, dp),
                                        data_key=ch.data_key if self.mcfg.tls_data else None,
                                        same_host=P.same_host(self.hello, ch.peer))
            # the region keys name the regions; a peer may write nothing yet: each PREFILL grants its
            # request's ranges and carries their write keys (pdkv/disagg/grants.py)
            keys, hidden_key, spec_key = self.kv.keys, self.hidden_key, self.spec_key
            await ch.send(M.Connect(info, tuple(keys), hidden_key, spec_key).to_wire())
            raw = await asyncio.wait_for(ch.recv(), self.mcfg.handshake_timeout_s)
            try:
                msg = M.parse_any(raw, {M.CONNECTED: M.Connected, M.REFUSE: M.Refuse})
            except M.MessageError as e:
                raise ControlError(f"prefill {peer.host}:{peer.port}: expected CONNECTED: {e}") from None
            if isinstance(msg, M.Refuse):  # "busy": the prefill node is full now (worth a redial)
                exc = ControlError if msg.busy else HandshakeRefused
                raise exc(f"prefill {peer.host}:{peer.port} refused: {msg.reason}")
            await self.loop.run_in_executor(self._setups, self.m.complete, conn, msg.info)
            P.log_route(self.m, conn, ch.peer.node_id, P.same_host(self.hello, ch.peer), "decode")
        except BaseException:
            ch.close()  # a half set-up connection must not stay behind (a redial tries again)
            if conn is not None:
                self.m.disconnect(conn)
            raise
        self.chooser.connected(peer)  # NOTE: before it is live: its reports count this channel's PREFILLs
        ch.on_heartbeat = lambda hb: peer.channel is ch and self._heard(peer, hb)
        peer.channel, peer.conn, peer.plan, peer.dead = ch, conn, plan, False
        # a new link: a node that is still draining says so on it at once (DRAINING), and one
        # that restarted at the same address is not draining
        peer.draining = False
        # NOTE: callbacks of this channel only act while it is the peer's current one (after a
        # redial, the old channel's reader and heartbeat must not kill the new connection)
        ch.start_heartbeat(self.mcfg.heartbeat_s, self.mcfg.lease_s,
                           lambda r: peer.channel is ch and self._on_dead(peer, r))
        self.loop.create_task(self._reader(peer, ch))
        log.info("decode: connected to prefill node %#x at %s:%d", ch.peer.node_id, peer.host, peer.port)

    async def _reader(self, peer: Peer, ch: ControlChannel) -> None:
        try:
            while not peer.dead and peer.channel is ch:
                self._on_message(peer, await ch.recv())
        except ControlError as e:
            if peer.channel is ch:
                self._on_dead(peer, str(e))

    def _heard(self, peer: Peer, hb) -> None:
        """A heartbeat of ``peer``: its load (a malformed one is logged and counts as none)."""
        try:
            load = M.PrefillLoad.parse(hb.fields.get("load"))
        except M.MessageError as e:
            self._rlog.warning(f"load:{peer.host}:{peer.port}", "decode: ignoring the load in a heartbeat of "
                               "prefill node %s:%d: %s", peer.host, peer.port, e)
            load = None
        self.chooser.report(peer, load)

    async def _redial(self, peer: Peer) -> None:
        """Dial a dead prefill peer again (e.g. restarted on the same address) with doubling
        backoff, until it answers or this node stops; each failed try is logged."""
        delay = REDIAL_FIRST_S
        try:
            while not self._stopping and peer.dead and not peer.gone:
                await asyncio.sleep(delay)
                try:
                    await self._connect(peer, once=True)
                    log.info("decode: prefill node at %s:%d is back", peer.host, peer.port)
                    return
                except Exception as e:  # noqa: BLE001 - refused, unreachable, broken set-up: try later
                    delay = min(2 * delay, REDIAL_MAX_S)
                    log.warning("decode: redial of prefill peer at %s:%d failed (%s); next try in %.1f s",
                                peer.host, peer.port, e, delay)
        finally:
            peer.redial = None

    def redial(self, peer: Peer) -> None:
        """Start dialling a dead peer again (once: a redial already running is kept)."""
        if not self._stopping and not peer.gone and peer.redial is None:
            peer.redial = self.loop.create_task(self._redial(peer))

    # ---- fleet discovery (pdkv/fleet): peers that come and go -----------------------------
    def find(self, host: str, port: int) -> Peer | None:
        return next((p for p in self.peers if p.host == host and p.port == port), None)

    def join(self, host: str, port: int) -> Peer:
        """A prefill node registered (or registered again): dial it through the authenticated
        handshake, like a redial (a refused or unreachable one is retried with backoff)."""
        peer = self.find(host, port)
        if peer is None:
            peer = Peer(host, port)
            # a node that left for good gives its place (the chooser's prefix affinity keeps
            # indices: a reused one only points a hint at the newcomer), so the list is bounded by
            # the nodes registered at once, not by every address ever seen
            free = next((i for i, p in enumerate(self.peers) if p.gone and p.dead and p.channel is None
                         and (p.redial is None or p.redial.done())), None)
            if free is not None:
                self.peers[free] = peer
            else:
                self.peers.append(peer)
            log.info("decode: prefill node at %s:%d joined", host, port)
        peer.gone = False
        peer.draining = False
        if peer.dead:
            self.redial(peer)
        return peer

    def leave(self, host: str, port: int, why: str) -> None:
        """A prefill node's registration ended: drop it (its requests fail as on a death)."""
        peer = self.find(host, port)
        if peer is None or peer.gone:
            return
        peer.gone = True
        if peer.redial is not None:
            peer.redial.cancel()
        log.info("decode: prefill node at %s:%d left (%s)", host, port, why)
        if not peer.dead or peer.channel is not None:
            self._on_dead(peer, why)

    def set_draining(self, host: str, port: int, draining: bool) -> None:
        peer = self.find(host, port)
        if peer is not None and peer.draining != draining:
            peer.draining = draining
            log.info("decode: prefill node at %s:%d is %s", host, port, "draining" if draining else "ready")

    async def stop(self) -> None:
        self._stopping = True
        self._setups.shutdown(wait=False, cancel_futures=True)
        for peer in self.peers:
            if peer.redial is not None:
                peer.redial.cancel()
            if peer.channel is not None:
                peer.dead = True
                peer.channel.close()

    def can_route(self) -> bool:  # engine thread: a racy read is fine (a dead peer fails the request)
        return any(not p.dead and not p.draining for p in self.peers)

    def live(self) -> list[Peer]:
        return [p for p in self.peers if not p.dead and not p.draining]



def split_address(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    return host, int(port)
