"""tcp data connections are bound to the control session, and unauthenticated ones get nothing.

prepare(peer, token=...) binds a connection to a token both nodes got from their authenticated
control session: a stream that does not present it in its first frame is closed before anything
else is read, and it is never in the info blob, so a copy of the info cannot open the connection.
Streams wait for their hello in ONE listener thread with a deadline and a cap: a bounded flood of
silent, garbage and wrong-token connections on 127.0.0.1 costs no thread, a bounded number of fds,
a rate-limited number of error reports, and the real peer keeps working.
"""
from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest

from pdkv._messenger import tcp_decode_info, tcp_frame, tcp_hello, tcp_parse_frame

TOKEN = bytes(range(32))
SIZE = 16 << 10


@pytest.fixture
def transport():  # these tests are about the tcp receiver only
    return "tcp"


def _dial(info: dict, node_id: int, token: bytes, stream: int = 0, num_streams: int = 1,
          timeout: float = 5.0) -> bytes:
    """Pose as node_id with `token`; returns the receiver's refusal reason (b"" if accepted)."""
    with socket.create_connection((info["host"], info["port"]), timeout=timeout) as s:
        s.sendall(tcp_hello(node_id, token, stream, num_streams))
        f = tcp_parse_frame(s.recv(40, socket.MSG_WAITALL))
        return s.recv(f["len"], socket.MSG_WAITALL) if f["len"] else b""


def test_session_token_binds_the_data_connection(spawn):
    a, b = spawn(1, num_streams=1), spawn(2, num_streams=1)
    a.alloc("src", SIZE, seed=3)
    b.alloc("dst", SIZE)
    lkey, rkey = a.register("src"), b.register("dst")
    b.m("grant", rkey, 1)
    ca, ia = a.m("prepare", 2, TOKEN)
    cb, ib = b.m("prepare", 1, TOKEN)
    info = tcp_decode_info(ib)
    # the info's random token no longer opens b's connection, nor does a wrong session token
    assert b"token" in _dial(info, 1, info["token"])
    assert b"token" in _dial(info, 1, TOKEN[:-1] + b"\x00")
    errs = [e[8] for e in b.wait("error", count=2, timeout=5) if e[0] == "error"]
    assert sum("rejected a connection" in r and "token" in r for r in errs) == 2, errs
    a.m("complete", ca, ib)  # the session token opens the connection's one stream
    b.m("complete", cb, ia)
    b.m("expect", 5, 1)
    a.m("write", ca, lkey, 0, rkey, 0, 512, imm=5)
    assert any(e[0] == "imm_done" for e in b.wait("imm_done"))
    assert b.read("dst", 0, 512) == a.read("src", 0, 512)


def test_a_valid_token_opens_only_the_agreed_streams(spawn):
    """Each index of the agreed num_streams once: 40 more hellos with the live token (as the
    probe sent) are refused at accept, counted, and start no receiver thread."""
    a, b = spawn(1, num_streams=2), spawn(2, num_streams=2)
    b.alloc("dst", SIZE)
    rkey = b.register("dst")
    b.m("grant", rkey, 1)
    ca, ia = a.m("prepare", 2, TOKEN)
    cb, ib = b.m("prepare", 1, TOKEN)
    a.m("complete", ca, ib)
    b.m("complete", cb, ia)
    info = tcp_decode_info(ib)
    deadline = time.monotonic() + 10
    while b.m("stats")["rx_threads"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    before = b.m("stats")
    assert before["rx_threads"] == 2, before
    reasons = [_dial(info, 1, TOKEN, stream=i % 2, num_streams=2) for i in range(2)]  # taken already
    reasons += [_dial(info, 1, TOKEN, stream=2 + i, num_streams=42) for i in range(38)]  # more streams
    reasons += [_dial(info, 1, TOKEN, stream=5, num_streams=2), _dial(info, 1, TOKEN, 0, num_streams=65)]
    assert all(b"accepted already" in r for r in reasons[:2]), reasons[:2]
    assert all(b"says 42 streams, its first stream said 2" in r for r in reasons[2:40]), reasons[2]
    assert b"stream 5 of connection" in reasons[40] and b"outside its 2 streams" in reasons[40]
    assert b"says 65 streams (1..64)" in reasons[41]
    after = b.m("stats")
    assert after["rx_threads"] == 2 and after["refused_conns"] == before["refused_conns"] + 42, after
    b.m("expect", 7, 1)  # the two real streams still carry writes
    a.alloc("src", SIZE, seed=4)
    a.m("write", ca, a.register("src"), 0, rkey, 0, 1024, imm=7)
    assert any(e[0] == "imm_done" for e in b.wait("imm_done"))
    assert b.read("dst", 0, 1024) == a.read("src", 0, 1024)


def test_a_peer_without_the_session_token_is_refused(spawn):
    a, b = spawn(1, num_streams=1), spawn(2, num_streams=1)
    b.alloc("dst", SIZE)
    b.m("grant", b.register("dst"), 1)
    ca, _ = a.m("prepare", 2)  # a has no session token: it presents the info's random token
    cb, ib = b.m("prepare", 1, TOKEN)
    with pytest.raises(Exception, match="PeerConnectionError.*token"):
        a.m("complete", ca, ib)
    assert b.read("dst") == bytes(SIZE)
    with pytest.raises(Exception, match="16..32 bytes"):
        a.m("prepare", 2, b"short")


def _flood(info: dict, n: int) -> list[socket.socket]:
    """n connections to the receiver, kept open: silent, garbage, wrong-token hellos, in turn."""
    socks = []
    for i in range(n):
        s = socket.create_connection((info["host"], info["port"]), timeout=5)
        if i % 3 == 1:
            s.sendall(os.urandom(100))
        elif i % 3 == 2:
            s.sendall(tcp_hello(1, os.urandom(32)) + tcp_frame(0, 0, 8) + b"\xee" * 8)
        socks.append(s)
    return socks


def test_unauthenticated_connections_get_no_thread_and_bounded_fds(spawn):
    cap, n = 16, 150
    b = spawn(2, num_streams=1, handshake_ms=300, max_pending=cap, max_per_source=cap)
    a = spawn(1, num_streams=1)
    b.alloc("dst", SIZE)
    rkey = b.register("dst")
    b.m("grant", rkey, 1)
    cb, ib = b.m("prepare", 1, TOKEN)
    info = tcp_decode_info(ib)
    base = b.resources()
    peak = dict(base)
    socks = []
    try:
        for _ in range(5):  # 5 bursts, sampling the receiver's /proc in between
            socks += _flood(info, n // 5)
            r, st = b.resources(), b.m("stats")
            peak = {k: max(peak[k], r[k]) for k in peak}
            assert st["pending_conns"] <= cap and st["rx_threads"] == 0, st
        deadline = time.monotonic() + 10
        while b.m("stats")["refused_conns"] < n and time.monotonic() < deadline:
            time.sleep(0.05)
        st = b.m("stats")
    finally:
        for s in socks:
            s.close()
    assert st["refused_conns"] >= n and st["pending_conns"] == 0, st
    assert peak["threads"] == base["threads"], (base, peak)  # not one thread for any of them
    assert peak["fds"] <= base["fds"] + cap + 2, (base, peak)  # the cap bounds fds too
    errs = [e[8] for e in b.wait("error", timeout=3) if e[0] == "error"]
    errs += [e[8] for e in b.wait(timeout=1.2) if e[0] == "error"]  # the summary of the last second
    assert 1 <= len(errs) <= 30, errs  # rate-limited: 5 reports per second, the rest summarised
    assert any("more connections" in r for r in errs), errs
    # the real peer still connects and writes; its stream gets the only receiver thread
    a.alloc("src", SIZE, seed=9)
    ca, ia = a.m("prepare", 2, TOKEN)
    a.m("complete", ca, ib)
    b.m("complete", cb, ia)
    b.m("expect", 1, 1)
    a.m("write", ca, a.register("src"), 0, rkey, 0, 256, imm=1)
    assert any(e[0] == "imm_done" for e in b.wait("imm_done"))
    assert np.frombuffer(b.read("dst", 0, 256), np.uint8).tobytes() == a.read("src", 0, 256)
    assert b.m("stats")["rx_threads"] == 1


def test_one_source_cannot_take_every_handshake_slot(spawn):
    # a flood from 127.0.0.2 holds at most max_per_source slots; the real peer (127.0.0.1) still
    # gets its handshake while the flood's sockets are open
    b = spawn(2, num_streams=1, handshake_ms=3000, max_pending=8, max_per_source=2)
    a = spawn(1, num_streams=1)
    cb, ib = b.m("prepare", 1, TOKEN)
    info = tcp_decode_info(ib)
    socks = []
    try:
        for _ in range(12):
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.connect((info["host"], info["port"]))
            socks.append(s)
        deadline = time.monotonic() + 5
        while b.m("stats")["refused_conns"] < 10 and time.monotonic() < deadline:
            time.sleep(0.02)
        st = b.m("stats")
        assert st["pending_conns"] == 2 and st["refused_conns"] >= 10, st
        ca, ia = a.m("prepare", 2, TOKEN)
        a.m("complete", ca, ib)  # accepted although 127.0.0.2 keeps its two sockets waiting
        b.m("complete", cb, ia)
        deadline = time.monotonic() + 10  # the receive thread starts once the accepted stream's token is read
        while b.m("stats")["rx_threads"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert b.m("stats")["rx_threads"] == 1
    finally:
        for s in socks:
            s.close()
