"""Disaggregation between nodes of different tensor-parallel degrees (CPU, gloo, tcp and shm): greedy
tokens through prefill TP2 -> decode TP1, TP1 -> TP2 and TP2 -> TP2 equal the colocated TP1
engine's, also for a model with fewer KV heads than ranks (replicated KV heads, seeded choice of
the source replica set); the handshake refuses a pair the shard planner cannot serve, naming it.

One set of nodes per model for the whole module (TP2 engines start follower processes):
prefill P1 (TP1) and P2 (TP2); decode D1 (TP1, fed by P2) and D2 (TP2, fed by P1 and P2 in turn);
D3 (TP1, fed by P2) and D4 (TP2, fed by P1) with prefix caching across the pair: only the pages
the decode node lacks move, from and to every rank (each replica set's choice seeded per request).
"""
from __future__ import annotations

from pdkv.server.app import NODE

import asyncio
import dataclasses
import json
import urllib.request
from pathlib import Path

import pytest

import torch

from _cluster import colocated_kv, hold_kv_on_landing, make_engine, node_config, wait_for
from _procs import NodeProc, free_port, node_dict
from pdkv.control import ControlChannel, HandshakeRefused
from pdkv.disagg.sharded import plan_link
from pdkv.engine import LLMEngine, SamplingParams
from pdkv.shard import KVGeometry, ShardSpec

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [list(range(3, 3 + n)) for n in (2, 6, 13, 21, 34)]  # odd count: see _run_twice
MAX_TOKENS = 5


def _engine(cfg):
    # tp > 1: pdkv.tp makes (and the messenger registers) every rank's KV memory itself
    return make_engine(cfg) if cfg.parallel.tp == 1 else LLMEngine.from_config(cfg, num_threads=1)


class Nodes:
    """P1, P2 (prefill TP1/TP2), D1 (TP1 <- P2), D2 (TP2 <- P1, P2), D3 (TP1 <- P2) and D4
    (TP2 <- P1) with prefix caching on both sides; ServerThreads on loopback."""

    def __init__(self, model_dir, staging: str = "auto", transport: str = "tcp"):
        from pdkv.disagg.node import DecodeNode, PrefillNode
        from pdkv.server.runner import ServerThread

        self.threads, self.engines, self.model_dir = [], [], model_dir

        def start(role, tp, node_cls, **over):
            cfg = node_config(model_dir, role, parallel__tp=tp, parallel__timeout_s=30.0,
                              messenger__staging=staging, messenger__transport=transport, **over)
            eng = _engine(cfg)
            self.engines.append(eng)
            t = ServerThread(cfg, eng, node_cls(cfg, eng)).start()
            self.threads.append(t)
            return t

        self.p1 = start("prefill", 1, PrefillNode)
        self.p2 = start("prefill", 2, PrefillNode)
        addr = {n: f"127.0.0.1:{t.app[NODE].control_port}" for n, t in (("p1", self.p1), ("p2", self.p2))}
        # NOTE: D1 and D2 without a prefix cache of their own, so every request's KV moves (the
        # landing checks below count them); the prefill nodes keep theirs (a prompt's second run
        # reuses its pages there, and they must still arrive). D3, D4: both sides' caches on.
        off = {"kv_cache__prefix_caching": False}
        self.d1 = start("decode", 1, DecodeNode, messenger__prefill_peers=[addr["p2"]], **off)
        # no prefix affinity: a prompt repeated goes to the other peer (ties rotate), so both serve it
        self.d2 = start("decode", 2, DecodeNode, messenger__prefill_peers=[addr["p1"], addr["p2"]],
                        disagg__affinity_pages=0, **off)
        self.d3 = start("decode", 1, DecodeNode, messenger__prefill_peers=[addr["p2"]])
        self.d4 = start("decode", 2, DecodeNode, messenger__prefill_peers=[addr["p1"]])

    def close(self):
        for t in reversed(self.threads):
            t.stop()
        for e in self.engines:
            e.close()

    def pools_full(self) -> bool:
        return all(e.allocator.num_free == e.allocator.num_total for e in self.engines)


def _reference(model_dir):
    eng = make_engine(node_config(model_dir, "colocated"))
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.output_token_ids for o in outs]


def _complete(url: str, prompt: list[int]) -> list[int]:
    name = json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name))


def _run_twice(url: str) -> list[list[int]]:
    """Every prompt, one at a time, twice: a decode node with two prefill peers takes them in
    turn, and with an odd number of prompts each prompt goes through both peers."""
    got = [[_complete(url, p) for p in PROMPTS] for _ in range(2)]
    assert got[0] == got[1]
    return got[0]


@pytest.fixture(scope="module", params=[(2, "auto", "tcp"), (1, "auto", "tcp"), (2, "cpu", "tcp"),
                                        (2, "auto", "shm")],
                ids=["kv2-sharded", "kv1-replicated", "kv2-sharded-staged", "kv2-sharded-shm"])
def nodes(request, tmp_path_factory, tiny_model_dir):
    """kv2: 2 KV heads, split one per rank at TP2. kv1: 1 KV head, on both ranks at TP2 (two
    replica sets per TP2 node). staged: every rank's pages through the staging rings (CPU copy
    engine over every rank's shared KV memory; pdkv/disagg/staged.py). shm: the same pairs over
    the same-host transport (each rank's shared KV file reopened and granted range by range)."""
    kv_heads, staging, transport = request.param
    if kv_heads == 2:
        model_dir = tiny_model_dir
    else:
        from pdkv.tiny_model import make_tiny_model

        model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny_kv1"), num_kv_heads=1, seed=3)
    n = Nodes(model_dir, staging, transport)
    n.want = _reference(model_dir)
    n.want_kv = colocated_kv(model_dir, PROMPTS)
    n.num_kv_heads = kv_heads
    n.staged = staging == "cpu"
    yield n
    n.close()


@pytest.mark.parametrize("decode", ["d1", "d2"])
def test_greedy_tokens_equal_colocated_tp1(nodes, decode):
    """d1: prefill TP2 -> decode TP1; d2: prefill TP1 -> decode TP2 and TP2 -> TP2."""
    node = getattr(nodes, decode)
    c = node.app[NODE].coordinator
    assert c.kv.spec.tp == (1 if decode == "d1" else 2)
    assert len(c.kv.keys) == c.kv.spec.tp  # every rank's region is registered (staged: its landing block)
    assert (c.landing is not None) == nodes.staged
    from pdkv.tp import kv_regions

    regions = kv_regions(c.engine)
    landed = hold_kv_on_landing(c, c.engine, [r.cache for r in regions])
    routed, send = [], c._send

    def record(peer, msg):  # which prefill peer each PREFILL went to
        if msg["type"] == "PREFILL":
            routed.append(peer.port)
        send(peer, msg)
    c._send = record
    prefill_nodes = {t.app[NODE].control_port: t for t in (nodes.p1, nodes.p2)}
    before = {port: _metric(t.url, "pdkv_queue_prefill_seconds_count") for port, t in prefill_nodes.items()}
    try:
        assert _run_twice(node.url) == nodes.want
    finally:
        landed.restore()
        c._send = send
    # the KV that landed on each rank, page by page in the request's logical order, before the
    # last prompt token ran: the colocated cache's first len-1 positions of the heads that rank holds
    assert len(landed) == 2 * len(PROMPTS)
    for prompt, per_rank in landed.values():
        want = nodes.want_kv[prompt]
        for region, got in zip(regions, per_rank):
            heads = list(region.kv_heads)
            for layer, (g, w) in enumerate(zip(got, want)):
                torch.testing.assert_close(g, w[:, :len(prompt) - 1, heads], rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"rank {region.rank}, {len(prompt)}-token prompt, "
                                                         f"layer {layer}: {m}")
    # every request went to a prefill peer of this node, and each of those peers served exactly
    # the requests routed to it (with two peers: both, in turn)
    ports = sorted({p.port for p in c.peers})
    assert sorted(set(routed)) == ports and len(routed) == 2 * len(PROMPTS), routed
    for port in ports:
        served_now = _metric(prefill_nodes[port].url, "pdkv_queue_prefill_seconds_count") - before[port]
        assert served_now == routed.count(port) > 0, (port, served_now, routed)
    served = sorted((p.plan.prefill.tp, p.plan.decode.tp) for p in c.peers)
    assert served == ([(2, 1)] if decode == "d1" else [(1, 2), (2, 2)])
    if nodes.num_kv_heads == 1 and decode == "d2":
        # both sides replicate the head: two source sets, two destination sets
        assert [len(p.plan.prefill.replica_sets) for p in c.peers] == [1, 2]
        assert all(len(p.plan.decode.replica_sets) == 2 for p in c.peers)
    wait_for(nodes.pools_full, 10, "every page back in every pool")


def _counts(url: str) -> dict:
    return {n: _metric(url, n + " ") + _metric(url, n + "{") for n in
            ("pdkv_kv_transfer_bytes_total", "pdkv_kv_transfer_pages_total", "pdkv_kv_transfer_pages_skipped_total",
             "pdkv_kv_transfer_writes_total")}


@pytest.mark.parametrize("decode,prefill", [("d3", "p2"), ("d4", "p1")], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_prefix_caching_across_a_sharded_pair(nodes, decode, prefill):
    """D3 (TP1) fed by P2 (TP2), D4 (TP2) fed by P1 (TP1), prefix caching on both sides:
    prompts sharing no prefix, part of a page, whole pages and a whole prompt, one after another
    and then together, answer the colocated tokens with every landed page on every decode rank
    equal to the colocated KV of that rank's heads; then a prompt sharing a 10-page prefix with
    the one before it moves 2 of its 12 pages, to every decode rank, and both nodes count exactly
    the pages, bytes and immediates of the link's plan for those 2."""
    from concurrent.futures import ThreadPoolExecutor

    from pdkv.tp import kv_regions

    dnode, pnode = getattr(nodes, decode), getattr(nodes, prefill)
    base = list(range(200, 214)) if decode == "d3" else list(range(300, 314))
    shapes = [base, [90] + base[1:], base[:2] + [91, 92, 93, 94, 95], base[:8] + [96, 97, 98, 99],
              list(base), base[:9]]
    dc = dnode.app[NODE].coordinator
    eng = make_engine(node_config(nodes.model_dir, "colocated", kv_cache__prefix_caching=False))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = [eng.generate([p], params)[0].output_token_ids for p in shapes]
    regions = kv_regions(dc.engine)
    landed = hold_kv_on_landing(dc, dc.engine, [r.cache for r in regions])
    try:
        assert [_complete(dnode.url, p) for p in shapes] == want
        with ThreadPoolExecutor(len(shapes)) as ex:
            assert list(ex.map(lambda p: _complete(dnode.url, p), shapes)) == want
    finally:
        landed.restore()
    want_kv = colocated_kv(nodes.model_dir, shapes)
    assert landed  # (the fully cached ones ran locally: nothing landed for them)
    for prompt, per_rank in landed.values():
        for region, got in zip(regions, per_rank):
            heads = list(region.kv_heads)
            for layer, (g, w) in enumerate(zip(got, want_kv[prompt])):
                torch.testing.assert_close(g, w[:, :len(prompt) - 1, heads], rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"rank {region.rank}, {len(prompt)}-token prompt, "
                                                         f"layer {layer}: {m}")
    prefix = [(11 * i) % 400 + 5 for i in range(40)]
    first, second = prefix + [31, 32, 33, 34, 35, 36], prefix + [41, 42, 43, 44, 45, 46]
    if decode == "d4":
        first, second = [t + 1 for t in first], [t + 1 for t in second]
    want = [eng.generate([p], params)[0].output_token_ids for p in (first, second)]
    assert _complete(dnode.url, first) == want[0]
    before = {"decode": _counts(dnode.url), "prefill": _counts(pnode.url)}
    assert _complete(dnode.url, second) == want[1]
    wait_for(lambda: _counts(pnode.url)["pdkv_kv_transfer_pages_total"] > before["prefill"]["pdkv_kv_transfer_pages_total"],
             10, "the prefill node's job finished")
    (peer,) = dc.peers
    L = dc.engine.kv.num_layers
    per_page = peer.plan.expected_writes_total(1, L) // L  # writes per page and layer, all shard pairs
    assert per_page >= (2 if nodes.num_kv_heads == 2 or decode == "d4" else 1)  # two ranks on one side
    want_delta = {"pdkv_kv_transfer_bytes_total": 2 * L * sum(r.cache.page_nbytes for r in regions) + dc.hidden_nbytes,
                  "pdkv_kv_transfer_pages_total": 2, "pdkv_kv_transfer_pages_skipped_total": 10,
                  "pdkv_kv_transfer_writes_total": 2 * L * per_page + 1}
    for node, url in (("decode", dnode.url), ("prefill", pnode.url)):
        after = _counts(url)
        assert {k: after[k] - before[node][k] for k in after} == want_delta, node


def test_prefill_refuses_a_pair_the_planner_cannot_serve(nodes):
    """A decode node announcing tp=3 for 2 KV heads (kv1: another layout) gets REFUSE naming both
    TP degrees and why; the decode side's check names the pair the same way."""
    p2 = nodes.p2.app[NODE].coordinator
    good = nodes.d1.app[NODE].coordinator.hello
    g = KVGeometry.from_wire(good.extra["shard"]["geometry"])
    if nodes.num_kv_heads == 2:
        shard, why = {"tp": 3, "geometry": g.to_wire()}, "decode tp=3 cannot replicate 2 KV heads"
    else:  # any tp can replicate one head: make the geometries disagree instead
        shard, why = {"tp": 2, "geometry": {**g.to_wire(), "layout": "NHD"}}, "layout 'HND' (prefill) != 'NHD'"
    bad = dataclasses.replace(good, extra={**good.extra, "shard": shard})

    async def dial():
        ch = await ControlChannel.connect("127.0.0.1", p2.port, bad, 10.0)
        try:
            return await asyncio.wait_for(ch.recv(), 10.0)
        finally:
            ch.close()

    msg = asyncio.run(dial())
    assert msg["type"] == "REFUSE"
    assert msg["reason"].startswith(f"cannot transfer KV from prefill tp=2 to decode tp={shard['tp']}: ")
    assert why in msg["reason"], msg
    # the decode side's check, on the same pair: prefill tp=2 -> decode tp=3
    if nodes.num_kv_heads == 2:
        with pytest.raises(HandshakeRefused, match="from prefill tp=3 to decode tp=1: prefill tp=3 cannot"):
            plan_link(ShardSpec(1, g), "decode", {"shard": {"tp": 3, "geometry": g.to_wire()}})
    with pytest.raises(HandshakeRefused, match=r"from prefill tp=1 to decode tp=1: .*head_dim 32 \(prefill\)"):
        plan_link(ShardSpec(1, g), "decode", {"shard": {"tp": 1, "geometry": {**g.to_wire(), "head_dim": 32}}})
    with pytest.raises(HandshakeRefused, match="decode node sent no shard spec"):
        plan_link(ShardSpec(2, g), "prefill", {})
    # the prefill node still serves its decode nodes afterwards
    assert _complete(nodes.d1.url, PROMPTS[2]) == nodes.want[2]


@pytest.mark.slow  # four `pdkv serve` processes, two of them TP2: ~1 min
def test_greedy_tokens_equal_colocated_over_verbs(tiny_model_dir, tmp_path, loopback_verbs_dir):
    """`pdkv serve` child processes on the loopback verbs device: prefill P2 (TP2) feeds decode D1
    (TP1: two source regions rebuild each page); D2 (TP2) is fed by P1 (TP1: one page split over
    two destination regions) and P2 (region to region) in turn."""
    want = _reference(tiny_model_dir)
    env = {"LD_LIBRARY_PATH": loopback_verbs_dir}

    def proc(name, role, tp, **kw):
        d = node_dict(tiny_model_dir, role, port=free_port(), transport="verbs", nics=["lo_verbs0"], **kw)
        d["parallel"] = {"tp": tp, "timeout_s": 30.0}
        return NodeProc(tmp_path, name, d, env)

    cport2, cport1 = free_port(), free_port()
    procs = [proc("p2", "prefill", 2, control_port=cport2), proc("p1", "prefill", 1, control_port=cport1)]
    try:
        procs += [proc("d1", "decode", 1, peers=[f"127.0.0.1:{cport2}"]),
                  proc("d2", "decode", 2, peers=[f"127.0.0.1:{cport1}", f"127.0.0.1:{cport2}"])]
        for p in procs:
            p.wait_healthy(120)
        for d in procs[2:]:
            wait_for(lambda: all(peer["connected"] for peer in d.health()["prefill_peers"]), 30,
                     "every prefill peer connected")
        d1, d2 = procs[2:]
        assert [_complete(d1.url, p) for p in PROMPTS] == want, d1.log_path
        assert _run_twice(d2.url) == want, d2.log_path
        for d in procs[2:]:
            wait_for(lambda: d.health()["num_pages_free"] == d.health()["num_pages_total"], 10, "decode pages back")
        for p in procs[:2]:
            wait_for(lambda: p.health()["num_pages_free"] == p.health()["num_pages_total"], 10, "prefill pages back")
        # P1 (TP1) really fed D2 (TP2) over verbs: it sent KV bytes
        with urllib.request.urlopen(procs[1].url + "/metrics", timeout=10) as r:
            sent = [line for line in r.read().decode().splitlines()
                    if line.startswith("pdkv_kv_transfer_bytes_total{")]
        assert sent and float(sent[0].split()[-1]) > 0, sent
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.mark.slow  # two TP2 `pdkv serve` processes: ~30 s each
@pytest.mark.parametrize("staging", ["auto", "cpu"])  # cpu: out of and into the staging rings
def test_each_rank_uses_its_own_nic_between_tp2_nodes_over_verbs(tiny_model_dir, tmp_path, loopback_verbs_dir,
                                                                 staging):
    """P2 -> D2 with two loopback NICs per node (messenger.nics explicit: rank r -> NIC r): the
    answers equal the colocated ones and each node's /metrics shows both NICs carried the KV
    (rank 0's pages through lo_a, rank 1's through lo_b, on both sides) -- staged too."""
    want = _reference(tiny_model_dir)
    env = {"LD_LIBRARY_PATH": loopback_verbs_dir, "PDKV_LOOPBACK_NICS": "lo_a,lo_b"}

    def proc(name, role, **kw):
        d = node_dict(tiny_model_dir, role, port=free_port(), transport="verbs", nics=["lo_a", "lo_b"], **kw)
        d["parallel"] = {"tp": 2, "timeout_s": 30.0}
        d["messenger"]["staging"] = staging
        return NodeProc(tmp_path, name, d, env)

    cport = free_port()
    procs = [proc("p2", "prefill", control_port=cport)]
    try:
        procs.append(proc("d2", "decode", peers=[f"127.0.0.1:{cport}"]))
        for p in procs:
            p.wait_healthy(120)
        pre, dec = procs
        wait_for(lambda: all(peer["connected"] for peer in dec.health()["prefill_peers"]), 30, "prefill connected")
        assert [_complete(dec.url, p) for p in PROMPTS[:2]] == want[:2], dec.log_path

        def nic_counts(node, name):
            with urllib.request.urlopen(node.url + "/metrics", timeout=10) as r:
                lines = [line for line in r.read().decode().splitlines() if line.startswith(f"pdkv_nic_{name}_total{{")]
            return {line.split('nic="')[1].split('"')[0]: float(line.split()[-1]) for line in lines}

        sent, landed = nic_counts(pre, "writes"), nic_counts(dec, "landed_writes")
        assert set(sent) == set(landed) == {"lo_a", "lo_b"} and min(sent.values()) > 0, (sent, landed)
        # split heads, TP2 -> TP2: pair (r, r) only, so what left NIC r landed on NIC r
        assert sent == landed, (sent, landed)
        # each rank's share of every page is the same; rank 0's NIC also carries the hidden rows
        assert sent["lo_a"] - sent["lo_b"] == 2, sent
    finally:
        for p in reversed(procs):
            p.stop()
