"""Fixtures for the router tests: three real colocated nodes (tiny model, ServerThread, free
loopback ports) and helpers to talk HTTP/SSE to them or to a router in front of them."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest

from pdkv.config import load_config
from pdkv.config.router import load_router_config
from pdkv.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def router_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("router-model") / "tiny-llama", arch="llama", hidden_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=512)


class Node:
    """A colocated node on a ServerThread (port 0: a free one, or a given one)."""

    def __init__(self, model_dir: Path, port: int = 0, *sets: str):
        """``sets``: more config overrides (``server.reasoning_parser=qwen3``)."""
        from pdkv.engine import LLMEngine
        from pdkv.server import ServerThread

        self.cfg = load_config(None, [f"model.path={model_dir}", f"server.port={port}", "kv_cache.num_pages=256",
                                      "kv_cache.page_size=16", *sets])
        self.engine = LLMEngine.from_config(self.cfg)
        self.pages_at_start = self.engine.allocator.num_free
        self.thread = ServerThread(self.cfg, self.engine).start()
        self.url = self.thread.url

    def stop(self) -> None:
        self.thread.stop()

    def wait_idle(self, timeout: float = 20.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.engine.allocator.num_free == self.pages_at_start and not self.engine.has_unfinished():
                return
            time.sleep(0.02)
        raise AssertionError(f"{self.url} not idle after {timeout} s")


@pytest.fixture(scope="session")
def nodes(router_model_dir):
    ns = [Node(router_model_dir) for _ in range(3)]
    yield ns
    for n in ns:
        n.stop()


def router_cfg(urls, *sets: str):
    return load_router_config(None, ["port=0", f"nodes=[{', '.join(urls)}]", "poll_interval_s=0.1",
                                     "poll_timeout_s=0.5", "down_after_s=1.0", *sets])


async def sse(resp: aiohttp.ClientResponse) -> list:
    """The ``data:`` payloads of an SSE response, JSON-decoded ("[DONE]" kept as a string)."""
    out = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: "):
            d = line[6:]
            out.append("[DONE]" if d == b"[DONE]" else json.loads(d))
    return out


async def post(session: aiohttp.ClientSession, url: str, body: dict, path: str = "/v1/completions"):
    """(status, node that answered, SSE events or JSON body)."""
    async with session.post(url + path, json=body) as r:
        node = r.headers.get("X-Pdkv-Node")
        if r.headers.get("Content-Type", "").startswith("text/event-stream"):
            return r.status, node, await sse(r)
        return r.status, node, await r.json()


def run(coro):
    return asyncio.run(coro)


class _Helpers:
    Node = Node
    router_cfg = staticmethod(router_cfg)
    sse = staticmethod(sse)
    post = staticmethod(post)
    run = staticmethod(run)


@pytest.fixture(scope="session")
def rt() -> _Helpers:
    """The helpers above, as a fixture (tests cannot import conftest under importlib mode)."""
    return _Helpers()
