"""pdkv's HTTP server: an aiohttp app with OpenAI-compatible endpoints around an engine.

``build_app(cfg, engine)`` makes the app; ``serve(cfg, engine)`` runs it until interrupted;
``ServerThread`` runs it on a background thread (tests, tools). They are imported on first use
so that ``server.protocol`` and ``server.errors`` load without the engine.
"""

from __future__ import annotations

__all__ = ["build_app", "serve", "ServerThread"]


def __getattr__(name: str):
    if name == "build_app":
        from pdkv.server.app import build_app

        return build_app
    if name in ("serve", "ServerThread"):
        from pdkv.server import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'server' has no attribute {name!r}")
