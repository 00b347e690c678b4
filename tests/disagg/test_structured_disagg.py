"""Structured output, logprobs and penalties on a disaggregated pair: the decode node owns every
sampling decision (the prefill node never samples), so a JSON schema holds for every completion
over tcp (with ngram k=4 on the decode node) and over the loopback verbs device (run on
test_verbs.py's pair: check_schema_choices); logprobs of the
sampled tokens equal transformers' log_softmax; echo + logprobs prompts are prefilled on the
prefill node (its forward computes them and sends PROMPT_LOGPROBS; it samples nothing) and equal
a colocated engine's and transformers' too."""
from __future__ import annotations

import json
import urllib.request

import jsonschema
import pytest
import torch

from _cluster import Cluster, make_engine, node_config, post_completion, wait_for

from pdkv.engine import SamplingParams

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
    "level": {"enum": ["low", "high"]},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 9}, "on": {"type": "boolean"}},
        "required": ["n", "on"], "additionalProperties": False}, "maxItems": 3}},
    "required": ["id", "level", "items"], "additionalProperties": False}
PROMPT = [7, 12, 99, 7, 12, 99, 7, 12, 99, 31, 200, 7, 12, 99, 7, 12, 99, 5]


def _chat(url, body):
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _schema_body(n=3):
    return {"messages": [{"role": "user", "content": "give me a record of the transfer, please"}],
            "max_tokens": 160, "n": n, "seed": 7,
            "response_format": {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA}}}


def _remote(url, where: str = "remote") -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(x.split()[-1]) for x in text.splitlines()
               if x.startswith("pdkv_disagg_prefill_decisions_total{") and f'where="{where}"' in x)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    c = Cluster(tiny_model_dir, decode_over={"speculative__method": "ngram", "speculative__num_tokens": 4,
                                             "kv_cache__num_pages": 256}, prefill_over={"kv_cache__num_pages": 256})
    yield c
    c.stop()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()

    def log_softmax(ids):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return log_softmax


def test_json_schema_over_tcp_with_ngram(cluster):
    before = _remote(cluster.url)
    body = _chat(cluster.url, _schema_body())
    for c in body["choices"]:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
    assert _remote(cluster.url) >= before + 3  # prefilled by the prefill node
    assert cluster.decode_engine.stats()["spec_num_draft_tokens"] > 0
    wait_for(cluster.pools_full, what="every page back on both nodes")


def test_logprobs_and_echo_equal_transformers(cluster, hf, tiny_model_dir):
    status, body = post_completion(cluster.url, {"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                                 "logprobs": 2, "ignore_eos": True, "return_token_ids": True,
                                                 "presence_penalty": 0.0})
    assert status == 200, body
    ids = body["choices"][0]["token_ids"]
    ref = hf(PROMPT + ids)
    got = body["choices"][0]["logprobs"]["token_logprobs"]
    assert max(abs(g - float(ref[len(PROMPT) - 1 + j, t])) for j, (g, t) in enumerate(zip(got, ids))) < 1e-4
    remote = _remote(cluster.url)
    status, echo = post_completion(cluster.url, {"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                                 "logprobs": 2, "echo": True, "ignore_eos": True})
    assert status == 200, echo
    lps = echo["choices"][0]["logprobs"]["token_logprobs"]
    assert lps[0] is None and _remote(cluster.url) == remote + 1  # prefilled by the prefill node
    # the last prompt token's logprob too: the prefill node's row n-2 scored the held-back token
    assert max(abs(lps[i] - float(ref[i - 1, PROMPT[i]])) for i in range(1, len(PROMPT))) < 1e-4
    tops = echo["choices"][0]["logprobs"]["top_logprobs"]
    assert all(max(tops[i].values()) == pytest.approx(float(ref[i - 1].max()), abs=1e-4)
               for i in range(1, len(PROMPT)))  # (tokens that decode alike share one key)
    wait_for(cluster.pools_full, what="every page back on both nodes")
    colocated = make_engine(node_config(tiny_model_dir, "colocated"))
    out = colocated.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2,
                                                      ignore_eos=True))[0]
    assert len(out.prompt_logprobs) == len(PROMPT) - 1
    assert max(abs(lps[i] - out.prompt_logprobs[i - 1].logprob) for i in range(1, len(PROMPT))) < 1e-4


def test_prompt_logprobs_beyond_what_was_asked_are_refused(cluster, monkeypatch):
    """FAULT INJECTION: the prefill node sends one PROMPT_LOGPROBS entry more than asked for; the
    decode node refuses the message naming it, the client gets that error, no page is leaked."""
    from pdkv.disagg import prompt_logprobs as PL

    real = PL.encode

    def one_too_many(req, logprobs):
        msg = real(req, logprobs)
        msg["logprobs"].append(msg["logprobs"][-1])
        return msg
    monkeypatch.setattr(PL, "encode", one_too_many)
    status, body = post_completion(cluster.url, {"prompt": PROMPT, "max_tokens": 2, "logprobs": 1, "echo": True})
    assert status >= 500 and "must hold 17 entries" in json.dumps(body), body
    monkeypatch.undo()
    wait_for(cluster.pools_full, what="every page back on both nodes")
    status, body = post_completion(cluster.url, {"prompt": PROMPT, "max_tokens": 2, "logprobs": 1, "echo": True})
    assert status == 200, body


def check_schema_choices(url: str, n: int = 2) -> None:
    """Every choice of a JSON-schema chat request to ``url`` validates (tests/disagg/test_verbs.py
    runs it on its loopback-verbs pair)."""
    body = _chat(url, _schema_body(n))
    for c in body["choices"]:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
