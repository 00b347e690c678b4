"""Landings spread over the decode node's NICs: the per-request grants (pdkv/disagg/grants.py)
are made on the NIC the request's seed picks for each decode rank.

A verbs key names a region and a NIC, and grant_range makes the range's MR on the NIC its key
names, so the write key it returns lands the peer's writes through that NIC. A decode rank near
several NICs gives RequestGrants its region's key on each (pdkv.messenger.rank_keys), and each
request's ranges are granted on ``pick_nic(seed, rank, n)``'s. The case that needs it: TP8 ->
TP1 with a replicated (MLA-like) latent, where the prefill side already spreads its sends over
its 8 NICs (tests/messenger/test_multinic.py) and the one decode rank would otherwise receive
everything through its first NIC. Both nodes are child processes on the loopback verbs device
with the DGX-H100 fixture's compute NICs; what landed where is read from the decode
messenger's per-NIC stats and from the device's own per-device rx counters.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pdkv.config import MessengerConfig
from pdkv.disagg.grants import RequestGrants
from pdkv.disagg.range_keys import RangeKeys
from pdkv.disagg.writes import Geometry, queue_chunk
from pdkv.messenger import plan_placement, rank_keys
from pdkv.shard import KVGeometry, pick_nic, plan_transfers, request_seed
from pdkv import topo

DGX = str(Path(__file__).resolve().parents[1] / "topo" / "fixtures" / "dgx-h100")

LAYERS, REQUESTS, HIDDEN = 2, 24, 256
KVG = KVGeometry(num_kv_heads=1, head_dim=64, page_size=4, dtype="float32", replicated=True, kv_parts=1)
COMPUTE = ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9")


def dgx_placement(tp: int):
    gpus = [g.bus_id for g in topo.discover(DGX).gpus][:tp]
    return plan_placement(MessengerConfig(transport="verbs", nics=("auto",)), sysfs_root=DGX, gpu_bus_ids=gpus)


@pytest.fixture
def transport():
    from pdkv._messenger import HAVE_VERBS

    if not HAVE_VERBS:
        pytest.skip("pdkv built without libibverbs")
    return "verbs"


class Remote:
    """A peer's Messenger seen through its RPCs: the calls grants.py, writes.py and
    pdkv.messenger.rank_keys make, with the peer's placement (``rank_nics``)."""

    def __init__(self, peer, rank_nics=()):
        self.peer, self.rank_nics = peer, rank_nics

    def nic_key(self, key, nic):
        return self.peer.m("nic_key", key, nic)

    def grant_range(self, *a):
        return self.peer.m("grant_range", *a)

    def revoke_range(self, *a):
        return self.peer.m("revoke_range", *a)

    def queue_pages(self, watch, target, conn, lkey, rkey, src_pages, dst_pages, **kw):
        self.peer.m("write_pages", conn, lkey, rkey, [int(x) for x in src_pages], [int(x) for x in dst_pages], **kw)


def _land(spawn, connect, decode_placement):
    """TP8 -> TP1, REQUESTS requests (one page each, its own page; its hidden row), granted per
    request as the decode node does; returns (decode peer, its NIC names, NIC index per request,
    writes per request)."""
    plan = plan_transfers(8, 1, KVG)
    page = plan.decode.page_bytes
    g = Geometry(LAYERS, page, REQUESTS * page)
    src_pl = dgx_placement(8)
    a = spawn(1, env_extra={"PDKV_LOOPBACK_NICS": ",".join(src_pl.nics)}, nics=list(src_pl.nics),
              isolate_peers=True)
    b = spawn(2, env_extra={"PDKV_LOOPBACK_NICS": ",".join(decode_placement.nics)},
              nics=list(decode_placement.nics), isolate_peers=True)
    ra, rb = Remote(a, src_pl.rank_nics), Remote(b, decode_placement.rank_nics)
    for p in range(8):
        a.alloc(f"kv{p}", LAYERS * g.layer_nbytes, seed=10 + p)
    a.alloc("hidden", REQUESTS * HIDDEN, seed=99)
    lkeys = [rank_keys(ra, a.register(f"kv{p}"), p) for p in range(8)]  # rank p on its own NIC
    src_hidden = a.register("hidden")
    b.alloc("kv0", LAYERS * g.layer_nbytes)
    b.alloc("hidden", REQUESTS * HIDDEN)
    grants = RequestGrants(rb, [rank_keys(rb, b.register("kv0"), 0)], g,
                           rank_keys(rb, b.register("hidden"), 0), HIDDEN)  # as decode.py builds them
    ca, _ = connect(a, b)
    want_kv = bytearray(LAYERS * g.layer_nbytes)
    src = [np.frombuffer(a.read(f"kv{p}"), np.uint8) for p in range(8)]
    nic_of, per_request, held = [], [], []
    for i in range(REQUESTS):
        seed, pages = request_seed(f"land-{i}"), np.asarray([i], dtype=np.int64)
        granted = grants.grant(1, pages, hidden_row=i, seed=seed)
        held.append(granted)
        keys = RangeKeys.parse(RequestGrants.write_keys(pages, granted).wire(), pages, 1, LAYERS)
        expected = LAYERS * sum(len(pair.segments) for pair in plan.active_pairs(seed)) + 1  # + the hidden row
        b.m("expect", 1000 + i, expected)
        _, writes = queue_chunk(ra, watch=0, base=0, layerwise=True, conn=ca, lkeys=lkeys, rkeys=keys, src=g,
                                dst=g, plan=plan, seed=seed, src_pages=pages, dst_pages=pages, imm=1000 + i, tag=i)
        a.m("write", ca, src_hidden, i * HIDDEN, keys.hidden, i * HIDDEN, HIDDEN, imm=1000 + i, tag=500 + i)
        assert writes + 1 == expected
        per_request.append(expected)
        nic_of.append(pick_nic(seed, 0, len(decode_placement.rank_nics[0])))
        for layer in range(LAYERS):
            for pair in plan.active_pairs(seed):
                for seg in pair.segments:
                    off = layer * g.layer_nbytes + i * page
                    s, d = off + seg.src_offset, off + seg.dst_offset
                    want_kv[d:d + seg.length] = src[pair.prefill_rank][s:s + seg.length].tobytes()
    b.wait("imm_done", count=REQUESTS, timeout=30)
    assert b.read("kv0") == bytes(want_kv)  # byte-exact, every request
    assert b.read("hidden") == a.read("hidden")
    assert b.m("stats")["refused_writes"] == 0
    for granted in held:  # revoked on the NIC each was granted on (Range.key names it)
        assert grants.revoke(1, granted) == []
    names = [decode_placement.nics[n] for n in decode_placement.rank_nics[0]]
    return b, names, nic_of, per_request


def test_tp8_to_tp1_landings_spread_over_the_decode_nics(spawn, connect):
    # a TP1 decode node with the 8 compute NICs and no GPU to go by: rank 0 is near all of them
    decode = plan_placement(MessengerConfig(transport="verbs", nics=COMPUTE), sysfs_root=DGX)
    assert decode.rank_nics == (tuple(range(8)),)
    b, names, nic_of, per_request = _land(spawn, connect, decode)
    want = Counter()
    for n, w in zip(nic_of, per_request):
        want[names[n]] += w
    imms = {s["name"]: s["imms"] for s in b.m("nic_stats")}
    rx = {n: c[2] for n, c in b.device_counters(list(decode.nics)).items()}  # the device's rx writes
    assert imms == rx == {n: want[n] for n in decode.nics}, (imms, rx)
    assert min(imms.values()) >= per_request[0], imms  # every decode NIC received some request
    assert max(imms.values()) <= 8 * per_request[0]  # 24 requests over 8 NICs: none takes a third
    landed = {s["name"]: s["imm_bytes"] for s in b.m("nic_stats")}
    assert landed == {n: c[3] for n, c in b.device_counters(list(decode.nics)).items()}


def test_one_decode_nic_lands_everything_there_as_before(spawn, connect):
    decode = dgx_placement(1)  # the decode GPU's one nearest NIC
    assert decode.rank_nics == ((0,),)
    b, names, nic_of, per_request = _land(spawn, connect, decode)
    assert names == ["mlx5_0"] and set(nic_of) == {0}
    assert {s["name"]: s["imms"] for s in b.m("nic_stats")} == {"mlx5_0": sum(per_request)}


def test_a_single_key_is_granted_on_its_own_nic_whatever_the_seed():
    """tcp and one-NIC verbs: int keys, so the seed changes nothing (the ranges are those of
    before); a tuple of per-NIC keys is picked from per rank by the request's seed."""
    g = Geometry(1, 64, 64 * 8)
    one = RequestGrants(None, [7, 8], g, 9, 32)
    assert {tuple(one.ranges([1, 2, 5], 3, seed=s)) for s in range(50)} == {tuple(one.ranges([1, 2, 5], 3))}
    assert [r.key for r in one.ranges([1], 0, seed=12345)] == [9, 7, 8]
    many = RequestGrants(None, [(10, 11, 12, 13), 20], g, (30, 31, 32, 33), 32)
    for s in (request_seed(f"x{i}") for i in range(40)):
        hidden, kv0, kv1 = (r.key for r in many.ranges([4], 1, seed=s))
        assert kv0 == 10 + pick_nic(s, 0, 4) and hidden == 30 + pick_nic(s, 0, 4) and kv1 == 20
    assert {many.ranges([4], 1, seed=request_seed(f"x{i}"))[1].key for i in range(40)} == {10, 11, 12, 13}
