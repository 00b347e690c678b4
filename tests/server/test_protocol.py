"""Request parsing: every field checked, with a message and ``param`` naming it."""

from __future__ import annotations

import pytest

from server.errors import APIError, error_body
from server.protocol import parse_chat, parse_completion


def test_completion_defaults_and_fields():
    r = parse_completion({"prompt": "hi", "max_tokens": 5, "temperature": 0, "top_p": 0.9, "top_k": 0, "seed": 7,
                          "stop": "x", "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True}, "user": "ignored-extra"})
    assert r.prompts == ["hi"] and not r.chat
    assert (r.max_tokens, r.temperature, r.top_p, r.top_k, r.seed) == (5, 0.0, 0.9, -1, 7)
    assert r.stop == ["x"] and r.ignore_eos and r.stream and r.include_usage
    assert parse_completion({"prompt": "a"}).max_tokens == 16  # OpenAI's completions default


def test_prompt_forms():
    assert parse_completion({"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert parse_completion({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert parse_completion({"prompt": [[1], [2, 3]]}).prompts == [[1], [2, 3]]


def test_chat_messages_and_content_parts():
    r = parse_chat({"messages": [{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}],
                    "max_completion_tokens": 9})
    assert r.chat and r.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert r.max_tokens == 9
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}).max_tokens is None  # up to the context


@pytest.mark.parametrize("body, param, needle", [
    ({}, "prompt", "'prompt' is required"),
    ({"prompt": 5}, "prompt", "'prompt' must be a non-empty string"),
    ({"prompt": ""}, "prompt", "'prompt' must not be empty"),
    ({"prompt": []}, "prompt", "'prompt' must be a non-empty string"),
    ({"prompt": [1, "a"]}, "prompt", "'prompt' must be"),
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens", "'max_tokens' must be an integer, got '5' (str)"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens", "'max_tokens' must be at least 1, got 0"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens", "'max_tokens' must be an integer"),
    ({"prompt": "a", "temperature": "hot"}, "temperature", "'temperature' must be a number"),
    ({"prompt": "a", "temperature": 3}, "temperature", "'temperature' must be between 0.0 and 2.0, got 3"),
    ({"prompt": "a", "top_p": 1.5}, "top_p", "'top_p' must be between"),
    ({"prompt": "a", "top_k": -2}, "top_k", "'top_k' must be at least -1"),
    ({"prompt": "a", "n": 0}, "n", "'n' must be at least 1"),
    ({"prompt": "a", "n": 1000}, "n", "'n' must be at most 16"),
    ({"prompt": "a", "stop": 3}, "stop", "'stop' must be a string or a list of strings"),
    ({"prompt": "a", "stop": [""]}, "stop", "'stop' strings must not be empty"),
    ({"prompt": "a", "stream": "yes"}, "stream", "'stream' must be true or false"),
    ({"prompt": "a", "seed": 1.5}, "seed", "'seed' must be an integer"),
    ({"prompt": "a", "model": 3}, "model", "'model' must be a string"),
    ({"prompt": "a", "logprobs": 3}, "logprobs", "'logprobs' is not supported"),
    ({"prompt": "a", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"prompt": "a", "echo": True}, "echo", "not supported"),
    ({"prompt": "a", "stream_options": 1}, "stream_options", "'stream_options' must be an object"),
])
def test_completion_errors(body, param, needle):
    with pytest.raises(APIError) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.param == param
    assert needle in e.value.message


@pytest.mark.parametrize("body, param, needle", [
    ({}, "messages", "'messages' is required"),
    ({"messages": []}, "messages", "'messages' must be a non-empty list"),
    ({"messages": "hi"}, "messages", "'messages' must be a non-empty list"),
    ({"messages": ["hi"]}, "messages[0]", "'messages[0]' must be an object"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "messages[0].role must be one of"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "must be a string or a list"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content", "parts must be"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools", "not supported"),
])
def test_chat_errors(body, param, needle):
    with pytest.raises(APIError) as e:
        parse_chat(body)
    assert e.value.param == param and needle in e.value.message


def test_body_must_be_an_object():
    with pytest.raises(APIError, match="must be a JSON object, got list"):
        parse_completion([1, 2])


def test_error_body_has_openai_shape():
    body = error_body("bad", 400, param="x")
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": "x", "code": None}}
    assert error_body("who", 401)["error"]["type"] == "authentication_error"
    assert error_body("boom", 500)["error"]["type"] == "server_error"
