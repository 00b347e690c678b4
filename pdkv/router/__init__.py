"""The router: one OpenAI endpoint in front of several decode (or colocated) nodes.

    nodes.py     each node's health and load, polled from its GET /load
    policy.py    which node: prefix affinity on a consistent-hash ring, bounded by load
    proxy.py     forwarding a request and streaming its answer back unbuffered
    metrics.py   the router's own Prometheus metrics
    app.py       the aiohttp app; serve_router (CLI), RouterThread (tests)
"""

from pdkv.router.app import RouterThread, build_router_app, serve_router

__all__ = ["RouterThread", "build_router_app", "serve_router"]
