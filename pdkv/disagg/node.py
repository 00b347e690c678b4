"""A disaggregated node: engine + messenger + coordinator, started and stopped with its app.

``kv_buffer_factory`` gives the engine one contiguous KV buffer (registered once with the
messenger). ``DecodeNode`` plugs into server.app.build_app (the OpenAI API); ``build_prefill_app``
is the prefill node's app (/health and /metrics only).
"""

from __future__ import annotations

import asyncio
import logging

import torch
from aiohttp import web

from pdkv.disagg.decode import DecodeCoordinator
from pdkv.disagg.decode_engine import DecodeAsyncEngine
from pdkv.disagg.metrics import DisaggMetrics
from pdkv.disagg.prefill import PrefillCoordinator
from pdkv.messenger import EventPump, new_node_id, open_messenger

log = logging.getLogger(__name__)


def kv_buffer_factory(device: str):
    """For LLMEngine(kv_buffer=...): the whole KV cache as one uint8 buffer."""
    return lambda nbytes: torch.zeros(nbytes, dtype=torch.uint8, device=device)


class _Node:
    def __init__(self, cfg, engine, messenger_factory=None):
        """``messenger_factory(cfg, node_id)``: a pdkv._messenger.Messenger; default: the config's
        transport (pdkv.messenger.open_messenger). Tests pass the FAKE transport for faults."""
        self.cfg, self.engine = cfg, engine
        self.messenger_factory = messenger_factory
        self.node_id = new_node_id(cfg.messenger)
        self.messenger = None
        self.pump = None

    def _open(self, loop):
        if self.messenger_factory is not None:
            self.messenger = self.messenger_factory(self.cfg, self.node_id)
        else:
            self.messenger = open_messenger(self.cfg.messenger, self.node_id)
        return self.messenger

    def _close(self) -> None:
        if self.pump is not None:
            self.pump.close()
        if self.messenger is not None:
            self.messenger.close()


class DecodeNode(_Node):
    """Used by server.app.build_app(cfg, engine, node=DecodeNode(cfg, engine))."""

    def __init__(self, cfg, engine, keep_hidden: bool = True, messenger_factory=None):
        super().__init__(cfg, engine, messenger_factory)
        self.keep_hidden = keep_hidden
        self.coordinator: DecodeCoordinator | None = None

    async def start(self, metrics, loop) -> DecodeAsyncEngine:
        m = self._open(loop)
        dm = DisaggMetrics(metrics.registry, metrics._model_name, "decode")
        self.coordinator = c = DecodeCoordinator(self.cfg, self.engine, m, self.node_id, dm, self.keep_hidden)
        aengine = DecodeAsyncEngine(self.engine, metrics, loop, c)
        c.aengine = aengine
        self.pump = EventPump(m, loop, c.on_event)
        try:
            await c.start()
        except BaseException:
            self._close()
            raise
        aengine.start()
        return aengine

    async def stop(self) -> None:
        if self.coordinator is not None:
            await self.coordinator.stop()
        self._close()

    def health(self) -> dict:
        c = self.coordinator
        return {"prefill_peers": [{"address": f"{p.host}:{p.port}", "connected": not p.dead} for p in c.peers],
                "transfers_in_flight": len(c.slots)} if c else {}


class PrefillNode(_Node):
    def __init__(self, cfg, engine, messenger_factory=None):
        super().__init__(cfg, engine, messenger_factory)
        self.coordinator: PrefillCoordinator | None = None
        self.control_port: int | None = None

    async def start(self, metrics, loop) -> None:
        m = self._open(loop)
        dm = DisaggMetrics(metrics.registry, metrics._model_name, "prefill")
        self.coordinator = c = PrefillCoordinator(self.cfg, self.engine, m, self.node_id, dm)
        self.pump = EventPump(m, loop, c.on_event)
        self.control_port = await c.start()
        log.info("prefill node %#x: control listener on %s:%d", self.node_id, self.cfg.messenger.control_host,
                 self.control_port)

    async def stop(self) -> None:
        if self.coordinator is not None:
            await self.coordinator.stop()
        self._close()


def build_prefill_app(cfg, engine, node: PrefillNode | None = None) -> web.Application:
    """The prefill node's HTTP face: /health (with its page pool) and /metrics."""
    from server.app import NODE
    from server.metrics import ServerMetrics

    node = node or PrefillNode(cfg, engine)
    app = web.Application()
    metrics = ServerMetrics(cfg.model.served_name or engine.model_name)
    app[NODE] = node

    async def start(app):
        await node.start(metrics, asyncio.get_running_loop())

    async def stop(app):
        await node.stop()

    async def health(request):
        c = node.coordinator
        if c is None or not c.is_alive():
            return web.json_response({"status": "error", "message": "the engine thread is not running"}, status=503)
        a = engine.allocator
        return web.json_response({"status": "ok", "role": "prefill", "node_id": node.node_id,
                                  "control_port": node.control_port, "num_pages_free": a.num_free,
                                  "num_pages_total": a.num_total, "requests": len(c.jobs),
                                  "decode_nodes": len(c.links)})

    async def metrics_route(request):
        a = engine.allocator
        metrics.set_engine_stats({"num_pages_used": a.num_used, "num_pages_total": a.num_total,
                                  "num_running": len(engine.scheduler.running),
                                  "num_waiting": len(engine.scheduler.waiting)})
        body, ctype = metrics.render()
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = ctype
        return resp

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_route)
    return app
