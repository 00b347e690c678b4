"""Logprobs in OpenAI's two shapes, from the engine's TokenLogprob records.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``. Completions:
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, where echoed prompt tokens come
first (the first prompt token has no logprob: null). A token masked out (-inf, e.g. by a
grammar) among the alternatives is reported as -9999.0, as vLLM does: JSON has no infinity.
"""

from __future__ import annotations

import math


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte alphabet, inverted: the character a byte-level token spells byte b with -> b."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class LogprobsFormatter:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._text: dict[int, str] = {}
        self._bytes = _byte_level_decoder() if getattr(tokenizer, "byte_encoding", "") == "ByteLevel" else None

    def raw_bytes(self, token_id: int, text: str) -> list[int]:
        """The token's own bytes (a piece of a UTF-8 character has no text of its own)."""
        piece = self.tok.id_to_token(token_id) if self._bytes is not None else None
        if piece is not None and all(c in self._bytes for c in piece):
            return [self._bytes[c] for c in piece]
        return list(text.encode("utf-8"))

    def text(self, token_id: int) -> str:
        t = self._text.get(token_id)
        if t is None:
            t = self.tok.decode([token_id], skip_special_tokens=False)
            if len(self._text) < 1 << 16:
                self._text[token_id] = t
        return t

    def chat(self, records: list) -> dict:
        def entry(tid: int, lp: float) -> dict:
            t = self.text(tid)
            return {"token": t, "logprob": _finite(lp), "bytes": self.raw_bytes(tid, t)}

        return {"content": [{**entry(r.token_id, r.logprob), "top_logprobs": [entry(i, v) for i, v in r.top]}
                            for r in records]}

    def _top_map(self, top) -> dict:
        """{text: logprob}, best first; tokens that decode alike (pieces of one UTF-8
        character) share a key, which keeps the best of them."""
        out: dict = {}
        for i, v in top:
            out.setdefault(self.text(i), _finite(v))
        return out

    def completion(self, records: list, offset: int = 0, prompt_ids: list[int] | None = None,
                   prompt_records: list | None = None) -> dict:
        """``prompt_ids`` / ``prompt_records``: the echoed prompt first (records for tokens 1..)."""
        tokens, lps, tops, offsets = [], [], [], []

        def add(tid: int, lp, top) -> None:
            nonlocal offset
            t = self.text(tid)
            tokens.append(t)
            lps.append(None if lp is None else _finite(lp))
            tops.append(None if top is None else self._top_map(top))
            offsets.append(offset)
            offset += len(t)

        if prompt_ids:
            add(prompt_ids[0], None, None)
            for tid, r in zip(prompt_ids[1:], prompt_records or []):
                add(tid, r.logprob, r.top)
        for r in records:
            add(r.token_id, r.logprob, r.top)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
