"""The prefill node's control listener: decode nodes connect, authenticate, agree on a shard
plan and a data path, and each becomes a :class:`Link` whose messages go to the coordinator.

Everything a remote party can make this node hold here is bounded: connections still
handshaking and established links, each with its own budget and a cap per source address
(pdkv/disagg/control_admission.py: a stranger never takes a link's place), the
time from accept to CONNECT (handshake_timeout_s), and data-path set-ups running at once
(max_setups): ``Messenger.complete()`` connects sockets / QPs and may block for seconds (bounded
in C by the transport's connect timeout), so it runs in a set-up thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pdkv.control import ControlChannel, ControlError
from pdkv.disagg import messages as M
from pdkv.disagg import protocol as P
from pdkv.disagg.control_admission import ControlAdmission, Place
from pdkv.disagg.ratelog import RateLimitedLog
from pdkv.disagg.sharded import check_keys, dp_size, link_pairs, plan_link
from pdkv.disagg.spec_handoff import connect_fields as spec_connect_fields
from pdkv.disagg.writes import Geometry
from pdkv.shard import ShardPlan
from pdkv.tls import server_context, start_server

log = logging.getLogger(__name__)


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


class DecodeLinks:
    def __init__(self, mcfg, messenger, kv_spec, hidden_nbytes: int, handoff_on: bool, secret: bytes | None,
                 on_message, on_dead, load_report, kv_dp: dict | None = None):
        """``on_message(link, msg)``, ``on_dead(link, reason)``: the coordinator's (event loop);
        ``load_report(link)``: what each heartbeat carries; ``handoff_on``: this node streams a
        speculative hand-off (CONNECT then carries the proposer's region); ``kv_dp``: this
        node's DP layout (pdkv/disagg/sharded.py dp_layout; None: not a DP group)."""
        self.mcfg, self.m, self.kv_spec, self.hidden_nbytes = mcfg, messenger, kv_spec, hidden_nbytes
        self.handoff_on, self.secret, self.kv_dp = handoff_on, secret, kv_dp
        self._on_message, self._on_dead, self._load_report = on_message, on_dead, load_report
        self.links: list[Link] = []
        self.draining = False  # said on every link made from now on (pdkv/disagg/messages.py Draining)
        self._hello = None
        self._server: asyncio.AbstractServer | None = None
        # messenger.tls, or None; a connection is upgraded only after it was counted (see _accept)
        self.tls = server_context(mcfg.tls)
        self.admission = ControlAdmission(mcfg.max_handshakes, mcfg.max_control_conns, mcfg.max_control_per_source)
        self._setups = ThreadPoolExecutor(mcfg.max_setups, thread_name_prefix="pdkv-prefill-setup")
        self._setups_busy = 0
        self._rlog = RateLimitedLog(log)

    async def start(self, hello) -> int:
        """Listen on messenger.control_host/port; returns the port."""
        self._hello = hello
        self._server = await start_server(self._accept, self.mcfg.control_host, self.mcfg.control_port,
                                          upgrade_later=self.tls is not None)
        return self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        """Accept no more connections (the links stay until the coordinator drops them)."""
        if self._server is not None:
            self._server.close()

    def shutdown(self) -> None:
        self._setups.shutdown(wait=False, cancel_futures=True)

    async def _accept(self, reader, writer) -> None:
        """One decode node's control connection: admitted (or refused, or taking an older
        handshaking connection's place), authenticated and handshaken within
        messenger.handshake_timeout_s, then served as a link."""
        peername = writer.get_extra_info("peername") or ("?", 0)
        source = peername[0]
        task = asyncio.current_task()

        def evict():  # NOTE: only while handshaking: no data-path set-up can be running for it
            writer.transport.abort()
            task.cancel()
        ticket = self.admission.admit(source, evict)
        if isinstance(ticket, str):
            self._rlog.warning(f"refuse:{source}", "prefill: refusing a control connection from %s: %s",
                               source, ticket)
            writer.close()
            return
        try:
            await self._serve(reader, writer, source, ticket)
        except asyncio.CancelledError:
            # NOTE: only our own eviction is swallowed (Task.cancelling: Python 3.11+)
            if ticket.state is not Place.GONE or getattr(task, "cancelling", lambda: 1)() > 1:
                raise
            self._rlog.warning(f"evict:{source}", "prefill: closed a handshaking control connection from %s "
                               "to make room for a newer one (messenger.max_handshakes %d)", source,
                               self.mcfg.max_handshakes)
        finally:
            self.admission.release(ticket)

    async def _serve(self, reader, writer, source: str, ticket) -> None:
        timeout = self.mcfg.handshake_timeout_s
        ch = None
        try:
            ch = await ControlChannel.accept(reader, writer, self._hello, timeout, secret=self.secret,
                                             max_frame=self.mcfg.max_frame_bytes, ssl=self.tls)
            refused = self.admission.establish(ticket)
            if refused is not None:
                await ch.send(M.Refuse(f"prefill node is full: {refused}", busy=True).to_wire())
                raise ControlError(refused)
            try:
                plan = plan_link(self.kv_spec, "prefill", ch.peer.extra, self.kv_dp)
            except ControlError as e:  # HandshakeRefused: the shard planner cannot serve the pair
                await ch.send(M.Refuse(str(e)).to_wire())
                raise
            try:  # NOTE: a peer that said HELLO but never CONNECTs is dropped after the deadline
                msg = await asyncio.wait_for(ch.recv(), timeout)
            except asyncio.TimeoutError as e:
                raise ControlError(f"no CONNECT within {timeout} s of HELLO (messenger.handshake_timeout_s)") from e
            if msg["type"] != M.CONNECT:
                raise ControlError(f"expected CONNECT after HELLO, got {msg['type']}")
            connect = M.Connect.parse(msg, self.handoff_on)
            # one per decode rank (HandshakeRefused); a DP group: one per DP rank
            rkeys = check_keys(plan, list(connect.kv_keys), dp_size(ch.peer.extra))
            dst = _peer_geometry(ch.peer.extra)
            spec_fields = spec_connect_fields(connect.spec_key, ch.peer.extra) if self.handoff_on else None
            # QPs only for the (NIC, peer NIC) pairs the plan's writes can use (None: every pair)
            # messenger.tls_data: the data streams sealed with the session's key (HELLO agreed on it)
            conn, info = self.m.prepare(ch.peer.node_id, ch.token, pairs=link_pairs(plan, "prefill", self.m,
                                                                                    ch.peer.extra, self.kv_dp),
                                        data_key=ch.data_key if self.mcfg.tls_data else None,
                                        same_host=P.same_host(self._hello, ch.peer))
            try:
                await self._complete(conn, connect.info)
                P.log_route(self.m, conn, ch.peer.node_id, P.same_host(self._hello, ch.peer), "prefill")
            except BaseException:
                self.m.disconnect(conn)
                raise
            await ch.send(M.Connected(info).to_wire())
        except (ControlError, OSError, ValueError) as e:
            self._rlog.warning(f"setup:{source}", "prefill: decode node connection from %s refused or broken "
                               "during set-up: %s", source, e)
            if ch is not None and isinstance(e, ValueError) and not isinstance(e, ControlError):
                try:
                    await ch.send(M.Refuse(str(e)).to_wire())
                except ControlError:
                    pass
            writer.close()
            return
        link = Link(ch, conn, rkeys, connect.hidden_key, dst, self.hidden_nbytes, plan)
        if self.handoff_on:  # the handshake made sure the peer expects the hand-off
            link.spec_rkey, link.spec_dst, link.spec_num_pages = spec_fields
        self.links.append(link)
        log.info("prefill: decode node %#x connected from %s (prefill tp=%d -> decode tp=%d%s)", ch.peer.node_id,
                 source, plan.prefill.tp, plan.decode.tp, ", authenticated" if ch.authenticated else "")
        ch.start_heartbeat(self.mcfg.heartbeat_s, self.mcfg.lease_s, lambda r: self._on_dead(link, r),
                           payload=lambda: M.heartbeat_fields(self._load_report(link)))
        try:
            if self.draining:  # the decode node must not start choosing this node
                await ch.send(M.Draining().to_wire())
            while not link.dead:
                self._on_message(link, await ch.recv())
        except ControlError as e:
            self._on_dead(link, str(e))

    async def _complete(self, conn: int, info: bytes) -> None:
        """Messenger.complete in a set-up thread (the transport bounds how long it may take)."""
        if self._setups_busy >= self.mcfg.max_setups:
            raise ControlError(f"{self._setups_busy} data-path set-ups already running (messenger.max_setups)")
        self._setups_busy += 1
        try:
            await asyncio.get_running_loop().run_in_executor(self._setups, self.m.complete, conn, info)
        finally:
            self._setups_busy -= 1


def _peer_geometry(extra: dict) -> Geometry:
    """The decode node's KV byte layout from its HELLO (ValueError naming the bad field)."""
    for name in ("num_layers", "page_nbytes", "layer_nbytes"):
        v = extra.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"the decode node's HELLO extra.{name} must be a positive integer, got {v!r}")
    return Geometry(extra["num_layers"], extra["page_nbytes"], extra["layer_nbytes"])
