"""Draining and an etcd outage, with real etcd, real ``pdkv serve`` processes and the router
watching etcd: under steady load through the router, etcd is stopped and restarted (serving
goes on, the fleet view resyncs), then one of two decode nodes is drained with an authenticated
POST /admin/drain: the router sends it nothing new, its requests complete, it deregisters and
exits 0; zero failed requests throughout. A prefill node drained by SIGTERM exits 0 too."""
from __future__ import annotations

import json
import signal
import time
import urllib.request

import pytest
import yaml

from _fleet import (Load, NodeProc, connected_peers, fleet_node, free_port, get, model_name, node_dict, pages_back,
                    post, routed, wait_for)
from pdkv.config.router import load_router_config
from pdkv.fleet.drain import admin_headers
from pdkv.router import RouterThread

SECRET = "fleet-test-secret-0123456789abcdef"


def _router(tmp_path, etcd_url: str):
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"port": 0, "poll_interval_s": 0.1, "poll_timeout_s": 0.5, "down_after_s": 1.0,
                                    "cluster": {"discovery": "etcd", "name": "t",
                                                "etcd": {"endpoints": [etcd_url], "timeout_s": 1.0}}}))
    return RouterThread(load_router_config(path))


def _router_nodes(router) -> dict:
    return {n["url"]: n for n in get(router.url + "/nodes")}


@pytest.mark.slow  # node processes, an etcd outage, a drain: ~50 s
def test_etcd_outage_then_drain_a_decode_node_under_load(tiny_model_dir, tmp_path, etcd):
    env = {"PDKV_CLUSTER_SECRET": SECRET}
    pre = NodeProc(tmp_path, "p", fleet_node(tiny_model_dir, "prefill", etcd.url, "p"), env)
    d1 = NodeProc(tmp_path, "d1", fleet_node(tiny_model_dir, "decode", etcd.url, "d1"), env)
    d2 = NodeProc(tmp_path, "d2", fleet_node(tiny_model_dir, "decode", etcd.url, "d2"), env)
    try:
        for n in (pre, d1, d2):
            n.wait_healthy(180)
        for d in (d1, d2):
            wait_for(lambda d=d: len(connected_peers(d)) == 1, 10, "decode connected to the prefill node")
        with _router(tmp_path, etcd.url) as router:
            wait_for(lambda: sum(n["health"] == "up" for n in _router_nodes(router).values()) == 2, 10,
                     "router found both decode nodes in etcd")
            name = model_name(router.url)
            with Load(router.url, name, clients=3) as load:
                wait_for(lambda: len(load.results) >= 6, 60, "load running")
                etcd.stop()
                n0 = len(load.results)
                wait_for(lambda: len(load.results) >= n0 + 6, 60, "serving on while etcd is down")
                etcd.start()
                # the fleet view resyncs: a key written now is seen through the watchers again
                wait_for(lambda: all(n["health"] == "up" for n in _router_nodes(router).values()), 10, "nodes up")
                # a drain without the secret's MAC is refused
                status, body = post(d1.url + "/admin/drain", {}, headers={"X-Pdkv-Admin": f"{int(time.time())}:00"})
                assert status == 403 and "MAC does not match" in body["error"]["message"], body
                t0 = time.monotonic()
                status, body = post(d1.url + "/admin/drain", {}, headers=admin_headers(SECRET.encode()))
                assert status == 202 and body["state"] == "draining", body
                wait_for(lambda: _router_nodes(router).get(d1.url, {}).get("draining") or d1.url not in
                         _router_nodes(router), 5, "router sees d1 draining")
                marked_s = time.monotonic() - t0
                wait_for(lambda: d1.url not in _router_nodes(router), 30, "d1 drained and deregistered")
                gone_s = time.monotonic() - t0
                assert d1.proc.wait(60) == 0, d1.log_path.read_text()[-2000:]
                exit_s = time.monotonic() - t0
                n1 = len(load.results)
                wait_for(lambda: len(load.results) >= n1 + 6, 60, "serving on d2 alone")
            assert not load.failures(), load.failures()[:3]
            print(f"drain: after POST /admin/drain the router saw d1 draining in {marked_s:.2f} s, d1 drained "
                  f"and deregistered in {gone_s:.2f} s, exited 0 in {exit_s:.2f} s; {len(load.results)} "
                  f"requests, 0 failed")
        # a prefill node drained by SIGTERM: d2 stops choosing it, it exits 0
        t0 = time.monotonic()
        pre.signal(signal.SIGTERM)
        wait_for(lambda: not connected_peers(d2), 30, "d2 dropped the drained prefill node")
        gone_s = time.monotonic() - t0
        assert pre.proc.wait(60) == 0, pre.log_path.read_text()[-2000:]
        print(f"drain: prefill node deregistered (d2 dropped it) {gone_s:.2f} s after SIGTERM, exited 0 after "
              f"{time.monotonic() - t0:.2f} s")
        assert post(d2.url + "/v1/completions", {"model": name, "prompt": list(range(5, 45)),
                                                 "max_tokens": 4})[0] == 200  # prefilled locally now
    finally:
        for n in (d1, d2, pre):
            n.stop()


def _peer_states(dec: NodeProc) -> dict[str, str]:
    return {p["address"]: p.get("state", "ready") for p in get(dec.url + "/health")["prefill_peers"]}


def test_static_prefill_drain_is_told_to_its_decode_nodes(tiny_model_dir, tmp_path):
    """No etcd: a decode node with two static prefill peers under load; one prefill node gets
    SIGTERM. Its DRAINING control message reaches the decode node before the drain notice is
    over, the decode node sends it no PREFILL from then on, it exits 0, and no request fails."""
    ports = [free_port(), free_port()]
    pres = []
    for i, cport in enumerate(ports):
        d = node_dict(tiny_model_dir, "prefill", port=free_port(), control_port=cport)
        d["cluster"] = {"drain_notice_s": 1.5, "drain_timeout_s": 30}  # discovery static (default)
        pres.append(NodeProc(tmp_path, f"p{i}", d))
    addrs = [f"127.0.0.1:{p}" for p in ports]
    dec = NodeProc(tmp_path, "d", node_dict(tiny_model_dir, "decode", port=free_port(), peers=addrs))
    try:
        for n in (*pres, dec):
            n.wait_healthy(180)
        wait_for(lambda: len(connected_peers(dec)) == 2, 20, "decode connected to both prefill nodes")
        with Load(dec.url, model_name(dec.url), clients=2) as load:
            wait_for(lambda: all(v > 0 for v in routed(dec).values()), 60, "both prefill nodes used")
            t0 = time.monotonic()
            pres[0].signal(signal.SIGTERM)
            wait_for(lambda: _peer_states(dec)[addrs[0]] == "draining", 5, "the decode node told p0 is draining",
                     step=0.01)
            told_s = time.monotonic() - t0
            assert pres[0].proc.poll() is None  # within the drain notice: told by the link, not by its exit
            before = routed(dec)
            time.sleep(1.0)
            after = routed(dec)
        assert after[addrs[0]] == before[addrs[0]] and after[addrs[1]] > before[addrs[1]], (before, after)
        assert pres[0].proc.wait(60) == 0, pres[0].log_path.read_text()[-2000:]
        assert load.results and not load.failures(), load.failures()[:3]
        wait_for(lambda: pages_back(dec) and pages_back(pres[1]), 10, "every page back")
        print(f"static drain: the decode node knew p0 was draining {told_s * 1000:.0f} ms after SIGTERM; "
              f"{len(load.results)} requests, none failed")
    finally:
        for n in (dec, *pres):
            n.stop()
