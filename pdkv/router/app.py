"""The router's aiohttp application and how to run it (foreground or on a test thread).

    POST /v1/completions, /v1/chat/completions   proxied to a chosen node (pdkv.router.proxy)
    GET  /v1/models                               the first healthy node's answer
    GET  /health                                  200 while at least one node is in, else 503
    GET  /metrics                                 the router's own (pdkv.router.metrics)
    GET  /nodes                                   every node's health and last load
"""

from __future__ import annotations

import asyncio
import logging
import signal

import aiohttp
from aiohttp import web

from pdkv.app_thread import AppThread
from pdkv.config.router import RouterConfig
from pdkv.router.metrics import RouterMetrics
from pdkv.router.nodes import Node, NodePoller
from pdkv.router.policy import Policy
from pdkv.router.proxy import Proxy

log = logging.getLogger(__name__)
PROXY = web.AppKey("pdkv.router.proxy", Proxy)


def build_router_app(cfg: RouterConfig) -> web.Application:
    app = web.Application(client_max_size=cfg.max_body_bytes)
    nodes = [Node(u.rstrip("/")) for u in cfg.nodes]
    metrics = RouterMetrics()
    state: dict = {}

    async def start(app: web.Application) -> None:
        # no total limit: streams last as long as they generate; sock_connect bounds a dead host
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=cfg.poll_timeout_s * 4)
        session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                        auto_decompress=False)
        poller = NodePoller(nodes, session, cfg.poll_interval_s, cfg.poll_timeout_s, cfg.down_after_s,
                            metrics.observe_node)
        state.update(session=session, poller=poller)
        poller.start()
        state["watchers"] = _watch_nodes(cfg, nodes, poller)
        await poller.wait_first_round(cfg.poll_timeout_s + cfg.down_after_s)
        app[PROXY] = Proxy(nodes, Policy(cfg.policy, cfg.virtual_nodes, cfg.balance_abs), metrics, session,
                           cfg.affinity_prefix_chars, migration_limit=cfg.migration_limit,
                           migration_max_tokens=cfg.migration_max_tokens)

    async def stop(app: web.Application) -> None:
        for w in state.get("watchers", []):
            await w.stop()
        await state["poller"].stop()
        await state["session"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        return await request.app[PROXY].forward(request)

    async def models(request: web.Request) -> web.StreamResponse:
        proxy = request.app[PROXY]
        for node in proxy.healthy():
            try:
                async with proxy.session.get(node.url + "/v1/models", headers={
                        h: request.headers[h] for h in ("Authorization",) if h in request.headers}) as r:
                    return web.Response(body=await r.read(), status=r.status,
                                        content_type=r.content_type or "application/json")
            except (aiohttp.ClientError, OSError):
                continue
        return proxy.no_node()

    async def health(request: web.Request) -> web.Response:
        proxy = request.app[PROXY]
        body = {"status": "ok" if proxy.healthy() else "no_healthy_node",
                "num_healthy": len(proxy.healthy()), "nodes": [n.describe() for n in nodes]}
        if not proxy.healthy():
            return web.json_response(body, status=503, headers={"Retry-After": "1"})
        return web.json_response(body)

    async def nodes_route(request: web.Request) -> web.Response:
        return web.json_response([n.describe() for n in nodes])

    async def metrics_route(request: web.Request) -> web.Response:
        body, content_type = metrics.render()
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = content_type
        return resp

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/completions", forward)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/nodes", nodes_route)
    app.router.add_get("/metrics", metrics_route)
    return app


def _watch_nodes(cfg: RouterConfig, nodes: list[Node], poller: NodePoller) -> list:
    """cluster.discovery etcd: decode and colocated nodes join and leave as their registrations
    do (pdkv/fleet/registry.py); a draining one is chosen for nothing new."""
    if cfg.cluster.discovery != "etcd":
        return []
    from pdkv.fleet.registry import Watcher  # noqa: PLC0415

    static = {n.url for n in nodes}
    urls: dict[tuple[str, str], str] = {}  # (role, node id) -> its URL

    def changed(role: str, node_id: str, rec: dict | None) -> None:
        old = urls.pop((role, node_id), None)
        if old is not None and (rec is None or rec["http"].rstrip("/") != old) and old not in static:
            log.info("node %s (%s) left", old, node_id)
            poller.remove(old)
        if rec is None:
            return
        url = rec["http"].rstrip("/")
        urls[(role, node_id)] = url
        node = next((n for n in nodes if n.url == url), None)
        if node is None:
            node = Node(url)
            poller.add(node)
            log.info("node %s (%s, %s) joined", url, role, node_id)
        node.draining = rec["state"] == "draining"

    watchers = []
    for role in ("decode", "colocated"):
        w = Watcher(cfg.cluster, role, lambda node_id, rec, role=role: changed(role, node_id, rec))
        w.start()
        watchers.append(w)
    return watchers


async def _start(cfg: RouterConfig) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(build_router_app(cfg), handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise OSError(e.errno, f"cannot listen on {cfg.host}:{cfg.port} (host, port in {cfg.source}): "
                               f"{e.strerror}") from None
    return runner, runner.addresses[0][1]


def serve_router(cfg: RouterConfig) -> None:
    """Serve until SIGINT or SIGTERM."""

    async def main() -> None:
        runner, port = await _start(cfg)
        log.info("pdkv router listening on http://%s:%d in front of %d node(s): %s%s", cfg.host, port,
                 len(cfg.nodes), ", ".join(cfg.nodes),
                 " (and those registered in etcd)" if cfg.cluster.discovery == "etcd" else "")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())


class RouterThread(AppThread):
    """The router on a background thread (tests, benchmarks): ``with RouterThread(cfg) as r: r.url``."""

    name, what = "pdkv-router", "router"

    def __init__(self, cfg: RouterConfig):
        super().__init__(cfg.host)
        self.cfg = cfg

    async def _open(self):
        return await _start(self.cfg)
