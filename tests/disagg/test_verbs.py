"""The equality test over the verbs transport: both nodes are child processes on the loopback
verbs device (tests/verbs_loopback, on LD_LIBRARY_PATH in the children only)."""
from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path

import pytest

from _cluster import make_engine, node_config
from _procs import NodeProc, free_port, node_dict
from pdkv.engine import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [list(range(3, 3 + n)) for n in (2, 9, 23, 37)]


def _with(d: dict, staging: str) -> dict:
    d["messenger"]["staging"] = staging
    return d


@pytest.mark.parametrize("staging", ["auto", "cpu"])  # cpu: through both nodes' staging rings
def test_greedy_tokens_equal_colocated_over_verbs(tiny_model_dir, tmp_path, loopback_verbs_dir, staging):
    ref = make_engine(node_config(tiny_model_dir, "colocated"))
    want = [o.output_token_ids for o in ref.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0,
                                                                              ignore_eos=True))]
    env = {"LD_LIBRARY_PATH": loopback_verbs_dir}
    cport = free_port()
    pre = NodeProc(tmp_path, "prefill", _with(node_dict(tiny_model_dir, "prefill", port=free_port(), control_port=cport,
                                                        transport="verbs", nics=["lo_verbs0"], chunk=8), staging), env)
    dec = NodeProc(tmp_path, "decode", _with(node_dict(tiny_model_dir, "decode", port=free_port(),
                                                       peers=[f"127.0.0.1:{cport}"], transport="verbs",
                                                       nics=["lo_verbs0"]), staging), env)
    try:
        pre.wait_healthy()
        dec.wait_healthy()
        name = json.loads(urllib.request.urlopen(dec.url + "/v1/models").read())["data"][0]["id"]
        got = [None] * len(PROMPTS)

        def run(i):
            body = json.dumps({"model": name, "prompt": PROMPTS[i], "max_tokens": 5, "temperature": 0,
                               "ignore_eos": True, "return_token_ids": True}).encode()
            req = urllib.request.Request(dec.url + "/v1/completions", body, {"Content-Type": "application/json"})
            got[i] = json.loads(urllib.request.urlopen(req, timeout=60).read())["choices"][0]["token_ids"]
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert got == want
        assert pre.health()["num_pages_free"] == pre.health()["num_pages_total"]
        h = dec.health()
        assert h["num_pages_free"] == h["num_pages_total"] and h["prefill_peers"][0]["connected"]
    finally:
        dec.stop()
        pre.stop()
