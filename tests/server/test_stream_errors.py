"""A streaming request that fails before its first token gets the answer a non-streaming one
gets (HTTP status, Retry-After, OpenAI error JSON), not a 200 with an error event inside; once
its first chunk is out, a failure is told in-band. Real servers on 127.0.0.1, real HTTP."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import aiohttp
import pytest

from pdkv.config import config_from_dict

PROMPT = list(range(5, 45))  # 40 tokens: more than one, so a strict decode node needs a prefill node


async def _post(url: str, path: str, body: dict) -> tuple[int, dict, str, str]:
    """(status, headers, Content-Type, body text) of one real HTTP request."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.post(url + path, json=body) as r:
            return r.status, dict(r.headers), r.headers.get("Content-Type", ""), await r.text()


def _node_config(model_dir, role: str, **sections):
    d = {"role": role, "model": {"path": str(model_dir)}, "server": {"port": 0},
         "kv_cache": {"page_size": 16, "num_pages": 64},
         "messenger": {"heartbeat_s": 0.2, "lease_s": 1.5, "connect_timeout_s": 5.0}}
    for sec, over in sections.items():
        d.setdefault(sec, {}).update(over)
    return config_from_dict(d)


@pytest.fixture(scope="module")
def strict_decode(server_model_dir):
    """A decode node without local fallback whose one prefill node went away (stopped; the decode
    node keeps redialling it): every multi-token prompt is refused with 503 + Retry-After."""
    from pdkv.disagg.node import build_node, kv_buffer_factory
    from pdkv.engine import LLMEngine
    from pdkv.server.app import NODE
    from pdkv.server.runner import ServerThread

    def engine_of(cfg):
        return LLMEngine.from_config(cfg, kv_buffer=kv_buffer_factory("cpu"), num_threads=1)

    pcfg = _node_config(server_model_dir, "prefill")
    peng = engine_of(pcfg)
    pre = ServerThread(pcfg, peng, build_node(pcfg, peng)).start()
    dcfg = _node_config(server_model_dir, "decode",
                        messenger={"prefill_peers": [f"127.0.0.1:{pre.app[NODE].control_port}"]},
                        disagg={"local_prefill_max_tokens": 0, "local_fallback": False})
    engine = engine_of(dcfg)
    srv = ServerThread(dcfg, engine, build_node(dcfg, engine)).start()
    try:
        pre.stop()
        deadline = time.monotonic() + 15
        while any(p["connected"] for p in json.loads(urllib.request.urlopen(srv.url + "/health").read())["prefill_peers"]):
            assert time.monotonic() < deadline, "the decode node still sees its stopped prefill node"
            time.sleep(0.05)
        yield srv, engine
    finally:
        srv.stop()


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "tell me a long story " * 4}],
                              "max_tokens": 4}),
])
def test_stream_refused_before_its_first_token_is_the_non_streaming_503(strict_decode, path, body):
    srv, engine = strict_decode

    async def both():
        return await _post(srv.url, path, body), await _post(srv.url, path, {**body, "stream": True})
    (status, headers, ctype, text), (s_status, s_headers, s_ctype, s_text) = asyncio.run(both())
    assert status == 503 and headers.get("Retry-After") == "2", (status, headers, text)
    want = json.loads(text)
    assert "no prefill node is connected" in want["error"]["message"]
    assert want["error"]["code"] == "engine_error" and want["error"]["type"] == "service_unavailable_error"
    # the stream: the same status, header and JSON body, no event stream
    assert s_status == 503 and s_headers.get("Retry-After") == "2", (s_status, s_headers, s_text)
    assert s_ctype.startswith("application/json") and json.loads(s_text) == want
    assert engine.allocator.num_free == engine.allocator.num_total and not engine.has_unfinished()


def test_stream_failing_in_its_first_forward_is_the_non_streaming_500(api, served, failing_forward):
    served.wait_idle()
    body = {"prompt": "Hi", "max_tokens": 4, "stream": True}
    with failing_forward(served.engine, 1):
        status, headers, ctype, text = asyncio.run(_post(served.url, "/v1/completions", body))
    assert status == 500 and ctype.startswith("application/json"), (status, text)
    assert json.loads(text)["error"]["code"] == "engine_error" and "Retry-After" not in headers
    served.wait_idle()


def test_stream_failing_after_its_first_chunk_is_told_in_band(api, served, failing_forward):
    served.wait_idle()
    body = {"prompt": "Hi", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with failing_forward(served.engine, 3):  # prefill (token 1), decode (token 2), then the failure
        events = api.stream(served.url, "/v1/completions", body)  # asserts the 200 event stream
    tokens = [t for e in events[:-2] for t in e["choices"][0]["token_ids"]]
    assert len(tokens) == 2, events
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error", events
    served.wait_idle()


def test_stream_client_leaving_before_its_first_token_aborts_it(api, served):
    """The stream waits for its first event before answering: a client that leaves meanwhile
    still has its handler cancelled and its request aborted (pages back, no more tokens)."""
    import threading

    served.wait_idle()
    aborts = api.metric(served.url, "pdkv_request_success_total", finished_reason="abort")
    gen_before = api.metric(served.url, "pdkv_generation_tokens_total")
    real, entered, release = served.engine.runner.execute, threading.Event(), threading.Event()

    def held(*a, **kw):  # fault injection: the first forward pass waits until the client left
        served.engine.runner.execute = real
        entered.set()
        release.wait(30)
        return real(*a, **kw)

    async def client():
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(s.post(served.url + "/v1/completions",
                                              json={"prompt": "Hi", "max_tokens": 400, "ignore_eos": True,
                                                    "stream": True}))
            while not entered.is_set():
                await asyncio.sleep(0.005)
            task.cancel()  # no status line yet: the client walks away
            with pytest.raises(asyncio.CancelledError):
                await task
        await asyncio.sleep(0.2)  # the server sees the connection close and cancels the handler

    served.engine.runner.execute = held
    try:
        asyncio.run(client())
    finally:
        release.set()
        served.engine.runner.execute = real
    served.wait_idle()
    assert api.metric(served.url, "pdkv_request_success_total", finished_reason="abort") == aborts + 1
    assert api.metric(served.url, "pdkv_generation_tokens_total") - gen_before < 400
