"""Structured output through the HTTP API on a random-weight model: every completion under a
JSON schema (nested objects, arrays, enums, required fields, a regex string) parses and
validates, colocated and with ngram speculation (k=4: drafts checked against the grammar, the
matcher rolled back on rejection); regex, choice, EBNF grammar and json_object through each
field name; max_tokens mid-structure says length; uncompilable constraints are a 400 naming the
field, and no matcher or page is left behind; the ``openai`` client's ``parse`` with Pydantic."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pdkv.server.app import ROUTES

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{2,6}$"},
    "kind": {"enum": ["cat", "dog", "owl"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    # NOTE: items by pattern, not maxLength: xgrammar 0.2.9 lets control characters into
    # maxLength strings, which JSON forbids
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z0-9 ]{1,4}$"}, "maxItems": 3},
    "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "ok": {"type": "boolean"}},
              "required": ["id", "ok"], "additionalProperties": False}},
    "required": ["name", "kind", "age", "tags", "owner"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "describe a pet"}]


@pytest.fixture(scope="module")
def spec_served(api, server_model_dir):
    s = api.Served(api.make_config(server_model_dir, "speculative.method=ngram", "speculative.num_tokens=4"))
    yield s
    s.close()


@pytest.fixture(params=["colocated", "ngram_k4"])
def node(request, served):
    return served if request.param == "colocated" else request.getfixturevalue("spec_served")


def _live_masks(s) -> int:
    g = s.thread.app[ROUTES].grammars
    return g.num_live_masks if g is not None else 0


def test_json_schema_choices_all_validate(api, node):
    status, body = api.http("POST", node.url + "/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 200, "n": 4, "seed": 5, "temperature": 1.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}})
    assert status == 200, body
    for c in body["choices"]:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
    node.wait_idle()
    assert _live_masks(node) == 0
    if node is not None and node.engine.spec is not None:
        assert node.engine.stats()["spec_num_draft_tokens"] > 0


def test_streamed_json_validates_and_completions_take_it_too(api, node):
    events = api.stream(node.url, "/v1/completions", {
        "prompt": "pet:", "max_tokens": 200, "seed": 2, "structured_outputs": {"json": SCHEMA}})
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("field,value,check", [
    ("guided_regex", "(ab|cd)[0-9]{2,4}x", lambda t: re.fullmatch(r"(ab|cd)[0-9]{2,4}x", t)),
    ("guided_choice", ["alpha", "beta \"q\"", "gamma"], lambda t: t in ("alpha", "beta \"q\"", "gamma")),
    ("guided_grammar", 'root ::= "[" num ("," num)* "]"\nnum ::= [1-9] [0-9]?',
     lambda t: re.fullmatch(r"\[[1-9][0-9]?(,[1-9][0-9]?)*\]", t)),
    ("structured_outputs", {"json_object": True}, "json_object"),
])
def test_regex_choice_grammar_and_json_object(api, node, field, value, check):
    status, body = api.http("POST", node.url + "/v1/completions", {
        "prompt": "x", "max_tokens": 120, "n": 3, "seed": 9, field: value})
    assert status == 200, body
    for c in body["choices"]:
        if check == "json_object":  # free-form JSON: a random model may write one string forever
            assert c["text"].startswith("{") and (c["finish_reason"] == "length" or json.loads(c["text"]) == {}
                                                  or isinstance(json.loads(c["text"]), dict)), c
        else:
            assert c["finish_reason"] == "stop" and check(c["text"]), c


def test_a_completed_grammar_ends_the_request_even_with_ignore_eos(api, served):
    """ignore_eos cannot make a grammar that accepted its stop token go on (no token is allowed
    after it): the request ends there, "stop", its text the grammar's."""
    status, body = api.http("POST", served.url + "/v1/completions", {
        "prompt": "x", "max_tokens": 40, "n": 2, "seed": 3, "ignore_eos": True, "guided_choice": ["si", "no"]})
    assert status == 200, body
    assert all(c["finish_reason"] == "stop" and c["text"] in ("si", "no") for c in body["choices"]), body
    assert _live_masks(served) == 0


def test_max_tokens_mid_structure_is_length(api, served):
    status, body = api.http("POST", served.url + "/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 4, "response_format": {"type": "json_schema",
                                                              "json_schema": {"schema": SCHEMA}}})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"].startswith("{")


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "a(("}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}}},
     "guided_json"),
])
def test_uncompilable_constraints_are_400_naming_the_field(api, served, body, param):
    free = served.engine.allocator.num_free
    status, err = api.http("POST", served.url + "/v1/chat/completions", {"messages": CHAT, **body})
    assert status == 400 and err["error"]["param"] == param, err
    assert param in err["error"]["message"] and "/project/" not in err["error"]["message"]
    assert served.engine.allocator.num_free == free and _live_masks(served) == 0


def test_openai_client_parse_with_pydantic(served):
    from typing import Literal

    import openai
    from pydantic import BaseModel, Field

    class Owner(BaseModel):
        id: int = Field(ge=0, le=99)
        ok: bool

    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        name: str = Field(pattern=r"^[a-z]{1,5}$")
        owner: Owner
        tags: list[bool]

    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.parse(model=served.model, messages=CHAT, response_format=Pet, max_tokens=300,
                                      seed=3, extra_body={"top_k": 8})
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and isinstance(pet.owner, Owner), r


def test_a_client_leaving_mid_stream_leaves_no_matcher(api, served):
    import asyncio

    import aiohttp

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(served.url + "/v1/completions", json={
                    "prompt": "x", "max_tokens": 400, "stream": True, "guided_json": {"type": "string"}}) as r:
                assert r.status == 200
                await r.content.readline()  # the first chunk: the request is decoding under its mask
                assert _live_masks(served) == 1
    asyncio.run(go())
    served.wait_idle()
    assert _live_masks(served) == 0


def test_a_compile_over_the_time_limit_is_400_and_the_worker_goes_on(api, server_model_dir):
    import time

    # 400 patterned properties: a few hundred ms of compiling, far over the 20 ms allowed
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{1,{i % 7 + 2}}}$"}
                                            for i in range(400)}, "required": ["p0"]}
    s = api.Served(api.make_config(server_model_dir, "server.grammar_compile_timeout_s=0.02"))
    try:
        body = {"prompt": "x", "max_tokens": 8, "guided_json": big}
        status, err = api.http("POST", s.url + "/v1/completions", body)
        assert status == 400 and err["error"]["param"] == "guided_json", err
        assert "server.grammar_compile_timeout_s" in err["error"]["message"]
        deadline = time.monotonic() + 30
        while status != 200 and time.monotonic() < deadline:  # the worker finished it: now cached
            time.sleep(0.2)
            status, out = api.http("POST", s.url + "/v1/completions", body)
        assert status == 200 and out["choices"][0]["text"].startswith("{"), out
        s.wait_idle()
    finally:
        s.close()
