"""Deterministic prompt synthesis: token ids from a trace's lengths and prefix blocks.

The same Mooncake ``hash_id`` always becomes the same block of token ids (seeded by the id), so
requests that share leading hash ids share a real token prefix in the replay, and a prefix cache
sees the hits the trace implies. A request without hash ids (Azure, synthetic) gets blocks seeded
by its own row, shared with no one. Nothing here depends on the architecture being measured:
every architecture receives the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import random


class PromptSynth:
    """Token blocks of ``block_tokens`` ids drawn from [vocab_lo, vocab_hi)."""

    def __init__(self, vocab_lo: int, vocab_hi: int, block_tokens: int, seed: int = 0):
        if not 0 <= vocab_lo < vocab_hi:
            raise ValueError(f"token id range [{vocab_lo}, {vocab_hi}) is empty")
        self.lo, self.hi, self.block_tokens, self.seed = vocab_lo, vocab_hi, max(1, block_tokens), seed
        self._blocks: dict[str, list[int]] = {}

    def block(self, key: str) -> list[int]:
        b = self._blocks.get(key)
        if b is None:
            rng = random.Random(f"pdkv-ab-{self.seed}-{key}")
            b = self._blocks[key] = [rng.randrange(self.lo, self.hi) for _ in range(self.block_tokens)]
        return b

    def prompt(self, length: int, hash_ids: tuple[int, ...], row: int) -> list[int]:
        """``length`` ids: the blocks of ``hash_ids`` in order (then private blocks if the ids run
        out), cut to ``length``."""
        out: list[int] = []
        i = 0
        while len(out) < length:
            key = f"h{hash_ids[i]}" if i < len(hash_ids) else f"r{row}-{i}"
            out.extend(self.block(key))
            i += 1
        return out[:length]


def request_body(model: str, prompt: list[int], max_tokens: int, token_ids: bool = True) -> bytes:
    """The exact bytes POSTed to /v1/completions: streamed, greedy, exactly ``max_tokens`` tokens
    (``ignore_eos``), usage in the last chunk, token ids per chunk (vLLM's ``return_token_ids``)
    so the client counts tokens even where a chunk's text is empty."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0, "stream_options": {"include_usage": True}}
    if token_ids:
        body["return_token_ids"] = True
    return json.dumps(body, separators=(",", ":")).encode()


def digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()
