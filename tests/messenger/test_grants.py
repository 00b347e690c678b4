"""Grants: a peer writes only where and while it was granted, on every transport.

tcp checks each frame against the writer's grants before a payload byte lands; verbs (with
isolate_peers: a protection domain per peer) has the NIC — here the loopback device, which checks
rkey, PD and bounds — refuse the write with a remote access error. Either way the writer is told,
the receiver reports an error event naming the writer, and the region is untouched.
"""
from __future__ import annotations

import numpy as np
import pytest
from fabrics import refusal_reported

SIZE = 64 << 10
PAGE = 4096


@pytest.fixture
def pair(spawn, connect, transport):
    """(writer node 1, writer node 3, receiver node 2 with a zeroed region "dst", dst's key)."""
    kw = {"isolate_peers": True} if transport == "verbs" else {}
    a, c, b = spawn(1), spawn(3), spawn(2, **kw)
    for w in (a, c):
        w.alloc("src", SIZE, seed=w.node_id)
    b.alloc("dst", SIZE)
    return a, c, b, b.register("dst")


def _lands(w, b, conn, key, roff, length, imm):
    """Write src[0:length] -> dst[roff:] and wait for the immediate at b."""
    b.m("expect", imm, 1)
    w.m("write", conn, w.register("src"), 0, key, roff, length, imm=imm)
    assert any(e[0] == "imm_done" and e[2] == imm for e in b.wait("imm_done", imm=imm)), "the write did not land"
    return np.frombuffer(w.read("src", 0, length), dtype=np.uint8).tobytes()


def _refused(w, b, conn, key, roff, length, imm, writer_id):
    """A write that must be refused: the writer sees a failure, the receiver an error naming it
    (where the transport reports them, conftest.refusal_reported; the caller checks the bytes)."""
    writer_told, receiver_told = refusal_reported(w.transport)
    w.m("write", conn, w.register("src"), 0, key, roff, length, imm=imm)
    if writer_told:
        assert any(e[0] == "error" or (e[0] == "batch_done" and e[6] > 0) for e in w.wait("failed", timeout=10))
    if receiver_told:
        errs = [e for e in b.wait("error", timeout=10) if e[0] == "error"]
        assert errs and errs[0][3] == writer_id, errs
    else:
        b.m("expect", imm, 1)
        assert not [e for e in b.wait("imm_done", timeout=1.0) if e[0] == "imm_done"], "a refused write landed"
        assert b.m("forget", imm) == 0


def test_a_peer_without_a_grant_lands_nothing(pair, connect, transport):
    a, c, b, region = pair
    key_a = b.m("grant", region, 1)  # only node 1 may write
    ca, _ = connect(a, b)
    cc, _ = connect(c, b)
    want = _lands(a, b, ca, key_a, 0, 256, imm=1)
    _refused(c, b, cc, key_a, 1024, 256, imm=2, writer_id=3)  # node 3 holding node 1's key
    assert b.read("dst", 0, 256) == want and b.read("dst", 256) == bytes(SIZE - 256)
    assert b.guards_ok("dst")
    # counted (verbs: the NIC's access error event); libfabric providers tell the target nothing
    assert b.m("stats")["refused_writes"] == (1 if refusal_reported(transport)[1] else 0)


def test_revoke_ends_a_grant(pair, connect):
    a, _, b, region = pair
    key = b.m("grant", region, 1)
    assert b.m("grant", region, 1) == key  # granting again changes nothing
    ca, _ = connect(a, b)
    want = _lands(a, b, ca, key, 0, 128, imm=3)
    b.m("revoke", region, 1)
    with pytest.raises(Exception, match="InvalidRequestError"):
        b.m("revoke", region, 1)  # nothing left to revoke
    _refused(a, b, ca, key, 4096, 128, imm=4, writer_id=1)
    assert b.read("dst", 0, 128) == want and b.read("dst", 128) == bytes(SIZE - 128)


def test_narrow_grant_admits_only_its_range_while_it_is_held(pair, connect):
    a, _, b, region = pair
    key = b.m("grant_range", region, 1, 2 * PAGE, 2 * PAGE)  # pages 2..3 only
    ca, _ = connect(a, b)
    want = _lands(a, b, ca, key, 2 * PAGE + 100, 512, imm=5)  # inside: lands
    _refused(a, b, ca, key, PAGE, 256, imm=6, writer_id=1)  # page 1: not granted
    ca, _ = connect(a, b)  # the refusal closed the connection (verbs: the QP broke)
    _refused(a, b, ca, key, 4 * PAGE - 100, 200, imm=7, writer_id=1)  # crosses the range's end
    dst = b.read("dst")
    assert dst[2 * PAGE + 100:2 * PAGE + 612] == want
    assert dst[:2 * PAGE + 100] == bytes(2 * PAGE + 100) and dst[2 * PAGE + 612:] == bytes(SIZE - 2 * PAGE - 612)
    b.m("revoke_range", region, 1, 2 * PAGE, 2 * PAGE)
    ca, _ = connect(a, b)
    _refused(a, b, ca, key, 2 * PAGE, 64, imm=8, writer_id=1)  # the range was given back
    assert b.read("dst", 2 * PAGE, 100) == bytes(100)


def test_grant_calls_check_their_arguments(pair):
    _, _, b, region = pair
    b.m("grant_range", region, 1, 0, PAGE)
    for args, what in [((region, 1, PAGE // 2, PAGE), "overlaps"),      # overlapping ranges of one peer
                       ((region, 1, SIZE - 8, 16), "outside"),           # past the region's end
                       ((region ^ (1 << 40), 1, 0, 8), "unknown")]:      # not a key of ours
        with pytest.raises(Exception) as ei:
            b.m("grant_range", *args)
        assert "InvalidRequestError" in str(ei.value) and what in str(ei.value), ei.value
    with pytest.raises(Exception, match="not granted"):
        b.m("revoke_range", region, 1, 0, PAGE // 2)  # not exactly a granted range
    b.m("grant_range", region, 1, PAGE, PAGE)  # adjacent is fine
    b.m("revoke_range", region, 1, 0, PAGE)


def test_verbs_shared_mode_refuses_narrow_grants(spawn, transport):
    if transport != "verbs":
        pytest.skip("shared-PD mode exists only on verbs")
    b = spawn(2)  # isolate_peers off: the region's key opens all of it to any peer
    b.alloc("dst", SIZE)
    region = b.register("dst")
    assert b.m("grant", region, 1) == region
    with pytest.raises(Exception, match="isolate_peers"):
        b.m("grant_range", region, 1, 0, PAGE)
