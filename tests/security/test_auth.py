"""Node authentication at the control channel (pdkv/auth.py, pdkv/control.py), over real
loopback sockets: the right secret works; a missing or wrong secret, a replayed handshake, an
echoed (reflected) HELLO and a tampered frame are refused with a clear error."""

import asyncio
import os
import stat
import struct

import msgpack
import pytest

from pdkv import auth
from pdkv.control import (PRE_AUTH_MAX_FRAME, AuthenticationFailed, ControlChannel, ControlError, Hello,
                          encode_frame, read_frame)

SECRET, OTHER = b"s" * 32, b"t" * 32


def hello(role):
    return Hello(node_id=1 if role == "decode" else 2, role=role, model_fingerprint="abc", dtype="float32",
                 kv_layout="HND", page_size=16, transport={"name": "tcp"})


async def pair(server_secret, client_secret):
    accepted = asyncio.get_running_loop().create_future()

    async def on_conn(reader, writer):
        try:
            accepted.set_result(await ControlChannel.accept(reader, writer, hello("prefill"), 5,
                                                            secret=server_secret))
        except Exception as e:  # noqa: BLE001 - surfaced through the future
            accepted.set_exception(e)

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        client = await ControlChannel.connect("127.0.0.1", port, hello("decode"), 5, secret=client_secret)
    except Exception as e:  # noqa: BLE001
        client = e
    try:
        server = await asyncio.wait_for(accepted, 5)
    except Exception as e:  # noqa: BLE001
        server = e
    srv.close()
    return client, server


def test_same_secret_authenticates_both_ways_and_shares_a_token():
    async def main():
        c, s = await pair(SECRET, SECRET)
        assert c.authenticated and s.authenticated
        assert c.token == s.token and 16 <= len(c.token) <= 32
        await c.send({"type": "PREFILL", "req": "r"})
        assert (await asyncio.wait_for(s.recv(), 5))["req"] == "r"
        c2, s2 = await pair(SECRET, SECRET)
        assert c2.token != c.token  # fresh nonces: every session its own token
        for ch in (c, s, c2, s2):
            ch.close()
    asyncio.run(main())


@pytest.mark.parametrize("server_secret,client_secret,words", [
    (SECRET, OTHER, "does not hold this cluster's secret"),
    (SECRET, None, "has a cluster secret and the peer has none"),
    (None, SECRET, "has a cluster secret and the peer has none"),
])
def test_missing_or_wrong_secret_is_refused_on_both_sides(server_secret, client_secret, words):
    async def main():
        c, s = await pair(server_secret, client_secret)
        assert isinstance(c, AuthenticationFailed) and isinstance(s, AuthenticationFailed), (c, s)
        assert words in str(c) + str(s)
    asyncio.run(main())


async def _raw_prefill(secret):
    """A prefill-side acceptor; returns (port, future of its outcome)."""
    done = asyncio.get_running_loop().create_future()

    async def on_conn(reader, writer):
        try:
            done.set_result(await ControlChannel.accept(reader, writer, hello("prefill"), 3, secret=secret))
        except Exception as e:  # noqa: BLE001
            done.set_exception(e)
    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1], done


def test_replayed_handshake_is_refused():
    """Record what a real decode node sends in a good handshake, replay it byte for byte to the
    same prefill node: its nonce is fresh, so the recorded proof does not verify."""
    async def main():
        srv, port, done = await _raw_prefill(SECRET)
        recorded = []
        # a recording relay between a real decode node and the prefill node
        async def relay(reader, writer):
            r2, w2 = await asyncio.open_connection("127.0.0.1", port)
            async def pump(src, dst, keep):
                while data := await src.read(65536):
                    if keep is not None:
                        keep.append(data)
                    dst.write(data)
                dst.close()
            await asyncio.gather(pump(reader, w2, recorded), pump(r2, writer, None), return_exceptions=True)
        relay_srv = await asyncio.start_server(relay, "127.0.0.1", 0)
        rport = relay_srv.sockets[0].getsockname()[1]
        good = await ControlChannel.connect("127.0.0.1", rport, hello("decode"), 5, secret=SECRET)
        assert (await asyncio.wait_for(done, 5)).authenticated
        good.close()
        srv.close()
        srv, port, done = await _raw_prefill(SECRET)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"".join(recorded))
        await writer.drain()
        with pytest.raises(AuthenticationFailed, match="does not hold"):
            await asyncio.wait_for(done, 5)
        frames = []
        with pytest.raises(ControlError):
            while True:
                frames.append(await asyncio.wait_for(read_frame(reader), 5))
        assert [f["type"] for f in frames] == ["AUTH", "REFUSE"]  # nothing past authentication
        writer.close()
        srv.close()
        relay_srv.close()
    asyncio.run(main())


def test_echoing_the_nodes_own_handshake_back_is_refused():
    """The attack of the issue: echo the prefill node's own frames back to it."""
    async def main():
        srv, port, done = await _raw_prefill(SECRET)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        first = await asyncio.wait_for(read_frame(reader), 5)
        writer.write(encode_frame(first))  # its own AUTH, nonce and all
        await writer.drain()
        with pytest.raises(AuthenticationFailed, match="own nonce"):
            await asyncio.wait_for(done, 5)
        writer.close()
        srv.close()
        # and with no secret at all: a HELLO before AUTH is not the protocol
        srv, port, done = await _raw_prefill(None)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.wait_for(read_frame(reader), 5)
        writer.write(encode_frame({"type": "HELLO", **hello("decode").__dict__}))
        await writer.drain()
        with pytest.raises(ControlError, match="expected AUTH"):
            await asyncio.wait_for(done, 5)
        writer.close()
        srv.close()
    asyncio.run(main())


def test_tampered_frame_after_authentication_breaks_the_channel():
    async def main():
        c, s = await pair(SECRET, SECRET)
        body = msgpack.packb({"type": "PREFILL", "req": "evil"})
        c.writer.write(struct.pack(">I", len(body) + 16) + body + b"\0" * 16)  # a frame without the MAC
        await c.writer.drain()
        with pytest.raises(ControlError, match="authentication check"):
            await asyncio.wait_for(s.recv(), 5)
        c.close(); s.close()
    asyncio.run(main())


def test_oversized_frame_before_authentication_is_refused_unread():
    async def main():
        srv, port, done = await _raw_prefill(SECRET)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(struct.pack(">I", 64 << 20) + b"\0" * 4096)  # announces 64 MiB, sends a little
        await writer.drain()
        with pytest.raises(ControlError, match=f"limit {PRE_AUTH_MAX_FRAME}"):
            await asyncio.wait_for(done, 5)
        writer.close()
        srv.close()
    asyncio.run(main())


def test_silent_peer_is_dropped_after_the_handshake_deadline():
    async def main():
        srv, port, done = await _raw_prefill(SECRET)  # 3 s handshake timeout
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        with pytest.raises(ControlError, match="within 3"):
            await asyncio.wait_for(done, 10)
        assert await asyncio.wait_for(reader.read(), 5) is not None  # the node closed it
        writer.close()
        srv.close()
    asyncio.run(main())


def test_secret_sources_and_their_checks(tmp_path):
    f = tmp_path / "secret"
    written = auth.write_secret_file(f)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    assert auth.load_secret(str(f), env={}) == written.encode()
    assert auth.load_secret(str(f), env={auth.SECRET_ENV: "e" * 20}) == b"e" * 20  # env wins
    assert auth.load_secret("", env={}) is None
    os.chmod(f, 0o644)
    with pytest.raises(auth.AuthError, match="readable by others"):
        auth.load_secret(str(f), env={})
    with pytest.raises(auth.AuthError, match="at least 16"):
        auth.load_secret("", env={auth.SECRET_ENV: "short"})


def test_no_secret_means_loopback_only_unless_insecure(caplog):
    auth.check_exposure({"messenger.control_host": "127.0.0.1", "messenger.host": "::1"}, None, False)
    with pytest.raises(auth.AuthError, match="messenger.control_host='0.0.0.0'"):
        auth.check_exposure({"messenger.control_host": "0.0.0.0"}, None, False)
    auth.check_exposure({"messenger.control_host": "0.0.0.0"}, SECRET, False)
    with caplog.at_level("WARNING"):
        auth.check_exposure({"messenger.control_host": "0.0.0.0"}, None, True)
    assert "INSECURE" in caplog.text


def test_a_node_that_stood_still_knows_it_was_itself():
    """A decode node frozen longer than the lease must not blame its peer: own_stall says so."""
    import time

    async def main():
        c, s = await pair(SECRET, SECRET)
        c.start_heartbeat(0.05, 0.5, lambda r: None)
        s.start_heartbeat(0.05, 0.5, lambda r: None)
        await asyncio.sleep(0.2)
        assert c.own_stall() is None
        time.sleep(0.8)  # this whole process (both sides) stands still, as under SIGSTOP
        assert c.own_stall() > 0.5
        await asyncio.sleep(0.2)
        assert c.own_stall() > 0.5 and not c.closed  # noticed, and the peer got a fresh lease
        c.close(); s.close()
    asyncio.run(main())
