"""Per-request grants through the real write planner (pdkv/disagg/grants.py -> PREFILL's keys ->
pdkv/disagg/range_keys.py -> writes.queue_chunk), on both transports.

The receiver grants a request's fragmented pages per (layer, run of pages) with RequestGrants;
the writer's planner names, per write, the key of the range it falls in. On verbs every range
is its own MR with its own rkey (the loopback device checks rkey, PD and bounds like a NIC), so
a write under the wrong range's key is refused there; tcp returns the region key for every range
and checks the writer's ranges itself. Either way every planned write lands exactly where the
shard plan says and nothing else changes; after revoke (verbs: the MRs are deregistered) the
same writes are refused.
"""
from __future__ import annotations

import numpy as np
import pytest
from fabrics import refusal_reported

from pdkv.disagg.grants import RequestGrants
from pdkv.disagg.range_keys import RangeKeys
from pdkv.disagg.writes import Geometry, QueueError, count_batches, queue_chunk
from pdkv.shard import KVGeometry, plan_transfers, request_seed

LAYERS, NUM_PAGES = 2, 16
KVG = KVGeometry(num_kv_heads=2, head_dim=16, page_size=4, dtype="float32", layout="HND")
SRC_PAGES = np.asarray([0, 1, 2, 3, 4, 5, 6], dtype=np.int64)
DST_PAGES = np.asarray([7, 2, 3, 9, 10, 11, 0], dtype=np.int64)  # runs (0,1) (2,2) (7,1) (9,3)


class Remote:
    """A peer's Messenger seen through its RPCs (the calls grants.py / writes.py make)."""

    def __init__(self, peer):
        self.peer = peer

    def grant_range(self, *a):
        return self.peer.m("grant_range", *a)

    def revoke_range(self, *a):
        return self.peer.m("revoke_range", *a)

    def queue_pages(self, watch, target, conn, lkey, rkey, src_pages, dst_pages, **kw):
        # posted now instead of on a layer counter: what is checked here is where and under which key
        self.peer.m("write_pages", conn, lkey, rkey, [int(x) for x in src_pages], [int(x) for x in dst_pages], **kw)


def _expected(dst_before: bytes, srcs: list[bytes], plan, seed, src: Geometry, dst: Geometry) -> bytes:
    out = bytearray(dst_before)
    for layer in range(LAYERS):
        for pair in plan.active_pairs(seed):
            for seg in pair.segments:
                for sp, dp in zip(SRC_PAGES, DST_PAGES):
                    s = layer * src.layer_nbytes + sp * src.page_nbytes + seg.src_offset
                    d = layer * dst.layer_nbytes + dp * dst.page_nbytes + seg.dst_offset
                    out[d:d + seg.length] = srcs[pair.prefill_rank][s:s + seg.length]
    return bytes(out)


@pytest.mark.parametrize("tp_p", [1, 2])
def test_planned_writes_name_each_ranges_key_and_land(spawn, connect, transport, tp_p):
    plan, seed = plan_transfers(tp_p, 1, KVG), request_seed("req-frag")
    src = Geometry(LAYERS, plan.prefill.page_bytes, NUM_PAGES * plan.prefill.page_bytes)
    dst = Geometry(LAYERS, plan.decode.page_bytes, NUM_PAGES * plan.decode.page_bytes)
    kw = {"isolate_peers": True} if transport == "verbs" else {}
    a, b = spawn(1), spawn(2, **kw)
    for p in range(tp_p):
        a.alloc(f"src{p}", LAYERS * src.layer_nbytes, seed=10 + p)
    lkeys = [a.register(f"src{p}") for p in range(tp_p)]
    b.alloc("dst", LAYERS * dst.layer_nbytes)
    b.alloc("hidden", 4096)
    region, hidden = b.register("dst"), b.register("hidden")
    grants = RequestGrants(Remote(b), [region], dst, hidden, 256)
    granted = grants.grant(1, DST_PAGES, hidden_row=3)
    assert len(granted) == grants.count(DST_PAGES) == 1 + LAYERS * 4
    keys = RangeKeys.parse(RequestGrants.write_keys(DST_PAGES, granted).wire(), DST_PAGES, 1, LAYERS)
    distinct = len({r.wkey for r in granted})
    per_mr = transport not in ("tcp", "shm", "auto")  # verbs, libfabric: every range is an MR of its own, with its key
    assert distinct == (len(granted) if per_mr else 2)
    ca, _ = connect(a, b)
    n = count_batches(plan, seed, LAYERS, keys, DST_PAGES)
    segs = sum(len(pair.segments) for pair in plan.active_pairs(seed))
    assert n == LAYERS * segs * (4 if per_mr else 1)  # per-MR keys: one batch per run
    before = b.read("dst")
    writes = LAYERS * segs * len(DST_PAGES)
    b.m("expect", 77, writes)
    got = queue_chunk(Remote(a), watch=0, base=0, layerwise=True, conn=ca, lkeys=lkeys, rkeys=keys, src=src,
                      dst=dst, plan=plan, seed=seed, src_pages=SRC_PAGES, dst_pages=DST_PAGES, imm=77, tag=5)
    assert got == (n, writes)
    assert any(e[0] == "imm_done" and e[2] == 77 for e in b.wait("imm_done", imm=77)), "not every write landed"
    assert b.read("dst") == _expected(before, [a.read(f"src{p}") for p in range(tp_p)], plan, seed, src, dst)
    assert b.m("stats")["refused_writes"] == 0
    # revoked: the same planned writes land nothing (verbs: the MRs are gone, the NIC refuses)
    assert grants.revoke(1, granted) == []
    b.fill("dst", 99)
    filled = b.read("dst")
    try:  # the first refusal takes the connection down, so a later batch may be refused at once
        queue_chunk(Remote(a), watch=0, base=0, layerwise=True, conn=ca, lkeys=lkeys, rkeys=keys, src=src, dst=dst,
                    plan=plan, seed=seed, src_pages=SRC_PAGES[:1], dst_pages=DST_PAGES[:1], imm=78, tag=6)
    except QueueError as e:
        assert "PeerConnectionError" in str(e), e
    if refusal_reported(transport)[0]:  # libfabric's shm drops a refused write silently
        assert any(e[0] == "error" or (e[0] == "batch_done" and e[6] > 0) for e in a.wait("failed", timeout=10))
    else:
        a.wait("batch_done", timeout=2)
    assert b.read("dst") == filled


def test_prefill_keys_are_checked_against_the_pages():
    fields = {"runs": [[0, 1], [2, 2]], "kv_rkeys": [11, 12, 13, 14], "hidden_rkey": 9}
    keys = RangeKeys.parse(fields, np.asarray([2, 0, 3]), 1, 2)
    split = keys.split(np.asarray([3, 0, 2]))
    assert [(k, None if p is None else p.tolist()) for k, p in keys.groups(split, 0, 1)] == [(13, [1]), (14, [0, 2])]
    assert RangeKeys.parse({"runs": [[0, 1]]}, np.asarray([0]), 1, 1) is None  # no keys: the link's
    for bad, what in [({**fields, "kv_rkeys": [1, 2, 3]}, "must be 4 keys"),
                      ({**fields, "runs": [[2, 2], [0, 1]]}, "ascending"),
                      ({**fields, "runs": [[0, 0], [2, 2]]}, "pairs"),
                      ({**fields, "hidden_rkey": -1}, "hidden_rkey"),
                      ({**fields, "kv_rkeys": [1, 2, 3, 2**64]}, "must be 4 keys")]:
        with pytest.raises(ValueError, match=what):
            RangeKeys.parse(bad, np.asarray([0, 2]), 1, 2)
    with pytest.raises(ValueError, match="3 runs for 2 pages"):
        RangeKeys.parse({**fields, "runs": [[0, 1], [2, 1], [4, 1]]}, np.asarray([0, 2]), 1, 2)
    with pytest.raises(ValueError, match="page 1 is in no granted run"):
        RangeKeys.parse(fields, np.asarray([0, 1]), 1, 2)


def test_grants_bench_prints_the_cost_per_run_count(capsys):
    from pdkv.bench.grants import main, pages_with_runs
    from pdkv.disagg.grants import page_runs

    assert [len(page_runs(pages_with_runs(16, r))) for r in (1, 2, 4, 16)] == [1, 2, 4, 16]
    assert main(["--layers", "2", "--pages", "4", "--pool", "16", "--repeat", "2", "--held", "3"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()[2:]]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(1, 3), (2, 5), (4, 9)]  # 1 + layers x runs ranges
