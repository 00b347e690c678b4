"""The router as a proxy: what comes back through it is what the node sends, streamed as it is
produced; a client that leaves frees the node's request; no healthy node is a 503."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from pdkv.router import RouterThread

GREEDY = {"temperature": 0, "max_tokens": 24, "return_token_ids": True, "ignore_eos": True}


def _tokens(events: list) -> tuple[list, str]:
    ids, text = [], ""
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]
            ids += c.get("token_ids") or []
            text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return ids, text


def test_streams_through_the_router_equal_the_nodes_own(rt, nodes):
    with RouterThread(rt.router_cfg([nodes[0].url], "policy=round_robin")) as router:
        async def go():
            async with aiohttp.ClientSession() as s:
                out = []
                for path, body in (("/v1/completions", {"prompt": "Le centrali di Roma", **GREEDY}),
                                   ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Ciao"}],
                                                             **GREEDY})):
                    for stream in (True, False):
                        b = {**body, "stream": stream, "model": "tiny-llama"}
                        direct = await rt.post(s, nodes[0].url, b, path)
                        routed = await rt.post(s, router.url, b, path)
                        out.append((path, stream, direct, routed))
                return out
        for path, stream, (ds, _, direct), (rs, node, routed) in rt.run(go()):
            assert ds == rs == 200, (path, routed)
            assert node == nodes[0].url
            if stream:
                assert routed[-1] == "[DONE]" and len(routed) == len(direct)
                assert _tokens(routed) == _tokens(direct) and len(_tokens(routed)[0]) == 24
                # chunk by chunk, not only the sum
                assert [_tokens([e]) for e in routed] == [_tokens([e]) for e in direct]
            else:
                assert routed["choices"][0].get("token_ids") == direct["choices"][0].get("token_ids")
                assert routed["choices"] == direct["choices"] and routed["usage"] == direct["usage"]


def test_chunks_are_forwarded_as_they_arrive_not_at_the_end(rt, nodes):
    # The first chunk must reach the client while the node is still generating: with buffering it
    # would arrive together with the last.
    with RouterThread(rt.router_cfg([nodes[1].url])) as router:
        async def go():
            async with aiohttp.ClientSession() as s:
                body = {"prompt": "uno due tre", "temperature": 0, "max_tokens": 400, "ignore_eos": True,
                        "stream": True}
                async with s.post(router.url + "/v1/completions", json=body) as r:
                    arrivals = []
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            arrivals.append(time.perf_counter())
                    return arrivals
        arrivals = rt.run(go())
        assert len(arrivals) >= 20  # the node may put several tokens in one event when it runs ahead
        assert arrivals[-1] - arrivals[0] > 0.05, "all chunks arrived at once: the router buffered the stream"


def _aborted(url: str) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pdkv_request_success_total" and s.labels.get("finished_reason") == "abort")


def test_client_leaving_mid_stream_aborts_the_request_on_the_node(rt, nodes):
    node = nodes[2]
    aborted = _aborted(node.url)
    with RouterThread(rt.router_cfg([node.url])) as router:
        async def go():
            async with aiohttp.ClientSession() as s:
                body = {"prompt": "una storia lunga", "max_tokens": 480, "ignore_eos": True, "stream": True}
                async with s.post(router.url + "/v1/completions", json=body) as r:
                    n = 0
                    async for line in r.content:
                        n += line.startswith(b"data: ")
                        if n == 3:
                            break
        rt.run(go())
        node.wait_idle(10)  # its pages are back
        assert _aborted(node.url) == aborted + 1  # the node aborted it: it did not run to 480 tokens


def test_no_healthy_node_is_a_503_with_retry_after(rt, nodes):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with RouterThread(rt.router_cfg([dead])) as router:
        async def go():
            async with aiohttp.ClientSession() as s:
                async with s.post(router.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
                    comp = r.status, r.headers.get("Retry-After"), await r.json()
                async with s.get(router.url + "/health") as r:
                    health = r.status, await r.json()
                async with s.get(router.url + "/v1/models") as r:
                    models = r.status
                return comp, health, models
        (status, retry, body), (hstatus, hbody), mstatus = rt.run(go())
        assert status == 503 and retry == "1" and mstatus == 503
        assert body["error"]["code"] == "no_healthy_node" and dead in body["error"]["message"]
        assert hstatus == 503 and hbody["nodes"][0]["health"] == "down"


def test_models_health_metrics_and_load(rt, nodes):
    with RouterThread(rt.router_cfg([n.url for n in nodes])) as router:
        async def go():
            async with aiohttp.ClientSession() as s:
                await rt.post(s, router.url, {"prompt": "ciao", "max_tokens": 3})
                async with s.get(router.url + "/v1/models") as r:
                    models = await r.json()
                async with s.get(router.url + "/health") as r:
                    health = await r.json()
                async with s.get(router.url + "/metrics") as r:
                    metrics = await r.text()
                async with s.get(nodes[0].url + "/load") as r:
                    load = await r.json()
                return models, health, metrics, load
        models, health, metrics, load = rt.run(go())
        assert models["data"][0]["id"] == "tiny-llama"
        assert health["num_healthy"] == 3 and all(n["health"] == "up" for n in health["nodes"])
        assert 'pdkv_router_requests_total{node="' in metrics and 'outcome="ok"} 1.0' in metrics
        assert "pdkv_router_request_seconds_bucket" in metrics and "pdkv_router_node_healthy" in metrics
        assert set(load) >= {"in_flight", "num_running", "num_waiting", "queued_prompt_tokens", "num_pages_free",
                             "num_pages_total"}
        assert load["num_pages_free"] == load["num_pages_total"] == 256 and load["in_flight"] == 0
