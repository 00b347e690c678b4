"""tcp data streams with and without messenger.tls_data, through an on-path relay (real sockets,
loopback) that flips one payload byte in flight: on a plain stream the altered bytes land (what
docs/RELIABILITY.md says an on-path attacker can do); on a sealed stream (AES-256-GCM records
keyed from the session) the write is refused before it counts, and a wrong key opens nothing."""
from __future__ import annotations

import socket
import struct
import threading

import pytest

from pdkv._messenger import HAVE_CRYPTO, tcp_decode_info

TOKEN = bytes(range(32))
KEY = bytes(range(100, 132))
SIZE = (1 << 20) + 4096  # more than one scratch buffer (256 KiB) per record


@pytest.fixture
def transport():
    if not HAVE_CRYPTO:
        pytest.skip("pdkv built without libcrypto (libssl-dev)")
    return "tcp"


class Relay:
    """Forwards one connection to ``port``; flips the byte at offset ``flip_at`` of the writer's
    stream (None: forwards unchanged)."""

    def __init__(self, port: int, flip_at: int | None):
        self.port, self.flip_at = port, flip_at
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.listen_port = self.srv.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _pipe(self, src, dst, flip):
        seen = 0
        try:
            while data := src.recv(65536):
                if flip is not None and seen <= flip < seen + len(data):
                    data = bytearray(data)
                    data[flip - seen] ^= 0x01
                seen += len(data)
                dst.sendall(bytes(data))
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _run(self):
        conn, _ = self.srv.accept()
        up = socket.create_connection(("127.0.0.1", self.port))
        threading.Thread(target=self._pipe, args=(conn, up, self.flip_at), daemon=True).start()
        self._pipe(up, conn, None)


def _via(info: bytes, port: int) -> bytes:
    """``info`` (tcp prepare()'s) pointing the writer at ``port`` instead."""
    off = info.find(struct.pack("<H", tcp_decode_info(info)["port"]))
    return info[:off] + struct.pack("<H", port) + info[off + 2:]


def _pair(spawn, key_a, key_b, flip_at):
    a, b = spawn(1, num_streams=1), spawn(2, num_streams=1)
    a.alloc("src", SIZE, seed=11)
    b.alloc("dst", SIZE)
    lkey, rkey = a.register("src"), b.register("dst")
    b.m("grant", rkey, 1)
    ca, ia = a.m("prepare", 2, TOKEN, data_key=key_a)
    cb, ib = b.m("prepare", 1, TOKEN, data_key=key_b)
    relay = Relay(tcp_decode_info(ib)["port"], flip_at)
    a.m("complete", ca, _via(ib, relay.listen_port))
    b.m("complete", cb, ia)
    b.m("expect", 9, 1)
    a.m("write", ca, lkey, 0, rkey, 0, SIZE, imm=9)
    return a, b


# the writer's stream: hello (56 bytes), then a 40-byte header (plain) or a 56-byte header record
FLIP_PLAIN, FLIP_SEALED = 56 + 40 + 300_000, 56 + 56 + 300_000


def test_sealed_stream_carries_the_bytes_and_the_relay_sees_no_plaintext(spawn):
    a, b = _pair(spawn, KEY, KEY, None)
    assert any(e[0] == "imm_done" for e in b.wait("imm_done", timeout=20))
    assert b.read("dst") == a.read("src")


def test_a_byte_flipped_in_flight_lands_on_a_plain_stream(spawn):
    a, b = _pair(spawn, None, None, FLIP_PLAIN)
    assert any(e[0] == "imm_done" for e in b.wait("imm_done", timeout=20))  # counted as landed
    got, want = b.read("dst"), a.read("src")
    diff = [i for i in range(SIZE) if got[i] != want[i]]
    assert diff == [300_000], diff[:5]  # the attacker's change, in the granted range


def test_a_byte_flipped_in_flight_is_refused_on_a_sealed_stream(spawn):
    a, b = _pair(spawn, KEY, KEY, FLIP_SEALED)
    evs = b.wait("error", timeout=20)
    errs = [e[8] for e in evs if e[0] == "error"]
    assert any("failed its authentication check" in r for r in errs), errs
    assert not any(e[0] == "imm_done" for e in evs + b.wait(timeout=0.5))  # never counted


def test_a_writer_with_another_key_lands_nothing(spawn):
    a, b = _pair(spawn, bytes(32), KEY, None)
    evs = b.wait("error", timeout=20)
    assert any("failed its authentication check" in e[8] for e in evs if e[0] == "error"), evs
    assert b.read("dst", 0, 4096) == bytes(4096)  # the header record failed: not a byte written


def test_data_key_errors_name_the_problem(spawn):
    a = spawn(1, num_streams=1)
    with pytest.raises(Exception, match="a data key must be 32 bytes"):
        a.m("prepare", 2, TOKEN, data_key=b"short")
    from pdkv._messenger import Messenger

    m = Messenger("fake", 5)
    try:
        with pytest.raises(Exception, match=r"messenger.tls_data: the fake transport .*\(tcp only\)"):
            m.prepare(6, data_key=KEY)
    finally:
        m.close()
