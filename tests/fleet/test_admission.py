"""SLO-aware admission (server.admission shed): a decode node in front of a slow prefill node
answers requests whose expected TTFT is over server.ttft_slo_ms with a 503 at once (Retry-After),
while a short request that fits keeps its budget; with local_fallback the same request is
prefilled here instead. Counted in pdkv_disagg_prefill_decisions_total."""
from __future__ import annotations

import json
import time
import urllib.request

from _cluster import make_engine, node_config, post_completion, serve_node, wait_for
from pdkv.server.app import NODE


def _decisions(url: str) -> dict:
    out = {}
    for line in urllib.request.urlopen(url + "/metrics").read().decode().splitlines():
        if line.startswith("pdkv_disagg_prefill_decisions_total{"):
            out[line.split('where="')[1].split('"')[0]] = float(line.split()[-1])
    return out


def _pair(tiny_model_dir, **decode_over):
    pcfg = node_config(tiny_model_dir, "prefill")
    peng = make_engine(pcfg)
    pre = serve_node(pcfg, peng)
    pre.start()
    hook = peng.connector.after_layer
    # FAULT INJECTION (a slow prefill node): 40 ms per layer per chunk of 16 tokens
    peng.connector.after_layer = lambda layer: (time.sleep(0.04), hook(layer))
    dcfg = node_config(tiny_model_dir, "decode", messenger__prefill_peers=[f"127.0.0.1:{pre.app[NODE].control_port}"],
                       server__admission="shed", server__ttft_slo_ms=400.0, **decode_over)
    dec = serve_node(dcfg, make_engine(dcfg))
    dec.start()
    wait_for(lambda: dec.app[NODE].coordinator.links.live(), 20, "decode connected")
    return pre, dec


def _warm(url: str, name: str) -> None:
    """One-chunk prompts until the decode node measured the prefill node's rate."""
    for i in range(3):
        assert post_completion(url, {"model": name, "prompt": [5 + i] * 16, "max_tokens": 1})[0] == 200


def test_shed_refuses_what_cannot_meet_the_budget_at_once(tiny_model_dir):
    pre, dec = _pair(tiny_model_dir, disagg__local_fallback=False)
    try:
        name = json.loads(urllib.request.urlopen(dec.url + "/v1/models").read())["data"][0]["id"]
        _warm(dec.url, name)
        est = dec.app[NODE].coordinator.ttft.expected_s(1)
        assert est is not None and est > 0
        long_tokens = 200  # 64 pages of 4 tokens hold it; expected well over the 400 ms budget:
        assert est * long_tokens > 0.6, est
        t0 = time.monotonic()
        status, body, headers = post_completion(dec.url, {"model": name, "prompt": [7] * long_tokens,
                                                          "max_tokens": 1}, headers=True)
        took = time.monotonic() - t0
        assert status == 503 and "over this node's budget (server.ttft_slo_ms 400)" in body["error"]["message"], body
        assert int(headers["Retry-After"]) >= 1
        assert took < 0.4, f"shed after {took:.3f} s, not at once"
        short = 8  # well within the budget
        t0 = time.monotonic()
        assert post_completion(dec.url, {"model": name, "prompt": [9] * short, "max_tokens": 1})[0] == 200
        assert _decisions(dec.url).get("refused_slo") == 1.0
    finally:
        dec.stop()
        pre.stop()


def test_shed_prefills_locally_when_the_chooser_may(tiny_model_dir):
    pre, dec = _pair(tiny_model_dir)  # disagg.local_fallback true (the default)
    try:
        name = json.loads(urllib.request.urlopen(dec.url + "/v1/models").read())["data"][0]["id"]
        _warm(dec.url, name)
        est = dec.app[NODE].coordinator.ttft.expected_s(1)
        long_tokens = 200
        assert est * long_tokens > 0.6, est
        assert post_completion(dec.url, {"model": name, "prompt": [7] * long_tokens, "max_tokens": 1})[0] == 200
        assert _decisions(dec.url).get("local_slo") == 1.0
    finally:
        dec.stop()
        pre.stop()
