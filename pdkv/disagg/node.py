"""A disaggregated node: engine + messenger + coordinator + KV connector, started and stopped
with the app the server builds around it (server.app.build_app's ``node``).

``build_node(cfg, engine)`` picks the node of ``cfg.role``; ``kv_buffer_factory`` gives the
engine one contiguous KV buffer (registered once with the messenger). Nothing here imports the
server: the server is handed the node, and the node plugs into the engine.
"""

from __future__ import annotations

import logging
import mmap

import torch

from pdkv import auth, transports
from pdkv.disagg.decode import DecodeCoordinator
from pdkv.disagg.metrics import DisaggMetrics
from pdkv.disagg.prefill import PrefillCoordinator
from pdkv.messenger import EventPump, new_node_id, open_messenger, register_nic_metrics

log = logging.getLogger(__name__)


def kv_buffer_factory(device: str):
    """For LLMEngine(kv_buffer=...): the whole KV cache as one uint8 buffer. On a GPU it is a
    cuMem allocation (pdkv/gpu/cumem.py), as every rank's is under tensor parallelism, so it
    can be exported (and registered for GPUDirect) the same way; the tensor keeps it mapped."""
    if str(device).startswith("cuda"):
        def cumem(nbytes: int):
            from pdkv.gpu.cumem import CuMemAllocation  # noqa: PLC0415 - GPU only

            index = int(str(device).split(":", 1)[1]) if ":" in str(device) else 0
            flat = CuMemAllocation.allocate(nbytes, index).tensor()  # [nbytes] uint8 on cuda:index
            return flat.zero_()
        return cumem
    return _host_buffer


def _host_buffer(nbytes: int) -> torch.Tensor:
    """Zeroed private memory starting on an OS page (``[nbytes]`` uint8): the shm transport moves
    it onto a shared file in place, and the shared hand-off maps granted pages over whole pages
    of it (pdkv/disagg/kv_share.py); torch's own allocator aligns to 64 bytes only."""
    mm = mmap.mmap(-1, max(1, int(nbytes)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]  # NOTE: the tensor keeps mm alive


class _Node:
    def __init__(self, cfg, engine, messenger_factory=None):
        """``messenger_factory(cfg, node_id)``: a pdkv._messenger.Messenger; default: the config's
        transport (pdkv.messenger.open_messenger). Tests pass the FAKE transport for faults."""
        self.cfg, self.engine = cfg, engine
        self.messenger_factory = messenger_factory
        self.node_id = new_node_id(cfg.messenger)
        self.messenger = None
        self.pump = None
        self.secret: bytes | None = None

    def _authenticate(self) -> None:
        """The cluster secret (pdkv/auth.py); without one, refuse to listen beyond loopback unless
        messenger.insecure. AuthError (a ValueError) names what is wrong."""
        ms = self.cfg.messenger
        self.secret = auth.load_secret(ms.secret_file)
        listeners = transports.options_class(ms.transport).listeners(ms)
        if self.cfg.role == "prefill":
            listeners["messenger.control_host"] = ms.control_host
        auth.check_exposure(listeners, self.secret, ms.insecure)
        if ms.tls_data:  # the data keys derive from the authenticated session: a secret is needed
            from pdkv._messenger import HAVE_CRYPTO

            if self.secret is None:
                raise auth.AuthError("messenger.tls_data needs a cluster secret ($PDKV_CLUSTER_SECRET or "
                                     "messenger.secret_file): the data streams' keys derive from the "
                                     "authenticated control session")
            if not HAVE_CRYPTO:
                raise auth.AuthError("messenger.tls_data: pdkv was built without libcrypto (install libssl-dev "
                                     "and rebuild: make install)")
        if self.secret is None:
            log.info("node %#x: no cluster secret: control connections are not authenticated (loopback only)",
                     self.node_id)

    def _open(self, loop):
        self._authenticate()
        if self.messenger_factory is not None:
            self.messenger = self.messenger_factory(self.cfg, self.node_id)
        else:
            # every TP rank's pages leave through its own NIC (verbs): the placement needs the ranks
            # a DP group's ranks too: each lands its own requests' pages (pdkv/dp/remote.py)
            self.messenger = open_messenger(self.cfg.messenger, self.node_id,
                                            num_ranks=max(self.cfg.parallel.tp, self.cfg.parallel.dp))
        return self.messenger

    def fleet_record(self) -> dict:
        """What this node's etcd record carries beyond the server's (pdkv/fleet/drain.py): the
        model fingerprint and KV geometry HELLO checks, the transport, its NICs."""
        c = getattr(self, "coordinator", None)
        h = getattr(c, "hello", None)
        if h is None:
            return {}
        ms = self.cfg.messenger
        return {"model_fingerprint": h.model_fingerprint, "node_int_id": self.node_id,
                "kv": {"dtype": h.kv_dtype or h.dtype, "layout": h.kv_layout, "page_size": h.page_size,
                       "num_layers": h.extra.get("num_layers"), "page_nbytes": h.extra.get("page_nbytes")},
                "transport": {"name": ms.transport, "host": ms.host}, "nics": list(ms.nics),
                "parallel": dict(h.parallel)}

    async def close(self) -> None:
        """Take no more work (before the server stops the engine loop)."""
        if self.coordinator is not None:
            self.coordinator.close()

    def _close(self) -> None:
        if self.pump is not None:
            self.pump.close()
        if self.messenger is not None:
            self.messenger.close()


class DecodeNode(_Node):
    """Serves the OpenAI API (the server's AsyncEngine front-end); prompts' KV comes from
    prefill nodes through the decode connector the coordinator installs in the engine."""

    serves_api = True

    def __init__(self, cfg, engine, messenger_factory=None):
        super().__init__(cfg, engine, messenger_factory)
        self.coordinator: DecodeCoordinator | None = None
        self._commands = None

    async def start(self, metrics, loop, engine_loop) -> None:
        """``engine_loop``: the server's; its front-end is the server's AsyncEngine."""
        m = self._open(loop)
        dm = DisaggMetrics(metrics.registry, metrics._model_name, "decode")
        register_nic_metrics(metrics.registry, m, metrics._model_name, "decode")  # per NIC (verbs)
        dm.pages_pinned.set_function(lambda: metrics.engine_stats.get("num_pages_pinned", 0))
        self.coordinator = c = DecodeCoordinator(self.cfg, self.engine, m, self.node_id, dm, engine_loop.put,
                                                 secret=self.secret)
        self.pump = EventPump(m, loop, c.on_event)
        try:
            await c.start()
        except BaseException:
            self.engine.set_connector(None)
            self._close()
            raise
        self._watch_prefill()

    def _watch_prefill(self) -> None:
        """cluster.discovery etcd: prefill nodes come and go as their registrations do (still
        dialled through the authenticated handshake; pdkv/fleet/registry.py)."""
        self.watcher = None
        if self.cfg.cluster.discovery != "etcd":
            return
        from pdkv.disagg.peers import split_address  # noqa: PLC0415
        from pdkv.fleet.registry import Watcher  # noqa: PLC0415

        links = self.coordinator.links

        def changed(node_id: str, rec: dict | None) -> None:
            addr = self._addresses.get(node_id) if rec is None else rec.get("control")
            if rec is None:
                self._addresses.pop(node_id, None)
                if addr:
                    links.leave(*split_address(addr), why=f"its etcd registration ({node_id}) ended")
                return
            try:
                host, port = split_address(str(addr))
            except ValueError:
                log.warning("fleet: prefill node %s registered no usable control address (%r); ignored",
                            node_id, addr)
                return
            old = self._addresses.get(node_id)
            if old is not None and old != addr:
                links.leave(*split_address(old), why=f"{node_id} registered again at {addr}")
            self._addresses[node_id] = addr
            links.join(host, port)
            links.set_draining(host, port, rec["state"] == "draining")

        self._addresses: dict[str, str] = {}
        self.watcher = Watcher(self.cfg.cluster, "prefill", changed,
                               fingerprint=self.coordinator.hello.model_fingerprint)
        self.watcher.start()

    async def stop(self) -> None:
        if getattr(self, "watcher", None) is not None:
            await self.watcher.stop()
        if self.coordinator is not None:
            await self.coordinator.stop()
        self._close()

    def health(self) -> dict:
        c = self.coordinator
        if c is None:
            return {}
        loads = c.chooser.snapshot()  # its queue as seen here, PREFILLs sent to it
        return {"prefill_peers": [{"address": f"{p.host}:{p.port}", "connected": not p.dead, **load,
                                   **({"state": "gone" if p.gone else "draining"} if p.gone or p.draining else {}),
                                   "grants": c.held.get(p.channel.peer.node_id, 0) if p.channel else 0}
                                  for p, load in zip(c.peers, loads)],
                "transfers_in_flight": len(c.slots), "grants_held": sum(c.held.values()),
                "refused_writes": c.m.stats()["refused_writes"]}


class PrefillNode(_Node):
    """No OpenAI API: its clients are decode nodes, over the control channel. The front-end of
    the server's engine loop (pdkv.engine.loop.EngineLoop) is the prefill coordinator."""

    serves_api = False

    def __init__(self, cfg, engine, messenger_factory=None):
        super().__init__(cfg, engine, messenger_factory)
        self.coordinator: PrefillCoordinator | None = None
        self.control_port: int | None = None

    async def start(self, metrics, loop, engine_loop) -> None:
        m = self._open(loop)
        dm = DisaggMetrics(metrics.registry, metrics._model_name, "prefill")
        register_nic_metrics(metrics.registry, m, metrics._model_name, "prefill")  # per NIC (verbs)
        self.coordinator = c = PrefillCoordinator(self.cfg, self.engine, m, self.node_id, engine_loop, dm,
                                                  engine_stats=metrics.set_engine_stats, secret=self.secret)
        self.pump = EventPump(m, loop, c.on_event)
        self.control_port = await c.start()
        log.info("prefill node %#x: control listener on %s:%d", self.node_id, self.cfg.messenger.control_host,
                 self.control_port)

    async def stop(self) -> None:
        if self.coordinator is not None:
            await self.coordinator.stop()
        self._close()

    def draining(self) -> None:
        """The node drains (server/runner.py): the decode nodes connected are told over their links."""
        if self.coordinator is not None:
            self.coordinator.set_draining(True)

    def busy(self) -> int:
        """Jobs in the table (a draining prefill node leaves once it has none)."""
        return len(self.coordinator.jobs) if self.coordinator is not None else 0

    def fleet_record(self) -> dict:
        from pdkv.fleet.drain import advertised_host  # noqa: PLC0415

        rec = super().fleet_record()
        if self.control_port:
            rec["control"] = f"{advertised_host(self.cfg.messenger.control_host)}:{self.control_port}"
        return rec

    def health(self) -> dict:
        c = self.coordinator
        return {"node_id": self.node_id, "control_port": self.control_port,
                "requests": len(c.jobs) if c else 0, "decode_nodes": len(c.links) if c else 0}


def build_node(cfg, engine, messenger_factory=None):
    """The node that serves ``cfg.role`` around ``engine`` (None for colocated: the engine as it
    is). ``messenger_factory``: see _Node (tests pass the fault-injecting fake transport)."""
    if cfg.role == "prefill":
        return PrefillNode(cfg, engine, messenger_factory)
    if cfg.role == "decode":
        return DecodeNode(cfg, engine, messenger_factory=messenger_factory)
    return None
