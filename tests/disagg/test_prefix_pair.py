"""Prefix caching across the disaggregated pair (tcp, loopback, TP1 -> TP1): the decode node asks
only for what its own cache lacks (PREFILL ``cached``), the prefill node computes only what its
own cache lacks and writes only the pages the decode node lacks; greedy tokens equal a colocated
engine without prefix caching for every sharing shape, one after another and all together, and
the nodes' metrics count exactly the pages, bytes and immediates the plan says.
(TP2 -> TP1 with replica sets: tests/disagg/test_sharded.py.)"""
from __future__ import annotations

import threading
import urllib.request

import pytest

from _cluster import Cluster, make_engine, node_config, post_completion, wait_for
from pdkv.engine import SamplingParams

MAX_TOKENS = 5
A = list(range(3, 17))  # 14 tokens: 13 sent, pages 0-2 whole + 1 token of page 3 (page size 4)
# Every sharing shape with A: none, part of a page, whole pages, the whole prompt, a prompt
# whose every page before its last token is A's (the decode node holds it all: it runs locally),
# A's prefix and more.
SHAPES = {
    "none": [90] + A[1:],
    "part-page": A[:2] + [91, 92, 93, 94, 95, 96, 97],
    "whole-pages": A[:8] + [98, 99, 100, 101, 102],
    "whole-prompt": list(A),
    "all-but-last": A[:9],
    "longer": A + [104, 105, 106, 107, 108, 109],
}
PROMPTS = [A] + list(SHAPES.values())


def reference(model_dir, prompts) -> list[list[int]]:
    """Greedy tokens of a colocated engine with prefix caching off, one prompt at a time."""
    eng = make_engine(node_config(model_dir, "colocated", kv_cache__prefix_caching=False))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [eng.generate([p], params)[0].output_token_ids for p in prompts]


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name + " ") or
               x.startswith(name + "{"))


COUNTERS = ("pdkv_kv_transfer_bytes_total", "pdkv_kv_transfer_pages_total", "pdkv_kv_transfer_pages_skipped_total",
            "pdkv_kv_transfer_writes_total")


def counters(c: Cluster) -> dict:
    """Both nodes' transfer counters once both are idle again: the prefill node counts a job when it
    hears its writes completed, which may come a moment after the decode node has answered."""
    wait_for(c.pools_full, 10, "every page back in both pools")
    return {(node, n): metric(url, n) for node, url in (("decode", c.url), ("prefill", c.prefill.url))
            for n in COUNTERS}


def complete(c: Cluster, name: str, prompt: list[int]) -> list[int]:
    status, body = post_completion(c.url, {"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                           "temperature": 0, "ignore_eos": True, "return_token_ids": True}, 60)
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def record_prefills(c: Cluster) -> list[dict]:
    """Every PREFILL the decode node sends, in order (its coordinator's _send, observed)."""
    sent, send = [], c.coordinator._send

    def record(peer, msg):
        if msg["type"] == "PREFILL":
            sent.append(msg)
        send(peer, msg)
    c.coordinator._send = record
    return sent


@pytest.fixture(scope="module")
def want(tiny_model_dir):
    return reference(tiny_model_dir, PROMPTS)


@pytest.mark.parametrize("caching", [True, False], ids=["cache-on", "cache-off"])
@pytest.mark.parametrize("together", [False, True], ids=["one-by-one", "together"])
def test_greedy_tokens_equal_with_prefix_caching_on_and_off(tiny_model_dir, want, caching, together):
    over = {"kv_cache__prefix_caching": caching}
    c = Cluster(tiny_model_dir, prefill_over=over, decode_over=over)
    try:
        name = c.model_name()
        sent = record_prefills(c)
        got = [None] * len(PROMPTS)
        if together:
            complete(c, name, A)  # the shared prompt first, then every shape at once
            got[0] = complete(c, name, A)

            def run(i):
                got[i] = complete(c, name, PROMPTS[i])
            threads = [threading.Thread(target=run, args=(i,)) for i in range(1, len(PROMPTS))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
        else:
            got = [complete(c, name, p) for p in PROMPTS]
        assert got == want
        by_len = {}
        for m in sent:
            assert m["cached"] % 4 == 0 and 0 <= m["cached"] < len(m["tokens"])
            assert len(m["pages"]) == -(-len(m["tokens"]) // 4) - m["cached"] // 4
            by_len.setdefault(tuple(m["tokens"]), []).append(m["cached"])
        if not caching:
            assert all(m["cached"] == 0 for m in sent) and len(sent) == len(PROMPTS) + together
        elif not together:
            # what the decode node held when each prompt came: A's three whole pages (its fourth
            # holds A's outputs too); all-but-last needs nothing and sends no PREFILL
            assert by_len == {tuple(A[:-1]): [0, 12], tuple(SHAPES["none"][:-1]): [0],
                              tuple(SHAPES["part-page"][:-1]): [0], tuple(SHAPES["whole-pages"][:-1]): [8],
                              tuple(SHAPES["longer"][:-1]): [12]}
        wait_for(c.pools_full, 10, "every page back in both pools (cached pages count as free)")
    finally:
        c.stop()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_second_request_moves_only_the_pages_the_decode_node_lacks(tiny_model_dir, transport):
    """Two prompts sharing a 10-page prefix (page size 4), each 46 tokens (45 sent: 12 pages).
    The first moves all 12 pages; the second only pages 10 and 11, which the metrics of both
    nodes count to the byte and the immediate, and its answer equals the colocated one (shm:
    only those pages' ranges are mapped into the prefill process)."""
    prefix = [(7 * i) % 500 + 3 for i in range(40)]
    first, second = prefix + [11, 12, 13, 14, 15, 16], prefix + [21, 22, 23, 24, 25, 26]
    want = reference(tiny_model_dir, [first, second])
    over = {"messenger__transport": transport}
    c = Cluster(tiny_model_dir, prefill_over=over, decode_over=over)
    try:
        name = c.model_name()
        sent = record_prefills(c)
        granted, grant = [], c.coordinator.grants.grant

        def record_grant(peer, pages, row, seed=0):  # tcp: narrow grants, the pages the peer may write
            granted.append(sorted(pages))
            return grant(peer, pages, row, seed)
        c.coordinator.grants.grant = record_grant
        kv = c.decode_engine.kv
        L, page, hidden = kv.num_layers, kv.page_nbytes, c.coordinator.hidden_nbytes
        assert c.coordinator.peers[0].plan.expected_writes_total(1, L) == L  # TP1 -> TP1: a write per page and layer
        prefill_hits = c.prefill_engine.stats()["prefix_cache_hits"]
        before = counters(c)
        assert complete(c, name, first) == want[0]
        mid = counters(c)
        assert complete(c, name, second) == want[1]
        after = counters(c)
        assert [(m["cached"], len(m["pages"])) for m in sent] == [(0, 12), (40, 2)]
        assert granted == [sorted(m["pages"]) for m in sent]  # only the pages written, never a cached one
        assert not set(granted[1]) & set(sent[0]["pages"][:10])
        for node in ("decode", "prefill"):
            d1 = {n: mid[node, n] - before[node, n] for n in COUNTERS}
            d2 = {n: after[node, n] - mid[node, n] for n in COUNTERS}
            assert d1 == {"pdkv_kv_transfer_bytes_total": 12 * L * page + hidden, "pdkv_kv_transfer_pages_total": 12,
                          "pdkv_kv_transfer_pages_skipped_total": 0, "pdkv_kv_transfer_writes_total": 12 * L + 1}, node
            assert d2 == {"pdkv_kv_transfer_bytes_total": 2 * L * page + hidden, "pdkv_kv_transfer_pages_total": 2,
                          "pdkv_kv_transfer_pages_skipped_total": 10, "pdkv_kv_transfer_writes_total": 2 * L + 1}, node
        # the prefill node computed the shared 40 tokens once: its own cache gave them the second time
        assert c.prefill_engine.stats()["prefix_cache_hits"] - prefill_hits == 40
        wait_for(c.pools_full, 10, "every page back in both pools")
    finally:
        c.stop()


def test_prefill_node_sends_the_pages_its_own_cache_gave_it(tiny_model_dir):
    """The decode node has no cache, the prefill node has: the second time, the prefill node
    computes only the last page's tokens but still writes every page (the reused ones with its
    first chunk), and the answer is unchanged."""
    prompt = [(5 * i) % 300 + 3 for i in range(30)]
    (want,) = reference(tiny_model_dir, [prompt])
    c = Cluster(tiny_model_dir, decode_over={"kv_cache__prefix_caching": False})
    try:
        name = c.model_name()
        hits = c.prefill_engine.stats()["prefix_cache_hits"]
        before = counters(c)
        assert complete(c, name, prompt) == want
        assert complete(c, name, prompt) == want
        after = counters(c)
        assert c.prefill_engine.stats()["prefix_cache_hits"] - hits == 28  # 29 sent: 7 whole pages reused
        for node in ("decode", "prefill"):
            assert after[node, "pdkv_kv_transfer_pages_total"] - before[node, "pdkv_kv_transfer_pages_total"] == 16
            assert after[node, "pdkv_kv_transfer_pages_skipped_total"] == before[node, "pdkv_kv_transfer_pages_skipped_total"]
        wait_for(c.pools_full, 10, "every page back in both pools")
    finally:
        c.stop()


def test_pages_still_arriving_are_not_reused_until_landed(tiny_model_dir):
    """The first request's KV has landed on the decode node but the engine has not heard it yet
    (RemoteKVReady held back): a second request with the same 8-token prefix arriving meanwhile
    finds nothing cached (PREFILL cached=0); once the first is ready, a third one reuses its
    pages (cached=8). All three answer the colocated tokens."""
    import time

    from pdkv.engine.loop import RemoteKVReady

    prompts = [list(range(40, 48)) + [1, 2, 3], list(range(40, 48)) + [4, 5, 6], list(range(40, 48)) + [7, 8, 9]]
    want = reference(tiny_model_dir, prompts)
    c = Cluster(tiny_model_dir)
    try:
        name = c.model_name()
        sent = record_prefills(c)
        put, held = c.coordinator.commands, []

        def commands(cmd):
            if isinstance(cmd, RemoteKVReady) and not held:
                held.append(cmd)  # the first landing only
            else:
                put(cmd)
        c.coordinator.commands = commands
        got = [None] * 3

        def run(i):
            got[i] = complete(c, name, prompts[i])
        first = threading.Thread(target=run, args=(0,))
        first.start()
        wait_for(lambda: held, 20, "the first request's KV landed")
        second = threading.Thread(target=run, args=(1,))
        second.start()
        wait_for(lambda: len(sent) == 2, 20, "the second PREFILL sent")
        time.sleep(0.1)
        put(held[0])
        first.join(30)
        second.join(30)
        run(2)
        assert [m["cached"] for m in sent] == [0, 0, 8]
        assert got == want
        wait_for(c.pools_full, 10, "every page back in both pools")
    finally:
        c.stop()
