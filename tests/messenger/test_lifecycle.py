"""Shutdown with writes in flight, a peer killed mid-transfer, reconnecting to its restart:
errors are reported, nothing hangs, no thread or fd is left behind."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

BIG = 4 << 20
REGION = 16 << 20


def _flood(a, ca, lkey, rkey, n=32, imm=1):
    """n writes of 4 MiB (more than the socket buffers hold), cycling over the region."""
    pages = [i % (REGION // BIG) for i in range(n)]
    a.m("write_pages", ca, lkey, rkey, pages, pages, seg_len=BIG, src_page_stride=BIG,
        dst_page_stride=BIG, imm=imm, tag=7)


def test_close_with_writes_in_flight(spawn, connect, transport):
    a, b = spawn(1), spawn(2)
    a.alloc("src", REGION, seed=1)
    b.alloc("dst", REGION)
    lkey, rkey = a.register("src"), b.register("dst")
    b.m("grant", rkey, 1)
    ca, _ = connect(a, b)
    os.kill(b.proc.pid, signal.SIGSTOP)  # the receiver stops reading: writes stay in flight
    try:
        _flood(a, ca, lkey, rkey)
        a.sleep(0.3)
        if transport != "shm":  # shm: a write is a memcpy inside post; none is left in flight
            with pytest.raises(Exception, match="RegionBusyError"):
                a.m("deregister", lkey)  # never frees memory a pending write reads
        a.close()  # returns although the peer is frozen mid-transfer
        assert a.resources() == a.get_baseline()
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    # the receiver sees its writer go away (tcp: the stream closes; with one-sided RDMA nothing
    # tells the responder, so liveness comes from the control channel's lease), and is healthy
    if transport in ("tcp", "shm", "auto"):
        assert any(e[0] == "error" for e in b.wait("error", timeout=10))
    assert b.guards_ok("dst")
    b.close()
    assert b.resources() == b.get_baseline()


def test_peer_killed_mid_transfer_then_reconnect_to_its_restart(spawn, connect):
    a, b = spawn(1), spawn(2)
    a.alloc("src", REGION, seed=4)
    b.alloc("dst", REGION)
    lkey, rkey = a.register("src"), b.register("dst")
    b.m("grant", rkey, 1)
    ca, _ = connect(a, b)
    before = a.resources()
    _flood(a, ca, lkey, rkey, n=64)
    b.kill()  # kill -9 mid-transfer (tcp; the loopback verbs device finished inside post)
    try:  # a write after the death must fail one way or the other, never hang
        a.m("write", ca, lkey, 0, rkey, 0, 4096, imm=2, tag=8)
    except Exception as e:
        assert "PeerConnectionError" in str(e), e
    evs = a.wait("failed", timeout=20)
    assert any(e[0] == "error" or e[6] > 0 for e in evs), evs
    a.m("disconnect", ca)
    evs += a.wait(timeout=0.3)
    # every batch ended (with errors where its writes were cut off): nothing hangs
    assert 7 in [e[1] for e in evs if e[0] == "batch_done"], evs
    # the dead connection's threads and sockets are gone
    assert a.resources()["threads"] <= before["threads"] - (2 if a.transport == "tcp" else 0)
    assert a.resources()["fds"] <= before["fds"]

    b2 = spawn(2)  # the peer restarts (same node id, new process, new memory)
    b2.alloc("dst", REGION)
    rkey2 = b2.register("dst")
    b2.m("grant", rkey2, 1)
    ca2, _ = connect(a, b2)
    b2.m("expect", 3, 4)
    pages = [0, 1, 2, 3]
    a.m("write_pages", ca2, lkey, rkey2, pages, [3, 2, 1, 0], seg_len=BIG, src_page_stride=BIG,
        dst_page_stride=BIG, imm=3, tag=9)
    assert any(e[0] == "imm_done" and e[2] == 3 for e in b2.wait("imm_done", timeout=20))
    src = np.frombuffer(a.read("src"), dtype=np.uint8).reshape(4, BIG)
    dst = np.frombuffer(b2.read("dst"), dtype=np.uint8).reshape(4, BIG)
    assert np.array_equal(dst, src[::-1])
    a.close()
    assert a.resources() == a.get_baseline()
