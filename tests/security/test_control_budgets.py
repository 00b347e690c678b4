"""The prefill node's control listener under a slow pre-authentication flood: handshaking
connections have their own budget (messenger.max_handshakes), a newcomer takes the place of the
oldest connection of the source holding most, and established links are never displaced.

The budget's rules on their own (ControlAdmission, no sockets), then the attack that kept 12
of 14 real handshakes out before: 64 connections from 127.0.0.2-5 dribbling AUTH at 1 byte/s,
reopened when closed, while a real decode node dials."""

import time

import pytest
from _cluster import make_engine, node_config, post_completion, serve_node, wait_for
from _flood import SlowFlood

from pdkv.auth import write_secret_file
from pdkv.disagg.control_admission import ControlAdmission, Place
from pdkv.server.app import NODE


def _fill(adm, sources, n, now=0.0):
    closed = []
    for src in sources:
        for _ in range(n):
            t = adm.admit(src, lambda src=src: closed.append(src), now)
            assert not isinstance(t, str), t
    return closed


def test_a_few_sources_displace_only_themselves():
    adm = ControlAdmission(max_handshakes=32, max_links=4, max_per_source=16, evict_after_s=1.0)
    closed = _fill(adm, ["a", "b", "c", "d"], 8)
    assert adm.num_handshaking == 32
    newcomer = adm.admit("honest", lambda: None, now=0.1)  # younger than evict_after_s: by fairness
    assert not isinstance(newcomer, str) and closed == ["a"]
    # the flood's reopen (a, now 7 of 8 at most) makes nothing fairer and nothing is old: refused
    assert "messenger.max_handshakes" in adm.admit("a", lambda: None, now=0.2)
    assert closed == ["a"] and adm.num_evicted == 1
    # the honest connection is never the victim: later newcomers take the flood's oldest
    later = adm.admit("x", lambda: None, now=5.0)
    assert not isinstance(later, str) and newcomer.state is Place.HANDSHAKING and len(closed) == 2


def test_many_sources_hold_a_place_at_most_evict_after_s():
    adm = ControlAdmission(max_handshakes=4, max_links=4, max_per_source=16, evict_after_s=1.0)
    closed = _fill(adm, ["a", "b", "c", "d"], 1)
    assert isinstance(adm.admit("e", lambda: None, now=0.5), str)  # all young, none fairer: refused
    assert not isinstance(adm.admit("e", lambda: None, now=1.5), str) and closed == ["a"]  # the oldest


def test_established_links_are_never_displaced_and_have_their_own_budget():
    adm = ControlAdmission(max_handshakes=2, max_links=1, max_per_source=2, evict_after_s=0.0)
    link = adm.admit("a", lambda: pytest.fail("an established link was evicted"))
    assert adm.establish(link) is None and link.state is Place.ESTABLISHED
    assert adm.num_handshaking == 0 and adm.num_links == 1
    t1, t2 = (adm.admit(s, lambda: None, now=10.0) for s in ("b", "c"))
    assert adm.num_handshaking == 2  # the link took none of the handshaking budget
    assert "messenger.max_control_conns 1" in adm.establish(t1)  # links full: the newcomer goes
    assert t1.state is Place.GONE and adm.num_links == 1
    adm.release(link)
    adm.release(link)  # idempotent
    assert adm.establish(t2) is None and adm.num_links == 1 and adm.num_handshaking == 0


def test_a_source_at_its_cap_has_its_newest_refused():
    adm = ControlAdmission(max_handshakes=8, max_links=8, max_per_source=2)
    _fill(adm, ["a"], 2)
    assert "messenger.max_control_per_source 2" in adm.admit("a", lambda: None)
    assert adm.num_evicted == 0 and adm.num_handshaking == 2


def test_real_decode_node_joins_during_a_slow_preauth_flood(tiny_model_dir, tmp_path):
    secret = tmp_path / "cluster.secret"
    write_secret_file(secret)
    sec = {"messenger__secret_file": str(secret)}
    pcfg = node_config(tiny_model_dir, "prefill", messenger__handshake_timeout_s=10.0, **sec)
    prefill = serve_node(pcfg, make_engine(pcfg)).start()
    pc = prefill.app[NODE].coordinator
    port = prefill.app[NODE].control_port

    def decode_node():
        cfg = node_config(tiny_model_dir, "decode", messenger__prefill_peers=[f"127.0.0.1:{port}"],
                          messenger__connect_timeout_s=5.0, **sec)
        return serve_node(cfg, make_engine(cfg))
    nodes = [decode_node().start()]  # established before the flood
    try:
        with SlowFlood(port) as flood:
            wait_for(lambda: flood.num_opened >= 64 and pc.listener.admission.num_handshaking >= 32, 10,
                     "the flood to fill the handshaking budget")
            t0 = time.monotonic()
            nodes.append(decode_node().start())  # raises if it cannot join within connect_timeout_s
            joined_s = time.monotonic() - t0
            adm = pc.listener.admission
            assert adm.num_handshaking <= pcfg.messenger.max_handshakes
            assert adm.num_links == len(pc.links) == 2 and not any(link.dead for link in pc.links)
            status, body = post_completion(nodes[1].url, {"prompt": "Roma non fu fatta", "max_tokens": 4,
                                                          "model": _model(nodes[1].url)})
            assert status == 200, body
        assert joined_s < 5.0
        assert adm.num_evicted >= 1 and flood.num_closed_by_node >= 1
    finally:
        for n in nodes:
            n.stop()
        prefill.stop()


def _model(url):
    import json
    import urllib.request

    return json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]
