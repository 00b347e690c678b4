"""A chat choice's text -> its message: reasoning (server/reasoning.py), content and tool calls
(server/tool_parsers.py), whole (``message``) or as stream deltas (``delta`` then ``end``).

Reasoning comes first and tools apply to the answer only. With ``tool_choice`` ``required`` or a
named function the answer is the JSON that structured output forced (vLLM's way): a list of
{name, parameters}, which becomes tool_calls when it ends, or the named function's arguments,
streamed as they come.

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
        else:
            calls = [{"name": c["name"], "arguments": json.dumps(c.get("parameters", {}), ensure_ascii=False)}
                     for c in obj if isinstance(c, dict) and "name" in c]
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
