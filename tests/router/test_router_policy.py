"""Choosing nodes: load spreads over three nodes; a conversation's turns land on the node that
served its first turn (hit rate measured) unless that node is overloaded."""

from __future__ import annotations

import asyncio
import collections
import random

import aiohttp

from pdkv.router import RouterThread

BODY = {"temperature": 0, "max_tokens": 48, "ignore_eos": True, "stream": True}


async def _burst(rt, url: str, prompts: list[str], concurrency: int) -> list[str]:
    """Send ``prompts`` with at most ``concurrency`` in flight; the node that served each."""
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as s:
        async def one(p: str) -> str:
            async with sem:
                status, node, events = await rt.post(s, url, {"prompt": p, **BODY})
                assert status == 200 and events[-1] == "[DONE]", events
                return node
        return await asyncio.gather(*(one(p) for p in prompts))


def _shares(served: list[str], urls: list[str]) -> list[int]:
    c = collections.Counter(served)
    return [c[u] for u in urls]


def test_load_spreads_over_three_nodes(rt, nodes):
    urls = [n.url for n in nodes]
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(["casa", "sole", "mare", "vento", "pane"]) for _ in range(8)) + f" {i}"
               for i in range(36)]
    for policy in ("cache_aware", "least_load"):
        with RouterThread(rt.router_cfg(urls, f"policy={policy}", "balance_abs=1")) as router:
            counts = _shares(rt.run(_burst(rt, router.url, prompts, concurrency=9)), urls)
        mean = sum(counts) / 3
        # stated bound: no node more than 50% above the mean share (36 requests: at most 18)
        assert max(counts) <= 1.5 * mean, (policy, counts)
        assert min(counts) > 0, (policy, counts)


def _conversation_turns(n_conv: int, n_turns: int) -> list[list[str]]:
    convs = []
    for c in range(n_conv):
        turns, text = [], f"Conversazione {c}: sei un assistente che parla di storia romana e di cucina. "
        for t in range(n_turns):
            text += f"Utente: domanda {t} sulla conversazione {c}? Assistente: risposta {t}. "
            turns.append(text)
        convs.append(turns)
    return convs


def _hit_rate(rt, url: str, convs: list[list[str]], concurrency: int) -> float:
    """Each conversation's turns in order (conversations concurrently): the fraction of later
    turns served by the node that served the conversation's first turn."""
    async def go():
        sem = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession() as s:
            async def conv(turns):
                served = []
                for p in turns:
                    async with sem:
                        status, node, _ = await rt.post(s, url, {"prompt": p, **BODY})
                        assert status == 200
                    served.append(node)
                return served
            return await asyncio.gather(*(conv(t) for t in convs))
    results = rt.run(go())
    later = [node == served[0] for served in results for node in served[1:]]
    return sum(later) / len(later)


def test_conversation_turns_land_on_the_node_holding_their_prefix(rt, nodes):
    urls = [n.url for n in nodes]
    convs = _conversation_turns(6, 4)
    # The load bound is out of reach: this measures affinity (the bound has its own test below).
    # A node's /load counts a request until its engine step ends, after its stream did, so on a
    # loaded machine even 3 in flight can pass the default bound and divert a first turn.
    with RouterThread(rt.router_cfg(urls, "policy=cache_aware", "affinity_prefix_chars=64",
                                    "balance_abs=1000")) as router:
        affine = _hit_rate(rt, router.url, convs, concurrency=3)
    # The baseline goes one request at a time, turn by turn across 4 conversations: with
    # conversations in flight concurrently, round robin can alias (3 conversations taking turns
    # in a fixed order each meet "their" node every time, a hit rate of 1 that says nothing).
    # Sequentially, turn t of conversation c is request 4t + c and goes to node (t + c) mod 3.
    with RouterThread(rt.router_cfg(urls, "policy=round_robin")) as router:
        rr = _sequential_hit_rate(rt, router.url, convs[:4])
    print(f"prefix hit rate: cache_aware {affine:.2f}, round_robin {rr:.2f}")
    assert affine == 1.0  # light load: every later turn where its prefix is
    assert rr < 0.7  # 1/3 with all three nodes healthy: the measurement can tell


def _sequential_hit_rate(rt, url: str, convs: list[list[str]]) -> float:
    """Like :func:`_hit_rate`, one request at a time: every conversation's turn t, then turn t + 1."""
    async def go():
        served = [[] for _ in convs]
        async with aiohttp.ClientSession() as s:
            for t in range(len(convs[0])):
                for c, turns in enumerate(convs):
                    status, node, _ = await rt.post(s, url, {"prompt": turns[t], **BODY})
                    assert status == 200
                    served[c].append(node)
        return served
    results = rt.run(go())
    later = [node == served[0] for served in results for node in served[1:]]
    return sum(later) / len(later)


def test_an_overloaded_affine_node_is_passed_over(rt, nodes):
    # 24 requests all sharing one prefix, 12 at a time: affinity alone would put all on one node;
    # the load bound (mean + 1) sends the excess elsewhere.
    urls = [n.url for n in nodes]
    same = [f"Lo stesso inizio per tutti, molto lungo e ripetuto per ogni richiesta. domanda {i}" for i in range(24)]
    with RouterThread(rt.router_cfg(urls, "policy=cache_aware", "affinity_prefix_chars=48",
                                    "balance_abs=1")) as router:
        counts = _shares(rt.run(_burst(rt, router.url, same, concurrency=12)), urls)
        import urllib.request

        metrics = urllib.request.urlopen(router.url + "/metrics", timeout=10).read().decode()
    assert sorted(counts)[1] > 0, counts  # at least two nodes served them
    assert max(counts) < 24
    assert 'pdkv_router_choices_total{choice="overloaded"}' in metrics
