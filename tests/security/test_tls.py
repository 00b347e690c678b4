"""Optional TLS on the control channel (messenger.tls: cert, key, ca), with certificates made at
test time (tests/security/_pki.py, the openssl command): a TLS pair (mutual, TLS 1.3, the HMAC
handshake inside) serves the colocated engine's tokens; a peer without a certificate, with one
from another CA, or speaking plain text is refused clearly and quickly, from either side, and
the node keeps serving; a flood of plain-text connections to the TLS listener is bounded; config
mistakes name the field."""
from __future__ import annotations

import asyncio
import socket
import ssl
import time

import pytest
from _cluster import Cluster, assert_colocated_answer, make_engine, node_config, post_completion, wait_for
from _hostile import closed_by_peer, proc_counts
from _pki import have_openssl, make_pki

from pdkv.auth import write_secret_file
from pdkv.config import ConfigError, config_from_dict
from pdkv.config.sections import TLSConfig
from pdkv.control import ControlChannel, ControlError, Hello, TLSRefused
from pdkv.tls import client_context, server_context
from pdkv.server.app import NODE

pytestmark = pytest.mark.skipif(have_openssl() is not None, reason=str(have_openssl()))
PROMPT = range(5, 30)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory, pki):
    f = tmp_path_factory.mktemp("secret") / "cluster.secret"
    write_secret_file(f)
    c = Cluster(tiny_model_dir,
                prefill_over={"messenger__secret_file": str(f), "messenger__tls": pki["prefill"],
                              "messenger__handshake_timeout_s": 2.0, "messenger__max_control_per_source": 8},
                decode_over={"messenger__secret_file": str(f), "messenger__tls": pki["decode"]})
    c.pc = c.prefill.app[NODE].coordinator
    c.port = c.prefill.app[NODE].control_port
    c.secret = f.read_text().strip().encode()
    c.model_dir = tiny_model_dir
    yield c
    c.stop()


def still_serves(c):
    assert_colocated_answer(c.url, c.model_name(), c.model_dir, PROMPT, 4)
    wait_for(c.pools_full, 10, "every page back in both pools")
    assert len(c.pc.links) == 1 and not c.pc.jobs  # only the real decode node


def a_hello():
    return Hello(node_id=77, role="decode", model_fingerprint="x", dtype="float32", kv_layout="HND", page_size=4,
                 transport={"name": "tcp"})


def test_tls_pair_serves_the_colocated_tokens(cluster):
    ch = cluster.coordinator.peers[0].channel
    tls = ch.writer.get_extra_info("ssl_object")
    assert tls is not None and tls.version() == "TLSv1.3"
    assert dict(x[0] for x in tls.getpeercert()["subject"])["commonName"] == "prefill"
    assert ch.authenticated  # the HMAC handshake ran inside TLS
    link = cluster.pc.links[0].channel
    assert dict(x[0] for x in link.writer.get_extra_info("peercert")["subject"])["commonName"] == "decode"
    for n in (1, 4, 9):
        assert_colocated_answer(cluster.url, cluster.model_name(), cluster.model_dir, range(5, 5 + 7 * n), 5)
    still_serves(cluster)


def _dial(port, ctx, secret, timeout=5.0):
    async def main():
        t0 = time.monotonic()
        try:
            ch = await ControlChannel.connect("127.0.0.1", port, a_hello(), timeout, secret=secret, ssl=ctx)
        except ControlError as e:
            return e, time.monotonic() - t0
        ch.close()
        return ch, time.monotonic() - t0
    return asyncio.run(main())


@pytest.mark.parametrize("who", ["no-certificate", "other-ca"])
def test_a_peer_without_a_cluster_certificate_is_refused(cluster, pki, who):
    if who == "no-certificate":  # trusts the cluster CA, presents nothing
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.load_verify_locations(pki["prefill"]["ca"])
    else:  # a valid certificate, from another CA, trusting the cluster's CA so it gets that far
        ctx = client_context(TLSConfig(cert=pki["stranger"]["cert"], key=pki["stranger"]["key"],
                                       ca=pki["prefill"]["ca"]))
    got, took = _dial(cluster.port, ctx, cluster.secret)
    assert isinstance(got, TLSRefused), got
    # the words depend on whether the alert or the close arrives first; both name the certificate
    assert "TLS" in str(got) and "certificate" in str(got), got
    assert took < 2.5
    still_serves(cluster)


def test_a_listener_with_a_certificate_from_another_ca_is_refused_by_the_dialler(pki):
    """A decode node dialling an impostor prefill listener (certificate from another CA)."""
    srv_ctx = server_context(TLSConfig(**pki["stranger"]))

    async def main():
        async def on_conn(reader, writer):
            await asyncio.sleep(1)
            writer.close()
        srv = await asyncio.start_server(on_conn, "127.0.0.1", 0, ssl=srv_ctx)
        port = srv.sockets[0].getsockname()[1]
        try:
            with pytest.raises(TLSRefused, match="not signed by the cluster's CA"):
                await ControlChannel.connect("127.0.0.1", port, a_hello(), 3, secret=b"s" * 32,
                                             ssl=client_context(TLSConfig(**pki["decode"])))
        finally:
            srv.close()
    asyncio.run(main())


def test_plain_text_and_tls_do_not_mix_and_say_so(cluster, pki):
    # a plain-text dialler at the TLS listener: refused at once, not after the deadline
    got, took = _dial(cluster.port, None, cluster.secret)
    assert isinstance(got, ControlError) and took < 2.5, got

    # a TLS dialler at a plain-text listener: told the peer does not speak TLS
    async def main():
        async def on_conn(reader, writer):
            try:
                await ControlChannel.accept(reader, writer, a_hello(), 2, secret=b"s" * 32)
            except ControlError as e:
                box["server"] = e
        srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:
            with pytest.raises(TLSRefused) as e:
                await ControlChannel.connect("127.0.0.1", port, a_hello(), 2, secret=b"s" * 32,
                                             ssl=client_context(TLSConfig(**pki["decode"])))
            box["client"] = e.value
            await asyncio.sleep(0.2)
        finally:
            srv.close()
    box = {}
    asyncio.run(main())
    assert "speaks TLS and this node does not" in str(box["server"]), box
    assert "TLS" in str(box["client"])
    still_serves(cluster)


def test_flood_of_plain_text_connections_to_the_tls_listener_is_bounded(cluster):
    """60 connections that send plain bytes or nothing: at most max_control_per_source held, each
    closed by the handshake deadline (2 s); the real pair keeps serving; fds and threads return."""
    before = proc_counts()
    socks = []
    for i in range(60):
        s = socket.create_connection(("127.0.0.1", cluster.port), timeout=5)
        if i % 2:
            s.sendall(b"\0\0\0\x10" + b"x" * 16)  # a plain-text frame where a ClientHello belongs
        socks.append(s)
    still_serves(cluster)
    assert proc_counts()["threads"] <= before["threads"] + 4
    adm = cluster.pc.listener.admission
    assert adm.num_handshaking <= 8 and adm.num_links == 1

    wait_for(lambda: all(closed_by_peer(s) for s in socks), 10, "every flood connection closed by the node")
    for s in socks:
        s.close()
    wait_for(lambda: proc_counts()["fds"] <= before["fds"] + 2, 10, "fds back to their level")
    wait_for(lambda: adm.num_handshaking == 0 and adm.num_links == 1, 5, "only the real pair held")
    still_serves(cluster)


def test_a_decode_node_with_a_foreign_certificate_fails_to_start_clearly(cluster, pki):
    from pdkv.disagg.node import DecodeNode
    from pdkv.server.runner import ServerThread

    dcfg = node_config(cluster.model_dir, "decode", messenger__prefill_peers=[f"127.0.0.1:{cluster.port}"],
                       messenger__tls={**pki["stranger"], "ca": pki["prefill"]["ca"]},
                       messenger__connect_timeout_s=120.0)
    eng = make_engine(dcfg)
    t0 = time.monotonic()
    with pytest.raises(TLSRefused):
        ServerThread(dcfg, eng, DecodeNode(dcfg, eng)).start()
    assert time.monotonic() - t0 < 60  # final at once, not redialled for connect_timeout_s (120 s)
    assert eng.allocator.num_free == eng.allocator.num_total
    still_serves(cluster)


def test_tls_config_mistakes_name_the_field(pki, tmp_path):
    base = {"role": "decode", "messenger": {"prefill_peers": ["127.0.0.1:1"]}}

    def cfg(tls):
        return config_from_dict({**base, "messenger": {**base["messenger"], "tls": tls}})

    with pytest.raises(ConfigError, match=r"messenger\.tls\.cert"):
        cfg({"key": pki["decode"]["key"], "ca": pki["decode"]["ca"]})  # a key without a certificate
    with pytest.raises(ConfigError, match=r"messenger\.tls\.key"):
        cfg({"cert": pki["decode"]["cert"], "ca": pki["decode"]["ca"]})
    with pytest.raises(ConfigError, match=r"messenger\.tls\.ca"):
        cfg({"cert": pki["decode"]["cert"], "key": pki["decode"]["key"]})
    with pytest.raises(ConfigError, match=r"messenger\.tls\.ca.*exists"):
        cfg({**pki["decode"], "ca": str(tmp_path / "missing.pem")})
    with pytest.raises(ConfigError, match=r"messenger\.tls.*cetr"):
        cfg({"cetr": "x"})  # an unknown field is named
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"messenger\.tls\.cert / messenger\.tls\.key"):
        server_context(TLSConfig(cert=str(garbage), key=pki["decode"]["key"], ca=pki["decode"]["ca"]))
    with pytest.raises(ConfigError, match=r"messenger\.tls\.cert / messenger\.tls\.key"):  # key of another cert
        server_context(TLSConfig(cert=pki["decode"]["cert"], key=pki["prefill"]["key"], ca=pki["decode"]["ca"]))
    with pytest.raises(ConfigError, match=r"messenger\.tls\.ca"):
        client_context(TLSConfig(cert=pki["decode"]["cert"], key=pki["decode"]["key"], ca=str(garbage)))
    assert server_context(TLSConfig()) is None and cfg({}).messenger.tls == TLSConfig()
