"""Writes that name memory they may not touch are refused before a byte lands, on both sides."""
from __future__ import annotations

import numpy as np
import pytest
from fabrics import refusal_reported

SIZE = 64 << 10

CASES = {
    # name: (which region key, remote offset, length)
    "foreign_key": ("other", 0, 256),      # a region granted to node 3, not to the writer
    "unknown_key": ("bogus", 0, 256),
    "offset_out_of_range": ("dst", SIZE + 8, 16),
    "crosses_the_end": ("dst", SIZE - 10, 20),
    "length_overflows_64_bits": ("dst", 2 ** 64 - 8, 64),
}


def _failed(events) -> bool:
    return any(e[0] == "error" or (e[0] == "batch_done" and e[6] > 0) for e in events)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_remote_write_is_refused(spawn, connect, transport, case):
    # verbs: a protection domain per peer makes the NIC enforce grants ("foreign_key": the key
    # granted to node 3 names an MR in node 3's PD, which node 1's queue pairs cannot reach)
    kw = {"isolate_peers": True} if transport == "verbs" else {}
    a, b = spawn(1), spawn(2, **kw)
    a.alloc("src", SIZE, seed=5)
    b.alloc("dst", SIZE)
    b.alloc("other", SIZE)
    lkey = a.register("src")
    region = {"dst": b.register("dst"), "other": b.register("other")}
    keys = {"dst": b.m("grant", region["dst"], 1), "other": b.m("grant", region["other"], 3)}
    keys["bogus"] = keys["dst"] ^ 0x5A5A00
    ca, _ = connect(a, b)
    which, roff, ln = CASES[case]
    try:
        a.m("write", ca, lkey, 0, keys[which], roff, ln, imm=9, tag=1)
        refused_locally = False
    except Exception as e:
        # an offset+length that wraps 64 bits is caught before posting; the receiver's own
        # check for it is exercised over a raw socket in test_tcp_wire.py
        assert case == "length_overflows_64_bits" and "overflows 64 bits" in str(e), e
        refused_locally = True
    writer_told, receiver_told = refusal_reported(transport)
    if not refused_locally and writer_told:
        evs = a.wait("failed", timeout=5)
        assert _failed(evs), "the writer was not told"
        if transport.startswith("libfabric:"):  # the provider's CQ error text (fi_cq_readerr)
            assert any("libfabric: write to peer 2 failed: " in e[8] for e in evs), evs
    if not refused_locally and receiver_told:  # verbs: its QP breaks on the bad write
        errs = [e for e in b.wait("error", timeout=5) if e[0] == "error"]
        assert errs and errs[0][3] == 1, errs
    if not refused_locally and not receiver_told:  # libfabric: the immediate never comes
        assert not [e for e in b.wait(timeout=0.5) if e[0] == "imm_done"]
    for name in ("dst", "other"):
        assert b.read(name) == bytes(SIZE), f"{name} was written"
        assert b.guards_ok(name)
    # the broken connection refuses or fails further writes; a new one works
    if not refused_locally and writer_told:
        try:
            a.m("write", ca, lkey, 0, keys["dst"], 0, 64, imm=10, tag=2)
            posted = True
        except Exception as e:  # RemoteError(PeerConnectionError)
            assert "PeerConnectionError" in str(e), e
            posted = False
        if posted:
            assert _failed(a.wait("failed", timeout=5))
    ca2, _ = connect(a, b)
    b.m("expect", 11, 1)
    a.m("write", ca2, lkey, 0, keys["dst"], 128, 64, imm=11)
    assert any(e[0] == "imm_done" for e in b.wait("imm_done"))
    src = np.frombuffer(a.read("src", 0, 64), dtype=np.uint8)
    assert b.read("dst", 128, 64) == src.tobytes()
    assert b.read("dst", 0, 128) == bytes(128)


def test_local_source_out_of_range_is_a_clear_error(spawn, connect):
    a, b = spawn(1), spawn(2)
    a.alloc("src", SIZE)
    b.alloc("dst", SIZE)
    lkey, rkey = a.register("src"), b.register("dst")
    b.m("grant", rkey, 1)
    ca, _ = connect(a, b)
    with pytest.raises(Exception) as ei:
        a.m("write", ca, lkey, SIZE - 4, rkey, 0, 16)
    assert "InvalidRequestError" in str(ei.value) and "outside" in str(ei.value) and "local region" in str(ei.value)
    with pytest.raises(Exception) as ei:
        a.m("write_pages", ca, lkey, rkey, [0, -1], [0, 1], seg_len=16, src_page_stride=16, dst_page_stride=16)
    assert "negative page index" in str(ei.value)
    with pytest.raises(Exception) as ei:
        a.m("write_pages", ca, lkey, rkey, [2 ** 62], [0], seg_len=16, src_page_stride=1 << 20)
    assert "overflows" in str(ei.value)
    # nothing was posted: no events, and the connection still works
    assert not a.wait(timeout=0.2)
    a.m("write", ca, lkey, 0, rkey, 0, 16, tag=5)
    assert [e[1] for e in a.wait("batch_done") if e[0] == "batch_done"] == [5]
