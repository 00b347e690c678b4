"""A chat choice's text -> its message: reasoning (server/reasoning.py), content and tool calls
(server/tool_parsers.py), whole (``message``) or as stream deltas (``delta`` then ``end``).

Reasoning comes first and tools apply to the answer only. With ``tool_choice`` ``required`` or a
named function the answer is the JSON that structured output forced (vLLM's way): a list of
{name, parameters}, each element a call (its ``parameters`` text as written is the arguments),
or the named function's arguments; both are streamed as they come.

Streamed tool calls take OpenAI's (and vLLM's) delta shape: a call's first delta has its index,
id, type and name with the arguments written so far (maybe empty), the later ones the index and
``function.arguments`` fragments only; the fragments of a call concatenate to the arguments a
whole (non-streamed) message gives it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from pdkv.server.reasoning import ReasoningSplitter, _held
from pdkv.server.tool_parsers import PARSERS, parser_name


@dataclass(frozen=True)
class OutputParsers:
    reasoning: str | None  # server.reasoning_parser
    tools: str | None  # the resolved server.tool_parser

    @classmethod
    def build(cls, server_config, engine) -> OutputParsers:
        cfg = getattr(engine, "config", None)
        arch = cfg.get("architectures") if isinstance(cfg, dict) else None
        template = getattr(engine.tokenizer, "chat_template", None)
        return cls(server_config.reasoning_parser,
                   parser_name(server_config.tool_parser, (arch or [None])[0], template))


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatOutput:
    def __init__(self, parsers: OutputParsers | None, req):
        self.req = req
        self.split = ReasoningSplitter(parsers.reasoning) if parsers and parsers.reasoning else None
        spec = req.tools
        self.forced = spec.choice if spec is not None and spec.choice in ("required", "named") else None
        self.parser = None
        if spec is not None and spec.choice == "auto" and parsers and parsers.tools:
            self.parser = PARSERS[parsers.tools](spec.functions)
        self.answer = ""  # the answer text so far (after any reasoning)
        self.sent = 0  # characters of the answer already given out as content
        self.num_calls = 0  # tool calls already given out (announced, for a stream)
        self.args_sent: list[int] = []  # per call given out: characters of its arguments sent
        self.in_calls = False
        self.whole = False  # a whole message: only the complete, well-formed calls
        self.required: RequiredCalls | None = None  # tool_choice required, streamed

    # ---- streaming ---------------------------------------------------------------------------
    def delta(self, text: str, final: bool = False) -> dict:
        reasoning, answer = self.split.feed(text, final) if self.split is not None else ("", text)
        self.answer += answer
        out: dict = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        content, calls = self._answer(final)
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    def end(self) -> dict:
        return self.delta("", final=True)

    @staticmethod
    def merge(a: dict, b: dict) -> dict:
        out = dict(a)
        for k, v in b.items():
            out[k] = out[k] + v if k in out else v
        return out

    def _answer(self, final: bool) -> tuple[str, list]:
        if self.forced == "named" and not self.whole:  # the answer is the arguments: stream them
            from pdkv.server.tool_parsers import Call  # noqa: PLC0415

            return "", self._stream_calls([Call(self.req.tools.name, self.answer, final)])
        if self.forced == "required" and not self.whole:
            if self.required is None:
                self.required = RequiredCalls()
            self.required.feed(self.answer[self.required.pos:])
            calls = self._stream_calls(self.required.calls)
            if final and not self.num_calls:
                return self.answer, []  # cut short before a name: what was written, as content
            return "", calls
        if self.forced is not None:
            if not final:
                return "", []
            calls = self._forced_calls()
            return ("" if calls else self.answer), calls  # cut short: what was written, as content
        if self.parser is None:
            content = self.answer[self.sent:]
            self.sent = len(self.answer)
            return content, []
        start = self.answer.find(self.parser.start)
        if start < 0:
            end = len(self.answer) if final else len(self.answer) - _held(self.answer, self.parser.start)
            content, self.sent = self.answer[self.sent:end], max(self.sent, end)
            return content, []
        content = self.answer[self.sent:start] if not self.in_calls else ""
        self.in_calls, self.sent = True, len(self.answer)
        if self.whole:
            calls = self.parser.calls(self.answer[start:])
            self.num_calls = len(calls)
            return content, [self._call(i, c) for i, c in enumerate(calls)]
        return content, self._stream_calls(self.parser.scan(self.answer[start:]))

    def _stream_calls(self, scanned: list) -> list:
        """The deltas that bring the client up to ``scanned`` (pdkv.server.tool_parsers.Call,
        in order): a call is announced once its name is written (a later one waits for it),
        then sent the arguments it has beyond what was sent."""
        out = []
        for i, c in enumerate(scanned):
            if c.name is None:
                break
            if i == self.num_calls:
                out.append(self._call(i, {"name": c.name, "arguments": c.arguments}))
                self.args_sent.append(len(c.arguments))
                self.num_calls += 1
            elif len(c.arguments) > self.args_sent[i]:
                out.append({"index": i, "function": {"arguments": c.arguments[self.args_sent[i]:]}})
                self.args_sent[i] = len(c.arguments)
        return out

    def _forced_calls(self) -> list:
        try:
            obj = json.loads(self.answer)
        except json.JSONDecodeError:
            return []  # cut short (finish_reason length): no call can be made of it
        if self.forced == "named":
            del obj  # the arguments as written: what a stream sends in fragments
            calls = [{"name": self.req.tools.name, "arguments": self.answer}]
        else:  # each call's arguments: its parameters as written (what a stream sends)
            scan = RequiredCalls()
            scan.feed(self.answer)
            calls = [{"name": c.name, "arguments": c.arguments} for c in scan.calls if c.done and c.name is not None]
        self.num_calls = len(calls)
        return [self._call(i, c) for i, c in enumerate(calls)]

    @staticmethod
    def _call(index: int, c: dict) -> dict:
        return {"index": index, "id": _call_id(), "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]}}

    # ---- whole -------------------------------------------------------------------------------
    def message(self, text: str) -> dict:
        self.whole = True
        d = self.delta(text, final=True)
        msg = {"role": "assistant", "content": d.get("content") if (d.get("content") or not d.get("tool_calls"))
               else None}
        if msg["content"] is None and not d.get("tool_calls"):
            msg["content"] = ""
        if self.split is not None:
            msg["reasoning_content"] = d.get("reasoning_content")
        if d.get("tool_calls"):
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in d["tool_calls"]]
        return msg

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's ``tool_calls`` when the answer ended by making calls."""
        return "tool_calls" if reason == "stop" and self.num_calls and self.forced != "named" else reason


class RequiredCalls:
    """The calls of ``tool_choice: required``'s forced answer, ``[{"name": ..., "parameters":
    {...}}, ...]``, read as it grows (``feed`` the new text): each element a
    pdkv.server.tool_parsers.Call whose ``arguments`` is its ``parameters`` value's text so far,
    so the streamed fragments add up to the value as written. A JSON scanner, not a parser: the
    grammar already guarantees the shape, so it tracks only strings, nesting and the two keys."""

    def __init__(self):
        from pdkv.server.tool_parsers import Call  # noqa: PLC0415

        self._call = Call
        self.text = ""
        self.pos = 0  # characters of the answer fed so far
        self.calls: list = []
        self._depth = 0
        self._in_str = self._esc = False
        self._str_start = -1
        self._last_str: str | None = None  # the last string closed at element depth (a key, or a name)
        self._key: str | None = None  # the element's key whose value comes next
        self._value_start = -1  # where the current parameters value starts in text
        self._value_depth = 0

    def feed(self, new: str) -> None:
        start = len(self.text)
        self.text += new
        self.pos += len(new)
        t = self.text
        for i in range(start, len(t)):
            ch = t[i]
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
                    if self._depth == 2 and self._value_start < 0:
                        self._closed_string(t[self._str_start:i + 1])
                continue
            if ch == '"':
                self._in_str, self._str_start = True, i
            elif ch == ":" and self._depth == 2 and self._value_start < 0:
                self._key, self._last_str = self._last_str, None
                if self._key == "parameters":
                    self._value_start = -2  # starts at the next non-blank character
            elif ch in "{[":
                self._depth += 1
                if self._depth == 2 and ch == "{":
                    self.calls.append(self._call(None, "", False))
                elif self._value_start == -2:
                    self._value_start, self._value_depth = i, self._depth - 1
            elif ch in "}]":
                self._depth -= 1
                if self._value_start >= 0 and self._depth == self._value_depth:
                    self._set_args(t[self._value_start:i + 1])
                    self._value_start, self._key = -1, None
                elif self._depth == 1 and ch == "}" and self.calls:
                    c = self.calls[-1]
                    self.calls[-1] = self._call(c.name, c.arguments, True)
        if self._value_start >= 0:
            self._set_args(t[self._value_start:])

    def _closed_string(self, raw: str) -> None:
        if self._key == "name" and self.calls:
            c = self.calls[-1]
            self.calls[-1] = self._call(json.loads(raw), c.arguments, False)
            self._key = None
        else:
            self._last_str = json.loads(raw)

    def _set_args(self, text: str) -> None:
        c = self.calls[-1]
        self.calls[-1] = self._call(c.name, text, c.done)
