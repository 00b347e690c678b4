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

from aiohttp import web

from pdkv.app_thread import AppThread
from pdkv.config import Config
from pdkv.server.app import build_app, served_model_name
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


def serve(cfg: Config, engine, node=None) -> None:
    """Serve until SIGINT or SIGTERM, then stop the engine cleanly (``node``: see server.app)."""

    async def main() -> None:
        runner, port = await _start(cfg, engine, node)
        name = served_model_name(cfg, engine)
        log.info("pdkv %s server for model '%s' listening on http://%s:%d (OpenAI API at /v1, /health, /metrics)",
                 cfg.role, name, cfg.server.host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
            log.info("shutting down")
        finally:
            await runner.cleanup()

    asyncio.run(main())


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
