"""Parsing OpenAI request bodies into one ``GenerateRequest``, with errors that name the field.

Both endpoints reduce to the same thing: some prompts (a string or token ids each), ``n``
choices per prompt, and sampling parameters. Checking every field here, before anything reaches
the engine, is what lets bad input get a 400 while nothing is queued and no page is taken.
Unknown fields are ignored, as OpenAI-compatible servers do (clients send extras such as
``user``); fields pdkv cannot honour (``suffix``, ``best_of``) are refused, not dropped.
Penalties, biases and logprobs are parsed in server/protocol_sampling.py, output constraints
and tools in server/protocol_structured.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pdkv.server.errors import APIError
from pdkv.server.protocol_sampling import parse_sampling
from pdkv.server.protocol_structured import StructuredSpec, ToolsSpec, parse_structured, parse_tools

MAX_N = 16  # most choices per prompt
MAX_STOP = 16  # most stop strings


@dataclass(frozen=True)
class GenerateRequest:
    """What the handler runs. ``prompts`` are strings or token-id lists; chat has one prompt."""

    chat: bool
    model: str | None
    prompts: list[str | list[int]]
    messages: list[dict] | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # extension (as in vLLM): token ids in every choice
    max_tokens: int | None = 16  # None: up to the context length (chat's default)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    bad_words: list[str] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    logprobs: int | None = None  # None: no logprobs; N: the sampled token's and N alternatives
    echo: bool = False  # completions: the prompt's text (and with logprobs its logprobs) first
    structured: StructuredSpec | None = None
    tools: ToolsSpec | None = None
    token_healing: bool | None = None  # extension (vLLM-style extra field); None: server.token_healing
    # vLLM's extra field: lower is scheduled first under scheduler.policy priority; any non-zero
    # value is refused under fcfs (the engine checks it, as vLLM's processor does)
    priority: int = 0
    # extension for the router's request migration (pdkv/router/migrate.py): the output tokens an
    # earlier node already streamed (the prompt is extended by them, max_tokens counts them) and
    # how many characters of their text the client already has
    resume_token_ids: tuple[int, ...] | None = None
    resume_text_chars: int = 0
    resume_prompt_token_ids: tuple[int, ...] | None = None  # the prompt as the first node ran it


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _bad(name: str, expected: str, got: Any) -> APIError:
    shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
    return APIError(f"'{name}' must be {expected}, got {shown} ({_type_name(got)})", 400, param=name)


def _int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None,
         nullable: bool = False) -> int | None:
    v = body.get(name, default)
    if v is None and (nullable or default is None):
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise _bad(name, "an integer", v)
    if lo is not None and v < lo:
        raise APIError(f"'{name}' must be at least {lo}, got {v}", 400, param=name)
    if hi is not None and v > hi:
        raise APIError(f"'{name}' must be at most {hi}, got {v}", 400, param=name)
    return v


def _float(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _bad(name, "a number", v)
    if not lo <= v <= hi:
        raise APIError(f"'{name}' must be between {lo} and {hi}, got {v}", 400, param=name)
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, "true or false", v)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _bad("stop", "a string or a list of strings", v)
    if len(items) > MAX_STOP:
        raise APIError(f"'stop' may hold at most {MAX_STOP} strings, got {len(items)}", 400, param="stop")
    if any(s == "" for s in items):
        raise APIError("'stop' strings must not be empty", 400, param="stop")
    return list(items)


def _token_ids(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """Fields whose meaning pdkv cannot honour are refused rather than silently ignored."""
    def off(name: str, ok) -> None:
        if name in body and body[name] is not None and not ok(body[name]):
            raise APIError(f"'{name}' is not supported by this server (got {body[name]!r})", 400, param=name)

    off("suffix", lambda v: v == "")
    off("best_of", lambda v: v == body.get("n", 1))
    if not chat:
        off("tools", lambda v: v == [])


def _common(body: dict, chat: bool) -> dict[str, Any]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "a string", model)
    _refuse_unsupported(body, chat)
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise _bad("stream_options", "an object", stream_options)
    include_usage = _bool(stream_options or {}, "include_usage", False)
    stop_token_ids = body.get("stop_token_ids") or []
    if stop_token_ids and not _token_ids(stop_token_ids):
        raise _bad("stop_token_ids", "a list of integers", stop_token_ids)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _int(body, "max_completion_tokens", None, lo=1)
    else:
        max_tokens = _int(body, "max_tokens", None if chat else 16, lo=1, nullable=True)
    top_k = _int(body, "top_k", -1, lo=-1)
    tools = parse_tools(body) if chat else None
    structured = parse_structured(body)
    return dict(
        **parse_sampling(body, chat),
        structured=structured,
        tools=tools,
        model=model,
        n=_int(body, "n", 1, lo=1, hi=MAX_N),
        stream=_bool(body, "stream", False),
        include_usage=include_usage,
        return_token_ids=_bool(body, "return_token_ids", False),
        max_tokens=max_tokens,
        temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0),
        top_k=-1 if top_k == 0 else top_k,
        seed=_int(body, "seed", None),
        stop=_stop(body),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=_bool(body, "ignore_eos", False),
        token_healing=_bool(body, "token_healing", None),
        priority=_int(body, "priority", 0),
        **_resume(body),
    )


def _resume(body: dict) -> dict:
    r = body.get("pdkv_resume")
    if r is None:
        return {}
    if not isinstance(r, dict) or not _token_ids(r.get("token_ids")) or not r.get("token_ids"):
        raise _bad("pdkv_resume", "an object with token_ids (a non-empty list of integers) and text_chars", r)
    chars = r.get("text_chars", 0)
    if isinstance(chars, bool) or not isinstance(chars, int) or chars < 0:
        raise _bad("pdkv_resume.text_chars", "a non-negative integer", chars)
    if body.get("n", 1) != 1 or body.get("echo"):
        raise APIError("pdkv_resume: only a request with n 1 and no echo can be resumed", 400, param="pdkv_resume")
    eng = r.get("prompt_token_ids")
    if eng is not None and not _token_ids(eng):
        raise _bad("pdkv_resume.prompt_token_ids", "a list of integers", eng)
    return {"resume_token_ids": tuple(r["token_ids"]), "resume_text_chars": chars,
            "resume_prompt_token_ids": tuple(eng) if eng else None}


def parse_completion(body: Any) -> GenerateRequest:
    """``POST /v1/completions``: ``prompt`` is a string, token ids, or a list of either."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {_type_name(body)}")
    if "prompt" not in body:
        raise APIError("'prompt' is required", 400, param="prompt")
    p = body["prompt"]
    if isinstance(p, str):
        prompts: list[str | list[int]] = [p]
    elif _token_ids(p):
        prompts = [list(p)]
    elif isinstance(p, list) and p and all(isinstance(x, str) or _token_ids(x) for x in p):
        prompts = [x if isinstance(x, str) else list(x) for x in p]
    else:
        raise _bad("prompt", "a non-empty string, a list of token ids, or a list of those", p)
    if any(x == "" for x in prompts):
        raise APIError("'prompt' must not be empty", 400, param="prompt")
    return GenerateRequest(chat=False, prompts=prompts, **_common(body, chat=False))


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _content(msg: dict, i: int) -> str:
    c = msg.get("content")
    if c is None and msg.get("role") == "assistant":
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: only text parts can be served by a text model
        texts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}; "
                               f"got {part!r}", 400, param=f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"messages[{i}].content", "a string or a list of text parts", c)


def _tool_calls(calls: Any, i: int) -> list[dict]:
    """An assistant message's tool_calls, with each call's ``arguments`` as an object: chat
    templates render them with ``tojson`` (Hugging Face's semantics, as vLLM passes them)."""
    name = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise _bad(name, "a list of tool calls", calls)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{name}[{j}]", "{'id', 'type': 'function', 'function': {'name', 'arguments'}}", c)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise _bad(f"{name}[{j}].function.arguments", "a JSON object (as a string)", args) from None
        out.append({"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def parse_chat(body: Any) -> GenerateRequest:
    """``POST /v1/chat/completions``: ``messages`` is a non-empty list of {role, content}."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {_type_name(body)}")
    if "messages" not in body:
        raise APIError("'messages' is required", 400, param="messages")
    msgs = body["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "a non-empty list of {role, content} objects", msgs)
    messages = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "an object with 'role' and 'content'", m)
        role = m.get("role")
        if role not in _ROLES:
            raise APIError(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}", 400,
                           param=f"messages[{i}].role")
        msg = {"role": role, "content": _content(m, i)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
            if m.get("content") is None:
                msg["content"] = None
        if role == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str) or not tid:
                raise _bad(f"messages[{i}].tool_call_id", "a non-empty string (the call it answers)", tid)
            msg["tool_call_id"] = tid
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        messages.append(msg)
    return GenerateRequest(chat=True, prompts=[], messages=messages, **_common(body, chat=True))
