"""Peers that die: a prefill node SIGKILLed while a decode node waits for its KV, a decode node
SIGKILLed while the prefill node streams its pages. The survivor fails only the affected
requests (clearly), returns every page, and keeps serving."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

from _cluster import Cluster, assert_colocated_answer, make_engine, node_config, post_completion as _post, serve_node, wait_for
from _procs import NodeProc, free_port, node_dict
from pdkv.disagg.node import DecodeNode
from pdkv.server.app import NODE
from pdkv.server.runner import ServerThread
import pytest


def _shm_files() -> set[int]:
    """Inodes of the unnamed /dev/shm files this process maps (shm transport: its own registered
    memory, and the ranges peers granted it)."""
    with open(f"/proc/{os.getpid()}/maps") as f:
        return {int(p[4]) for p in (line.split(maxsplit=5) for line in f) if len(p) == 6 and p[5].startswith("/dev/shm/#")}


# NOTE: tcp only: the prefill node is frozen (SIGSTOP) before the PREFILL; on shm the decode node's
# grant waits for the prefill process to map it (up to SHM_REPLY_MS, csrc/shm_internal.h), so
# there is no "PREFILL sent, KV awaited" state to kill it in (docs/TRANSPORTS.md, shm)
@pytest.mark.parametrize("transport", ["tcp"])
@pytest.mark.parametrize("retries", [0, 2], ids=["fails", "prefilled-here"])
def test_prefill_sigkilled_while_decode_waits_for_its_kv(tiny_model_dir, tmp_path, transport, retries):
    """disagg.prefill_retries 0: the request fails with a 503; by default (the only prefill node
    died, disagg.local_fallback) it is prefilled on the decode node and answers as colocated."""
    cport = free_port()
    pre = NodeProc(tmp_path, "prefill", node_dict(tiny_model_dir, "prefill", port=free_port(), control_port=cport,
                                                  transport=transport))
    try:
        pre.wait_healthy()
        dcfg = node_config(tiny_model_dir, "decode", messenger__prefill_peers=[f"127.0.0.1:{cport}"],
                           messenger__lease_s=30.0,  # the death is seen by the broken connection
                           messenger__transport=transport, disagg__prefill_retries=retries)
        eng = make_engine(dcfg)
        with serve_node(dcfg, eng) as dec:
            coord = dec.app[NODE].coordinator
            name = json.loads(urllib.request.urlopen(dec.url + "/v1/models").read())["data"][0]["id"]
            pre.signal(signal.SIGSTOP)
            box = {}
            t = threading.Thread(target=lambda: box.setdefault("r", _post(dec.url, {
                "model": name, "prompt": list(range(5, 40)), "max_tokens": 4, "temperature": 0}, headers=True)))
            t.start()
            wait_for(lambda: coord.slots, 10, "PREFILL sent")
            assert eng.allocator.num_free < eng.allocator.num_total
            t0 = time.monotonic()
            pre.signal(signal.SIGKILL)
            t.join(20)
            status, body, headers = box["r"]
            assert time.monotonic() - t0 < 5
            if retries:
                assert status == 200, body
                want = _post(dec.url, {"model": name, "prompt": list(range(5, 40)), "max_tokens": 4,
                                       "temperature": 0})
                assert body["choices"][0]["text"] == want[1]["choices"][0]["text"], (body, want)
            else:  # transient, not the client's fault: 503 + Retry-After, as for "no prefill node"
                assert status == 503 and "prefill node died" in body["error"]["message"], body
                assert headers["Retry-After"] == "2"
            wait_for(lambda: eng.allocator.num_free == eng.allocator.num_total, 10, "decode pool full")
            health = json.loads(urllib.request.urlopen(dec.url + "/health").read())
            assert health["prefill_peers"][0]["connected"] is False
            # a prompt of one token never needs a prefill node; longer ones are prefilled here now
            # (disagg.local_fallback; test_gaps keeps the strict 503) and answer as colocated
            assert _post(dec.url, {"model": name, "prompt": [5], "max_tokens": 2})[0] == 200
            assert_colocated_answer(dec.url, name, tiny_model_dir, list(range(5, 40)), 4)
            metrics = urllib.request.urlopen(dec.url + "/metrics").read().decode()
            assert 'pdkv_disagg_prefill_decisions_total{model_name="%s",role="decode",where="local_no_peer"} %d.0' \
                % (name, 2 if retries else 1) in metrics, [x for x in metrics.splitlines() if "decisions" in x]
            assert ('pdkv_disagg_prefill_retries_total{cause="peer_dead",model_name="%s",role="decode",to="local"} '
                    '%d.0' % (name, 1 if retries else 0)) in metrics, [x for x in metrics.splitlines() if "retr" in x]
    finally:
        pre.stop()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_decode_sigkilled_while_prefill_streams(tiny_model_dir, tmp_path, transport):
    pcfg = node_config(tiny_model_dir, "prefill", messenger__lease_s=30.0, messenger__transport=transport)
    peng = make_engine(pcfg)
    with serve_node(pcfg, peng) as pre:
        pnode = pre.app[NODE]
        own = _shm_files()  # shm: the prefill node's own registered memory
        hook = peng.connector.after_layer
        # FAULT INJECTION (slow prefill): 20 ms per layer, so the kill lands mid-stream
        peng.connector.after_layer = lambda layer: (time.sleep(0.02), hook(layer))
        dec = NodeProc(tmp_path, "decode", node_dict(tiny_model_dir, "decode", port=free_port(),
                                                     peers=[f"127.0.0.1:{pnode.control_port}"], chunk=8,
                                                     transport=transport))
        try:
            dec.wait_healthy()
            name = json.loads(urllib.request.urlopen(dec.url + "/v1/models").read())["data"][0]["id"]
            def doomed():  # its server is killed under it
                try:
                    _post(dec.url, {"model": name, "prompt": list(range(5, 150)), "max_tokens": 4}, 10)
                except OSError:
                    pass
            threading.Thread(target=doomed, daemon=True).start()
            coord = pnode.coordinator
            wait_for(lambda: any(j.num_writes for j in list(coord.jobs.values())), 20, "writes streaming")
            if transport == "shm":  # the decode node's granted pages are mapped here while it streams
                assert _shm_files() - own
            dec.signal(signal.SIGKILL)
            wait_for(lambda: peng.allocator.num_free == peng.allocator.num_total and not coord.jobs, 10,
                     "prefill pool full")
            if transport == "shm":  # and none of them once it died
                wait_for(lambda: not _shm_files() - own, 10, "the dead node's pages unmapped here")
        finally:
            dec.stop()
        peng.connector.after_layer = hook
        # the prefill node still serves a new decode node
        dcfg = node_config(tiny_model_dir, "decode", messenger__prefill_peers=[f"127.0.0.1:{pnode.control_port}"],
                           messenger__transport=transport)
        with serve_node(dcfg, make_engine(dcfg)) as d2:
            name = json.loads(urllib.request.urlopen(d2.url + "/v1/models").read())["data"][0]["id"]
            assert_colocated_answer(d2.url, name, tiny_model_dir, range(5, 30), 3)


def test_handshake_refuses_a_different_page_size_or_model(tiny_model_dir, tmp_path):
    import pytest

    from pdkv.control import HandshakeRefused
    from pdkv.tiny_model import make_tiny_model

    c = Cluster(tiny_model_dir)
    try:
        port = c.prefill.app[NODE].control_port
        for model, over, word in ((tiny_model_dir, {"kv_cache__page_size": 8}, "page_size"),
                                  (make_tiny_model(tmp_path / "other", hidden_size=32), {}, "model_fingerprint")):
            dcfg = node_config(model, "decode", messenger__prefill_peers=[f"127.0.0.1:{port}"], **over)
            eng = make_engine(dcfg)
            with pytest.raises(HandshakeRefused) as e:
                ServerThread(dcfg, eng, DecodeNode(dcfg, eng)).start()
            assert word in str(e.value), e.value
            assert eng.allocator.num_free == eng.allocator.num_total
        # the prefill node is unharmed
        assert_colocated_answer(c.url, c.model_name(), tiny_model_dir, range(5, 20), 3)
    finally:
        c.stop()


@pytest.mark.slow  # a node process frozen past its lease: ~20 s
def test_client_leaves_while_prefill_is_frozen_pages_wait_for_the_ack(tiny_model_dir, tmp_path):
    """A frozen (SIGSTOPped) prefill node may still write: the decode node keeps the pages of a
    request whose client left until the thawed prefill node acknowledged the CANCEL."""
    import socket

    cport = free_port()
    pre = NodeProc(tmp_path, "prefill", node_dict(tiny_model_dir, "prefill", port=free_port(), control_port=cport))
    try:
        pre.wait_healthy()
        dcfg = node_config(tiny_model_dir, "decode", messenger__prefill_peers=[f"127.0.0.1:{cport}"],
                           messenger__lease_s=30.0)
        eng = make_engine(dcfg)
        with serve_node(dcfg, eng) as dec:
            coord = dec.app[NODE].coordinator
            name = json.loads(urllib.request.urlopen(dec.url + "/v1/models").read())["data"][0]["id"]
            pre.signal(signal.SIGSTOP)
            raw = json.dumps({"model": name, "prompt": list(range(5, 40)), "max_tokens": 4}).encode()
            s = socket.create_connection(("127.0.0.1", dec.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
            wait_for(lambda: coord.slots, 10, "PREFILL sent")
            s.close()
            wait_for(lambda: eng.num_held_pages > 0, 5, "pages quarantined")
            time.sleep(1.0)
            assert eng.num_held_pages > 0  # NOTE: never reused while the peer may still write them
            pre.signal(signal.SIGCONT)
            wait_for(lambda: eng.allocator.num_free == eng.allocator.num_total, 10, "decode pool full")
            wait_for(lambda: pre.health()["num_pages_free"] == pre.health()["num_pages_total"], 10,
                     "prefill pool full")
            assert_colocated_answer(dec.url, name, tiny_model_dir, range(5, 20), 2)
    finally:
        pre.stop()


@pytest.mark.slow  # a node process frozen past its lease: ~20 s
def test_frozen_prefill_past_its_lease_is_dead(tiny_model_dir, tmp_path):
    """A prefill node silent for messenger.lease_s is declared dead: its waiting request fails
    clearly, the data connection is torn down, then the pages return."""
    cport = free_port()
    pre = NodeProc(tmp_path, "prefill", node_dict(tiny_model_dir, "prefill", port=free_port(), control_port=cport))
    try:
        pre.wait_healthy()
        dcfg = node_config(tiny_model_dir, "decode", messenger__prefill_peers=[f"127.0.0.1:{cport}"],
                           messenger__lease_s=1.0, messenger__heartbeat_s=0.2,
                           disagg__prefill_retries=0)  # the failure itself (retries: prefilled here)
        eng = make_engine(dcfg)
        with serve_node(dcfg, eng) as dec:
            name = json.loads(urllib.request.urlopen(dec.url + "/v1/models").read())["data"][0]["id"]
            pre.signal(signal.SIGSTOP)
            t0 = time.monotonic()
            status, body, headers = _post(dec.url, {"model": name, "prompt": list(range(5, 40)), "max_tokens": 4},
                                          headers=True)
            assert status == 503 and "prefill node died" in body["error"]["message"], body
            assert headers["Retry-After"] == "2"
            assert "lease 1.0 s" in body["error"]["message"]
            assert time.monotonic() - t0 < 5
            wait_for(lambda: eng.allocator.num_free == eng.allocator.num_total, 10, "decode pool full")
    finally:
        pre.stop()
