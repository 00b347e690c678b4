"""Fixtures for the server tests: a real tiny model folder, real engines, real servers on free
loopback ports. Nothing is mocked: requests go over TCP through aiohttp into the engine."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest

from pdkv.config import Config, load_config
from pdkv.tiny_model import make_tiny_model

NUM_PAGES = 512


@pytest.fixture(scope="session")
def server_model_dir(tmp_path_factory) -> Path:
    # Llama-shaped, float32, small enough that 64 concurrent streams finish in seconds on 2 cores.
    return make_tiny_model(tmp_path_factory.mktemp("server-model") / "tiny-llama", arch="llama", hidden_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=512)


def make_config(model_dir: Path, *overrides: str) -> Config:
    return load_config(None, [f"model.path={model_dir}", "server.port=0", f"kv_cache.num_pages={NUM_PAGES}",
                              "kv_cache.page_size=16", *overrides])


def make_engine(cfg: Config):
    from pdkv.engine import LLMEngine

    return LLMEngine.from_config(cfg)


class Served:
    """A running ServerThread, its engine, and helpers to talk to it."""

    def __init__(self, cfg: Config):
        from pdkv.server import ServerThread

        self.cfg = cfg
        self.engine = make_engine(cfg)
        self.pages_at_start = self.engine.allocator.num_free
        self.thread = ServerThread(cfg, self.engine).start()
        self.url = self.thread.url
        self.model = self.engine.model_name if cfg.model.served_name is None else cfg.model.served_name

    def close(self) -> None:
        self.thread.stop()

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until the engine has no unfinished request and every page is back in the pool."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.engine.allocator.num_free == self.pages_at_start and not self.engine.has_unfinished():
                return
            time.sleep(0.02)
        raise AssertionError(f"engine not idle after {timeout} s: {self.engine.allocator.num_free} of "
                             f"{self.pages_at_start} pages free, unfinished={self.engine.has_unfinished()}")


@pytest.fixture(scope="session")
def served(server_model_dir):
    s = Served(make_config(server_model_dir))
    yield s
    s.close()


@pytest.fixture(scope="session")
def reference_engine(server_model_dir):
    """A second engine on the same folder: its greedy output is what the server must stream."""
    return make_engine(make_config(server_model_dir))


def http(method: str, url: str, body=None, headers: dict | None = None, raw: bytes | None = None,
         timeout: float = 60) -> tuple[int, dict | str]:
    """One real HTTP request; returns (status, parsed JSON or text)."""
    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            async with s.request(method, url, data=data, headers=hdrs) as r:
                text = await r.text()
                try:
                    return r.status, json.loads(text)
                except json.JSONDecodeError:
                    return r.status, text
    return asyncio.run(go())


async def read_sse(resp: aiohttp.ClientResponse) -> list:
    """All ``data:`` payloads of a Server-Sent Events response, JSON-decoded, up to [DONE]."""
    events = []
    async for line in resp.content:
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            events.append("[DONE]")
            break
        events.append(json.loads(data))
    return events


def stream(url: str, path: str, body: dict, headers: dict | None = None) -> list:
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(url + path, json={**body, "stream": True}, headers=headers) as r:
                assert r.status == 200, await r.text()
                assert r.headers["Content-Type"].startswith("text/event-stream")
                return await read_sse(r)
    return asyncio.run(go())


def metric(url: str, name: str, **labels) -> float:
    """The value of one sample in /metrics (summed over samples matching ``labels``)."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = http("GET", url + "/metrics")
    assert status == 200
    total, found = 0.0, False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
                found = True
    assert found, f"{name} {labels} not in /metrics"
    return total


class _Helpers:
    """The HTTP helpers above, as a fixture (tests cannot import conftest under importlib mode)."""

    http = staticmethod(http)
    stream = staticmethod(stream)
    metric = staticmethod(metric)
    read_sse = staticmethod(read_sse)
    make_config = staticmethod(make_config)
    Served = Served


@pytest.fixture(scope="session")
def api() -> _Helpers:
    return _Helpers()


class FailingForward:
    """Makes the real model runner's ``nth`` forward pass from now raise (fault injection, not a
    mock): the engine finishes that step's requests with 'error' and frees their pages."""

    def __init__(self, engine, nth: int):
        self.engine, self.real, self.left = engine, engine.runner.execute, nth

    def __enter__(self):
        def execute(*a, **kw):
            self.left -= 1
            if self.left == 0:
                self.engine.runner.execute = self.real
                raise RuntimeError("injected forward-pass failure")
            return self.real(*a, **kw)
        self.engine.runner.execute = execute
        return self

    def __exit__(self, *exc):
        self.engine.runner.execute = self.real


@pytest.fixture
def failing_forward():
    """``failing_forward(engine, nth)``: a context in which the runner's nth forward pass raises."""
    return FailingForward
