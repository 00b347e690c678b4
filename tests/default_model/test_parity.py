"""transformers' greedy tokens on the shipped model equal pdkv's, token for token: colocated
(one engine) and disaggregated (prefill node -> tcp -> decode node, over real HTTP)."""
from __future__ import annotations

from pdkv.engine import SamplingParams
from pdkv.tokenizer import Tokenizer

from _cluster import Cluster, make_engine, node_config, post_completion
from _common import CODE_PROMPTS, hf_greedy

NEW_TOKENS = 24


def _want(shipped_dir, hf_model):
    tok = Tokenizer(shipped_dir)
    prompts = [tok.encode(p) for p in CODE_PROMPTS]
    return prompts, [hf_greedy(hf_model, ids, NEW_TOKENS) for ids in prompts]


def test_colocated_greedy_equals_transformers(shipped_dir, hf_model):
    prompts, want = _want(shipped_dir, hf_model)
    eng = make_engine(node_config(shipped_dir, "colocated"))
    outs = eng.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert [o.output_token_ids for o in outs] == want


def test_disaggregated_greedy_equals_transformers(shipped_dir, hf_model):
    prompts, want = _want(shipped_dir, hf_model)
    c = Cluster(shipped_dir, prefill_over={"scheduler__chunk_size": 8})  # several chunks per prompt
    try:
        name = c.model_name()
        got = []
        for ids in prompts:
            status, body = post_completion(c.url, {"model": name, "prompt": ids, "max_tokens": NEW_TOKENS,
                                                   "temperature": 0, "ignore_eos": True,
                                                   "return_token_ids": True})
            assert status == 200, body
            got.append(body["choices"][0]["token_ids"])
        assert got == want
    finally:
        c.stop()
