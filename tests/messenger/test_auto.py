"""What only the auto transport has: a route per link. Peers the handshake puts on this host
connect through shm (the grant maps pages into the writer, the key says shm, nothing goes
through tcp); a link where either side's handshake says otherwise, or whose shm check fails,
goes through tcp, and route() says why; a whole-region grant also takes writes naming the
region key itself.
"""
from __future__ import annotations

import pytest

from test_shm import PAGE, SIZE, _mapped_from

SHM_TAG = 1 << 63


@pytest.fixture
def transport():
    return "auto"


def _link(a, b, hint_a: bool, hint_b: bool):
    ca, ia = a.m("prepare", b.node_id, same_host=hint_a)
    cb, ib = b.m("prepare", a.node_id, same_host=hint_b)
    a.m("complete", ca, ib)
    b.m("complete", cb, ia)
    return ca, cb


def _routes(p) -> dict:
    return {s["name"]: s for s in p.m("nic_stats")}


def _write_lands(a, b, ca, lkey, key, off, imm):
    b.m("expect", imm, 1)
    a.m("write", ca, lkey, 0, key, off, 4096, imm=imm)
    assert any(e[0] == "imm_done" for e in b.wait("imm_done", imm=imm))
    assert b.read("dst", off, 4096) == a.read("src", 0, 4096)


def test_one_host_links_go_through_shm(spawn):
    a, b = spawn(1), spawn(2)
    a.alloc("src", SIZE, seed=3)
    b.alloc("dst", SIZE)
    region, lkey = b.register("dst"), a.register("src")
    ca, cb = _link(a, b, True, True)
    assert a.m("route", ca) == ["shm", ""] and b.m("route", cb) == ["shm", ""]
    key = b.m("grant_range", region, 1, 8192, 4096)
    assert key & SHM_TAG and 4096 <= _mapped_from(a, b) <= 4096 + PAGE  # a mapping in the writer, as on shm
    _write_lands(a, b, ca, lkey, key, 8192, 7)
    ra, rb = _routes(a), _routes(b)
    assert ra["shm"]["writes"] == 1 and ra["shm"]["bytes"] == 4096 and ra["tcp"]["writes"] == 0
    assert rb["shm"]["imms"] == 1 and rb["shm"]["imm_bytes"] == 4096 and rb["tcp"]["imms"] == 0
    assert ra["shm"]["qps"] == rb["shm"]["qps"] == 1 and ra["tcp"]["qps"] == 0
    b.m("revoke_range", region, 1, 8192, 4096)
    assert _mapped_from(a, b) == 0


@pytest.mark.parametrize("hints", [(False, False), (True, False), (False, True)])
def test_a_link_the_handshake_did_not_put_on_this_host_goes_through_tcp(spawn, hints):
    a, b = spawn(1), spawn(2)
    a.alloc("src", SIZE, seed=4)
    b.alloc("dst", SIZE)
    region, lkey = b.register("dst"), a.register("src")
    ca, cb = _link(a, b, *hints)
    for p, c in ((a, ca), (b, cb)):
        via, why = p.m("route", c)
        assert via == "tcp" and ("did not find" in why or "offered no shm" in why), why
    key = b.m("grant_range", region, 1, 0, 4096)
    assert not key & SHM_TAG and _mapped_from(a, b) == 0
    _write_lands(a, b, ca, lkey, key, 0, 8)
    assert _routes(b)["tcp"]["imms"] == 1 and _routes(b)["shm"]["imms"] == 0


def test_a_forged_boot_id_falls_back_to_tcp_on_both_sides(spawn):
    a, b = spawn(1), spawn(2, fault_host_id="00000000-forged")
    a.alloc("src", SIZE, seed=5)
    b.alloc("dst", SIZE)
    region, lkey = b.register("dst"), a.register("src")
    ca, cb = _link(a, b, True, True)
    for p, c in ((a, ca), (b, cb)):
        via, why = p.m("route", c)
        assert via == "tcp" and "another host" in why and "00000000-forged" in why, why
    _write_lands(a, b, ca, lkey, b.m("grant_range", region, 1, 4096, 4096), 4096, 9)


def test_a_whole_region_grant_takes_the_region_key_too(spawn):
    a, b = spawn(1), spawn(2)
    a.alloc("src", SIZE, seed=6)
    b.alloc("dst", SIZE)
    b.alloc("other", SIZE)
    region, other, lkey = b.register("dst"), b.register("other"), a.register("src")
    ca, _ = _link(a, b, True, True)
    key = b.m("grant", region, 1)
    assert key == region | SHM_TAG
    _write_lands(a, b, ca, lkey, key, 0, 10)  # through shm
    _write_lands(a, b, ca, lkey, region, 4096, 11)  # the region key itself: through tcp
    assert b.m("grant_range", other, 1, 0, 4096) & SHM_TAG
    b.m("revoke", region, 1)
    assert 4096 <= _mapped_from(a, b) <= 4096 + PAGE  # only the other region's range is left
