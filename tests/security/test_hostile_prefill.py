"""Hostile decode-node peers against a real prefill node (tcp, loopback) of a cluster with a
secret: unauthenticated and wrong-secret peers, duplicate and malformed PREFILLs, floods of idle
control connections. Each ends with a clear refusal, the real decode node keeps serving with
unchanged outputs, /proc counts stay bounded and no page is leaked."""

import asyncio
import socket
import time

import pytest
from _cluster import Cluster, post_completion, wait_for
from _hostile import HostileDecode, blackhole_info, closed_by_peer, proc_counts

from pdkv.auth import write_secret_file
from pdkv.control import AuthenticationFailed, ControlChannel, ControlError
from pdkv.disagg import protocol as P
from pdkv.server.app import NODE

PROMPT = {"prompt": "Roma non fu fatta in un giorno", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    f = tmp_path_factory.mktemp("secret") / "cluster.secret"
    write_secret_file(f)
    over = {"messenger__secret_file": str(f), "messenger__handshake_timeout_s": 2.0,
            "messenger__max_control_per_source": 8, "messenger__max_control_conns": 16,
            "server__max_prompt_logprobs_tokens": 16}
    c = Cluster(tiny_model_dir, prefill_over=over, decode_over={"messenger__secret_file": str(f)})
    c.secret = f.read_text().strip().encode()
    c.pc = c.prefill.app[NODE].coordinator
    c.expected = post_completion(c.url, {**PROMPT, "model": c.model_name()})[1]["choices"][0]["text"]
    yield c
    c.stop()


def still_serves(c):
    status, body = post_completion(c.url, {**PROMPT, "model": c.model_name()})
    assert status == 200 and body["choices"][0]["text"] == c.expected, body
    wait_for(c.pools_full, 10, "every page back in both pools")
    assert len(c.pc.jobs) == 0


def test_real_pair_is_authenticated(cluster):
    assert all(link.channel.authenticated for link in cluster.pc.links)
    assert cluster.coordinator.peers[0].channel.authenticated


@pytest.mark.parametrize("secret", [None, b"w" * 32], ids=["unauthenticated", "wrong-secret"])
def test_peer_without_the_secret_is_refused(cluster, secret):
    async def main():
        h = HostileDecode(cluster.pc)
        try:
            with pytest.raises(AuthenticationFailed):
                await h.connect(cluster.prefill.app[NODE].control_port, secret)
        finally:
            h.close()
    asyncio.run(main())
    assert len(cluster.pc.links) == 1  # only the real decode node
    still_serves(cluster)


def test_duplicate_prefill_is_refused_and_the_first_job_finishes(cluster):
    async def main():
        h = HostileDecode(cluster.pc)
        try:
            ch = await h.connect(cluster.prefill.app[NODE].control_port, cluster.secret)
            msg = {"type": P.PREFILL, "req": "dup", "tokens": list(range(1, 30)), "pages": list(range(8)),
                   "imm": 7, "hidden_off": 0, "expected": 1}
            await ch.send(msg)
            for _ in range(20):  # a few dozen leaked the pool before
                await ch.send({**msg, "pages": list(range(8, 16))})
            got = await h.until(lambda m: m["type"] == P.DONE_AT and m["req"] == "dup")
            fails = [m for m in got if m["type"] == P.FAIL]
            assert len(fails) >= 1 and all("duplicate PREFILL" in m["reason"] and "'dup'" in m["reason"]
                                          for m in fails)
        finally:
            h.close()
    asyncio.run(main())
    still_serves(cluster)


@pytest.mark.parametrize("bad,words", [
    ({"pages": "0,1"}, "pages must be"),
    ({"pages": [-1, 2]}, "pages must be"),
    ({"pages": [10**6]}, "pages must be"),
    ({"imm": -5}, "imm must be"),
    ({"tokens": [1, "x"]}, "tokens must be"),
    ({"req": None}, "req must be"),
    ({"hidden_off": 1.5}, "hidden_off must be"),
    # prefix caching: the decode node's cached prefix must be whole pages inside the tokens sent,
    # and the pages must be exactly those after it (page size 4 here)
    ({"cached": "4"}, "cached must be an integer"),
    ({"cached": -4}, "cached must be an integer"),
    ({"cached": 3}, "cached must be an integer in [0, 3)"),
    ({"tokens": list(range(1, 10)), "cached": 2, "pages": [0, 1]}, "cached must be a multiple of the page size 4"),
    ({"tokens": list(range(1, 10)), "cached": 4, "pages": [0, 1, 2]}, "pages must name 2 page(s)"),
    ({"tokens": list(range(1, 10)), "pages": [0]}, "pages must name 3 page(s)"),
    ({"runs": [[0, 1]], "kv_rkeys": [1], "hidden_rkey": 2}, "kv_rkeys must be"),  # one key per layer needed
    ({"runs": [[1, 1]], "kv_rkeys": [1, 1], "hidden_rkey": 2}, "page 0 is in no granted run"),
    ({"runs": [[0, 1]], "kv_rkeys": [1, 1], "hidden_rkey": None}, "hidden_rkey must be"),
    # echo + logprobs: the alternatives asked are bounded, the prompt by the prefill node's
    # server.max_prompt_logprobs_tokens (16 here), and the held-back last token is needed
    ({"prompt_logprobs": 21, "last_token": 5}, "prompt_logprobs must be an integer in [0, 20]"),
    ({"prompt_logprobs": "2", "last_token": 5}, "prompt_logprobs must be"),
    ({"prompt_logprobs": True, "last_token": 5}, "prompt_logprobs must be"),
    ({"prompt_logprobs": 1}, "last_token must be"),
    ({"prompt_logprobs": 1, "last_token": -3}, "last_token must be"),
    ({"tokens": list(range(1, 17)), "pages": [0, 1, 2, 3], "prompt_logprobs": 1, "last_token": 5},
     "the prompt's 17 tokens exceed this prefill node's server.max_prompt_logprobs_tokens 16"),
])
def test_malformed_prefill_is_answered_with_fail(cluster, bad, words, caplog):
    async def main():
        h = HostileDecode(cluster.pc)
        try:
            ch = await h.connect(cluster.prefill.app[NODE].control_port, cluster.secret)
            await ch.send({"type": P.PREFILL, "req": "m", "tokens": [1, 2, 3], "pages": [0], "imm": 1,
                           "hidden_off": 0, **bad})
            got = await h.until(lambda m: m["type"] == P.FAIL)
            assert words in got[-1]["reason"] and got[-1]["posted"] == 0
        finally:
            h.close()
    asyncio.run(main())
    assert "Traceback" not in caplog.text
    still_serves(cluster)


def test_prompt_logprobs_come_before_done_at_bounded_by_what_was_asked(cluster):
    """A PREFILL asking for prompt logprobs gets PROMPT_LOGPROBS (one entry per prompt token after
    the first, the held-back last token included, N alternatives each) before its DONE_AT; one
    not asking (an older decode node) gets none."""
    from pdkv.disagg import prompt_logprobs as PL

    async def main():
        h = HostileDecode(cluster.pc)
        try:
            ch = await h.connect(cluster.prefill.app[NODE].control_port, cluster.secret)
            tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5]
            base = {"type": P.PREFILL, "tokens": tokens, "pages": [0, 1, 2], "imm": 1, "hidden_off": 0}
            await ch.send({**base, "req": "lp", "prompt_logprobs": 3, "last_token": 35})
            got = await h.until(lambda m: m["type"] in (P.DONE_AT, P.FAIL) and m["req"] == "lp")
            kinds = [m["type"] for m in got if m.get("req") == "lp"]
            assert kinds == [PL.PROMPT_LOGPROBS, P.DONE_AT], got
            lps = PL.decode(got[kinds.index(PL.PROMPT_LOGPROBS)], tokens + [35], 3)
            assert [lp.token_id for lp in lps] == tokens[1:] + [35]
            assert all(len(lp.top) == 3 and lp.logprob <= 0 for lp in lps)
            await ch.send({**base, "req": "old", "imm": 2})
            got = await h.until(lambda m: m["type"] in (P.DONE_AT, P.FAIL) and m["req"] == "old")
            assert [m["type"] for m in got if m.get("req") == "old"] == [P.DONE_AT], got
        finally:
            h.close()
    asyncio.run(main())
    still_serves(cluster)


def test_negative_node_id_is_refused(cluster):
    async def main():
        h = HostileDecode(cluster.pc, node_id=1)
        try:
            import dataclasses
            h.hello = lambda: dataclasses.replace(cluster.pc.hello, node_id=-3, role="decode")
            with pytest.raises(ControlError):
                await h.connect(cluster.prefill.app[NODE].control_port, cluster.secret)
        finally:
            h.close()
    asyncio.run(main())
    still_serves(cluster)


def test_flood_of_idle_control_connections_is_bounded(cluster):
    """200 connections that never speak: at most max_control_per_source are held, each dropped
    after the handshake deadline; the real pair keeps working; fds and threads come back."""
    port = cluster.prefill.app[NODE].control_port
    before = proc_counts()
    socks = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        socks.append(s)
    t0 = time.monotonic()
    still_serves(cluster)  # while the flood is held
    assert time.monotonic() - t0 < 30
    during = proc_counts()
    assert during["threads"] <= before["threads"] + 4, (before, during)

    wait_for(lambda: all(closed_by_peer(s) for s in socks), 10, "every flood connection closed by the node")
    for s in socks:
        s.close()
    wait_for(lambda: proc_counts()["fds"] <= before["fds"] + 2, 10, "fds back to their level")
    adm = cluster.pc.listener.admission
    assert adm.num_handshaking == 0 and adm.num_links == len(cluster.pc.links) == 1  # only the real pair is held


def test_oversized_frame_before_authentication_costs_no_memory(cluster):
    port = cluster.prefill.app[NODE].control_port
    before = proc_counts()
    socks = []
    for _ in range(4):  # four 64 MiB frames grew the node by ~2.9 GB before
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall((64 << 20).to_bytes(4, "big") + b"\0" * (1 << 20))
        socks.append(s)
    time.sleep(0.5)
    for s in socks:
        s.close()
    assert proc_counts()["rss_kb"] - before["rss_kb"] < 64 << 10  # < 64 MiB grown in all
    still_serves(cluster)


def test_refused_large_frames_after_authentication_are_freed_without_the_collector(cluster):
    """A member holding the secret sends 16 MiB sealed frames of nils in place of CONNECT: each is
    refused, and with the garbage collector off the node's RSS stays flat (four grew it ~590 MB)."""
    import gc

    port = cluster.prefill.app[NODE].control_port
    n = cluster.pc.listener.mcfg.max_frame_bytes - 16
    body = b"\xdd" + (n - 5).to_bytes(4, "big") + b"\xc0" * (n - 5)  # msgpack: an array of n-5 nils

    async def refused():
        h = HostileDecode(cluster.pc)
        try:
            ch = await ControlChannel.connect("127.0.0.1", port, h.hello(), 5, secret=cluster.secret)
            sealed = body + ch._out.tag(body)
            ch.writer.write(len(sealed).to_bytes(4, "big") + sealed)
            del sealed
            await ch.writer.drain()
            with pytest.raises(ControlError):
                await asyncio.wait_for(ch.recv(), 10)  # the node drops the connection
            ch.close()
        finally:
            h.close()
    asyncio.run(refused())  # warm-up: buffers the first frame grows stay with the process
    gc.collect()
    gc.disable()
    try:
        before = proc_counts()["rss_kb"]
        for _ in range(4):
            asyncio.run(refused())
        grown_mb = (proc_counts()["rss_kb"] - before) / 1024
    finally:
        gc.enable()
    assert grown_mb < 100, f"RSS grew {grown_mb:.0f} MB over four refused frames"
    still_serves(cluster)


def test_connect_to_a_data_address_that_never_answers_does_not_stall_the_node(cluster):
    """Finding 1: Messenger.complete() toward a listener that never accepts blocks ~10 s; the
    prefill node's event loop must keep serving /health and the real decode node meanwhile."""
    import urllib.request

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(0)
    pc = cluster.pc

    async def main():
        h = HostileDecode(cluster.pc)
        try:
            _, real = h.m.prepare(pc.node_id, b"z" * 32)
            await h.connect(cluster.prefill.app[NODE].control_port, cluster.secret,
                            info=blackhole_info(real, hole.getsockname()[1]))
            wait_for(lambda: pc.listener._setups_busy == 1, 5, "the set-up to be running")
            loop = asyncio.get_running_loop()
            with urllib.request.urlopen(cluster.prefill.url + "/health", timeout=30) as r:
                assert r.status == 200
            assert pc.listener._setups_busy == 1  # /health answered while the set-up was still blocked
            await loop.run_in_executor(None, still_serves, cluster)
            assert pc.listener._setups_busy == 1  # ... and so did the real decode node's request
        finally:
            h.close()
    asyncio.run(main())
    hole.close()
    wait_for(lambda: pc.listener._setups_busy == 0, 30, "the set-up to give up")
    assert len(cluster.pc.links) == 1
