"""Tool calling and reasoning: each tool-call parser's golden model outputs (hand-written in the
model's own format) become the expected tool_calls, whole and streamed in every split of the
deltas; the same through the HTTP server, where a stand-in sampler emits the golden text's
tokens; tool_choice required and a named function force a call from a random model; the chat
template renders tools and tool round-trips as transformers' apply_chat_template does."""

from __future__ import annotations

import json
import random

import pytest

from pdkv.server.chat_output import ChatOutput, OutputParsers
from pdkv.server.protocol import parse_chat

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["CET", "UTC"]}}, "required": ["tz"]}}}
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "CET"})]

GOLDEN = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
               "Let me check.\n", CALLS),
    "qwen3_coder": ("I will look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                    "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                    "<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>",
                    "I will look it up.\n", CALLS),
    "deepseek_v3": ("Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function'
                    '<｜tool▁sep｜>get_time\n```json\n{"tz": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                    "Sure.", CALLS),
    "none": ("No tools needed <tool here.", "No tools needed <tool here.", []),
}


def _req(**kw):
    return parse_chat({"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER, TIME], **kw})


def _calls(tool_calls) -> list:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


def _streamed(parsers, req, pieces, fragments=None) -> tuple[str, str, list]:
    """What a client assembles from the deltas of ``pieces`` (a token-emitting stand-in's text),
    checking OpenAI's delta shape: a call's first delta has its id, type and name, the later
    ones only ``function.arguments`` fragments. ``fragments``: filled with each call's."""
    out = ChatOutput(parsers, req)
    content, reasoning, calls, frags = "", "", {}, {}
    for i, p in enumerate(pieces):
        d = out.delta(p)
        if i == len(pieces) - 1:
            d = out.merge(d, out.end())
        content += d.get("content", "")
        reasoning += d.get("reasoning_content", "")
        for c in d.get("tool_calls", []):
            if c["index"] not in calls:
                assert c["id"].startswith("call_") and c["type"] == "function" and c["function"]["name"]
                assert c["index"] == len(calls)  # in order
                calls[c["index"]] = {**c, "function": dict(c["function"])}
                frags[c["index"]] = [c["function"]["arguments"]]
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}, c
                assert c["function"]["arguments"]  # no empty fragments
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
                frags[c["index"]].append(c["function"]["arguments"])
    if fragments is not None:
        fragments.update(frags)
    return content, reasoning, [(calls[i]["function"]["name"], calls[i]["function"]["arguments"])
                                for i in sorted(calls)]


def _splits(text: str):
    yield [text]
    yield list(text)  # one character per delta
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    rnd = random.Random(0)
    for _ in range(40):
        cuts = sorted(rnd.sample(range(1, len(text)), 4))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name", list(GOLDEN))
@pytest.mark.parametrize("reasoning", [None, "qwen3", "deepseek_r1"])
def test_golden_outputs_whole_and_streamed_in_every_split(name, reasoning):
    text, content, calls = GOLDEN[name]
    think = {"qwen3": "<think>\nweather needs a tool</think>\n\n", "deepseek_r1": "weather needs a tool</think>\n\n",
             None: ""}[reasoning]
    parsers = OutputParsers(reasoning, "hermes" if name == "none" else name)
    req = _req()
    msg = ChatOutput(parsers, req).message(think + text)
    assert (msg["content"] or "") == content and _calls(msg.get("tool_calls", [])) == calls
    if reasoning:
        assert msg["reasoning_content"].strip() == "weather needs a tool"
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
    for pieces in _splits(think + text):
        got = _streamed(parsers, req, pieces)
        # the fragments of each call concatenate to the whole message's arguments, exactly
        assert got[0] == content and got[2] == whole, pieces
        assert got[1].strip() == ("weather needs a tool" if reasoning else "")
    frags = {}
    _streamed(parsers, req, list(think + text), frags)  # a character per delta
    # the arguments come as they are written, not in one piece at the call's end
    assert all(len(f) > 2 for f in frags.values()) and len(frags) == len(calls)


def test_a_streamed_call_cut_short_and_a_malformed_one():
    parsers = OutputParsers(None, "hermes")
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    content, _, calls = _streamed(parsers, _req(), list(cut))
    assert content == "" and calls == [("get_weather", '{"city": "Pa')]  # what was written so far
    msg = ChatOutput(parsers, _req()).message(cut)
    assert "tool_calls" not in msg  # a whole message keeps the complete calls only
    bad = '<tool_call>{"name": "get_time", "arguments": {"tz": CET}}</tool_call>'
    assert "tool_calls" not in ChatOutput(parsers, _req()).message(bad)


def test_tool_choice_none_and_no_parser_leave_the_text_as_content():
    text = GOLDEN["hermes"][0]
    assert ChatOutput(OutputParsers(None, "hermes"), _req(tool_choice="none")).message(text)["content"] == text
    assert ChatOutput(OutputParsers(None, None), _req()).message(text)["content"] == text


class ScriptedSampler:
    """A test stand-in for the engine's sampler: emits the given token ids in order, then EOS."""

    def __init__(self, real, script: list[int], eos: int):
        self.real, self.script, self.eos = real, script, eos
        self.generator, self.eos_token_ids = real.generator, real.eos_token_ids

    def __call__(self, logits, requests):
        return [self.script[len(r.output_token_ids)] if len(r.output_token_ids) < len(self.script)
                else self.eos for r in requests]


@pytest.fixture(scope="module")
def scripted(api, server_model_dir):
    s = api.Served(api.make_config(server_model_dir, "server.tool_parser=hermes", "server.reasoning_parser=qwen3"))
    text = "<think>\nweather needs a tool</think>\n\n" + GOLDEN["hermes"][0]
    tok = s.engine.tokenizer
    script = tok.encode(text, add_special_tokens=False)
    assert tok.decode(script) == text
    s.engine.runner.sampler = ScriptedSampler(s.engine.runner.sampler, script, next(iter(tok.eos_token_ids)))
    yield s
    s.close()


def test_http_tool_calls_and_reasoning_whole_and_streamed(api, scripted):
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER, TIME], "max_tokens": 200}
    status, r = api.http("POST", scripted.url + "/v1/chat/completions", body)
    assert status == 200, r
    ch = r["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] == "Let me check.\n"
    assert ch["message"]["reasoning_content"] == "\nweather needs a tool"
    assert _calls(ch["message"]["tool_calls"]) == CALLS
    events = api.stream(scripted.url, "/v1/chat/completions", body)
    deltas = [e["choices"][0] for e in events[:-1] if e["choices"]]
    calls = {}
    for c in (c for d in deltas for c in d["delta"].get("tool_calls", [])):
        if c["index"] in calls:  # an arguments fragment
            calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
        else:
            calls[c["index"]] = c
    streamed = [calls[i] for i in sorted(calls)]
    assert [c["function"]["arguments"] for c in streamed] == \
        [c["function"]["arguments"] for c in ch["message"]["tool_calls"]]
    assert _calls(streamed) == CALLS and deltas[-1]["finish_reason"] == "tool_calls"
    assert sum(1 for d in deltas for c in d["delta"].get("tool_calls", [])) > len(CALLS)  # fragments
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Let me check.\n"
    assert "".join(d["delta"].get("reasoning_content", "") for d in deltas) == "\nweather needs a tool"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_force_a_call_from_a_random_model(api, served, choice):
    status, r = api.http("POST", served.url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, TIME], "tool_choice": choice,
        "max_tokens": 400, "seed": 1})
    assert status == 200 and r["choices"][0]["message"].get("tool_calls"), r
    calls = _calls(r["choices"][0]["message"]["tool_calls"])
    assert calls and all(n in ("get_weather", "get_time") for n, _ in calls)
    if choice != "required":
        assert [n for n, _ in calls] == ["get_time"] and calls[0][1]["tz"] in ("CET", "UTC")
    served.wait_idle()


TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tools_render_as_transformers_apply_chat_template(tmp_path, server_model_dir):
    import shutil

    from transformers import AutoTokenizer

    from pdkv.tokenizer import Tokenizer

    folder = tmp_path / "m"
    shutil.copytree(server_model_dir, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOL_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    body = {"messages": [{"role": "user", "content": "weather?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "call_1", "type": "function",
                              "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}}]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
            "tools": [WEATHER, TIME]}
    req = parse_chat(body)
    ours = Tokenizer(folder).apply_chat_template(req.messages, add_generation_prompt=True,
                                                 tools=[dict(t) for t in req.tools.tools])
    hf_messages = [dict(m) for m in body["messages"]]
    hf_messages[1] = {**hf_messages[1], "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Rome", "days": 2}}}]}
    theirs = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        hf_messages, tools=[WEATHER, TIME], add_generation_prompt=True, tokenize=False)
    assert ours == theirs and '"arguments": {"city": "Rome", "days": 2}' in ours and "sunny" in ours


def test_the_openai_client_reads_the_streamed_calls(scripted):
    import openai

    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="none", max_retries=0)
    calls, reasons = {}, []
    for ch in client.chat.completions.create(model=scripted.model, messages=[{"role": "user", "content": "w?"}],
                                             tools=[WEATHER, TIME], max_tokens=200, stream=True):
        for c in ch.choices:
            reasons.append(c.finish_reason)
            for tc in c.delta.tool_calls or []:  # the name first, then arguments fragments
                name, args = calls.get(tc.index, (tc.function.name, ""))
                calls[tc.index] = (name, args + (tc.function.arguments or ""))
    assert [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))] == CALLS
    assert reasons[-1] == "tool_calls"
    r = client.chat.completions.create(model=scripted.model, messages=[{"role": "user", "content": "w?"}],
                                       tools=[WEATHER, TIME], max_tokens=200)
    assert [(t.function.name, json.loads(t.function.arguments)) for t in r.choices[0].message.tool_calls] == CALLS


def test_a_named_function_streams_its_arguments():
    """tool_choice naming a function: the forced answer is the arguments, sent as they come."""
    req = _req(tool_choice={"type": "function", "function": {"name": "get_time"}})
    parsers = OutputParsers(None, "hermes")
    whole = ChatOutput(parsers, req).message('{"tz": "CET"}')["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == [("get_time", '{"tz": "CET"}')]
    for pieces in (['{"tz"', ': "CET"}'], list('{"tz": "CET"}')):
        frags = {}
        assert _streamed(parsers, req, pieces, frags)[2] == [("get_time", '{"tz": "CET"}')]
        assert frags[0][0] == pieces[0] and len(frags[0]) == len(pieces)  # one fragment per delta


REQUIRED_ANSWER = ('[{"name": "get_weather", "parameters": {"city": "Pa\\"ris {x}", "days": 3}}, '
                   '{"name":"get_time","parameters":{"tz":"CET"}}]')


def test_required_calls_stream_their_arguments_in_every_split():
    """tool_choice required: the forced list's calls are announced once named, their parameters'
    text streamed in fragments that add up to the whole message's arguments (as written)."""
    req = _req(tool_choice="required")
    parsers = OutputParsers(None, "hermes")
    whole = ChatOutput(parsers, req).message(REQUIRED_ANSWER)["tool_calls"]
    expected = [("get_weather", '{"city": "Pa\\"ris {x}", "days": 3}'), ("get_time", '{"tz":"CET"}')]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == expected
    assert [json.loads(a) for _, a in expected] == [{"city": 'Pa"ris {x}', "days": 3}, {"tz": "CET"}]
    for pieces in _splits(REQUIRED_ANSWER):
        frags = {}
        assert _streamed(parsers, req, pieces, frags)[2] == expected, pieces
    frags = {}
    _streamed(parsers, req, list(REQUIRED_ANSWER), frags)
    assert len(frags[0]) > 5  # really in fragments, not one piece at the end
    done = ChatOutput(parsers, req)
    done.merge(done.delta(REQUIRED_ANSWER), done.end())
    assert done.finish_reason("stop") == "tool_calls"
    cut = ChatOutput(parsers, req)
    d = cut.merge(cut.delta('[{"name": "get_wea'), cut.end())  # cut short before a whole name
    assert d == {"content": '[{"name": "get_wea'} and cut.finish_reason("length") == "length"
