"""Request parsing: every field checked, with a message and ``param`` naming it."""

from __future__ import annotations

import pytest

from pdkv.server.errors import APIError, error_body
from pdkv.server.protocol import parse_chat, parse_completion


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
    ({"prompt": "a", "logprobs": 21}, "logprobs", "'logprobs' must be an integer in [0, 20]"),
    ({"prompt": "a", "logprobs": True}, "logprobs", "'logprobs' must be an integer"),
    ({"prompt": "a", "presence_penalty": 2.5}, "presence_penalty", "'presence_penalty' must be a number in"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty", "in (0.0, 100.0]"),
    ({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias", "keyed by token ids"),
    ({"prompt": "a", "logit_bias": {"5": 200}}, "logit_bias[5]", "in [-100, 100]"),
    ({"prompt": "a", "min_tokens": -1}, "min_tokens", "'min_tokens' must be an integer"),
    ({"prompt": "a", "bad_words": [""]}, "bad_words", "non-empty strings"),
    ({"prompt": "a", "echo": "yes"}, "echo", "'echo' must be true or false"),
    ({"prompt": "a", "suffix": "x"}, "suffix", "not supported"),
    ({"prompt": "a", "tools": [{"type": "function"}]}, "tools", "not supported"),
    ({"prompt": "a", "response_format": {"type": "yaml"}}, "response_format.type", "'json_schema'"),
    ({"prompt": "a", "response_format": {"type": "json_schema"}}, "response_format.json_schema", "'schema'"),
    ({"prompt": "a", "guided_json": "{nope"}, "guided_json", "not valid JSON"),
    ({"prompt": "a", "guided_choice": []}, "guided_choice", "non-empty list"),
    ({"prompt": "a", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of"),
    ({"prompt": "a", "guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "only one output constraint"),
    ({"prompt": "a", "stream_options": 1}, "stream_options", "'stream_options' must be an object"),
])
def test_completion_errors(body, param, needle):
    with pytest.raises(APIError) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.param == param
    assert needle in e.value.message


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("body, param, needle", [
    ({}, "messages", "'messages' is required"),
    ({"messages": []}, "messages", "'messages' must be a non-empty list"),
    ({"messages": "hi"}, "messages", "'messages' must be a non-empty list"),
    ({"messages": ["hi"]}, "messages[0]", "'messages[0]' must be an object"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "messages[0].role must be one of"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "must be a string or a list"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content", "parts must be"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]",
     "'tools[0]' must be"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [_TOOL], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope', which is not in 'tools'"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [_TOOL, _TOOL]}, "tools[1].function.name",
     "given twice"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "in [0, 20]"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "needs 'logprobs'"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "the call it answers"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "a JSON object"),
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


def test_new_fields_parse():
    r = parse_completion({"prompt": "a", "logprobs": 3, "echo": True, "presence_penalty": 0.5,
                          "frequency_penalty": -1, "repetition_penalty": 1.2, "logit_bias": {"7": -5},
                          "min_tokens": 2, "bad_words": "x", "guided_regex": "[ab]+"})
    assert (r.logprobs, r.echo, r.presence_penalty, r.frequency_penalty) == (3, True, 0.5, -1.0)
    assert (r.repetition_penalty, r.logit_bias, r.min_tokens, r.bad_words) == (1.2, {7: -5.0}, 2, ["x"])
    assert (r.structured.kind, r.structured.value, r.structured.field) == ("regex", "[ab]+", "guided_regex")
    c = parse_chat({"messages": [{"role": "user", "content": "x"},
                                 {"role": "assistant", "content": None, "tool_calls": [
                                     {"id": "c1", "type": "function",
                                      "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                                 {"role": "tool", "tool_call_id": "c1", "content": "42"}],
                    "logprobs": True, "top_logprobs": 4, "tools": [_TOOL],
                    "tool_choice": {"type": "function", "function": {"name": "f"}},
                    "response_format": {"type": "text"}})
    assert c.logprobs == 4 and c.structured is None and c.tools.choice == "named" and c.tools.name == "f"
    assert c.messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}  # an object, for templates
    assert c.messages[2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": False}).logprobs is None
