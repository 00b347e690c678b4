"""Where a decode node prefills, on real nodes (loopback tcp, real HTTP, real heartbeats): a
short prompt here (no PREFILL reaches the prefill node), a long one there; every prefill node
saturated: here, chunked like colocated; two prefill nodes, one busy: the other gets them all;
a heartbeat with a bad load is ignored. Greedy answers equal colocated either way."""
from __future__ import annotations

import itertools
import logging
import re
import threading
import urllib.request
from types import SimpleNamespace

import pytest

from _cluster import Cluster, assert_colocated_answer, make_engine, node_config, wait_for
from pdkv.disagg.load import PrefillLoad
from pdkv.disagg.ratelog import RateLimitedLog
from pdkv.server.app import NODE

HEAVY = 10**6  # prompt tokens a fault-injected prefill node claims to have queued


def _metrics(url: str) -> str:
    return urllib.request.urlopen(url + "/metrics").read().decode()


def decisions(url: str) -> dict[str, float]:
    """where -> count, from the decode node's pdkv_disagg_prefill_decisions_total."""
    out = {}
    for line in _metrics(url).splitlines():
        m = re.match(r'pdkv_disagg_prefill_decisions_total\{.*where="(\w+)"\} (\S+)', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def prefills_served(url: str) -> float:
    """Jobs a prefill node started (pdkv_queue_prefill_seconds_count on its /metrics)."""
    return sum(float(x.split()[-1]) for x in _metrics(url).splitlines()
               if x.startswith("pdkv_queue_prefill_seconds_count"))


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def inject_load(prefill_coordinator, make):
    """FAULT INJECTION: the prefill node's heartbeats report ``make(real_load)`` (an object with
    ``to_wire``) instead of its real load. Returns the undo."""
    real = prefill_coordinator.load_report

    def fault_injected_load_report(link):
        return make(real(link))
    prefill_coordinator.load_report = fault_injected_load_report
    return lambda: setattr(prefill_coordinator, "load_report", real)


def heavy(load: PrefillLoad) -> PrefillLoad:
    return PrefillLoad(HEAVY, load.running, load.waiting, load.free_pages, load.seen)


_SEEDS = itertools.count(100)


def _prompt(seed: int | None, n: int) -> list[int]:
    """Distinct prompts (no shared first page; None: a fresh one): the decode node's prefix cache
    never shortens one."""
    seed = next(_SEEDS) if seed is None else seed
    return [5 + (seed * 37 + i * 11) % 200 for i in range(n)]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    c = Cluster(tiny_model_dir, decode_over={"disagg__local_prefill_max_tokens": 12})
    c.name = c.model_name()
    c.pc = c.prefill.app[NODE].coordinator
    yield c
    c.stop()


def test_short_prompt_prefilled_here_long_one_there(cluster, tiny_model_dir):
    c = cluster
    d0, p0 = decisions(c.url), prefills_served(c.prefill.url)
    assert_colocated_answer(c.url, c.name, tiny_model_dir, _prompt(1, 12), 4)
    assert prefills_served(c.prefill.url) == p0  # no PREFILL reached the prefill node
    assert _delta(decisions(c.url), d0) == {"local_short": 1}
    assert_colocated_answer(c.url, c.name, tiny_model_dir, _prompt(2, 13), 4)
    assert prefills_served(c.prefill.url) == p0 + 1
    assert _delta(decisions(c.url), d0) == {"local_short": 1, "remote": 1}
    # the prefill node's heartbeats acknowledge what was sent: its queue, as seen here, is empty again
    route = c.coordinator.peers[0].route
    wait_for(lambda: route.report is not None and route.report.seen == route.num_sent >= 1, 5,
             "the prefill node's heartbeat counts every PREFILL sent on the channel")
    assert c.coordinator.chooser.snapshot()[0]["queued_tokens"] == 0  # idle, and nothing left unacknowledged
    wait_for(lambda: c.pools_full(), 10, "every page back")


def test_a_prompt_mostly_cached_here_is_prefilled_here(cluster, tiny_model_dir):
    """What counts against disagg.local_prefill_max_tokens (12 here) is the part of the prompt
    this node's prefix cache does not hold: 40 tokens go to the prefill node, and the pages that
    land are cached here (at least the 9 whole pages of the 39 tokens sent); the same 40 plus 8
    more (48 > 12, at most 12 not cached) are prefilled here, without a PREFILL, while a fresh
    48-token prompt still goes there."""
    c = cluster
    base = _prompt(None, 40)
    d0, p0 = decisions(c.url), prefills_served(c.prefill.url)
    assert_colocated_answer(c.url, c.name, tiny_model_dir, base, 4)  # remote: its pages land and are cached
    assert _delta(decisions(c.url), d0) == {"remote": 1}
    d0, p0 = decisions(c.url), prefills_served(c.prefill.url)
    assert_colocated_answer(c.url, c.name, tiny_model_dir, base + _prompt(None, 8), 4)
    assert prefills_served(c.prefill.url) == p0  # no PREFILL reached the prefill node
    assert _delta(decisions(c.url), d0) == {"local_short": 1}
    assert_colocated_answer(c.url, c.name, tiny_model_dir, _prompt(None, 48), 4)
    assert prefills_served(c.prefill.url) == p0 + 1
    assert _delta(decisions(c.url), d0) == {"local_short": 1, "remote": 1}
    wait_for(lambda: c.pools_full(), 10, "every page back")


def test_every_prefill_node_saturated_prefills_here_chunked(cluster, tiny_model_dir):
    """The prefill node reports a queue far above disagg.max_prefill_queue_tokens (fault
    injection on its heartbeats): long prompts are prefilled here, in chunks of
    scheduler.chunk_size like colocated; once it reports its real load they go there again."""
    c = cluster
    undo = inject_load(c.pc, heavy)
    chunks = []
    conn = c.coordinator.connector

    def record(batch):  # the decode engine's forward passes: (request, start, num_tokens) of prompt rows
        chunks.extend((e.request_id, e.start, e.num_tokens) for e in batch.entries
                      if e.start < e.request.num_prompt_tokens)
    conn.before_forward = record
    try:
        wait_for(lambda: c.coordinator.chooser.snapshot()[0]["queued_tokens"] >= HEAVY, 5, "the heavy load heard")
        d0, p0 = decisions(c.url), prefills_served(c.prefill.url)
        for i in range(2):
            assert_colocated_answer(c.url, c.name, tiny_model_dir, _prompt(10 + i, 40), 4)
        assert prefills_served(c.prefill.url) == p0
        assert _delta(decisions(c.url), d0) == {"local_saturated": 2}
        per_req = {}
        for rid, start, n in chunks:
            per_req.setdefault(rid, []).append((start, n))
        assert sorted(per_req.values()) == [[(0, 16), (16, 16), (32, 8)]] * 2, per_req  # chunk_size 16
    finally:
        undo()
        del conn.before_forward  # back to the class's no-op
    wait_for(lambda: c.coordinator.chooser.snapshot()[0]["queued_tokens"] < HEAVY, 5, "the real load heard")
    d0, p0 = decisions(c.url), prefills_served(c.prefill.url)
    assert_colocated_answer(c.url, c.name, tiny_model_dir, _prompt(12, 40), 4)
    assert prefills_served(c.prefill.url) == p0 + 1 and _delta(decisions(c.url), d0) == {"remote": 1}


@pytest.mark.parametrize("garbage", [
    {"queued_tokens": "lots"}, [1, 2, 3], {"seen": -5}, {"free_pages": 2**63}, "busy"])
def test_a_heartbeat_with_a_bad_load_is_ignored(cluster, tiny_model_dir, caplog, garbage):
    """FAULT INJECTION: the prefill node's heartbeats carry a malformed load. The decode node
    logs it naming the field, treats the node as reporting no load, keeps the connection and
    keeps sending it prompts."""
    c = cluster
    c.coordinator.links._rlog = RateLimitedLog(logging.getLogger("pdkv.disagg.decode"))  # each case logs afresh
    undo = inject_load(c.pc, lambda real: SimpleNamespace(to_wire=lambda: garbage))
    try:
        with caplog.at_level(logging.WARNING, logger="pdkv.disagg.decode"):
            wait_for(lambda: "ignoring the load in a heartbeat" in caplog.text, 5, "the bad load logged")
            wait_for(lambda: not c.coordinator.chooser.snapshot()[0]["reported"], 5, "the bad load ignored")
            d0, p0 = decisions(c.url), prefills_served(c.prefill.url)
            assert_colocated_answer(c.url, c.name, tiny_model_dir, _prompt(None, 30), 4)
            assert prefills_served(c.prefill.url) == p0 + 1 and _delta(decisions(c.url), d0) == {"remote": 1}
        assert "HEARTBEAT load" in caplog.text
        assert not c.coordinator.peers[0].dead
    finally:
        undo()
    wait_for(lambda: c.coordinator.chooser.snapshot()[0]["reported"], 5, "a good load heard again")


def test_a_failing_load_report_still_beats(cluster, tiny_model_dir, caplog):
    """FAULT INJECTION: the prefill node's load report raises: its heartbeats go out without a
    load (the lease holds, nothing dies) and prompts are still served there."""
    c = cluster

    def broken(real):
        raise RuntimeError("fault injection: the load report failed")
    undo = inject_load(c.pc, broken)
    try:
        with caplog.at_level(logging.ERROR, logger="pdkv.control"):
            wait_for(lambda: "heartbeat payload failed" in caplog.text, 5, "the failure logged")
        wait_for(lambda: not c.coordinator.chooser.snapshot()[0]["reported"], 5, "a heartbeat without load")
        p0 = prefills_served(c.prefill.url)
        assert_colocated_answer(c.url, c.name, tiny_model_dir, _prompt(21, 30), 4)
        assert prefills_served(c.prefill.url) == p0 + 1 and not c.coordinator.peers[0].dead
    finally:
        undo()


def test_bound_zero_always_prefills_here(tiny_model_dir):
    """disagg.max_prefill_queue_tokens: 0 saturates every prefill node by definition: no PREFILL
    is ever sent, and the metric says local_saturated."""
    c = Cluster(tiny_model_dir, decode_over={"disagg__max_prefill_queue_tokens": 0})
    try:
        name = c.model_name()
        for i in range(3):
            assert_colocated_answer(c.url, name, tiny_model_dir, _prompt(30 + i, 25), 3)
        assert prefills_served(c.prefill.url) == 0
        assert _delta(decisions(c.url), {}) == {"local_saturated": 3}
    finally:
        c.stop()


def test_two_prefill_nodes_the_busy_one_gets_nothing(tiny_model_dir):
    """Two prefill nodes; one reports a heavy queue (fault injection on its heartbeats, bound
    above it so neither is saturated): every request goes to the other one, one at a time and in
    a burst. Without the injection both serve (the load, not the order, decides), and prompts
    that share their first pages go to one node (prefix affinity)."""
    from pdkv.disagg.node import DecodeNode, PrefillNode
    from pdkv.server.runner import ServerThread

    threads = []

    def start(role, node_cls, **over):
        cfg = node_config(tiny_model_dir, role, **over)
        eng = make_engine(cfg)
        t = ServerThread(cfg, eng, node_cls(cfg, eng)).start()
        threads.append(t)
        return t

    try:
        p = [start("prefill", PrefillNode) for _ in range(2)]
        peers = [f"127.0.0.1:{t.app[NODE].control_port}" for t in p]
        d = start("decode", DecodeNode, messenger__prefill_peers=peers, disagg__max_prefill_queue_tokens=None)
        dc = d.app[NODE].coordinator
        name = dc.engine.model_name
        busy = 1  # dc.peers are in messenger.prefill_peers order: p[1]
        undo = inject_load(p[busy].app[NODE].coordinator, heavy)
        wait_for(lambda: dc.chooser.snapshot()[busy]["queued_tokens"] >= HEAVY, 5, "the heavy load heard")
        before = [prefills_served(t.url) for t in p]
        for i in range(4):
            assert_colocated_answer(d.url, name, tiny_model_dir, _prompt(40 + i, 24), 3)
        burst = [threading.Thread(target=assert_colocated_answer,
                                  args=(d.url, name, tiny_model_dir, _prompt(50 + i, 24), 3)) for i in range(4)]
        for t in burst:
            t.start()
        for t in burst:
            t.join(60)
        served = [prefills_served(t.url) - b for t, b in zip(p, before)]
        assert served[busy] == 0 and served[1 - busy] == 8, served
        assert dc.chooser.snapshot()[busy]["routed"] == 0
        undo()
        wait_for(lambda: dc.chooser.snapshot()[busy]["queued_tokens"] < HEAVY, 5, "the real load heard")
        before = [prefills_served(t.url) for t in p]
        for i in range(4):
            assert_colocated_answer(d.url, name, tiny_model_dir, _prompt(60 + i, 24), 3)
        served = [prefills_served(t.url) - b for t, b in zip(p, before)]
        assert min(served) >= 1 and sum(served) == 4, served
        # prefix affinity: prompts sharing their first disagg.affinity_pages pages (16 tokens)
        # all go to the node that prefilled the first of them (both queues are near empty)
        before = [prefills_served(t.url) for t in p]
        shared = _prompt(70, 16)
        for i in range(4):
            assert_colocated_answer(d.url, name, tiny_model_dir, shared + _prompt(71 + i, 8), 3)
        served = [prefills_served(t.url) - b for t, b in zip(p, before)]
        assert sorted(served) == [0, 4], served
    finally:
        for t in reversed(threads):
            t.stop()
