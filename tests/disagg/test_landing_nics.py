"""Node level: a TP1 decode node with two NICs receives through both (pdkv/disagg/grants.py
grants each request's ranges on the NIC its seed picks), and the answers stay the colocated ones
-- directly into the KV pages, and staged (messenger.staging cpu: the prefill node's writes
leave its staging ring, the decode node's land in its landing slots, pdkv/disagg/staged_*.py).
Each request goes, on both nodes, through NIC ``pick_nic(seed, 0, 2)`` of rank 0 (the seed is
``request_seed`` of the decode node's request id, the response id + "-0"): the per-NIC counts
of /metrics are the sums of the requests' writes and bytes on their NIC, exactly.

`pdkv serve` child processes on the loopback verbs device with two loopback NICs per node
(messenger.nics explicit; TP1: rank 0 has both, one per request by pdkv.shard.pick_nic). The
request ids, so the seeds, are the server's own: with 20 requests the chance that every one
picks the same NIC is 2 * 2**-20. The per-request choice itself is checked deterministically on
the messenger level (tests/messenger/test_landing_nics.py).
"""
from __future__ import annotations

import json
import urllib.request
from collections import Counter

import pytest

from _cluster import make_engine, node_config, wait_for
from _procs import NodeProc, free_port, node_dict
from pdkv.disagg.sharded import NodeKV
from pdkv.engine import SamplingParams
from pdkv.shard import pick_nic, plan_specs, request_seed

PROMPTS = [list(range(3 + i, 3 + i + 5 + i % 4)) for i in range(20)]  # distinct: no prefix-cache hit
MAX_TOKENS = 3


def _complete(url: str, name: str, prompt: list[int]) -> tuple[str, list[int]]:
    """(the decode node's request id, the answer's token ids)"""
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.loads(r.read())
    return out["id"] + "-0", out["choices"][0]["token_ids"]


def _nic_counts(node, name):
    with urllib.request.urlopen(node.url + "/metrics", timeout=10) as r:
        lines = [line for line in r.read().decode().splitlines() if line.startswith(f"pdkv_nic_{name}_total{{")]
    return {line.split('nic="')[1].split('"')[0]: float(line.split()[-1]) for line in lines}


def _per_nic(eng, rids) -> tuple[Counter, Counter]:
    """What every request's writes (its KV pages, then its hidden row) weigh, summed on the NIC its
    seed picks: (writes, bytes) by NIC name."""
    kv = NodeKV(eng, None, register=False)
    plan = plan_specs(kv.spec, kv.spec)  # TP1 -> TP1
    page_size, hidden_nbytes = eng.kv.page_size, int(eng.loaded.arch.hidden_size) * 4  # float32 rows
    writes, nbytes = Counter(), Counter()
    for rid, prompt in zip(rids, PROMPTS):
        seed, num_pages = request_seed(rid), -(-(len(prompt) - 1) // page_size)  # the last token stays
        nic = ("lo_a", "lo_b")[pick_nic(seed, 0, 2)]
        writes[nic] += plan.expected_writes_total(num_pages, kv.geometry.num_layers) + 1
        seg = sum(s.length for pair in plan.active_pairs(seed) for s in pair.segments)
        nbytes[nic] += num_pages * kv.geometry.num_layers * seg + hidden_nbytes
    return writes, nbytes


@pytest.mark.slow  # `pdkv serve` processes over two loopback NICs: ~45 s each
@pytest.mark.parametrize("staging", ["auto", "cpu"])  # cpu: through both nodes' staging rings
def test_a_tp1_decode_node_lands_over_both_its_nics(tiny_model_dir, tmp_path, loopback_verbs_dir, staging):
    eng = make_engine(node_config(tiny_model_dir, "colocated"))
    want = [o.output_token_ids for o in eng.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                              ignore_eos=True))]
    env = {"LD_LIBRARY_PATH": loopback_verbs_dir, "PDKV_LOOPBACK_NICS": "lo_a,lo_b"}

    def proc(name, role, **kw):
        d = node_dict(tiny_model_dir, role, port=free_port(), transport="verbs", nics=["lo_a", "lo_b"], **kw)
        d["messenger"]["staging"] = staging
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
        rids, got = zip(*(_complete(dec.url, name, p) for p in PROMPTS))
        assert list(got) == want, dec.log_path
        writes, nbytes = _per_nic(eng, rids)
        assert set(writes) == {"lo_a", "lo_b"}, writes  # 20 seeds: both NICs picked (see the docstring)
        want_writes, want_bytes = ({n: float(c[n]) for n in ("lo_a", "lo_b")} for c in (writes, nbytes))
        # landed on the decode node through the NIC each request's grants named, exactly
        assert _nic_counts(dec, "landed_writes") == want_writes, dec.log_path
        assert _nic_counts(dec, "landed_bytes") == want_bytes
        # and left the prefill node through rank 0's NIC its seed picks (staged: out of the ring)
        assert _nic_counts(pre, "writes") == want_writes, pre.log_path
        assert _nic_counts(pre, "write_bytes") == want_bytes
    finally:
        for p in reversed(procs):
            p.stop()
