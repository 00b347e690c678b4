"""Node level: a TP1 decode node with two NICs receives through both (pdkv/disagg/grants.py
grants each request's ranges on the NIC its seed picks), and the answers stay the colocated ones.

`pdkv serve` child processes on the loopback verbs device with two loopback NICs per node
(messenger.nics explicit; TP1: rank 0 has both, one per request by pdkv.shard.pick_nic). The
request ids, so the seeds, are the server's own: with 20 requests the chance that every one
picks the same NIC is 2 * 2**-20. The per-request choice itself is checked deterministically on
the messenger level (tests/messenger/test_landing_nics.py).
"""
from __future__ import annotations

import json
import urllib.request

from _cluster import make_engine, node_config, wait_for
from _procs import NodeProc, free_port, node_dict
from pdkv.engine import SamplingParams

PROMPTS = [list(range(3 + i, 3 + i + 5 + i % 4)) for i in range(20)]  # distinct: no prefix-cache hit
MAX_TOKENS = 3


def _complete(url: str, name: str, prompt: list[int]) -> list[int]:
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def _nic_counts(node, name):
    with urllib.request.urlopen(node.url + "/metrics", timeout=10) as r:
        lines = [line for line in r.read().decode().splitlines() if line.startswith(f"pdkv_nic_{name}_total{{")]
    return {line.split('nic="')[1].split('"')[0]: float(line.split()[-1]) for line in lines}


def test_a_tp1_decode_node_lands_over_both_its_nics(tiny_model_dir, tmp_path, loopback_verbs_dir):
    eng = make_engine(node_config(tiny_model_dir, "colocated"))
    want = [o.output_token_ids for o in eng.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                              ignore_eos=True))]
    env = {"LD_LIBRARY_PATH": loopback_verbs_dir, "PDKV_LOOPBACK_NICS": "lo_a,lo_b"}

    def proc(name, role, **kw):
        d = node_dict(tiny_model_dir, role, port=free_port(), transport="verbs", nics=["lo_a", "lo_b"], **kw)
        return NodeProc(tmp_path, name, d, env)

    cport = free_port()
    procs = [proc("p1", "prefill", control_port=cport)]
    try:
        procs.append(proc("d1", "decode", peers=[f"127.0.0.1:{cport}"]))
        for p in procs:
            p.wait_healthy(120)
        pre, dec = procs
        wait_for(lambda: all(peer["connected"] for peer in dec.health()["prefill_peers"]), 30, "prefill connected")
        name = json.loads(urllib.request.urlopen(dec.url + "/v1/models").read())["data"][0]["id"]
        assert [_complete(dec.url, name, p) for p in PROMPTS] == want, dec.log_path
        sent, landed = _nic_counts(pre, "writes"), _nic_counts(dec, "landed_writes")
        assert set(landed) == {"lo_a", "lo_b"} and min(landed.values()) > 0, (sent, landed)  # both NICs received
        assert sum(landed.values()) == sum(sent.values()), (sent, landed)
        bytes_in = _nic_counts(dec, "landed_bytes")
        assert min(bytes_in.values()) > 0, bytes_in
    finally:
        for p in reversed(procs):
            p.stop()
