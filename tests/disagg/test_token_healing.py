"""Token healing over real HTTP: disaggregated (the decode node heals and masks, the prefill node
prefills the shortened prompt, the decode node drafts with ngram from its first step) gives the
tokens and text of a colocated engine; ``server.token_healing`` auto heals a completion's text
prompt and leaves chat and token-id prompts alone, a request's own field wins, and usage counts
the prompt the engine ran."""
from __future__ import annotations

import json
import urllib.request

import pytest

from _cluster import Cluster, make_engine, node_config, post_completion, serve_node, wait_for
from pdkv.engine import SamplingParams
from pdkv.tokenizer import Tokenizer

PROMPTS = ["def add(a, b):\n", "class Counter:\n    def increment(self):\n", "def f(x):\n    ret"]
N = 10
NGRAM = {"speculative__method": "ngram", "speculative__num_tokens": 3}


def _post_chat(url, body):
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def tok(boundary_model_dir):
    return Tokenizer(boundary_model_dir)


def test_disaggregated_with_ngram_equals_colocated(boundary_model_dir, tok):
    plain = make_engine(node_config(boundary_model_dir, "colocated"))
    want = plain.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True,
                                                  token_healing=True))
    c = Cluster(boundary_model_dir, decode_over=NGRAM)
    sent = []  # the prompts the prefill node was asked to prefill
    real_submit = c.prefill_engine.submit  # the engine loop submits every request it is given

    def submit(request_id, prompt, params, arrival=None, priority=0):
        sent.append(list(prompt))
        return real_submit(request_id, prompt, params, arrival, priority)

    c.prefill_engine.submit = submit
    try:
        for p, w in zip(PROMPTS, want):
            short, h = tok.healer().heal(tok.encode(p))
            assert h is not None
            status, body = post_completion(c.url, {"prompt": p, "max_tokens": N, "temperature": 0,
                                                   "ignore_eos": True, "return_token_ids": True})
            assert status == 200, body  # healed by default (auto): a completion's text prompt
            ch = body["choices"][0]
            assert ch["token_ids"] == w.output_token_ids and ch["text"] == w.text
            assert body["prompt_token_ids"] == [short]
            assert sent[-1] == short[:-1]  # the shortened prompt, its last token held back for decode
            assert body["usage"]["prompt_tokens"] == len(short)
            assert body["usage"]["completion_tokens"] == N
        wait_for(c.pools_full, 10, "every page back on both nodes")
    finally:
        c.stop()


def test_server_default_and_the_request_field(boundary_model_dir, tok):
    cfg = node_config(boundary_model_dir, "colocated")
    with serve_node(cfg, make_engine(cfg)) as srv:
        ids = tok.encode(PROMPTS[0])
        base = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}

        def prompt_tokens(body):
            status, out = post_completion(srv.url, {**base, **body})
            assert status == 200, out
            return out["usage"]["prompt_tokens"]

        assert prompt_tokens({"prompt": PROMPTS[0]}) == len(ids) - 1  # auto: healed
        assert prompt_tokens({"prompt": PROMPTS[0], "token_healing": False}) == len(ids)
        assert prompt_tokens({"prompt": ids}) == len(ids)  # token ids: the client's tokenization
        assert prompt_tokens({"prompt": ids, "token_healing": True}) == len(ids) - 1
        # streamed, the chunks add up to the same text (the given-back text is in none of them)
        status, whole = post_completion(srv.url, {**base, "prompt": PROMPTS[1]})
        assert status == 200, whole
        req = urllib.request.Request(srv.url + "/v1/completions", json.dumps(
            {**base, "prompt": PROMPTS[1], "stream": True}).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
        chunks = [json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]"]
        assert "".join(chunks) == whole["choices"][0]["text"] and len(chunks) > 1
        status, out = post_completion(srv.url, {**base, "prompt": PROMPTS[0], "token_healing": "yes"})
        assert status == 400 and "token_healing" in out["error"]["message"], out
        messages = [{"role": "user", "content": "add"}]
        chat_ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        assert tok.id_to_token(chat_ids[-1]) == "Ċ"  # the template ends on a newline a longer token has
        assert _post_chat(srv.url, {**base, "messages": messages})["usage"]["prompt_tokens"] == len(chat_ids)
        healed = _post_chat(srv.url, {**base, "messages": messages, "token_healing": True})
        assert healed["usage"]["prompt_tokens"] == len(chat_ids) - 1
    cfg = node_config(boundary_model_dir, "colocated", server__token_healing="off")
    with serve_node(cfg, make_engine(cfg)) as srv:
        status, out = post_completion(srv.url, {**base, "prompt": PROMPTS[0]})
        assert status == 200 and out["usage"]["prompt_tokens"] == len(ids), out


def test_config_names_a_bad_mode():
    from pdkv.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="server.token_healing must be auto, on or off"):
        config_from_dict({"server": {"token_healing": "sometimes"}})
    for yaml_spelling in (True, False, "on", "off", "auto"):  # YAML reads a bare on/off as a bool
        config_from_dict({"server": {"token_healing": yaml_spelling}})
