"""Tool-call parsers (server.tool_parser): a model's own tool-call format -> OpenAI tool_calls.

Each parser knows the text that opens the tool-call part of an answer (``start``) and scans the
text from there (``scan``) into the calls begun so far: each with its name once that is written,
the part of its ``arguments`` written so far, and whether it is complete. The arguments so far
are always a prefix of the call's final arguments (text that could still turn out to be the
call's end is held back), so a stream sends each call's name once and then its arguments as
fragments whose concatenation is the whole call's ``arguments`` (what ``calls`` returns, the
complete and well-formed calls, for a whole message). Text before ``start`` is content.

- ``hermes`` (Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; the
  arguments are the model's own JSON text, as written.
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function>
  </tool_call>``; a value is JSON where the tool's schema says it is not a string; the arguments
  are an object written a parameter at a time (``{`` at the function, each parameter once its
  value is closed, ``}`` at ``</function>``).
- ``deepseek_v3`` (V3, R1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  \n```json\n{...}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``; the arguments are the JSON
  text inside the fence, as written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pdkv.server.reasoning import _held

# architecture -> parser, when server.tool_parser is auto (Qwen3-MoE serves both Qwen3 and
# Qwen3-Coder: the chat template tells them apart)
BY_ARCH = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v3",
           "Qwen3MoeForCausalLM": "hermes", "Qwen3ForCausalLM": "hermes", "Qwen2ForCausalLM": "hermes"}


@dataclass
class Call:
    name: str | None  # None: not written yet
    arguments: str  # written so far (a prefix of the final arguments)
    done: bool  # the call's closing text came
    valid: bool = True  # done and well formed (a whole message keeps only these)


def _blocks(text: str, open_tag: str, close_tag: str):
    """(body so far, closed) of each ``open_tag ... close_tag`` block of ``text``; a block still
    open has its trailing text that could be the start of ``close_tag`` held back."""
    pos = 0
    while True:
        i = text.find(open_tag, pos)
        if i < 0:
            return
        j = text.find(close_tag, i + len(open_tag))
        if j < 0:
            body = text[i + len(open_tag):]
            yield body[:len(body) - _held(body, close_tag)], False
            return
        yield text[i + len(open_tag):j], True
        pos = j + len(close_tag)


def _top_level(body: str) -> tuple[dict, dict]:
    """The top-level keys of the JSON object ``body`` begins (it may be cut short): {key: value
    text start} and {key: value text end} for the values that ended (``body`` is not checked
    further: json.loads does that once the call is complete)."""
    starts, ends = {}, {}
    i = len(body) - len(body.lstrip())
    if not body[i:i + 1] == "{":
        return starts, ends
    depth, in_str, esc, key, key_start, expect_key, value_of = 0, False, False, None, None, True, None
    for j in range(i, len(body)):
        ch = body[j]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 1 and expect_key and key_start is not None:
                    try:
                        key = json.loads(body[key_start:j + 1])
                    except json.JSONDecodeError:
                        key = None
                    key_start = None
            continue
        if ch == '"':
            in_str = True
            if depth == 1 and expect_key:
                key_start = j
            elif depth == 1 and value_of is not None and value_of not in starts:
                starts[value_of] = j
        elif ch in "{[":
            if depth == 1 and value_of is not None and value_of not in starts:
                starts[value_of] = j
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                if value_of is not None and value_of in starts:
                    ends[value_of] = len(body[:j].rstrip())
                return starts, ends
        elif depth == 1 and ch == ":" and key is not None:
            value_of, expect_key, key = key, False, None
        elif depth == 1 and ch == ",":
            if value_of is not None and value_of in starts:
                ends[value_of] = len(body[:j].rstrip())
            value_of, expect_key = None, True
        elif depth == 1 and value_of is not None and value_of not in starts and not ch.isspace():
            starts[value_of] = j  # a number, true, false or null
    return starts, ends


class Hermes:
    start = "<tool_call>"
    close = "</tool_call>"

    def __init__(self, tools: dict | None = None):
        self.tools = tools or {}

    def calls(self, text: str) -> list[dict]:
        """The complete, well-formed calls of ``text``: {name, arguments} each."""
        return [{"name": c.name, "arguments": c.arguments} for c in self.scan(text) if c.done and c.valid]

    def scan(self, text: str) -> list[Call]:
        out = []
        for body, closed in _blocks(text, self.start, self.close):
            out.append(self._call(body.strip() if closed else body.lstrip(), closed))
        return out

    def _call(self, body: str, closed: bool) -> Call:
        starts, ends = _top_level(body)
        name = None
        if "name" in ends:
            try:
                name = json.loads(body[starts["name"]:ends["name"]])
            except json.JSONDecodeError:
                name = None
            name = name if isinstance(name, str) else None
        key = "arguments" if "arguments" in starts or "parameters" not in starts else "parameters"
        if key in ends:
            args = body[starts[key]:ends[key]]
        elif key in starts:
            args = body[starts[key]:].rstrip()  # the trailing space may be the value's end
        else:
            args = ""
        if not closed:
            return Call(name, args, False)
        try:
            obj = json.loads(body)
            valid = isinstance(obj, dict) and obj.get("name") == name and name is not None
        except json.JSONDecodeError:
            valid = False
        if valid and key not in starts:
            args = "{}"  # a call without arguments
        return Call(name, args, True, valid)


class Qwen3Coder(Hermes):
    _function = re.compile(r"\s*<function=([^>\n]+)>")
    _param = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def _value(self, fn: str, name: str, raw: str):
        schema = ((self.tools.get(fn) or {}).get("parameters") or {}).get("properties", {}).get(name, {})
        if isinstance(schema, dict) and schema.get("type") == "string":
            return raw
        try:  # a number, true/false/null, an object or array (or a string the schema did not type)
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw

    def _call(self, body: str, closed: bool) -> Call:
        m = self._function.match(body)
        if m is None:
            return Call(None, "", closed, False)
        fn = m.group(1).strip()
        end = body.find("</function>", m.end())
        inner = body[m.end():] if end < 0 else body[m.end():end]
        params = [json.dumps(p.group(1).strip(), ensure_ascii=False) + ": "
                  + json.dumps(self._value(fn, p.group(1).strip(), p.group(2)), ensure_ascii=False)
                  for p in self._param.finditer(inner)]
        args = "{" + ", ".join(params) + ("}" if end >= 0 else "")
        return Call(fn, args, closed, closed and end >= 0)


class DeepSeekV3(Hermes):
    start = "<｜tool▁calls▁begin｜>"
    _begin, _end = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    _head = re.compile(r"\s*(?:function)?\s*<｜tool▁sep｜>\s*([^\n<]+?)\s*\n```(?:json)?[ \t]*\n")
    _fence = "\n```"

    def scan(self, text: str) -> list[Call]:
        return [self._call(body, closed) for body, closed in _blocks(text, self._begin, self._end)]

    def _call(self, body: str, closed: bool) -> Call:
        m = self._head.match(body)
        if m is None:
            return Call(None, "", closed, False)
        rest = body[m.end():]
        end = rest.find(self._fence)
        if end < 0:
            return Call(m.group(1), rest[:len(rest) - _held(rest, self._fence)], closed, False)
        args = rest[:end]
        try:
            json.loads(args)
            valid = closed
        except json.JSONDecodeError:
            valid = False
        return Call(m.group(1), args, closed, valid)


PARSERS = {"hermes": Hermes, "qwen3_coder": Qwen3Coder, "deepseek_v3": DeepSeekV3}


def parser_name(setting: str | None, architecture: str | None, chat_template: str | None) -> str | None:
    """server.tool_parser resolved: a name, or None (tool calls are not parsed)."""
    if setting != "auto":
        return setting
    if chat_template and "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    if chat_template and "tool▁calls▁begin" in chat_template:
        return "deepseek_v3"
    if chat_template and "<tool_call>" in chat_template:
        return "hermes"
    return BY_ARCH.get(architecture or "", "hermes")
