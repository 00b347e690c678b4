"""Running the app: in the foreground until a signal (``serve``) or on a background thread.

Both use aiohttp's ``AppRunner`` with ``handler_cancellation=True``: when a client disconnects,
aiohttp cancels its handler task, and the handler's ``finally`` aborts the engine requests —
that is how a client that walks away gets its pages returned, even while it is still waiting
for a first token and nothing is being written to it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from aiohttp import web

from pdkv.app_thread import AppThread
from pdkv.config import Config
from pdkv.server.app import ASYNC_ENGINE, DRAIN, build_app, served_model_name
from pdkv.server.conn_limits import ConnectionReaper

log = logging.getLogger(__name__)


async def _start(cfg: Config, engine, node=None) -> tuple[web.AppRunner, int]:
    app = build_app(cfg, engine, node)
    # shutdown_timeout: on SIGINT, in-flight requests get a few seconds to finish, then their
    # handlers are cancelled (which aborts them in the engine) instead of holding the exit for 60 s.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
                           keepalive_timeout=cfg.server.keepalive_timeout_s)
    reapers: list[ConnectionReaper] = []

    async def stop_reaper(_app) -> None:
        for r in reapers:
            await r.stop()
    app.on_cleanup.append(stop_reaper)
    await runner.setup()
    reapers.append(ConnectionReaper(runner.server, cfg.server.idle_timeout_s, cfg.server.max_connections))
    reapers[0].start()
    site = web.TCPSite(runner, cfg.server.host, cfg.server.port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise OSError(e.errno, f"cannot listen on {cfg.server.host}:{cfg.server.port} (server.host, server.port "
                               f"in {cfg.source}): {e.strerror}") from None
    port = runner.addresses[0][1]
    return runner, port


def serve(cfg: Config, engine, node=None) -> int:
    """Serve until SIGINT (stop now) or SIGTERM / POST /admin/drain (drain: finish what is in
    flight, deregister, stop), then stop the engine cleanly (``node``: see server.app). Returns
    the exit status: 0, or 1 when a drain ran out of cluster.drain_timeout_s with requests left."""
    from pdkv.fleet.drain import Membership  # noqa: PLC0415
    from pdkv.fleet.registry import FleetError  # noqa: PLC0415

    async def main() -> int:
        runner, port = await _start(cfg, engine, node)
        app = runner.app
        name = served_model_name(cfg, engine)
        log.info("pdkv %s server for model '%s' listening on http://%s:%d (OpenAI API at /v1, /health, /metrics)",
                 cfg.role, name, cfg.server.host, port)
        member = Membership(cfg, node, cfg.server.host, port, engine)
        try:
            await member.start()
        except FleetError as e:
            await runner.cleanup()
            raise OSError(0, f"{cfg.source}: {e}") from None
        stop = asyncio.Event()
        drain = app[DRAIN]
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, stop.set)
        # SIGTERM drains (a planned scale-in, Kubernetes' preStop); a second one stops at once
        loop.add_signal_handler(signal.SIGTERM, lambda: stop.set() if drain.draining else drain.request("SIGTERM"))
        status = 0
        try:
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(drain.requested.wait())]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if drain.draining and not stop.is_set():
                status = await _drain(cfg, app, node, member, stop)
            log.info("shutting down")
        finally:
            await member.stop()
            await runner.cleanup()
        return status

    return asyncio.run(main())


def _busy(app, node) -> int:
    """What this node still serves: API requests in flight, a prefill node's jobs."""
    aengine = app.get(ASYNC_ENGINE)
    n = aengine.num_in_flight if aengine is not None else 0
    busy = getattr(node, "busy", None)
    return n + (busy() if busy is not None else 0)


async def _drain(cfg: Config, app, node, member, stop: asyncio.Event) -> int:
    """Publish draining, give watchers drain_notice_s to stop choosing this node, then wait for
    what is in flight (bounded by drain_timeout_s); 0 when everything finished."""
    cl = cfg.cluster
    t0 = time.monotonic()
    tell = getattr(node, "draining", None)  # a prefill node tells its decode nodes over their links
    if tell is not None:
        tell()
    await member.draining()
    await asyncio.sleep(cl.drain_notice_s)
    deadline = t0 + cl.drain_timeout_s
    idle_since = None
    while not stop.is_set():
        now = time.monotonic()
        if _busy(app, node) == 0:
            # NOTE: a PREFILL already on the wire when the decode nodes saw "draining" may still
            # arrive: idle for a short while, not just once, before leaving
            idle_since = idle_since or now
            if now - idle_since >= 0.2:
                log.warning("drained in %.2f s; deregistering and stopping", now - t0)
                return 0
        else:
            idle_since = None
        if now > deadline:
            log.error("drain: %d request(s) still in flight after %.0f s (cluster.drain_timeout_s); stopping",
                      _busy(app, node), cl.drain_timeout_s)
            return 1
        await asyncio.sleep(0.05)
    return 0


class ServerThread(AppThread):
    """The server on a background thread with its own event loop (tests, tools, benchmarks).

    ``with ServerThread(cfg, engine) as srv: ... srv.url ...``; ``cfg.server.port = 0`` picks a
    free port, available as ``srv.port`` once started.
    """

    name, what = "pdkv-server", "server"

    def __init__(self, cfg: Config, engine, node=None):
        """``node``: what serves a role other than colocated (see server.app; e.g.
        pdkv.disagg.node.build_node(cfg, engine), or a node on the fault-injecting fake transport)."""
        super().__init__(cfg.server.host)
        self.cfg = cfg
        self.engine = engine
        self.node = node

    async def _open(self):
        return await _start(self.cfg, self.engine, self.node)
