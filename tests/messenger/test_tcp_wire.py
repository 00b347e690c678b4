"""The tcp receiver against arbitrary bytes: a raw socket speaks the wire format (built by the
same C code the sender uses) to a real tcp Messenger. Fuzzed with hypothesis, bounded."""
from __future__ import annotations

import select
import socket
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdkv._messenger import (InvalidRequestError, Messenger, tcp_decode_info, tcp_frame, tcp_hello,
                             tcp_parse_frame)
from pdkv.transports import TcpOptions

SIZE = 16 << 10
GUARD = 1024
HDR = 40


# ---- the header parser alone ----

# random bytes, and random bytes behind a valid magic so the parser gets past its first check
headers = st.one_of(st.binary(min_size=HDR, max_size=HDR),
                    st.binary(min_size=HDR - 4, max_size=HDR - 4).map(lambda b: b"PDKF" + b))


@settings(max_examples=600, deadline=None)
@given(headers)
def test_parser_accepts_only_what_the_encoder_emits(raw):
    try:
        f = tcp_parse_frame(raw)
    except InvalidRequestError as e:
        assert e.errno == 71 and str(e)  # EPROTO with a reason
        return
    types = {1: "data", 2: "error", 3: "bye", 4: "ack"}
    again = tcp_frame(f["key"], f["off"], f["len"], f["imm"] if f["flags"] else None, types[f["type"]])
    assert again == raw


@settings(max_examples=600, deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
       st.integers(0, 2**32 - 1), st.integers(0, HDR - 1), st.integers(1, 255))
def test_any_single_byte_change_is_caught(key, off, length, imm, pos, flip):
    raw = bytearray(tcp_frame(key, off, length, imm))
    assert tcp_parse_frame(bytes(raw))["len"] == length
    raw[pos] ^= flip
    with pytest.raises(InvalidRequestError):
        tcp_parse_frame(bytes(raw))


# ---- a live receiver ----

class Receiver:
    """A tcp Messenger (node 2) with one guarded region granted to node 1, and a prepared
    connection whose token lets a raw socket pose as node 1."""

    def __init__(self):
        self.m = Messenger("tcp", 2, TcpOptions(num_streams=1))
        self.raw = np.full(SIZE + 2 * GUARD, 0xA5, dtype=np.uint8)
        self.region = self.raw[GUARD:GUARD + SIZE]
        self.region[:] = 0
        self.key = self.m.register(self.region)
        self.m.grant(self.key, 1)
        self.other = self.m.register(np.zeros(64, dtype=np.uint8))  # granted to nobody
        self.conn = None
        self.fresh()

    def fresh(self) -> None:
        """A new prepared connection (its one stream can be opened once), the last one dropped."""
        if self.conn is not None:
            self.m.disconnect(self.conn)
        self.conn, info = self.m.prepare(1)
        self.info = tcp_decode_info(info)

    def dial(self, token=None) -> socket.socket:
        if token is None:
            self.fresh()
        s = socket.create_connection((self.info["host"], self.info["port"]))
        s.sendall(tcp_hello(1, self.info["token"] if token is None else token))
        ack = s.recv(HDR, socket.MSG_WAITALL)
        f = tcp_parse_frame(ack)
        reason = s.recv(f["len"], socket.MSG_WAITALL) if f["len"] else b""
        assert f["type"] == 4
        return s, reason

    def events(self, until, timeout=5.0):
        out, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline and not until(out):
            select.select([self.m.fileno()], [], [], 0.05)
            out += self.m.drain()
        return out

    def guards_ok(self) -> bool:
        return bool((self.raw[:GUARD] == 0xA5).all() and (self.raw[-GUARD:] == 0xA5).all())


@pytest.fixture(scope="module")
def rx():
    r = Receiver()
    yield r
    r.m.close()


frames = st.lists(st.tuples(st.integers(0, SIZE), st.integers(0, 2048), st.binary(min_size=1, max_size=1)),
                  max_size=6)
BAD = ["none", "foreign_key", "unknown_key", "off_past_end", "len_past_end", "len_wraps", "corrupt_byte",
       "truncated_header", "truncated_payload", "garbage"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames, st.sampled_from(BAD), st.integers(0, HDR - 1), st.binary(min_size=HDR, max_size=HDR))
def test_receiver_lands_valid_frames_and_refuses_the_rest(rx, good, bad, pos, garbage):
    rx.region[:] = 0
    rx.m.drain()
    model = np.zeros(SIZE, dtype=np.uint8)
    s, reason = rx.dial()
    assert reason == b""
    wire = b""
    for i, (off, ln, fill) in enumerate(good):
        ln = min(ln, SIZE - off)
        payload = bytes([fill[0]]) * ln
        wire += tcp_frame(rx.key, off, ln, imm=7) + payload
        model[off:off + ln] = fill[0]  # one stream is ordered: later frames overwrite earlier
    hdr = {"foreign_key": tcp_frame(rx.other, 0, 8), "unknown_key": tcp_frame(rx.key + (1 << 40), 0, 8),
           "off_past_end": tcp_frame(rx.key, SIZE + 1, 1), "len_past_end": tcp_frame(rx.key, SIZE - 4, 8),
           "len_wraps": tcp_frame(rx.key, 16, 2**64 - 8), "garbage": garbage}.get(bad)
    if bad == "corrupt_byte":
        b = bytearray(tcp_frame(rx.key, 0, 8))
        b[pos] ^= 0x40
        hdr = bytes(b)
    if bad == "truncated_header":
        hdr = tcp_frame(rx.key, 0, 8)[:pos]
    if bad == "truncated_payload":
        hdr = tcp_frame(rx.key, 0, 64) + b"\x77" * 10  # 10 of 64 bytes, then the writer is gone
        model[:10] = 0x77  # bytes that arrived inside the target range may land (as with RDMA)
    elif hdr is not None:
        hdr += b"\xee" * 8  # a payload that must never be written
    if hdr is not None:
        wire += hdr
    n = len(good)
    if n:
        rx.m.expect(7, n)
    try:
        s.sendall(wire)
        s.shutdown(socket.SHUT_WR)
    except OSError:  # the receiver may already have refused and closed
        pass
    evs = rx.events(lambda e: any(x.kind == "error" for x in e) and (n == 0 or any(x.kind == "imm_done" for x in e)))
    errors = [e for e in evs if e.kind == "error"]
    s.close()
    assert errors, evs  # refused frames and ends of stream are reported
    if bad == "none":
        assert "closed the connection" in errors[0].reason, errors
    else:
        assert errors[0].peer == 1 and errors[0].status < 0
    assert np.array_equal(rx.region, model)
    assert rx.guards_ok()
    if n:
        assert [(e.imm, e.count) for e in evs if e.kind == "imm_done"] == [(7, n)]


def test_hello_with_a_foreign_token_is_refused(rx):
    rx.m.drain()
    s, reason = rx.dial(token=bytes([rx.info["token"][0] ^ 1]) + rx.info["token"][1:])
    assert b"token" in reason
    s.close()
    evs = rx.events(lambda e: any(x.kind == "error" for x in e))
    assert any("rejected a connection" in e.reason for e in evs)
