"""A TP2 prefill node -> TP1 decode node over the libfabric transport: greedy tokens and the KV
each request landed equal the colocated engine's. Both ranks' pages leave through the one
messenger of the prefill node, into MRs granted per request (a fabric domain per peer)."""
from __future__ import annotations

import json
import urllib.request

from pdkv.server.app import NODE

import pytest
import torch

from _cluster import colocated_kv, hold_kv_on_landing, make_engine, node_config, wait_for
from pdkv.engine import SamplingParams
from test_equality import MREP_DOUBLE, admit_test_double, libfabric_messenger

PROMPTS = [list(range(3, 3 + n)) for n in (2, 7, 18, 33)]
MAX_TOKENS = 5


def _complete(url: str, name: str, prompt: list[int]) -> list[int]:
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


@pytest.mark.parametrize("provider, domains", [("tcp;ofi_rxm", None), ("tcp;ofi_rxm", ("lo", "lo@127.0.0.1/32")),
                                              (MREP_DOUBLE, ("lo", "lo@127.0.0.1/32"))],
                         ids=["one-domain", "two-domains", "two-domains-mr-endpoint"])
def test_tp2_prefill_to_tp1_decode_over_libfabric_equals_colocated(tiny_model_dir, provider, domains, monkeypatch):
    """Two domains (one opened twice under two names: any endpoint reaches any, as EFA devices
    do): prefill rank r's pages leave through domain r, each request lands through the decode
    rank's domain its seed picks, over only the endpoint pairs the plan uses. MREP_DOUBLE: the
    same with every MR bound to its endpoint (FI_MR_ENDPOINT, the test double)."""
    from _tp_pair import TP2ToTP1

    admit_test_double(monkeypatch, provider)

    ms = {f"messenger__{k}": v for k, v in libfabric_messenger(provider, domains).items()}
    ref = make_engine(node_config(tiny_model_dir, "colocated"))
    want = [o.output_token_ids for o in ref.generate(PROMPTS, SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))]
    want_kv = colocated_kv(tiny_model_dir, PROMPTS)
    pair = TP2ToTP1(tiny_model_dir, ms, {"kv_cache__prefix_caching": False, **ms})
    try:
        dec = pair.decode.app[NODE]
        assert dec.messenger.transport == pair.prefill.app[NODE].messenger.transport == "libfabric"
        landed = hold_kv_on_landing(pair.coordinator, pair.decode_engine)
        name = pair.model_name()
        try:
            got = [_complete(pair.url, name, p) for p in PROMPTS]
        finally:
            landed.restore()
        assert got == want
        # what landed, page by page before each request's last prompt token ran: the colocated KV
        assert len(landed) == len(PROMPTS)
        for prompt, (per_rank,) in landed.values():
            for layer, (g, w) in enumerate(zip(per_rank, want_kv[prompt])):
                torch.testing.assert_close(g, w[:, :len(prompt) - 1], rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{len(prompt)}-token prompt, layer {layer}: {m}")
        assert dec.messenger.stats()["refused_writes"] == 0
        if domains:  # both domains carried the prefill node's writes (rank r: domain r)
            pre = pair.prefill.app[NODE].messenger
            assert pre.rank_nics == ((0,), (1,)) and dec.messenger.rank_nics == ((0, 1),)
            assert all(s["writes_done"] > 0 for s in pre.nic_stats()), pre.nic_stats()
            # each request lands through the domain its (random) id's seed picks: some domain
            assert sum(s["imms"] for s in dec.messenger.nic_stats()) > 0, dec.messenger.nic_stats()
        wait_for(pair.pools_full, 10, "every page back on both nodes")
    finally:
        pair.stop()
