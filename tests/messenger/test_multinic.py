"""Every NIC in use: one verbs transport over several devices (pdkv/csrc/verbs_multi.h).

Two nodes shaped like the DGX-H100 fixture (tests/topo/fixtures/dgx-h100: 8 GPUs, each with a
ConnectX-7 under its PCIe switch) run as child processes on the loopback verbs device with the
8 compute NICs the topology gives the 8 GPUs. Each rank's region key names the NIC its GPU is
nearest to (pdkv.messenger.plan_placement + rank_key); the writes are the shard plan's
(pdkv.shard) page segments, posted through the real transport and the real device. What each
NIC carried is read twice: from the messenger's per-NIC stats and from the device's own
counters (pdkv_loopback_counters: the port counters, kept by the loopback device), on the
sending and on the receiving node.

The tests of what any multi-device transport does (pairs made only where asked, writes routed
by their keys' devices, each rank through its own device) also run over libfabric's tcp;ofi_rxm
(csrc/fabric_link.c), and over it again under the FI_MR_ENDPOINT test double (mrep_double,
fabrics.py: several endpoints in one peer domain, each MR bound to each): its "lo" domain is listed under two fabrics, 127.0.0.1/32 and ::1/128,
which are two real domains (``lo@127.0.0.1/32``, ``lo@::1/128``: an endpoint of one cannot
reach the other's, so their writes use the pairs (0, 0) and (1, 1) only); where a test needs
cross pairs the same domain is opened twice under two names (``lo``, ``lo@127.0.0.1/32``).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pdkv.config import MessengerConfig
from pdkv.messenger import plan_placement
from pdkv.shard import KVGeometry, pick_nic, plan_transfers, request_seed
from pdkv import topo
from fabrics import fabric_params

DGX = str(Path(__file__).resolve().parents[1] / "topo" / "fixtures" / "dgx-h100")
PAGES = 64  # pages per rank region (one layer); at least one per request in a test
FABRIC_PROVIDERS = ("tcp;ofi_rxm", "mrep_double")
LO_V4_V6 = ("lo@127.0.0.1/32", "lo@::1/128")  # two real domains: pairs (0, 0), (1, 1) only
LO_TWICE = ("lo", "lo@127.0.0.1/32")  # one domain opened twice: every pair connects
# the words of each transport's refusals: (what a device pair is, what a device is)
PAIR_WORDS = {"verbs": ("queue pair", "NIC"), **{f"libfabric:{p}": ("endpoint pair", "domain")
                                                   for p in FABRIC_PROVIDERS}}
BOTH = pytest.mark.parametrize("transport", ["verbs", *fabric_params(FABRIC_PROVIDERS)], indirect=True)


@pytest.fixture
def transport(request):
    from pdkv._messenger import HAVE_VERBS

    name = getattr(request, "param", "verbs")
    if name == "verbs" and not HAVE_VERBS:
        pytest.skip("pdkv built without libibverbs")
    return name


def device_kwargs(transport: str, names) -> dict:
    """spawn() keyword arguments for a messenger over the devices `names`."""
    if transport == "verbs":
        return {"env_extra": {"PDKV_LOOPBACK_NICS": ",".join(names)}, "nics": list(names), "isolate_peers": True}
    return {"domains": list(names)}


def dgx_placement(tp: int):
    gpus = [g.bus_id for g in topo.discover(DGX).gpus][:tp]
    return plan_placement(MessengerConfig(transport="verbs", nics=("auto",)), sysfs_root=DGX, gpu_bus_ids=gpus)


def test_the_dgx_topology_gives_each_rank_its_own_nic():
    p = dgx_placement(8)
    assert p.nics == ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9")
    assert p.rank_nics == tuple((r,) for r in range(8))  # the storage NICs (4, 5, 10, 11) carry no KV
    one = dgx_placement(1)
    assert one.nics == ("mlx5_0",) and one.rank_nics == ((0,),)
    explicit = plan_placement(MessengerConfig(transport="verbs", nics=("auto",), rank_nics=("mlx5_9", "mlx5_9")),
                              sysfs_root=DGX, gpu_bus_ids=[g.bus_id for g in topo.discover(DGX).gpus][:2])
    assert explicit.nics == ("mlx5_9",) and explicit.rank_nics == ((0,), (0,))  # the config wins
    # no GPU to go by: the NICs are dealt to the ranks in turn, every NIC used
    listed = MessengerConfig(transport="verbs", nics=("mlx5_0", "mlx5_1", "mlx5_2"))
    assert plan_placement(listed, sysfs_root=DGX).rank_nics == ((0, 1, 2),)
    assert plan_placement(listed, sysfs_root=DGX, num_ranks=2).rank_nics == ((0, 2), (1,))
    assert plan_placement(listed, sysfs_root=DGX, num_ranks=4).rank_nics == ((0,), (1,), (2,), (0,))


class Node:
    """A child-process messenger with one region per TP rank, each keyed on the rank's NIC."""

    def __init__(self, spawn, node_id, placement, tp, page_nbytes, seed=None, transport="verbs"):
        self.p = spawn(node_id, **device_kwargs(transport, placement.nics))
        self.nics, self.tp = placement.nics, tp
        self.rank_nics = placement.rank_nics
        self.keys = []
        for r in range(tp):
            self.p.alloc(f"kv{r}", PAGES * page_nbytes, seed=None if seed is None else seed + r)
            key = self.p.register(f"kv{r}")
            self.keys.append(self.p.m("nic_key", key, self.rank_nics[r][0]))

    def nic_counts(self, field):
        return {s["name"]: s[field] for s in self.p.m("nic_stats")}

    def device_counts(self, index):
        return {n: c[index] for n, c in self.p.device_counters(list(self.nics)).items()}


def _transfer(spawn, connect, plan, src_tp, dst_tp, seeds, nodes=None):
    """``connect(a, b)`` (the Nodes' peers) -> (conn of a to b, conn of b to a); ``nodes``: the
    two Nodes, made here when None."""
    g = plan.geometry
    page_nbytes = g.num_kv_heads * g.head_dim * g.page_size * 4 * g.kv_parts
    a, b = nodes or (Node(spawn, 1, dgx_placement(src_tp), src_tp, page_nbytes, seed=100),
                     Node(spawn, 2, dgx_placement(dst_tp), dst_tp, page_nbytes))
    rkeys = [b.p.m("grant", k, 1) for k in b.keys]  # in A's protection domain on rank d's NIC
    ca, _ = connect(a.p, b.p)
    want = {d: np.zeros(PAGES * page_nbytes, np.uint8) for d in range(dst_tp)}
    src = {p: np.frombuffer(a.p.read(f"kv{p}"), np.uint8) for p in range(src_tp)}
    per_rank = Counter()
    # Writes from different prefill ranks travel on different QPs, which the fabric does not order:
    # two requests sharing a page would make the expected bytes a race.
    assert len(seeds) <= PAGES
    tag = 0
    for req, seed in enumerate(seeds):
        page = req % PAGES  # request req owns page `page` on both sides (a fresh page per request)
        for pair in plan.active_pairs(seed):
            for seg in pair.segments:
                tag += 1
                a.p.m("write_pages", ca, a.keys[pair.prefill_rank], rkeys[pair.decode_rank], [page], [page],
                      seg_len=seg.length, src_page_stride=page_nbytes, dst_page_stride=page_nbytes,
                      src_off=seg.src_offset, dst_off=seg.dst_offset, imm=7, tag=tag)
                s, d = page * page_nbytes + seg.src_offset, page * page_nbytes + seg.dst_offset
                want[pair.decode_rank][d:d + seg.length] = src[pair.prefill_rank][s:s + seg.length]
                per_rank[pair.prefill_rank] += 1
    done = [e for e in a.p.wait("batch_done", count=tag, timeout=30) if e[0] == "batch_done"]
    assert len(done) == tag and all(e[6] == 0 for e in done), done[:3]
    b.p.wait_stat("imms", tag)
    for d in range(dst_tp):  # byte-exact, every rank
        assert b.p.read(f"kv{d}") == want[d].tobytes(), f"decode rank {d}"
    return a, b, per_rank


def test_tp8_to_tp8_each_rank_leaves_through_its_own_nic(spawn, connect):
    geo = KVGeometry(num_kv_heads=8, head_dim=8, page_size=4, dtype="float32")
    plan = plan_transfers(8, 8, geo)
    a, b, per_rank = _transfer(spawn, connect, plan, 8, 8, [request_seed(f"r{i}") for i in range(2)])
    nics = a.nics
    # rank r's writes (its one head's K and V, for 2 requests) left through NIC r and nothing else
    want = {nics[r]: per_rank[r] for r in range(8)}
    assert len(set(want.values())) == 1 and want["mlx5_0"] >= 2
    assert a.nic_counts("writes_done") == want
    assert {s["name"]: s["writes"] for s in a.p.m("stats")["nics"]} == want  # also in stats()
    assert {n: c for n, c in a.device_counts(0).items()} == want  # the device's tx writes
    # ... and landed on the decode node through decode rank r's NIC (pairs (r, r))
    assert b.nic_counts("imms") == want
    assert b.device_counts(2) == want  # the device's rx writes
    nbytes = 2 * sum(s.length for s in plan.segments(0, 0))
    assert a.device_counts(1) == {n: nbytes for n in nics} == b.device_counts(3)
    # the node's /metrics says the same, per NIC
    text = a.p.nic_metrics()
    for n in nics:
        assert f'pdkv_nic_writes_total{{model_name="test-model",nic="{n}",role="prefill"}} {float(want[n])}' in text
        assert f'pdkv_nic_write_bytes_total{{model_name="test-model",nic="{n}",role="prefill"}} {float(nbytes)}' in text


def _qps(node) -> tuple[dict, dict]:
    """(the messenger's QPs per NIC, the loopback device's live QPs per NIC)"""
    return node.nic_counts("qps"), {n: c[1] for n, c in node.p.device_objects(list(node.nics)).items()}


def test_tp8_to_tp8_makes_queue_pairs_only_for_the_nic_pairs_its_writes_use(spawn, connect):
    """Every (local NIC, remote NIC) pair: 64 QPs per side, of which TP8 -> TP8 (rank r's pages
    from NIC r to NIC r) uses 8. With the pairs pdkv.disagg.sharded.link_pairs derives from the
    plan and both placements (what the nodes' handshake does), 8 QPs per side, and the transfer
    is still byte-exact, each rank through its own NIC."""
    from types import SimpleNamespace

    from pdkv.disagg.sharded import hello_rank_nics, link_pairs

    geo = KVGeometry(num_kv_heads=8, head_dim=8, page_size=4, dtype="float32")
    plan = plan_transfers(8, 8, geo)
    page_nbytes = geo.num_kv_heads * geo.head_dim * geo.page_size * 4 * geo.kv_parts  # as _transfer sizes it
    a = Node(spawn, 1, dgx_placement(8), 8, page_nbytes, seed=100)
    b = Node(spawn, 2, dgx_placement(8), 8, page_nbytes)
    ca, cb = connect(a.p, b.p)  # no pairs named: every pair
    every = {n: 8 for n in a.nics}
    assert _qps(a) == _qps(b) == (every, every)  # 8 x 8 = 64 per side
    a.p.m("disconnect", ca)
    b.p.m("disconnect", cb)
    none = {n: 0 for n in a.nics}
    assert _qps(a) == _qps(b) == (none, none)
    pa = link_pairs(plan, "prefill", SimpleNamespace(rank_nics=a.rank_nics), hello_rank_nics(b))
    pb = link_pairs(plan, "decode", SimpleNamespace(rank_nics=b.rank_nics), hello_rank_nics(a))
    assert pa == pb == [(r, r) for r in range(8)]

    def connect_pairs(x, y):
        cx, ix = x.m("prepare", y.node_id, pairs=pa)
        cy, iy = y.m("prepare", x.node_id, pairs=pb)
        x.m("complete", cx, iy)
        y.m("complete", cy, ix)
        return cx, cy
    a, b, per_rank = _transfer(spawn, connect_pairs, plan, 8, 8, [request_seed(f"r{i}") for i in range(2)],
                               nodes=(a, b))
    one = {n: 1 for n in a.nics}
    assert _qps(a) == _qps(b) == (one, one)  # 8 per side
    text = a.p.nic_metrics()  # and on /metrics
    assert all(f'pdkv_nic_queue_pairs{{model_name="test-model",nic="{n}",role="prefill"}} 1.0' in text for n in a.nics)
    want = {a.nics[r]: per_rank[r] for r in range(8)}
    assert a.nic_counts("writes_done") == want == a.device_counts(0)  # rank r's writes left through NIC r
    assert b.nic_counts("imms") == want == b.device_counts(2)  # and landed through decode rank r's


@BOTH
def test_only_the_nic_pairs_both_sides_asked_for_are_made_and_others_are_refused(spawn, connect, transport):
    """A asks for (its NIC 0 -> B's NIC 1) and (1 -> 0), B for (its 1 -> A's 0) only: just the
    pair (A 1, B 0) is made (one QP each side). A write on it lands; one on the pair only A
    asked for, or on one nobody did, is refused naming it; so is a pair beyond the NICs."""
    names = ("mlx5_0", "mlx5_1") if transport == "verbs" else LO_TWICE
    pair, unit = PAIR_WORDS[transport]
    a = spawn(1, **device_kwargs(transport, names))
    b = spawn(2, **device_kwargs(transport, names))
    ca, ia = a.m("prepare", 2, pairs=[(0, 1), (1, 0)])
    cb, ib = b.m("prepare", 1, pairs=[(0, 1)])
    a.m("complete", ca, ib)
    b.m("complete", cb, ia)
    assert [s["qps"] for s in a.m("nic_stats")] == [0, 1] and [s["qps"] for s in b.m("nic_stats")] == [1, 0]
    a.alloc("src", 4096, seed=3)
    b.alloc("dst", 4096)
    src = a.register("src")
    region = b.register("dst")
    rkey0 = b.m("grant", region, 1)
    a.m("write", ca, a.m("nic_key", src, 1), 0, rkey0, 0, 4096, imm=5, tag=1)
    assert [e[6] for e in a.wait("batch_done") if e[0] == "batch_done"] == [0]
    b.wait_stat("imms", 1)
    assert b.read("dst") == a.read("src")
    assert [s["writes_done"] for s in a.m("nic_stats")] == [0, 1] and [s["imms"] for s in b.m("nic_stats")] == [1, 0]
    rkey1 = b.m("grant", b.m("nic_key", region, 1), 1)
    with pytest.raises(Exception, match=f"no {pair} from {unit} {names[0]} to remote {unit} 1"):  # only A asked
        a.m("write", ca, src, 0, rkey1, 0, 64, tag=2)
    with pytest.raises(Exception, match=f"no {pair} from {unit} {names[0]} to remote {unit} 0"):  # nobody asked
        a.m("write", ca, src, 0, rkey0, 0, 64, tag=3)
    with pytest.raises(Exception, match=rf"{pair} \(local {unit} 2, remote {unit} 0\) asked for: this transport has 2"):
        a.m("prepare", 3, pairs=[(2, 0)])


def _two_device_placement(transport: str, num_ranks: int, domains=LO_V4_V6):
    """Two devices dealt to `num_ranks` ranks (no GPU to go by): the placement a node makes."""
    from pdkv.config import LibfabricConfig

    if transport == "verbs":
        cfg = MessengerConfig(transport="verbs", nics=("mlx5_0", "mlx5_1"))
    else:
        cfg = MessengerConfig(transport="libfabric", libfabric=LibfabricConfig(provider="tcp;ofi_rxm",
                                                                               domains=domains))
    return plan_placement(cfg, sysfs_root=DGX, num_ranks=num_ranks)


@BOTH
def test_tp2_to_tp2_each_rank_through_its_own_device_on_only_the_pairs_it_uses(spawn, transport):
    """Two devices, rank r's pages on device r on both sides (the placement), connected with the
    pairs pdkv.disagg.sharded.link_pairs derives (what the nodes' handshake does): (0, 0) and
    (1, 1), one endpoint / QP per device and side; byte-exact, each rank's writes counted on its
    own device on both nodes. On libfabric the two are real domains (lo over IPv4 and IPv6)."""
    from types import SimpleNamespace

    from pdkv.disagg.sharded import hello_rank_nics, link_pairs

    geo = KVGeometry(num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")
    plan = plan_transfers(2, 2, geo)
    where = _two_device_placement(transport, 2)
    assert where.rank_nics == ((0,), (1,))
    page_nbytes = geo.num_kv_heads * geo.head_dim * geo.page_size * 4 * geo.kv_parts
    a = Node(spawn, 1, where, 2, page_nbytes, seed=100, transport=transport)
    b = Node(spawn, 2, where, 2, page_nbytes, transport=transport)
    pairs = link_pairs(plan, "prefill", SimpleNamespace(rank_nics=a.rank_nics), hello_rank_nics(b))
    assert pairs == link_pairs(plan, "decode", SimpleNamespace(rank_nics=b.rank_nics), hello_rank_nics(a))
    assert pairs == [(0, 0), (1, 1)]

    def connect_pairs(x, y):
        cx, ix = x.m("prepare", y.node_id, pairs=pairs)
        cy, iy = y.m("prepare", x.node_id, pairs=pairs)
        x.m("complete", cx, iy)
        y.m("complete", cy, ix)
        return cx, cy
    a, b, per_rank = _transfer(spawn, connect_pairs, plan, 2, 2, [request_seed(f"r{i}") for i in range(3)],
                               nodes=(a, b))
    want = {a.nics[r]: per_rank[r] for r in range(2)}
    assert min(want.values()) >= 3
    assert a.nic_counts("writes_done") == want and b.nic_counts("imms") == want
    assert a.nic_counts("qps") == b.nic_counts("qps") == {n: 1 for n in a.nics}


@BOTH
def test_tp2_to_tp1_replicated_spreads_requests_over_both_devices(spawn, connect, transport):
    """One latent head replicated on both prefill ranks (rank r on device r): the seed's replica
    choice (pdkv.shard) sends each request from one rank, so both devices carry requests, in
    exactly the seeded split; everything lands on the one decode rank's device. (Every pair is
    made: on libfabric one domain opened twice, where any endpoint reaches any.)"""
    geo = KVGeometry(num_kv_heads=1, head_dim=64, page_size=4, dtype="float32", replicated=True, kv_parts=1)
    plan = plan_transfers(2, 1, geo)
    seeds = [request_seed(f"req-{i}") for i in range(24)]
    page_nbytes = geo.num_kv_heads * geo.head_dim * geo.page_size * 4 * geo.kv_parts
    src, dst = _two_device_placement(transport, 2, LO_TWICE), _two_device_placement(transport, 1, LO_TWICE)
    a = Node(spawn, 1, src, 2, page_nbytes, seed=100, transport=transport)
    b = Node(spawn, 2, dst, 1, page_nbytes, transport=transport)
    a, b, per_rank = _transfer(spawn, connect, plan, 2, 1, seeds, nodes=(a, b))
    chosen = Counter(a.nics[a.rank_nics[plan.active_pairs(s)[0].prefill_rank][0]] for s in seeds)
    assert a.nic_counts("writes_done") == dict(chosen) and min(chosen.values()) >= 4, chosen
    assert b.nic_counts("imms") == {b.nics[0]: 24, b.nics[1]: 0}


def test_tp8_to_tp1_replicated_spreads_over_every_nic(spawn, connect):
    # MLA-like: one latent "head" replicated on every prefill rank, 8 replica sets to choose from
    geo = KVGeometry(num_kv_heads=1, head_dim=64, page_size=4, dtype="float32", replicated=True, kv_parts=1)
    plan = plan_transfers(8, 1, geo)
    seeds = [request_seed(f"req-{i}") for i in range(48)]
    a, b, per_rank = _transfer(spawn, connect, plan, 8, 1, seeds)
    tx = a.device_counts(0)
    assert sum(tx.values()) == 48 and set(tx) == set(a.nics)
    # every NIC carried some of the load; the choice is the seeded one, so it is exactly this:
    chosen = Counter(a.nics[a.rank_nics[plan.active_pairs(s)[0].prefill_rank][0]] for s in seeds)
    assert tx == dict(chosen) and min(tx.values()) >= 1, tx
    assert a.nic_counts("writes_done") == tx
    assert max(tx.values()) <= 12  # 48 over 8 NICs: no NIC takes a quarter
    # the one decode rank is nearest mlx5_0: everything landed there
    assert b.nic_counts("imms") == {"mlx5_0": 48} and b.device_counts(2) == {"mlx5_0": 48}


def test_pick_nic_spreads_a_ranks_requests_over_its_nics():
    picks = Counter(pick_nic(request_seed(f"q{i}"), 3, 4) for i in range(4000))
    assert set(picks) == {0, 1, 2, 3} and min(picks.values()) > 900  # about 1000 each
    assert pick_nic(request_seed("q1"), 3, 1) == 0
    # Fixed values: both nodes compute the choice on their own, so it must never change between
    # versions (splitmix64(seed ^ splitmix64(rank + 1)) % num_nics)
    assert [pick_nic(5, r, 4) for r in range(8)] == [3, 2, 3, 0, 1, 2, 2, 0]
    assert [pick_nic(s, 3, 4) for s in (0, 1, 2**64 - 1, 0xDEADBEEF)] == [3, 3, 3, 2]
    assert [pick_nic(5, 3, n) for n in (1, 2, 3, 8)] == [0, 0, 1, 0]


def test_a_write_to_a_nic_without_a_queue_pair_is_refused_naming_it(spawn, connect):
    one = dgx_placement(1)
    two = plan_placement(MessengerConfig(transport="verbs", nics=("mlx5_0", "mlx5_1")), sysfs_root=DGX, num_ranks=2)
    env = {"PDKV_LOOPBACK_NICS": "mlx5_0,mlx5_1"}
    a = spawn(1, env_extra=env, nics=list(two.nics), remote_nics=1)  # pairs toward 1 peer NIC only
    b = spawn(2, env_extra=env, nics=list(one.nics), remote_nics=2)
    ca, ia = a.m("prepare", 2)
    cb, ib = b.m("prepare", 1)
    a.m("complete", ca, ib)
    b.m("complete", cb, ia)
    b2 = spawn(3, env_extra=env, nics=list(two.nics))  # two NICs: more than A prepared pairs toward
    c2, _ = a.m("prepare", 3)
    _, i3 = b2.m("prepare", 1)
    with pytest.raises(Exception, match="has 2 NICs and prepared .* set messenger remote_nics"):
        a.m("complete", c2, i3)  # unequal hosts need the larger count on both
    a.alloc("src", 4096, seed=1)
    b.alloc("dst", 4096)
    lkey = a.m("nic_key", a.register("src"), 1)
    rkey = b.register("dst")
    a.m("write", ca, lkey, 0, rkey, 0, 64, tag=1)  # NIC 1 -> the peer's only NIC: fine
    assert [e[6] for e in a.wait("batch_done") if e[0] == "batch_done"] == [0]
    with pytest.raises(Exception, match="no queue pair from NIC mlx5_1 to remote NIC 1"):
        a.m("write", ca, lkey, 0, rkey | (1 << 48), 0, 64, tag=2)
    with pytest.raises(Exception, match="NIC 2 does not exist"):
        a.m("nic_key", lkey, 2)


def test_queue_chunk_sends_each_request_through_the_nic_its_seed_picks():
    """A rank near several NICs (aws-p5: 4 per GPU) offers a key on each; the prefill write path
    (pdkv.disagg.writes.queue_chunk) sends each request's pages from the seeded source rank
    through the seeded one of that rank's NICs."""
    from pdkv.disagg.writes import Geometry, queue_chunk

    class Recorder:  # stand-in messenger: records which local key each queued batch names
        def __init__(self):
            self.lkeys = []

        def queue_pages(self, watch, target, conn, lkey, rkey, *args, **kwargs):
            self.lkeys.append(lkey)

    geo = KVGeometry(num_kv_heads=1, head_dim=8, page_size=4, dtype="float32", replicated=True, kv_parts=1)
    plan = plan_transfers(2, 1, geo)
    g = Geometry(1, 128, 512)
    lkeys = [(10, 11, 12, 13), (20, 21, 22, 23)]  # rank p's key on each of its 4 NICs
    used = Counter()
    for i in range(400):
        seed, rec = request_seed(f"m{i}"), Recorder()
        queue_chunk(rec, watch=0, base=0, layerwise=True, conn=0, lkeys=lkeys, rkeys=[99], src=g, dst=g, plan=plan,
                    seed=seed, src_pages=np.array([0]), dst_pages=np.array([1]), imm=1, tag=1)
        p = plan.active_pairs(seed)[0].prefill_rank
        assert rec.lkeys == [lkeys[p][pick_nic(seed, p, 4)]]
        used[rec.lkeys[0]] += 1
    assert set(used) == {10, 11, 12, 13, 20, 21, 22, 23} and min(used.values()) > 25  # ~50 each


def test_link_pairs_are_the_plans_rank_pairs_over_both_placements():
    """TP8 -> TP1 replicated: any prefill rank may carry a request (the seed's replica), to the
    decode rank's NICs; a decode node with every NIC for its one rank gets every pair. No
    placement (tcp, a single path), or none from the peer: every pair (None). A malformed
    rank_nics from the peer is refused, naming it."""
    from types import SimpleNamespace

    from pdkv.control import HandshakeRefused
    from pdkv.disagg.sharded import hello_rank_nics, link_pairs

    geo = KVGeometry(num_kv_heads=1, head_dim=64, page_size=4, dtype="float32", replicated=True, kv_parts=1)
    plan = plan_transfers(8, 1, geo)
    pre, one, every = (SimpleNamespace(rank_nics=dgx_placement(8).rank_nics), SimpleNamespace(rank_nics=((0,),)),
                       SimpleNamespace(rank_nics=(tuple(range(8)),)))
    assert link_pairs(plan, "prefill", pre, hello_rank_nics(one)) == [(i, 0) for i in range(8)]
    assert link_pairs(plan, "decode", one, hello_rank_nics(pre)) == [(0, i) for i in range(8)]
    assert link_pairs(plan, "prefill", pre, hello_rank_nics(every)) == [(i, j) for i in range(8) for j in range(8)]
    tp2 = plan_transfers(2, 2, KVGeometry(num_kv_heads=2, head_dim=8, page_size=4, dtype="float32"))
    two = SimpleNamespace(rank_nics=((0, 2), (1, 3)))  # 4 NICs, 2 per rank
    assert link_pairs(tp2, "prefill", two, hello_rank_nics(two)) == [(0, 0), (0, 2), (1, 1), (1, 3), (2, 0), (2, 2),
                                                                    (3, 1), (3, 3)]  # 8 of 16
    assert link_pairs(plan, "prefill", SimpleNamespace(rank_nics=()), hello_rank_nics(one)) is None
    assert link_pairs(plan, "prefill", pre, {}) is None and hello_rank_nics(SimpleNamespace()) == {}
    for bad in ([[0, 99]], [[]], "x", [["0"]], [[True]]):
        with pytest.raises(HandshakeRefused, match="rank_nics must be a list of per-rank lists"):
            link_pairs(plan, "prefill", pre, {"rank_nics": bad})


# where a key names its device: verbs_multi.h (NIC bits 53:48), fabric_internal.h (bits 62:59)
DEVICE_BIT = {"verbs": 1 << 48, **{f"libfabric:{p}": 1 << 59 for p in FABRIC_PROVIDERS}}


@BOTH
def test_a_key_moved_to_another_device_by_a_hostile_peer_opens_nothing(spawn, connect, transport):
    """B grants A its region on device 0. A rewrites the key's device bits to aim at B's device 1
    (a pair both made): the grant lives only in A's domain on B's device 0, so device 1 has no such
    key: the write fails at A and nothing lands."""
    names = ("mlx5_0", "mlx5_1") if transport == "verbs" else LO_TWICE
    a = spawn(1, **device_kwargs(transport, names))
    b = spawn(2, **device_kwargs(transport, names))
    ca, _ = connect(a, b)
    a.alloc("src", 4096, seed=9)
    b.alloc("dst", 4096)
    src = a.register("src")
    rkey = b.m("grant", b.register("dst"), 1)
    a.m("write", ca, src, 0, rkey | DEVICE_BIT[transport], 0, 4096, imm=3, tag=1)
    (done,) = [e for e in a.wait("batch_done", timeout=30) if e[0] == "batch_done"]
    assert done[6] != 0, done  # failed at the writer
    assert b.read("dst") == bytes(4096) and b.m("stats")["imms"] == 0  # nothing landed
