"""An FP8 KV cache across a disaggregated pair: a TP2 prefill node feeds a TP1 decode node (tcp,
and `pdkv serve` processes on the loopback verbs device); the pages move as they are (e4m3
bytes): the pages that land equal the colocated FP8 cache byte for byte, the bytes moved are
half of a bf16 cache's for the same prompts (from /metrics), the tokens are the colocated
FP8-KV run's. A pair whose caches differ in dtype is refused at HELLO, naming both."""
from __future__ import annotations

import json
import threading
import urllib.request

import pytest
import torch

from _cluster import colocated_kv, hold_kv_on_landing, make_engine, node_config, wait_for
from _procs import NodeProc, free_port, node_dict
from pdkv.engine import SamplingParams

PROMPTS = [list(range(3, 3 + n)) for n in (5, 13, 30)]
FP8 = {"kv_cache__dtype": "fp8_e4m3"}
BF16 = {"model__dtype": "bfloat16"}  # the bf16-KV run (a bf16 model: its cache dtype)
NEW = 5


def _complete(url, prompt):
    body = json.dumps({"model": _name(url), "prompt": prompt, "max_tokens": NEW, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=90) as r:
        return json.loads(r.read())


def _name(url):
    return json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]


def _metric(url, name) -> float:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name))


def _want(model_dir):
    eng = make_engine(node_config(model_dir, "colocated", **FP8))
    return [o.output_token_ids for o in eng.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0,
                                                                              ignore_eos=True))]


def _pair_run(model_dir, kv: dict, landed: bool):
    """TP2 -> TP1 over tcp: (token ids per prompt, KV bytes the prefill node sent, landed KV)."""
    from _tp_pair import TP2ToTP1

    pair = TP2ToTP1(model_dir, kv, {**kv, "kv_cache__prefix_caching": False})
    seen = hold_kv_on_landing(pair.coordinator, pair.decode_engine) if landed else {}
    try:
        results = [None] * len(PROMPTS)

        def run(i, p):
            results[i] = _complete(pair.url, p)
        threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(PROMPTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(r is not None for r in results)
        wait_for(pair.pools_full, 10, "every page back on both nodes")
        sent = _metric(pair.prefill.url, "pdkv_kv_transfer_bytes_total")
        got = {tuple(p): seen.get(r["id"] + "-0") for p, r in zip(PROMPTS, results)}
        assert pair.decode_engine.kv.layer(0).dtype == (torch.float8_e4m3fn if FP8.items() <= kv.items()
                                                         else torch.bfloat16)
        return [r["choices"][0]["token_ids"] for r in results], sent, got, pair.decode_engine.kv.page_nbytes
    finally:
        pair.stop()


@pytest.mark.slow  # a TP2 engine and its follower: ~30 s
def test_tp2_prefill_to_tp1_decode_moves_fp8_pages_as_they_are(tiny_model_dir):
    want = _want(tiny_model_dir)
    want_kv = colocated_kv(tiny_model_dir, PROMPTS, **FP8)
    tokens, fp8_sent, landed, fp8_page = _pair_run(tiny_model_dir, FP8, landed=True)
    assert tokens == want
    for p in PROMPTS:
        _, (got,) = landed[tuple(p)]
        for layer, (g, w) in enumerate(zip(got, want_kv[tuple(p)])):
            assert g.dtype == torch.float8_e4m3fn
            assert torch.equal(g.view(torch.uint8), w[:, :len(p) - 1].view(torch.uint8)), (len(p), layer)
    tokens16, bf16_sent, _, bf16_page = _pair_run(tiny_model_dir, BF16, landed=False)
    assert bf16_page == 2 * fp8_page
    # one hidden-state row per request besides the pages: float32 (the FP8-KV run's model), bf16
    assert fp8_sent - len(PROMPTS) * 64 * 4 == (bf16_sent - len(PROMPTS) * 64 * 2) / 2 > 0
    assert len(tokens16) == len(PROMPTS)


@pytest.mark.slow  # node processes on the loopback verbs device: ~1 min
def test_over_the_loopback_verbs_device_and_a_refused_dtype_pair(tiny_model_dir, tmp_path, loopback_verbs_dir):
    """`pdkv serve` processes: P2 (TP2, FP8 KV) feeds D1 (TP1, FP8 KV) over verbs with the
    colocated FP8 tokens and FP8 page bytes; a float32-KV decode node is refused by name."""
    want = _want(tiny_model_dir)
    env = {"LD_LIBRARY_PATH": loopback_verbs_dir}

    def proc(name, role, tp, kv_dtype, **kw):
        d = node_dict(tiny_model_dir, role, port=free_port(), transport="verbs", nics=["lo_verbs0"], **kw)
        d["parallel"] = {"tp": tp, "timeout_s": 30.0}
        d.setdefault("kv_cache", {})["dtype"] = kv_dtype
        return NodeProc(tmp_path, name, d, env)

    cport = free_port()
    procs = [proc("p2", "prefill", 2, "fp8_e4m3", control_port=cport)]
    try:
        procs.append(proc("d1", "decode", 1, "fp8_e4m3", peers=[f"127.0.0.1:{cport}"]))
        for p in procs:
            p.wait_healthy(120)
        p2, d1 = procs
        wait_for(lambda: all(peer["connected"] for peer in d1.health()["prefill_peers"]), 30, "connected")
        got = [_complete(d1.url, p)["choices"][0]["token_ids"] for p in PROMPTS]
        assert got == want, d1.log_path
        L, page = 2, 4 * 2 * 1 * 16  # tiny llama: 2 layers; a rank's page: 4 tokens x K,V x 1 head x 16, 1 B
        # one after another, and the decode node's prefix cache on: each prompt (a prefix of the
        # next) finds the earlier ones' full pages there and fetches only the rest: 1 + 2 + 5 pages
        pages = 1 + (3 - 1) + (8 - 3)
        want_bytes = 2 * pages * page * L + len(PROMPTS) * 64 * 4
        try:
            wait_for(lambda: _metric(p2.url, "pdkv_kv_transfer_bytes_total") >= want_bytes, 10, "counted")
        finally:
            assert _metric(p2.url, "pdkv_kv_transfer_bytes_total") == want_bytes, \
                urllib.request.urlopen(p2.url + "/metrics").read().decode()[-3000:]
        procs.append(proc("d32", "decode", 1, "auto", peers=[f"127.0.0.1:{cport}"]))
        wait_for(lambda: procs[-1].proc.poll() is not None, 120, "the float32-KV decode node refused")
        log = procs[-1].log_path.read_text()
        assert ("kv_dtype: this decode node has 'float32', the prefill node has 'float8_e4m3fn'" in log), log[-2000:]
    finally:
        for p in reversed(procs):
            p.stop()
