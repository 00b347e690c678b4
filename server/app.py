"""The aiohttp application: OpenAI routes, /health, /metrics, auth and error middleware.

``build_app(cfg, engine, node)`` embeds an engine that is already loaded. The engine thread
starts with the app (``on_startup``, where the event loop is known) and stops with it
(``on_cleanup``), aborting whatever is still running so no page is left taken.

The server knows nothing about roles. It owns the one engine loop (pdkv.engine.loop.EngineLoop)
of every role: it makes it, starts it once the node is plugged in and stops it before the node.
The loop's front-end (its LoopEvents) is the AsyncEngine on a node that serves the API
(colocated, decode), the node's own on one that does not (a prefill node's coordinator). A
``node`` (built by the caller, e.g. the CLI with pdkv.disagg.node.build_node) is anything with
this shape:

    serves_api: bool        mount the OpenAI routes (and run an AsyncEngine front-end)
    async start(metrics, loop, engine_loop)  plug into the engine and its loop (commands go to
                            ``engine_loop.put``; a node that does not serve the API binds its
                            front-end with ``engine_loop.attach``)
    async close()           take no more work, before the engine loop stops (a prefill node
                            drops its decode nodes' links: their requests fail as transient)
    async stop()            after the engine loop stopped
    health() -> dict        merged into /health
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import web

from pdkv.config import Config
from pdkv.engine.loop import EngineLoop, LoopEvents
from pdkv.fleet.drain import ADMIN_HEADER, DRAINING_HEADER, Drain, admin_refusal
from pdkv.server.async_engine import AsyncEngine
from pdkv.server.errors import MAX_BODY_BYTES, error_middleware, error_response
from pdkv.server.metrics import ServerMetrics
from pdkv.server.openai_api import OpenAIRoutes

log = logging.getLogger(__name__)

CONFIG = web.AppKey("pdkv.config", Config)
ASYNC_ENGINE = web.AppKey("pdkv.async_engine", AsyncEngine)
METRICS = web.AppKey("pdkv.metrics", ServerMetrics)
NODE = web.AppKey("pdkv.node", object)  # the disaggregated node (role prefill/decode), else None
ROUTES = web.AppKey("pdkv.routes", object)  # the OpenAIRoutes (its grammars, parsers)
DRAIN = web.AppKey("pdkv.drain", Drain)  # draining: no new API requests (pdkv/fleet/drain.py)
ENGINE_LOOP = web.AppKey("pdkv.engine_loop", EngineLoop)  # the one engine thread, every role


def served_model_name(cfg: Config, engine) -> str:
    return cfg.model.served_name or engine.model_name


def _auth_middleware(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def auth(request: web.Request, handler):
        # Only the API is protected; /health and /metrics stay open to probes and scrapers
        # (as in vLLM). compare_digest: no timing hint about the key.
        if request.path.startswith("/v1/"):
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, expected):
                return error_response("missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                                      401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return auth


def _drain_middleware(drain: Drain, retry_after_s: int = 1):
    @web.middleware
    async def refuse_new(request: web.Request, handler):
        # A draining node finishes what it has and takes nothing new; the header tells a router
        # that another node can serve the request (nothing was started here).
        if drain.draining and request.path.startswith("/v1/") and request.method == "POST":
            return error_response("this node is draining (shutting down): send the request to another node", 503,
                                  code="draining", headers={"Retry-After": str(retry_after_s), DRAINING_HEADER: "1"})
        return await handler(request)

    return refuse_new


def _held_pages(engine) -> int | None:
    """Pages quarantined until no write can land in them (read from the event loop while the
    engine thread may change the table: a count one step stale is fine, a torn read is retried)."""
    for _ in range(3):
        try:
            return engine.num_held_pages
        except RuntimeError:  # the table changed size while it was summed
            continue
    return None


def build_app(cfg: Config, engine, node=None) -> web.Application:
    """An app serving ``engine`` (already loaded) with the ``server`` section of ``cfg``;
    ``node``: see the module docstring (None: the engine as it is, colocated)."""
    if node is None and cfg.role != "colocated":
        raise ValueError(f"{cfg.source}: role {cfg.role!r} needs its node (pdkv.disagg.node.build_node(cfg, "
                         f"engine)); the server only serves HTTP around it")
    serves_api = node is None or node.serves_api
    drain = Drain()
    middlewares = [error_middleware, _drain_middleware(drain)]
    if cfg.server.api_key:
        middlewares.append(_auth_middleware(cfg.server.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=cfg.server.max_body_bytes)
    name = served_model_name(cfg, engine)
    metrics = ServerMetrics(name)
    app[CONFIG] = cfg
    app[MAX_BODY_BYTES] = cfg.server.max_body_bytes
    app[METRICS] = metrics
    app[NODE] = node
    app[DRAIN] = drain
    from pdkv import auth  # noqa: PLC0415

    admin_secret = auth.load_secret(cfg.messenger.secret_file)  # AuthError names a bad file
    routes = OpenAIRoutes(None, name, cfg.model.path or "(embedded default model)", cfg.server.max_body_bytes,
                          cfg.server.max_prompts_x_n, cfg.server)
    app[ROUTES] = routes

    async def start_engine(app: web.Application) -> None:
        loop = asyncio.get_running_loop()
        engine_loop = EngineLoop(engine, LoopEvents(), name="pdkv-engine" if serves_api else "pdkv-prefill-engine",
                                 max_waiting=cfg.server.max_waiting_requests)
        aengine = AsyncEngine(engine, metrics, loop, engine_loop) if serves_api else None
        if node is not None:
            await node.start(metrics, loop, engine_loop)
        metrics.set_engine_stats(engine.stats())
        engine_loop.start()
        app[ENGINE_LOOP] = engine_loop
        if aengine is not None:
            app[ASYNC_ENGINE] = aengine
            routes.set_engine(aengine)

    async def stop_engine(app: web.Application) -> None:
        aengine, engine_loop = app.get(ASYNC_ENGINE), app.get(ENGINE_LOOP)
        if aengine is not None:
            aengine.close()  # every request of a client aborted, no new one taken
        if node is not None:
            await node.close()
        if engine_loop is not None:  # NOTE: the thread frees what is left (pages, queued requests)
            await asyncio.get_running_loop().run_in_executor(None, engine_loop.stop)
        if routes.grammars is not None:
            routes.grammars.close()
        if node is not None:
            await node.stop()

    def alive(request: web.Request) -> bool:
        engine_loop = request.app.get(ENGINE_LOOP)
        return engine_loop is not None and engine_loop.is_alive()

    async def health(request: web.Request) -> web.Response:
        if not alive(request):
            return error_response("the engine thread is not running", 503)
        if not getattr(engine, "healthy", True):  # a data-parallel group whose rank failed (pdkv/dp)
            return error_response(f"the data-parallel group failed: {engine.error}", 503)
        a = engine.allocator
        body = {"status": "ok", "model": name, "role": cfg.role, "num_pages_free": a.num_free,
                "num_pages_total": a.num_total, "num_pages_cached": a.num_evictable,
                "num_pages_held": _held_pages(engine)}
        if node is not None:
            body.update(node.health())
        body["state"] = "draining" if drain.draining else "ready"
        return web.json_response(body)

    async def load(request: web.Request) -> web.Response:
        # What a router polls (several times a second) to pick a node: a few integers, no
        # Prometheus rendering. Read from the event loop while the engine thread runs: len() and
        # list() of the scheduler's queues are atomic under the GIL; a count one step stale is fine.
        aengine = request.app.get(ASYNC_ENGINE)
        if not alive(request):
            return error_response("the engine thread is not running", 503)
        if hasattr(engine, "load_report"):  # a data-parallel group: summed, and per rank (pdkv/dp)
            return web.json_response({"role": cfg.role, **engine.load_report(
                aengine.num_in_flight if aengine is not None else 0)})
        s, a = engine.scheduler, engine.allocator
        pending = list(s.pending)  # submitted, not admitted yet: waiting too
        waiting = list(s.waiting) + pending
        body = {"role": cfg.role, "in_flight": aengine.num_in_flight if aengine is not None else 0,
                "num_running": len(s.running), "num_waiting": len(waiting) + len(s.remote),
                "num_remote": len(s.remote),  # of the waiting: for remote KV (not decode streams yet)
                "num_pending": len(pending),
                "queued_prompt_tokens": sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in waiting),
                "num_pages_free": a.num_free, "num_pages_total": a.num_total, "draining": drain.draining}
        return web.json_response(body)

    async def admin_drain(request: web.Request) -> web.Response:
        why = admin_refusal(admin_secret, request.headers.get(ADMIN_HEADER), request.remote, request.method,
                            request.path)
        if why is not None:
            return error_response(f"drain refused: {why}", 403, code="forbidden")
        started = drain.request("POST /admin/drain")
        return web.json_response({"state": "draining", "started": started}, status=202)

    async def metrics_route(request: web.Request) -> web.Response:
        body, content_type = metrics.render()
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = content_type
        return resp

    async def version(request: web.Request) -> web.Response:
        import pdkv

        return web.json_response({"version": pdkv.__version__})

    app.on_startup.append(start_engine)
    app.on_cleanup.append(stop_engine)
    app.router.add_get("/health", health)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics_route)
    app.router.add_get("/version", version)
    app.router.add_post("/admin/drain", admin_drain)
    if serves_api:
        routes.add_to(app)
    return app
