"""The control channel over real loopback sockets: handshake, refusals, framing errors, leases."""

import asyncio
import struct
import time

import msgpack
import pytest

from pdkv.control import (MAX_FRAME, ControlChannel, ControlError, HandshakeRefused, Hello,
                          model_fingerprint, read_frame)


def hello(role, **kw):
    base = dict(node_id=1 if role == "decode" else 2, role=role, model_fingerprint="abc",
                dtype="float32", kv_layout="HND", page_size=16, parallel={"tp": 1},
                transport={"name": "tcp"})
    base.update(kw)
    return Hello(**base)


async def pair(server_hello, client_hello):
    """Start a listener that accepts with server_hello; connect with client_hello."""
    accepted: asyncio.Future = asyncio.get_running_loop().create_future()

    async def on_conn(reader, writer):
        try:
            accepted.set_result(await ControlChannel.accept(reader, writer, server_hello, timeout=5))
        except Exception as e:  # surfaced through the future
            accepted.set_exception(e)

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        client = await ControlChannel.connect("127.0.0.1", port, client_hello, timeout=5)
    except Exception as e:
        client = e
    try:
        server = await asyncio.wait_for(accepted, 5)
    except Exception as e:
        server = e
    srv.close()
    return client, server


def test_handshake_and_messages_roundtrip():
    async def main():
        client, server = await pair(hello("prefill"), hello("decode"))
        assert client.peer.role == "prefill" and server.peer.role == "decode"
        await client.send({"type": "PREFILL", "req": "r1", "tokens": list(range(100)), "imm": 7})
        msg = await asyncio.wait_for(server.recv(), 5)
        assert msg == {"type": "PREFILL", "req": "r1", "tokens": list(range(100)), "imm": 7}
        client.close(); server.close()
    asyncio.run(main())


@pytest.mark.parametrize("field,value,words", [
    ("model_fingerprint", "zzz", "model_fingerprint"),
    ("page_size", 32, "page_size: this"),
    ("kv_layout", "NHD", "kv_layout"),
    ("dtype", "bfloat16", "dtype"),
    ("parallel", {"tp": 2}, "parallel"),
])
def test_handshake_refuses_and_names_the_difference(field, value, words):
    async def main():
        client, server = await pair(hello("prefill", **{field: value}), hello("decode"))
        for side in (client, server):
            assert isinstance(side, HandshakeRefused), side
            assert words in str(side)
        # both values are in the message so an operator sees what to fix
        assert repr(value) in str(client) or repr(value) in str(server)
    asyncio.run(main())


def test_oversized_and_garbage_frames_are_clear_errors():
    async def main():
        got = []

        async def on_conn(reader, writer):
            try:
                await ControlChannel.accept(reader, writer, hello("prefill"), timeout=5)
            except ControlError as e:
                got.append(str(e))

        srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        for k, payload in enumerate((struct.pack(">I", MAX_FRAME + 1),
                                     struct.pack(">I", 3) + b"\xc1\xc1\xc1",
                                     struct.pack(">I", 2) + msgpack.packb([1]))):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(payload)
            await w.drain()
            # one connection at a time, so got[k] is payload k's error; the wait is a hang guard
            await until(lambda: len(got) > k, f"the error for payload {k}")
            w.close()
        srv.close()
        return got
    got = asyncio.run(main())
    assert len(got) == 3
    assert "limit" in got[0]
    assert "undecodable" in got[1] or "not a map" in got[1]
    assert "not a map" in got[2]


def _read(data: bytes, limit: int):
    async def main():
        r = asyncio.StreamReader()
        r.feed_data(struct.pack(">I", len(data)) + data)
        r.feed_eof()
        return await read_frame(r, None, limit)
    return asyncio.run(main())


def test_decoded_frames_are_bounded_and_a_refused_frame_leaves_nothing_alive():
    """Containers decode to at most limit // 8 elements in all (each one's length checked before
    it is built), and the error's traceback holds neither the frame's bytes nor what they decoded
    to (a refused 16 MiB frame's ~128 MB list lived until the collector ran)."""
    limit = 64 << 10  # 8192 elements
    assert len(_read(msgpack.packb({"type": "P", "tokens": list(range(8000))}), limit)["tokens"]) == 8000
    cases = [(msgpack.packb([None] * 60000), "exceeds max_array_len"),  # nils in place of a map
             (msgpack.packb({"type": "P", "a": [[]] * 5000, "b": [[]] * 5000}), "elements in all"),
             (msgpack.packb({"type": "P", "a": [0] * 5000, "b": [None] * 5000}), "elements in all"),
             (msgpack.packb([0] * 5000), "not a map")]
    for data, words in cases:
        with pytest.raises(ControlError, match=words) as info:
            _read(data, limit)
        tb = info.value.__traceback__
        while tb is not None:
            mine = "/pdkv/" in tb.tb_frame.f_code.co_filename  # the test's own frames hold `data`
            for name, v in (tb.tb_frame.f_locals.items() if mine else ()):
                size = len(v) if isinstance(v, (bytes, bytearray, memoryview, list, dict)) else 0
                assert size < 1024, f"{tb.tb_frame.f_code.co_name}: {name} ({size}) alive in the traceback"
            tb = tb.tb_next


class FakeClock:
    """pdkv.control's view of time.monotonic, moved by the test: a lease then expires because
    the test says so, never because a loaded machine was slow (asyncio keeps the real clock)."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()


@pytest.fixture
def clock(monkeypatch):
    import pdkv.control

    c = FakeClock()
    monkeypatch.setattr(pdkv.control, "time", c)
    return c


async def until(cond, what: str, timeout: float = 30.0):
    """Wait for cond() -- the timeout is a hang guard, never the thing tested."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"hang guard: {what} did not happen in {timeout} s")
        await asyncio.sleep(0.005)


def test_silent_peer_is_declared_dead_once_and_only_after_its_lease(clock):
    async def main():
        client, server = await pair(hello("prefill"), hello("decode"))
        deaths = []
        # server beats; the client reads the beats but never answers (no heartbeat of its own)
        server.start_heartbeat(interval=0.01, lease=10.0, on_dead=deaths.append)
        for _ in range(3):
            msg = await asyncio.wait_for(read_frame(client.reader), 30)
            assert msg["type"] == "HEARTBEAT"
        assert deaths == [] and not server.closed  # silent, but for 0 s of its 10 s lease
        clock.now += 9.0
        for _ in range(3):  # beats go on after 9 s of silence: still within the lease
            assert (await asyncio.wait_for(read_frame(client.reader), 30))["type"] == "HEARTBEAT"
        assert deaths == [] and not server.closed
        clock.now += 1.5  # 10.5 s of silence
        await until(lambda: deaths, "declaring the silent peer dead")
        assert deaths == ["peer silent for 10.5 s (lease 10.0 s)"]
        assert server.closed
        await until(server._hb_task.done, "the heartbeat task ending")  # nothing can fire again
        assert len(deaths) == 1
        client.close()
    asyncio.run(main())


def test_live_peer_keeps_its_lease_and_heartbeats_are_invisible(clock):
    async def main():
        client, server = await pair(hello("prefill"), hello("decode"))
        deaths, got = [], []
        server.start_heartbeat(interval=0.01, lease=1.0, on_dead=deaths.append)
        client.start_heartbeat(interval=0.01, lease=1.0, on_dead=deaths.append)

        async def drain(ch):
            try:
                while True:
                    got.append(await ch.recv())
            except ControlError:
                pass
        tasks = [asyncio.create_task(drain(server)), asyncio.create_task(drain(client))]
        # 10 x 0.6 s = 6 s of (fake) time, six leases: each side's heartbeats renew the other's
        # lease after every step, so neither is ever silent for more than 0.6 s.
        for _ in range(10):
            clock.now += 0.6
            await until(lambda: deaths or server.last_heard == client.last_heard == clock.now,
                        "a heartbeat renewing both leases")
            assert deaths == []
        await client.send({"type": "CANCEL", "req": "x"})
        await until(lambda: got, "the CANCEL arriving")
        assert got == [{"type": "CANCEL", "req": "x"}]  # the heartbeats never surfaced in recv()
        assert not server.closed and not client.closed
        client.close(); server.close()
        for t in tasks:
            t.cancel()
    asyncio.run(main())


def test_fingerprint_sees_shapes_and_config_but_not_paths():
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "_name_or_path": "/a"}
    shapes = {"w": (64, 64)}
    fp = model_fingerprint(cfg, shapes)
    assert fp == model_fingerprint({**cfg, "_name_or_path": "/b"}, shapes)
    assert fp != model_fingerprint({**cfg, "hidden_size": 128}, shapes)
    assert fp != model_fingerprint(cfg, {"w": (64, 65)})
