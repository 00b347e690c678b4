"""Registration and watching against a real etcd, no model: leases, duplicates, foreign
fingerprints, malformed keys, an unreachable etcd, etcd stopped and restarted."""
from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from pdkv.config import config_from_dict
from pdkv.fleet.etcd import EtcdClient
from pdkv.fleet.registry import FleetError, Registration, Watcher, parse_record
from pdkv.ports import free_port


def _cl(url: str, **kw):
    return config_from_dict({"cluster": {"discovery": "etcd", "name": "t", "etcd": {"endpoints": [url],
                                                                                     "timeout_s": 0.5}, **kw}}).cluster


def _rec(fp="fp1", http="http://127.0.0.1:1"):
    return {"model_fingerprint": fp, "http": http}


async def _until(pred, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_join_state_leave_and_bad_records(etcd, caplog):
    async def main():
        cl = _cl(etcd.url)
        seen = []
        w = Watcher(cl, "prefill", lambda nid, rec: seen.append((nid, rec and rec["state"])), fingerprint="fp1")
        w.start()
        await asyncio.wait_for(w.synced.wait(), 5)
        a = Registration(cl, "prefill", "a", _rec(), 2)
        t0 = time.monotonic()
        await a.start(True, 5)
        await _until(lambda: "a" in w.nodes, 2, "a joined")
        join_s = time.monotonic() - t0
        # another model's node, a malformed key and value, a record naming another node: ignored
        other = Registration(cl, "prefill", "b", _rec(fp="fp2"), 2)
        await other.start(True, 5)
        c = EtcdClient([etcd.url])
        await c.put(b"/pdkv/t/prefill/x/y", b"{}")
        await c.put(b"/pdkv/t/prefill/bad", b"not json")
        await c.put(b"/pdkv/t/prefill/liar", json.dumps({"role": "prefill", "node_id": "a", "state": "ready",
                                                          "model_fingerprint": "fp1", "http": "h"}).encode())
        await a.set_state("draining")
        await _until(lambda: w.nodes["a"]["state"] == "draining", 2, "a draining")
        assert set(w.nodes) == {"a"}
        # the id is taken: a second node with it is refused, naming the holder
        with pytest.raises(FleetError, match="already registered.*cluster.node_id"):
            await Registration(cl, "prefill", "a", _rec(http="http://127.0.0.1:2"), 2).start(True, 5)
        t0 = time.monotonic()
        await a.stop()  # deregisters at once
        await _until(lambda: "a" not in w.nodes, 2, "a left")
        print(f"registry: join {join_s * 1000:.0f} ms, deregister seen in {(time.monotonic() - t0) * 1000:.0f} ms")
        await other.stop()
        await w.stop()
        await c.close()
        assert seen == [("a", "ready"), ("a", "draining"), ("a", None)]

    with caplog.at_level(logging.WARNING, "pdkv.fleet"):
        asyncio.run(main())
    text = caplog.text
    assert "model fingerprint fp2 is not this node's fp1" in text
    assert "'/pdkv/t/prefill/x/y' is not /pdkv/t/prefill/<node_id>" in text
    assert "/pdkv/t/prefill/bad': the value is not JSON" in text
    assert "its record names node 'a'" in text


def test_lease_ends_when_the_node_stops_refreshing(etcd):
    async def main():
        cl = _cl(etcd.url)
        w = Watcher(cl, "decode", lambda *a: None)
        w.start()
        r = Registration(cl, "decode", "d", _rec(), 2)
        await r.start(True, 5)
        await _until(lambda: "d" in w.nodes, 2, "d joined")
        r._task.cancel()  # as a kill -9: nobody refreshes the lease any more
        t0 = time.monotonic()
        await _until(lambda: "d" not in w.nodes, 6, "d's lease ended")
        gone = time.monotonic() - t0
        assert 1.0 < gone < 4.5, gone  # the 2 s TTL (etcd rounds up a little)
        await r.client.close()
        await w.stop()
    asyncio.run(main())


def test_unreachable_etcd_is_a_clear_bounded_error_unless_not_required():
    dead = f"http://127.0.0.1:{free_port()}"

    async def main():
        cl = _cl(dead)
        t0 = time.monotonic()
        with pytest.raises(FleetError, match=r"etcd did not answer within 1.0 s.*cluster.required: false"):
            await Registration(cl, "prefill", "a", _rec(), 2).start(True, 1.0)
        assert time.monotonic() - t0 < 3
        r = Registration(cl, "prefill", "a", _rec(), 2)
        await r.start(False, 0.5)  # not required: starts, keeps trying in the background
        assert not r.registered.is_set()
        await r.stop()
    asyncio.run(main())


def test_etcd_stopped_and_restarted_watchers_keep_then_resync(etcd, caplog):
    async def main():
        cl = _cl(etcd.url)
        w = Watcher(cl, "prefill", lambda *a: None)
        w.start()
        a = Registration(cl, "prefill", "a", _rec(), 3)
        await a.start(True, 5)
        await _until(lambda: "a" in w.nodes, 2, "a joined")
        etcd.stop()
        await asyncio.sleep(1.0)
        assert "a" in w.nodes  # etcd away: the known nodes stay
        etcd.start()
        t0 = time.monotonic()
        b = Registration(cl, "prefill", "b", _rec(), 3)  # joins while the watcher reconnects
        await b.start(True, 5)
        await _until(lambda: {"a", "b"} <= set(w.nodes) and w.resyncs >= 1, 5, "resynced")
        print(f"registry: resynced {time.monotonic() - t0:.2f} s after etcd came back")
        await a.stop()
        await _until(lambda: "a" not in w.nodes, 3, "a left after the resync")
        await b.stop()
        await w.stop()

    with caplog.at_level(logging.WARNING, "pdkv.fleet"):
        asyncio.run(main())
    assert caplog.text.count("keeping the 1 node(s) known") == 1  # logged once per outage


def test_parse_record_names_the_problem():
    with pytest.raises(ValueError, match="state 'gone' is not one of ready, draining"):
        parse_record("/p/", b"/p/n", json.dumps({"role": "prefill", "node_id": "n", "state": "gone",
                                                  "model_fingerprint": "f", "http": "h"}).encode())
    with pytest.raises(ValueError, match="field 'http' missing"):
        parse_record("/p/", b"/p/n", json.dumps({"role": "prefill", "node_id": "n", "state": "ready",
                                                  "model_fingerprint": "f"}).encode())
