"""Three paths the other disaggregation tests leave open: a client that leaves while the prefill
node is computing its chunks (not frozen), the hidden state that arrives over verbs, and a
prefill node restarted on the same address that the decode node dials again by itself."""
from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from _cluster import Cluster, make_engine, node_config, post_completion as _post, serve_node, wait_for
from _procs import NodeProc, free_port, node_dict
from pdkv.engine import SamplingParams
from pdkv.server.app import NODE

ROOT = Path(__file__).resolve().parents[2]


def _reference(model_dir, prompts, max_tokens):
    """Colocated greedy tokens, and the final hidden state at position len(prompt) - 2 (what the
    prefill node sends: the last row of prompt[:-1])."""
    eng = make_engine(node_config(model_dir, "colocated"))
    hidden = {}

    def listen(batch, h):  # h: [num_tokens, hidden_size], rows in batch order
        for e in batch.entries:
            target = e.request.num_prompt_tokens - 2
            if h is not None and e.start <= target < e.start + e.num_tokens:
                hidden[tuple(e.request.prompt_token_ids)] = h[e.row + target - e.start].clone()
    eng.connector.after_forward = listen  # the colocated engine's no-op connector, observed
    outs = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.output_token_ids for o in outs], hidden


def _body(name, prompt, max_tokens=4):
    return {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}


# ---- 1: the client leaves while the prefill node computes its chunks ----------------------------

def test_client_leaves_while_prefill_computes_its_chunks(tiny_model_dir):
    other_prompt, doomed_prompt = list(range(7, 20)), list(range(40, 100))
    (want,), _ = _reference(tiny_model_dir, [other_prompt], 4)
    c = Cluster(tiny_model_dir, prefill_over={"scheduler__chunk_size": 4})
    try:
        peng, pc = c.prefill_engine, c.prefill.app[NODE].coordinator
        start_free = (peng.allocator.num_free, c.decode_engine.allocator.num_free)
        hook, computing = peng.connector.after_layer, threading.Event()

        def slow_hook(layer):  # FAULT INJECTION: 40 ms a layer, so the prompt takes ~1.2 s to compute
            hook(layer)
            computing.set()
            time.sleep(0.04)
        peng.connector.after_layer = slow_hook
        # spies on what each side sends on its control channel (looked up at every call)
        seen = []
        p_send, d_send = pc._send, c.coordinator._send
        pc._send = lambda link, msg: (seen.append(("prefill", msg["type"], dict(msg))), p_send(link, msg))
        c.coordinator._send = lambda peer, msg: (seen.append(("decode", msg["type"], dict(msg))), d_send(peer, msg))
        name = c.model_name()
        host, port = c.url.removeprefix("http://").split(":")
        raw = json.dumps(_body(name, doomed_prompt)).encode()
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        box = {}
        other = threading.Thread(target=lambda: box.setdefault("r", _post(c.url, _body(name, other_prompt), 60)))
        other.start()
        # the doomed request's chunks are being computed and streamed: leave now
        wait_for(lambda: any(j.num_writes and j.tokens == doomed_prompt[:-1] for j in list(pc.jobs.values())),
                 10, "doomed request streaming")
        wait_for(computing.is_set, 10, "the prefill forward running")
        s.close()
        other.join(60)
        status, body = box["r"]
        assert status == 200 and body["choices"][0]["token_ids"] == want, body
        wait_for(lambda: any(k == "CANCEL_ACK" for _, k, _ in seen), 30, f"CANCEL_ACK {[(w, k, m.get('req'), m.get('posted')) for w, k, m in seen]}")
        wait_for(lambda: (peng.allocator.num_free, c.decode_engine.allocator.num_free) == start_free, 30,
                 "both page pools back to their start")
        assert ("decode", "CANCEL") in [(w, k) for w, k, _ in seen]
        ack = next(m for w, k, m in seen if k == "CANCEL_ACK")
        num_pages = -(-(len(doomed_prompt) - 1) // 4)
        full = num_pages * peng.kv.num_layers + 1  # every page once per layer + the hidden state
        assert 0 < ack["posted"] < full, (ack, full)  # cut short mid-prompt, some pages had left
        assert not any(k == "DONE_AT" and m["req"] == ack["req"] for _, k, m in seen)
        assert not c.coordinator.slots and not pc.jobs and c.decode_engine.num_held_pages == 0
        metrics = urllib.request.urlopen(c.url + "/metrics").read().decode()
        assert any(x.startswith("pdkv_kv_transfer_failures_total") and 'reason="cancelled"' in x
                   and x.endswith(" 1.0") for x in metrics.splitlines())
    finally:
        c.stop()


# ---- 2: the hidden state that arrives over verbs ------------------------------------------------

VERBS_PROMPTS = [list(range(3, 3 + n)) for n in (2, 9, 23, 37)]

DECODE_CHILD = """
import json, sys, threading, urllib.request
import torch
sys.path.insert(0, {tests!r})
from _cluster import keep_landed_hidden, make_engine, serve_node
from pdkv.config import config_from_dict
from pdkv.server.app import NODE
cfg = config_from_dict(json.loads({cfg!r}))
prompts = json.loads({prompts!r})
with serve_node(cfg, make_engine(cfg)) as dec:
    name = json.loads(urllib.request.urlopen(dec.url + "/v1/models").read())["data"][0]["id"]
    hs = keep_landed_hidden(dec.app[NODE].coordinator)
    got = [None] * len(prompts)
    def run(i):
        body = json.dumps({{"model": name, "prompt": prompts[i], "max_tokens": 4, "temperature": 0,
                           "ignore_eos": True, "return_token_ids": True}}).encode()
        req = urllib.request.Request(dec.url + "/v1/completions", body, {{"Content-Type": "application/json"}})
        got[i] = json.loads(urllib.request.urlopen(req, timeout=60).read())
    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in ts]
    [t.join(90) for t in ts]
    torch.save({{"tokens": [g["choices"][0]["token_ids"] for g in got],
                "hidden": [hs[g["id"] + "-0"] for g in got],
                "transport": dec.app[NODE].messenger.transport}}, sys.argv[1])
"""


@pytest.mark.slow  # node processes on the loopback verbs device: ~40 s
def test_hidden_state_over_verbs_equals_colocated(tiny_model_dir, tmp_path, loopback_verbs_dir):
    want_tokens, want_hidden = _reference(tiny_model_dir, VERBS_PROMPTS, 4)
    env = {"LD_LIBRARY_PATH": loopback_verbs_dir}
    cport = free_port()
    pre = NodeProc(tmp_path, "prefill", node_dict(tiny_model_dir, "prefill", port=free_port(), control_port=cport,
                                                  transport="verbs", nics=["lo_verbs0"], chunk=8), env)
    try:
        pre.wait_healthy()
        dcfg = node_dict(tiny_model_dir, "decode", port=0, peers=[f"127.0.0.1:{cport}"], transport="verbs",
                         nics=["lo_verbs0"])
        script = DECODE_CHILD.format(tests=str(ROOT / "tests" / "disagg"), cfg=json.dumps(dcfg),
                                     prompts=json.dumps(VERBS_PROMPTS))
        out = tmp_path / "decode_hidden.pt"
        import os

        child_env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"} | env
        r = subprocess.run([sys.executable, "-c", script, str(out)], cwd=str(ROOT), env=child_env,
                           capture_output=True, timeout=120)
        assert r.returncode == 0, r.stderr.decode()[-3000:]
        got = torch.load(out)
        assert got["transport"] == "verbs"
        assert got["tokens"] == want_tokens
        for p, h in zip(VERBS_PROMPTS, got["hidden"]):
            torch.testing.assert_close(h, want_hidden[tuple(p)], rtol=1e-4, atol=1e-5)
        assert pre.health()["num_pages_free"] == pre.health()["num_pages_total"]
    finally:
        pre.stop()


# ---- 3: a prefill node restarted on the same address is dialled again ---------------------------

@pytest.mark.slow  # a prefill process started twice: ~35 s
def test_decode_redials_a_restarted_prefill_node(tiny_model_dir, tmp_path, caplog):
    prompt = list(range(5, 45))
    (want,), _ = _reference(tiny_model_dir, [prompt], 4)
    cport = free_port()
    pdict = node_dict(tiny_model_dir, "prefill", port=free_port(), control_port=cport)
    pre = NodeProc(tmp_path, "prefill", pdict)
    try:
        pre.wait_healthy()
        dcfg = node_config(tiny_model_dir, "decode", messenger__prefill_peers=[f"127.0.0.1:{cport}"],
                           disagg__local_fallback=False)  # strict: no prefill node is a 503 (test_kill: local)
        eng = make_engine(dcfg)
        with caplog.at_level(logging.INFO, logger="pdkv.disagg.decode"), serve_node(dcfg, eng) as dec:
            name = json.loads(urllib.request.urlopen(dec.url + "/v1/models").read())["data"][0]["id"]

            def connected():
                return json.loads(urllib.request.urlopen(dec.url + "/health").read())["prefill_peers"][0]["connected"]
            status, body = _post(dec.url, _body(name, prompt))
            assert status == 200 and body["choices"][0]["token_ids"] == want, body
            pre.signal(signal.SIGKILL)
            pre.proc.wait(10)
            pre.stop()
            wait_for(lambda: not connected(), 10, "decode sees the prefill node gone")
            status, body = _post(dec.url, _body(name, prompt))
            assert status == 503 and "no prefill node is connected" in body["error"]["message"], body
            req = urllib.request.Request(dec.url + "/v1/completions", json.dumps(_body(name, prompt)).encode(),
                                         {"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=30)
            assert err.value.code == 503 and err.value.headers["Retry-After"] == "2"
            # the same address, a new process (a new node id, a new data connection)
            pdict["server"]["port"] = free_port()
            pre = NodeProc(tmp_path, "prefill2", pdict)
            pre.wait_healthy()
            wait_for(connected, 20, "decode redialled the restarted prefill node")
            status, body = _post(dec.url, _body(name, prompt))
            assert status == 200 and body["choices"][0]["token_ids"] == want, body
            assert pre.health()["decode_nodes"] == 1
            wait_for(lambda: eng.allocator.num_free == eng.allocator.num_total, 10, "decode pool full")
        logs = [r.getMessage() for r in caplog.records]
        assert any("redial of prefill peer" in m and "next try in" in m for m in logs), logs
        assert any("is back" in m for m in logs), logs
    finally:
        pre.stop()
