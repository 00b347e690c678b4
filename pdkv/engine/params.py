"""Sampling parameters of one request, validated with errors that name the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdkv.errors import InvalidRequest

MAX_LOGPROBS = 20  # most top alternatives per token (OpenAI's chat limit)
MAX_LOGIT_BIAS = 300  # most logit_bias entries (OpenAI's limit)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Resume:
    """A stream another node began (request migration, pdkv/router/migrate.py): the prompt's
    last tokens after ``prompt_len`` are output that node produced. The engine replays them into
    the request's state, so the rest continues exactly as the undisturbed run would: the
    detokenizer (text held back for a stop string, a character split between tokens, stop
    strings spanning the point of failure), the structured-output matcher and the output-token
    penalties; the seeded generator is seeded per output position (pdkv/engine/sampler.py), so
    it goes on from the resumed tokens' count."""

    prompt_len: int  # the prompt's own tokens (the engine's prompt is them + the resumed output)
    sent_chars: int = 0  # characters of the resumed output's text the client has already
    skip_prefix: str = ""  # text the output starts with that is not the client's (healing)


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
    # Logits processing (pdkv/engine/logits.py), in vLLM's meanings: presence / frequency over
    # the output tokens, repetition over prompt + output (divides positive logits, multiplies
    # negative ones), logit_bias added to the logits, min_tokens before which EOS and stop
    # tokens cannot be sampled, bad_words_ids banned as sequences (the last token is banned
    # where the ones before it were just generated), allowed_token_ids the only tokens allowed.
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0, 1 = off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> [-100, 100]
    min_tokens: int = 0
    bad_words_ids: list[list[int]] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    # Log-probabilities of each sampled token plus this many top alternatives (None: none), and
    # of each prompt token (prompt_logprobs; None: none), from the distribution sampled from.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # A per-request token-mask factory (structured output, pdkv/engine/structured.py): its
    # ``new_mask()`` gives the request's TokenMask (pdkv/engine/logits.py). Shared, immutable.
    constraint: object = None
    # Take the prompt's last token(s) off when a longer token could cover their text and make
    # the output give that text back first (pdkv/tokenizer_healing.py); the returned text
    # excludes it. The server sets it from the request or server.token_healing.
    token_healing: bool = False
    resume: Resume | None = None  # a migrated stream's state to replay (see Resume)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_processing(self) -> bool:
        """Whether the logits of this request's rows change before sampling (masks aside)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.bad_words_ids
                    or self.allowed_token_ids is not None)

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _number(v) or not -2 <= v <= 2:
                bad(name, v, "a number in [-2, 2]")
        if not _number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            bad("repetition_penalty", self.repetition_penalty, "a number in (0, 100]")
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", self.logit_bias, f"a map of at most {MAX_LOGIT_BIAS} token ids to biases")
        for t, b in self.logit_bias.items():
            if not _int(t) or t < 0:
                bad("logit_bias", t, "keyed by non-negative token ids")
            if not _number(b) or not -100 <= b <= 100:
                bad(f"logit_bias[{t}]", b, "a number in [-100, 100]")
        if not _int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", self.min_tokens, "an integer >= 0")
        if not isinstance(self.bad_words_ids, list) or not all(
                isinstance(w, list) and w and all(_int(t) and t >= 0 for t in w) for w in self.bad_words_ids):
            bad("bad_words", self.bad_words_ids, "a list of non-empty token id sequences")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or not all(_int(t) and t >= 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _int(v) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, v, f"an integer in [0, {MAX_LOGPROBS}] or null")

    def token_ids_used(self) -> dict[str, list[int]]:
        """The token ids these parameters name, by field (checked against the vocabulary)."""
        return {"logit_bias": list(self.logit_bias), "bad_words": [t for w in self.bad_words_ids for t in w],
                "allowed_token_ids": list(self.allowed_token_ids or [])}
