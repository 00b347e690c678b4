"""The request fields that change how tokens are chosen and what is reported about them:
penalties and biases (OpenAI's and vLLM's extensions), logprobs and echo. Each is checked here
with a 400 naming it; token ids are checked against the vocabulary by the engine."""

from __future__ import annotations

from typing import Any

from pdkv.server.errors import APIError

MAX_TOP_LOGPROBS = 20  # chat's top_logprobs and completions' logprobs (vLLM allows 20 too)
MAX_BAD_WORDS = 64


def _bad(name: str, expected: str, got: Any) -> APIError:
    shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
    return APIError(f"'{name}' must be {expected}, got {shown}", 400, param=name)


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not (lo < v if lo_open else lo <= v) or v > hi:
        raise _bad(name, f"a number in {'(' if lo_open else '['}{lo}, {hi}]", v)
    return float(v)


def _count(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise _bad(name, f"an integer in [{lo}, {hi}]", v)
    return v


def _logit_bias(body: dict) -> dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _bad("logit_bias", "an object mapping token ids to biases", v)
    if len(v) > 300:
        raise APIError(f"'logit_bias' may hold at most 300 entries, got {len(v)}", 400, param="logit_bias")
    out = {}
    for k, b in v.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise _bad("logit_bias", "keyed by token ids", k) from None
        if t < 0:
            raise _bad("logit_bias", "keyed by non-negative token ids", k)
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not -100 <= b <= 100:
            raise _bad(f"logit_bias[{k}]", "a number in [-100, 100]", b)
        out[t] = float(b)
    return out


def _token_list(body: dict, name: str) -> list[int] | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or not v or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in v):
        raise _bad(name, "a non-empty list of token ids", v)
    return list(v)


def _bad_words(body: dict) -> list[str]:
    v = body.get("bad_words")
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(w, str) and w for w in items):
        raise _bad("bad_words", "a list of non-empty strings", v)
    if len(items) > MAX_BAD_WORDS:
        raise APIError(f"'bad_words' may hold at most {MAX_BAD_WORDS} strings, got {len(items)}", 400,
                       param="bad_words")
    return list(items)


def parse_sampling(body: dict, chat: bool) -> dict[str, Any]:
    """The GenerateRequest fields for penalties, biases, logprobs and echo."""
    if chat:
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise _bad("logprobs", "true or false", lp)
        top = _count(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top and not lp:
            raise APIError("'top_logprobs' needs 'logprobs': true", 400, param="top_logprobs")
        logprobs = (top or 0) if lp else None
        echo = False
    else:
        if isinstance(body.get("logprobs"), bool):
            raise _bad("logprobs", "an integer in [0, 20]", body["logprobs"])
        logprobs = _count(body, "logprobs", 0, MAX_TOP_LOGPROBS)
        echo = body.get("echo", False)
        if echo is None:
            echo = False
        if not isinstance(echo, bool):
            raise _bad("echo", "true or false", echo)
    return dict(
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 100.0, lo_open=True),
        logit_bias=_logit_bias(body),
        min_tokens=_count(body, "min_tokens", 0, 1 << 30) or 0,
        bad_words=_bad_words(body),
        allowed_token_ids=_token_list(body, "allowed_token_ids"),
        logprobs=logprobs,
        echo=echo,
    )
