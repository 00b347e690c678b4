"""A decode node really frozen: the whole ``pdkv serve`` process SIGSTOPped while the prefill
node streams its pages, thawed (SIGCONT) well past both leases. The prefill node gives it up and
releases the transfer while it is still frozen; the thawed node tells its client what happened
(it was frozen itself, not "the prefill node died"), returns every page, redials and serves."""
from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request

from _cluster import assert_colocated_answer, make_engine, node_config, post_completion, serve_node, wait_for
from _procs import NodeProc, free_port, node_dict
from pdkv.server.app import NODE

LEASE = 1.0  # both sides


def test_decode_node_sigstopped_mid_transfer_says_it_was_frozen(tiny_model_dir, tmp_path):
    pcfg = node_config(tiny_model_dir, "prefill", messenger__lease_s=LEASE, messenger__heartbeat_s=0.2)
    peng = make_engine(pcfg)
    with serve_node(pcfg, peng) as pre:
        pnode = pre.app[NODE]
        coord = pnode.coordinator
        hook = peng.connector.after_layer
        # FAULT INJECTION (slow prefill): 0.1 s per layer, so the transfer of a 145-token prompt
        # lasts a few seconds and the freeze lands in the middle of it
        peng.connector.after_layer = lambda layer: (time.sleep(0.1), hook(layer))
        d = node_dict(tiny_model_dir, "decode", port=free_port(), peers=[f"127.0.0.1:{pnode.control_port}"],
                      chunk=8)
        d["messenger"].update(lease_s=LEASE, heartbeat_s=0.2)
        d["disagg"]["prefill_retries"] = 0  # the failure and its message (retries: prefilled here)
        dec = NodeProc(tmp_path, "decode", d)
        try:
            h = dec.wait_healthy()
            wait_for(lambda: dec.health()["prefill_peers"][0]["connected"], 20, "decode node connected")
            total = h["num_pages_total"]
            name = json.loads(urllib.request.urlopen(dec.url + "/v1/models").read())["data"][0]["id"]
            box = {}
            t = threading.Thread(target=lambda: box.setdefault("r", post_completion(dec.url, {
                "model": name, "prompt": list(range(5, 150)), "max_tokens": 4}, 60)))
            t.start()
            wait_for(lambda: any(j.num_writes for j in list(coord.jobs.values())), 20, "writes streaming")
            dec.signal(signal.SIGSTOP)
            t_stop = time.monotonic()
            # the prefill node gives the frozen peer up after its lease and releases the transfer
            # (job gone, source pages back) while the decode node is still stopped
            wait_for(lambda: not coord.jobs and peng.allocator.num_free == peng.allocator.num_total, 10,
                     "prefill node released the transfer")
            assert not coord.links, "the frozen decode node's link is still up"
            gave_up_s = time.monotonic() - t_stop
            time.sleep(max(0.0, 3 * LEASE - gave_up_s))  # frozen well past both leases
            dec.signal(signal.SIGCONT)
            t.join(30)
            status, body = box["r"]
            msg = body["error"]["message"]
            assert status == 503, body  # transient: retry shortly (the node redials)
            assert "this decode node was frozen for" in msg and "lease" in msg, msg
            assert "prefill node died" not in msg, msg
            # no page leaked on either side: the decode node's pool is whole, nothing quarantined
            wait_for(lambda: dec.health()["num_pages_free"] == total, 10, "decode pool full")
            assert dec.health()["num_pages_held"] == 0
            assert peng.allocator.num_free == peng.allocator.num_total and peng.num_held_pages == 0
            # it redials the prefill node and serves again, with the colocated answer
            peng.connector.after_layer = hook
            wait_for(lambda: dec.health()["prefill_peers"][0]["connected"], 20, "decode node redialled")
            assert_colocated_answer(dec.url, name, tiny_model_dir, range(5, 40), 3)
            wait_for(lambda: dec.health()["num_pages_free"] == total, 10, "decode pool full again")
            log = dec.log_path.read_text()
            assert "Traceback" not in log, log[-3000:]
        finally:
            peng.connector.after_layer = hook
            dec.stop()
