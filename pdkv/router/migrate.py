"""Request migration: a stream whose node dies mid-generation goes on on another node.

The router asks the node for token ids in every chunk (``return_token_ids``, taken back out of
what the client sees unless it asked too), and keeps what it relayed: the output token ids and
how many characters of text the client has. When the node's stream breaks (connection reset,
cut before ``[DONE]``, an error event), the same request goes to a healthy node with
``pdkv_resume: {token_ids, text_chars}``: that node runs prompt + those tokens as its prompt,
counts them against ``max_tokens``, first sends the text of them the client did not get yet
(held back for a possible stop string), and then its own tokens. A greedy stream therefore goes
on with exactly the tokens an undisturbed run gives, none lost or repeated; chunk ids and
``created`` keep the first node's values, usage counts the whole output.

Only streams with one choice and no echo migrate, at most ``migration_limit`` times and while
they have streamed at most ``migration_max_tokens`` tokens (what the router holds per stream).
The new node replays the resumed tokens into the request's state (pdkv.engine.params.Resume):
the seeded generator's position (a seeded sampled stream goes on with the tokens an undisturbed
run gives), the detokenizer's (text held back for a stop string, a stop string spanning the
point of failure, a character whose bytes the failure split), the structured-output matcher's
and the penalties' counts. Not carried: a tool parser's state (requests with ``tools`` do not
migrate). A chat stream's reasoning parser is fed, on the new node, the output text the client
has (its node counts it in each chunk as ``pdkv_text_chars``: the deltas drop the reasoning
tags, so the router cannot count it from them), so it goes on in the state the first one's was.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


def migratable(body: dict | None, limit: int) -> bool:
    if limit <= 0 or not isinstance(body, dict) or body.get("stream") is not True:
        return False
    if body.get("n", 1) != 1 or body.get("echo") or "pdkv_resume" in body:
        return False
    return "tools" not in body  # a tool parser's state is not carried


@dataclass
class StreamState:
    """What one migrating stream has relayed so far."""

    chat: bool
    client_token_ids: bool  # the client asked for token ids itself
    token_ids: list[int] = field(default_factory=list)
    text_chars: int = 0
    done: bool = False  # [DONE] relayed
    finished: bool = False  # a finish_reason relayed
    error: str | None = None  # an error event from the node
    first_id: str | None = None
    created: int | None = None
    resumed: int = 0  # tokens the current node was handed (usage is shifted by them)
    prompt_token_ids: list[int] | None = None  # the prompt as the first node ran it (healed or not)
    buf: bytes = b""

    def feed(self, data: bytes, resumed_stream: bool) -> bytes:
        """Complete SSE events of ``data`` (with what was buffered), rewritten for the client."""
        self.buf += data
        out = []
        while b"\n\n" in self.buf:
            event, self.buf = self.buf.split(b"\n\n", 1)
            rewritten = self._event(event, resumed_stream)
            if rewritten is not None:
                out.append(rewritten + b"\n\n")
        return b"".join(out)

    def _event(self, event: bytes, resumed_stream: bool) -> bytes | None:
        line = event.strip()
        if not line.startswith(b"data:"):
            return event
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return event
        try:
            msg = json.loads(payload)
        except ValueError:
            return event
        if not isinstance(msg, dict):
            return event
        if "error" in msg and "choices" not in msg:
            self.error = str((msg.get("error") or {}).get("message", msg["error"]))
            return None  # held: a migration may still save the stream (else the proxy says why)
        if self.first_id is None:
            self.first_id, self.created = msg.get("id"), msg.get("created")
        else:
            msg["id"], msg["created"] = self.first_id, self.created
        keep = True
        for ch in msg.get("choices") or []:
            if self.prompt_token_ids is None and isinstance(ch.get("prompt_token_ids"), list):
                self.prompt_token_ids = ch["prompt_token_ids"]
            ids = ch.get("token_ids") or []
            self.token_ids.extend(ids)
            fed = ch.pop("pdkv_text_chars", None)  # the node's own count, never the client's
            if self.chat:
                delta = ch.get("delta") or {}
                text = delta.get("content") or ""
                if resumed_stream and not text and not ids and ch.get("finish_reason") is None:
                    keep = False  # the new node's opening role chunk: the client had it
            else:
                text = ch.get("text") or ""
            if isinstance(fed, int) and not isinstance(fed, bool) and fed >= self.text_chars:
                self.text_chars = fed  # chat: the output text given to its parser (reasoning tags too)
            else:
                self.text_chars += len(text)
            if ch.get("finish_reason") is not None:
                self.finished = True
            if not self.client_token_ids:
                ch.pop("token_ids", None)
                ch.pop("prompt_token_ids", None)
            elif resumed_stream:
                ch.pop("prompt_token_ids", None)  # the client has the original prompt's ids
        if not self.client_token_ids:
            msg.pop("prompt_token_ids", None)
        u = msg.get("usage")
        if isinstance(u, dict) and self.resumed:
            u["prompt_tokens"] = u.get("prompt_tokens", 0) - self.resumed
            u["completion_tokens"] = u.get("completion_tokens", 0) + self.resumed
        if not keep:
            return None
        return b"data: " + json.dumps(msg, ensure_ascii=False).encode()

    def resume_body(self, body: dict) -> dict:
        self.resumed = len(self.token_ids)
        self.buf = b""
        return {**body, "return_token_ids": True,
                "pdkv_resume": {"token_ids": list(self.token_ids), "text_chars": self.text_chars,
                                **({"prompt_token_ids": self.prompt_token_ids} if self.prompt_token_ids else {})}}
