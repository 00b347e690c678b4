"""Logprobs over HTTP equal log_softmax of transformers' logits for the same tokens (1e-4):
greedy and sampled (after temperature: the distribution drawn from), completions with echo
(prompt logprobs) and chat top_logprobs, streamed and whole, and with ngram speculation (the
accepted drafts' logprobs too). top_logprobs above 20 is a 400 naming the field."""

from __future__ import annotations

import pytest
import torch

PROMPT = [5, 9, 17, 5, 9, 17, 5, 9, 17, 40, 41, 5, 9, 17, 5, 9, 17]


@pytest.fixture(scope="module")
def hf(server_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(server_model_dir), dtype=torch.float32).eval()

    def log_softmax(ids: list[int], temperature: float = 1.0) -> torch.Tensor:  # row i scores ids[i + 1]
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float() / temperature, -1)
    return log_softmax


@pytest.fixture(scope="module")
def spec_served(api, server_model_dir):
    s = api.Served(api.make_config(server_model_dir, "speculative.method=ngram", "speculative.num_tokens=4"))
    yield s
    s.close()


def _check_completion(body: dict, ref: torch.Tensor, prompt: list[int], temperature_ref=None) -> list[int]:
    ch = body["choices"][0]
    ids = ch["token_ids"]
    lp = ch["logprobs"]
    n = len(prompt)
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == n + len(ids)
    full = prompt + ids
    for i in range(1, len(full)):
        r = ref if i < n or temperature_ref is None else temperature_ref
        assert abs(lp["token_logprobs"][i] - float(r[i - 1, full[i]])) < 1e-4, i
        # keyed by token text: tokens that decode alike (partial UTF-8) share one key
        top = sorted(lp["top_logprobs"][i].values(), reverse=True)
        want = torch.topk(r[i - 1], 3).values.tolist()
        assert abs(top[0] - want[0]) < 1e-4 and all(min(abs(a - b) for b in want) < 1e-4 for a in top)
    return ids


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_completion_echo_logprobs_equal_transformers(api, served, hf, temperature):
    status, body = api.http("POST", served.url + "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 8, "temperature": temperature, "seed": 4, "logprobs": 3, "echo": True,
        "ignore_eos": True, "return_token_ids": True})
    assert status == 200, body
    ids = body["choices"][0]["token_ids"]
    _check_completion(body, hf(PROMPT + ids), PROMPT,
                      hf(PROMPT + ids, temperature) if temperature else None)


def test_chat_top_logprobs_streamed_equal_whole_and_transformers(api, served, hf):
    req = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 6, "temperature": 0,
           "logprobs": True, "top_logprobs": 4, "ignore_eos": True, "return_token_ids": True}
    status, body = api.http("POST", served.url + "/v1/chat/completions", req)
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    ids = body["choices"][0]["token_ids"]
    prompt = body["prompt_token_ids"][0]
    ref = hf(prompt + ids)
    assert len(content) == len(ids)
    text = body["choices"][0]["message"]["content"]  # bytes: each token's own, pieces of characters too
    assert b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", errors="replace") == text
    for j, (e, t) in enumerate(zip(content, ids)):
        assert abs(e["logprob"] - float(ref[len(prompt) - 1 + j, t])) < 1e-4
        assert len(e["top_logprobs"]) == 4 and e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][-1]["logprob"]
    events = api.stream(served.url, "/v1/chat/completions", req)
    streamed = [x for e in events[:-1] if e["choices"] and e["choices"][0].get("logprobs")
                for x in e["choices"][0]["logprobs"]["content"]]
    assert [x["token"] for x in streamed] == [x["token"] for x in content]
    assert max(abs(x["logprob"] - y["logprob"]) for x, y in zip(streamed, content)) < 1e-4


def test_spec_accepted_tokens_have_the_same_logprobs(api, served, spec_served):
    req = {"prompt": PROMPT * 2, "max_tokens": 24, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    before = spec_served.engine.stats()["spec_num_accepted_tokens"]
    a = api.http("POST", served.url + "/v1/completions", req)[1]["choices"][0]["logprobs"]
    b = api.http("POST", spec_served.url + "/v1/completions", req)[1]["choices"][0]["logprobs"]
    assert spec_served.engine.stats()["spec_num_accepted_tokens"] > before
    assert a["tokens"] == b["tokens"]
    assert max(abs(x - y) for x, y in zip(a["token_logprobs"], b["token_logprobs"])) < 1e-4


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": "x", "allowed_token_ids": [99999]}, "allowed_token_ids"),
    ({"prompt": "x " * 40, "echo": True, "logprobs": 1}, "echo"),
])
def test_bad_logprobs_and_bias_are_400(api, server_model_dir, served, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    url = served.url
    if param == "echo":  # a node with a small prompt-logprobs bound
        s = api.Served(api.make_config(server_model_dir, "server.max_prompt_logprobs_tokens=16"))
        url = s.url
    try:
        status, err = api.http("POST", url + path, body)
        assert status == 400 and err["error"]["param"] == param, err
    finally:
        if param == "echo":
            s.close()
    served.wait_idle()
