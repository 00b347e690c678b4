"""The equality test over the verbs transport: both nodes are child processes on the loopback
verbs device (tests/verbs_loopback, on LD_LIBRARY_PATH in the children only). Every request's
pages are granted as MRs of their own (one per layer and run of pages, pdkv/disagg/grants.py)
whose keys the prefill node's writes name; waves of requests finishing in different orders
fragment the decode pool until some request's pages form several runs (several keys per layer)."""
from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path

import pytest

from _cluster import make_engine, node_config
from test_structured_disagg import check_schema_choices
from _procs import NodeProc, free_port, node_dict
from pdkv.engine import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [list(range(3, 3 + n)) for n in (2, 9, 23, 37)]
LENGTHS = (2, 9, 23, 37, 5, 14)
WAVES = [[list(range(3 + 50 * w + k, 3 + 50 * w + k + n)) for k, n in enumerate(LENGTHS)] for w in range(1, 5)]


def _grants_total(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith("pdkv_kv_grants_total"))


def _with(d: dict, staging: str) -> dict:
    d["messenger"]["staging"] = staging
    return d


@pytest.mark.parametrize("staging", ["auto", "cpu"])  # cpu: through both nodes' staging rings
def test_greedy_tokens_equal_colocated_over_verbs(tiny_model_dir, tmp_path, loopback_verbs_dir, staging):
    ref = make_engine(node_config(tiny_model_dir, "colocated"))
    prompts = PROMPTS + [p for w in WAVES for p in w]
    want = [o.output_token_ids for o in ref.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0,
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
        got = [None] * len(prompts)

        def run(i):
            body = json.dumps({"model": name, "prompt": prompts[i], "max_tokens": 5, "temperature": 0,
                               "ignore_eos": True, "return_token_ids": True}).encode()
            req = urllib.request.Request(dec.url + "/v1/completions", body, {"Content-Type": "application/json"})
            got[i] = json.loads(urllib.request.urlopen(req, timeout=60).read())["choices"][0]["token_ids"]

        def wave(ids):
            threads = [threading.Thread(target=run, args=(i,)) for i in ids]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
        wave(range(len(PROMPTS)))
        assert got[:len(PROMPTS)] == want[:len(PROMPTS)]
        # a request of a single run per layer is granted 1 + layers ranges; more: several runs.
        # Staged, the ranges are landing slots: 1 + one per run of slots (all layers in one)
        single, done = 1 + (1 if staging == "cpu" else ref.kv.num_layers), len(PROMPTS)
        for w in WAVES:
            if _grants_total(dec.url) > single * done:
                break
            wave(range(done, done + len(w)))
            done += len(w)
        assert got[:done] == want[:done]
        if staging == "auto":  # the ring's slots need not fragment within a few waves
            assert _grants_total(dec.url) > single * done, "no request's pages were fragmented into several runs"
        if staging == "auto":  # structured output: the decode node's masks over a verbs transfer
            check_schema_choices(dec.url)
        assert pre.health()["num_pages_free"] == pre.health()["num_pages_total"]
        h = dec.health()
        assert h["num_pages_free"] == h["num_pages_total"] and h["prefill_peers"][0]["connected"]
    finally:
        dec.stop()
        pre.stop()
