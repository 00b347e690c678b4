"""A client that goes away aborts its request: generation stops and its pages return to the pool."""

from __future__ import annotations

import asyncio
import time

import aiohttp

LONG = {"prompt": "The quick brown fox", "max_tokens": 480, "temperature": 0, "ignore_eos": True}


def wait_for(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_disconnect_mid_stream_aborts_and_frees_pages(api, served):
    served.wait_idle()
    aborts = api.metric(served.url, "pdkv_request_success_total", finished_reason="abort")
    gen_before = api.metric(served.url, "pdkv_generation_tokens_total")
    pages_in_use = []

    async def client():
        async with aiohttp.ClientSession() as s:
            resp = await s.post(served.url + "/v1/completions", json={**LONG, "stream": True})
            assert resp.status == 200
            n = 0
            async for line in resp.content:
                if line.startswith(b"data: "):
                    n += 1
                    if n == 3:
                        break
            pages_in_use.append(served.engine.allocator.num_used)
            resp.close()  # drop the TCP connection mid-stream, as a killed client would

    asyncio.run(client())
    assert pages_in_use[0] > 0  # the request held pages while it streamed
    served.wait_idle()  # every page back, no unfinished request
    generated = api.metric(served.url, "pdkv_generation_tokens_total") - gen_before
    assert generated < LONG["max_tokens"], "the engine kept generating for a client that left"
    assert api.metric(served.url, "pdkv_request_success_total", finished_reason="abort") == aborts + 1
    assert api.metric(served.url, "pdkv_kv_cache_pages_used") == 0


def test_disconnect_before_any_output_aborts_non_streaming_request(api, served):
    served.wait_idle()
    gen_before = api.metric(served.url, "pdkv_generation_tokens_total")
    aborts = api.metric(served.url, "pdkv_request_success_total", finished_reason="abort")

    async def client():
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(s.post(served.url + "/v1/completions", json=LONG))
            # Wait until the engine really has the request, then walk away without reading.
            while not served.engine.has_unfinished():
                await asyncio.sleep(0.005)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    asyncio.run(client())
    served.wait_idle()
    assert api.metric(served.url, "pdkv_generation_tokens_total") - gen_before < LONG["max_tokens"]
    assert api.metric(served.url, "pdkv_request_success_total", finished_reason="abort") == aborts + 1
    status, body = api.http("POST", served.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200, body
    served.wait_idle()


def test_engine_failure_is_an_error_not_a_hang(api, served, failing_forward):
    served.wait_idle()
    with failing_forward(served.engine, 1):
        status, body = api.http("POST", served.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
    assert status == 500 and body["error"]["code"] == "engine_error"
    served.wait_idle()
    with failing_forward(served.engine, 1):  # failed before its first token: an HTTP error (test_stream_errors)
        status, body = api.http("POST", served.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 4,
                                                                          "stream": True})
    assert status == 500 and body["error"]["code"] == "engine_error"
    served.wait_idle()
    assert api.metric(served.url, "pdkv_request_success_total", finished_reason="error") >= 2
    status, body = api.http("POST", served.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200, body  # the next request is served normally


def test_shutdown_with_a_stream_in_flight_frees_everything(api, server_model_dir):
    import threading

    s = api.Served(api.make_config(server_model_dir))
    got = []

    def client():
        try:
            got.append(api.stream(s.url, "/v1/completions", LONG))
        except Exception as e:  # noqa: BLE001 - the server closes the connection under us
            got.append(e)

    t = threading.Thread(target=client)
    t.start()
    wait_for(lambda: s.engine.has_unfinished())
    s.close()
    t.join(30)
    assert not t.is_alive() and got
    assert s.engine.allocator.num_free == s.pages_at_start and not s.engine.has_unfinished()
    from pdkv.server.app import ASYNC_ENGINE

    assert not s.thread._thread.is_alive() and not s.thread.app[ASYNC_ENGINE].is_alive()
