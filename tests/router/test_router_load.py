"""The router's choices follow what each node reports on ``GET /load`` (polled over real HTTP),
and sequential choices over equally loaded nodes rotate.

The nodes here are test-only HTTP servers (fault injection: a node whose /load says a load the
router did not cause, e.g. requests that reached it around the router) that answer /load with
what the test sets and a completion with their own name; the router, its poller and its proxy
are the real ones."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from pdkv.app_thread import AppThread
from pdkv.router import RouterThread


class ReportingNode(AppThread):
    """GET /load answers ``self.load`` (set from the test's thread: a dict swapped whole, read
    by the node's loop); POST /v1/completions answers which node it is. Its own thread and
    loop, as a node is another process to the router."""

    name, what = "reporting-node", "test node"

    def __init__(self, node: str):
        super().__init__("127.0.0.1")
        self.node, self.load = node, {"in_flight": 0}

    async def _open(self):
        app = web.Application()

        async def load(request):
            return web.json_response(self.load)

        async def complete(request):
            return web.json_response({"node": self.node})
        app.router.add_get("/load", load)
        app.router.add_post("/v1/completions", complete)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, 0)
        await site.start()
        return runner, runner.addresses[0][1]


async def _seen(session, router_url: str, want: dict[str, float], timeout: float = 10.0) -> None:
    """Until the router's /nodes shows each node's reported load as ``want`` (url -> load)."""
    end = time.monotonic() + timeout
    while True:
        async with session.get(router_url + "/nodes") as r:
            nodes = {n["url"]: n["load"] for n in await r.json()}
        if all(nodes.get(u) == load for u, load in want.items()):
            return
        assert time.monotonic() < end, (nodes, want)
        await asyncio.sleep(0.05)


async def _all_up(session, router_url: str, timeout: float = 10.0) -> None:
    """The router starts serving once one node is up: wait for all three."""
    end = time.monotonic() + timeout
    while True:
        async with session.get(router_url + "/nodes") as r:
            health = [n["health"] for n in await r.json()]
        if health == ["up"] * 3:
            return
        assert time.monotonic() < end, health
        await asyncio.sleep(0.02)


async def _choices(session, router_url: str, n: int, prompt=None) -> list[str]:
    out = []
    for i in range(n):  # one at a time: the router's own in-flight count is 0 at each choice
        body = {"prompt": prompt or f"request {i}", "max_tokens": 1}
        async with session.post(router_url + "/v1/completions", json=body) as r:
            assert r.status == 200
            out.append((await r.json())["node"])
    return out


def _with_router(rt, policy: str, body):
    nodes = [ReportingNode(f"n{i}").start() for i in range(3)]
    try:
        with RouterThread(rt.router_cfg([n.url for n in nodes], f"policy={policy}", "poll_interval_s=0.05",
                                        "balance_abs=1")) as router:
            async def main():
                async with aiohttp.ClientSession() as s:
                    await _all_up(s, router.url)
                    await body(nodes, router.url, s)
            rt.run(main())
    finally:
        for n in nodes:
            n.stop()


def test_sequential_choices_over_equally_loaded_nodes_rotate(rt):
    async def body(nodes, url, s):
        got = await _choices(s, url, 6)
        assert sorted(got[:3]) == ["n0", "n1", "n2"] and got[3:] == got[:3], got
    _with_router(rt, "least_load", body)


def test_choices_follow_the_load_each_node_reports(rt):
    async def body(nodes, url, s):
        nodes[0].load = {"num_running": 4, "num_waiting": 3}  # busy with requests not sent by the router
        await _seen(s, url, {nodes[0].url: nodes[0].load})
        got = await _choices(s, url, 4)
        assert set(got) == {"n1", "n2"}, got  # both: the rotation goes on over the idle ones
        nodes[1].load = {"in_flight": 2}
        await _seen(s, url, {nodes[1].url: nodes[1].load})
        assert await _choices(s, url, 3) == ["n2"] * 3
        nodes[0].load = nodes[1].load = {"in_flight": 0}  # reported idle again: back in the rotation
        nodes[2].load = {"num_waiting": 9}
        await _seen(s, url, {n.url: n.load for n in nodes})
        assert set(await _choices(s, url, 4)) == {"n0", "n1"}
    _with_router(rt, "least_load", body)


def test_an_affine_node_reporting_load_past_the_bound_is_passed_over(rt):
    """cache_aware: a prompt's ring node is kept while its reported load is within mean +
    balance_abs (1 here), and passed over once its report says more."""
    async def body(nodes, url, s):
        prompt = "one conversation, the same prefix every turn"
        owner = (await _choices(s, url, 3, prompt))
        assert len(set(owner)) == 1, owner  # affinity: the same node every time
        node = next(n for n in nodes if n.node == owner[0])
        node.load = {"num_running": 1}  # mean 1/3, bound 4/3: kept
        await _seen(s, url, {node.url: node.load})
        assert await _choices(s, url, 2, prompt) == owner[:2]
        node.load = {"num_running": 3}  # mean 1, bound 2: passed over
        await _seen(s, url, {node.url: node.load})
        got = await _choices(s, url, 2, prompt)
        assert owner[0] not in got, got
    _with_router(rt, "cache_aware", body)
