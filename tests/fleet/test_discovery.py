"""Discovery on a real etcd with real ``pdkv serve`` processes: a prefill node that joins under
load is used within 2 s, one killed -9 is dropped when its lease ends (every page back), nodes
of another model are ignored, a taken node id is refused, etcd stopped and restarted mid-run."""
from __future__ import annotations

import signal
import time

import pytest

from _fleet import Load, NodeProc, connected_peers, fleet_node, get, model_name, pages_back, post, routed, wait_for


@pytest.mark.slow  # node processes and a real etcd: ~40 s
def test_join_under_load_then_kill9_leave(tiny_model_dir, tmp_path, etcd):
    p1 = NodeProc(tmp_path, "p1", fleet_node(tiny_model_dir, "prefill", etcd.url, "p1"))
    dec = NodeProc(tmp_path, "d", fleet_node(tiny_model_dir, "decode", etcd.url, "d"))
    p2 = None
    try:
        p1.wait_healthy(180)
        dec.wait_healthy(180)
        wait_for(lambda: len(connected_peers(dec)) == 1, 10, "decode connected to p1 through etcd")
        name = model_name(dec.url)
        with Load(dec.url, name) as load:
            wait_for(lambda: len(load.results) >= 3, 30, "load running")
            p2 = NodeProc(tmp_path, "p2", fleet_node(tiny_model_dir, "prefill", etcd.url, "p2"))
            p2.wait_healthy(180)
            t0 = time.monotonic()  # p2 serves (and so registered) from here: the join time
            wait_for(lambda: len(connected_peers(dec)) == 2, 2.0, "decode connected to p2 within 2 s")
            join_s = time.monotonic() - t0
            wait_for(lambda: all(v > 0 for v in routed(dec).values()) and len(routed(dec)) == 2, 20,
                     "both prefill nodes prefilled requests", info=lambda: (get(dec.url + "/health"),
                                                                            len(load.results)))
        assert not load.failures(), load.failures()[:3]
        print(f"join: decode connected {join_s:.2f} s after p2 answered /health")
        # kill -9 p2: its lease (2 s) ends, the decode node drops it and keeps serving on p1
        p2.signal(signal.SIGKILL)
        t0 = time.monotonic()
        wait_for(lambda: len(connected_peers(dec)) == 1, 10, "p2 dropped")
        leave_s = time.monotonic() - t0
        print(f"leave: p2 dropped {leave_s:.2f} s after kill -9")
        assert post(dec.url + "/v1/completions", {"model": name, "prompt": list(range(5, 45)),
                                                  "max_tokens": 4})[0] == 200
        wait_for(lambda: pages_back(dec) and pages_back(p1), 10, "every page back")
    finally:
        for n in (p2, dec, p1):
            if n is not None:
                n.stop()


@pytest.mark.slow  # waits out the bounded wait: ~20 s
def test_serve_with_an_unreachable_etcd_fails_clearly_after_a_bounded_wait(tiny_model_dir, tmp_path):
    from _procs import free_port

    cfg = fleet_node(tiny_model_dir, "colocated", f"http://127.0.0.1:{free_port()}", "c")
    cfg["cluster"]["connect_timeout_s"] = 1.0
    cfg.pop("messenger")
    node = NodeProc(tmp_path, "c", cfg)
    try:
        assert node.proc.wait(120) == 1
        log = node.log_path.read_text()
        assert "etcd did not answer within 1.0 s (cluster.connect_timeout_s)" in log, log[-2000:]
        assert "cluster.required: false" in log
    finally:
        node.stop()
