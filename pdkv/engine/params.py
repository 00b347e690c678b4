"""Sampling parameters of one request, validated with errors that name the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdkv.errors import InvalidRequest


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = -1  # -1 or 0 = off
    seed: int | None = None  # per-request generator: the same seed gives the same tokens
    stop: list[str] = field(default_factory=list)  # stop strings, checked on the detokenized text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Take the prompt's last token(s) off when a longer token could cover their text and make
    # the output give that text back first (pdkv/tokenizer_healing.py); the returned text
    # excludes it. The server sets it from the request or server.token_healing.
    token_healing: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raises InvalidRequest naming the first bad field; changes nothing."""
        def bad(name, value, want):
            raise InvalidRequest(f"{name} must be {want}, got {value!r}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", self.temperature, "a number >= 0")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) \
                or not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", self.top_k, "an integer >= 1, or 0 / -1 for no limit")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad("seed", self.seed, "an integer or null")
        if not isinstance(self.token_healing, bool):
            bad("token_healing", self.token_healing, "true or false")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            bad("stop", self.stop, "a list of strings")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "a list of non-negative integers")
