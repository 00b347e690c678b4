"""Tool-call parsers (server.tool_parser): a model's own tool-call format -> OpenAI tool_calls.

Each parser knows the text that opens the tool-call part of an answer (``start``) and turns the
text from there into the calls it completes (a call still being written is not returned, so a
stream gives each call once, whole, as soon as it closes). Text before ``start`` is content.

- ``hermes`` (Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function>
  </tool_call>``; a value is JSON where the tool's schema says it is not a string.
- ``deepseek_v3`` (V3, R1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  \\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``.
"""

from __future__ import annotations

import json
import re

# architecture -> parser, when server.tool_parser is auto (Qwen3-MoE serves both Qwen3 and
# Qwen3-Coder: the chat template tells them apart)
BY_ARCH = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v3",
           "Qwen3MoeForCausalLM": "hermes", "Qwen3ForCausalLM": "hermes", "Qwen2ForCausalLM": "hermes"}


def _args(obj) -> str:
    return json.dumps(obj if obj is not None else {}, ensure_ascii=False)


class Hermes:
    start = "<tool_call>"
    _call = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def __init__(self, tools: dict | None = None):
        self.tools = tools or {}

    def calls(self, text: str) -> list[dict]:
        out = []
        for m in self._call.finditer(text):
            try:
                obj = json.loads(m.group(1))
            except json.JSONDecodeError:
                continue  # not a call: the model wrote something else in the tags
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                out.append({"name": obj["name"], "arguments": _args(obj.get("arguments", obj.get("parameters")))})
        return out


class Qwen3Coder(Hermes):
    _call = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
    _param = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def _value(self, fn: str, name: str, raw: str):
        schema = ((self.tools.get(fn) or {}).get("parameters") or {}).get("properties", {}).get(name, {})
        if isinstance(schema, dict) and schema.get("type") == "string":
            return raw
        try:  # a number, true/false/null, an object or array (or a string the schema did not type)
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw

    def calls(self, text: str) -> list[dict]:
        out = []
        for m in self._call.finditer(text):
            fn = m.group(1).strip()
            args = {p.group(1).strip(): self._value(fn, p.group(1).strip(), p.group(2))
                    for p in self._param.finditer(m.group(2))}
            out.append({"name": fn, "arguments": _args(args)})
        return out


class DeepSeekV3(Hermes):
    start = "<｜tool▁calls▁begin｜>"
    _call = re.compile(r"<｜tool▁call▁begin｜>\s*(?:function)?\s*<｜tool▁sep｜>\s*([^\n<]+?)\s*\n"
                       r"```(?:json)?\s*\n(.*?)\n```\s*<｜tool▁call▁end｜>", re.S)

    def calls(self, text: str) -> list[dict]:
        out = []
        for m in self._call.finditer(text):
            try:
                args = json.loads(m.group(2))
            except json.JSONDecodeError:
                continue
            out.append({"name": m.group(1), "arguments": _args(args)})
        return out


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
