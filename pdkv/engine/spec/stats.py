"""Counters of speculative decoding, in vLLM's vocabulary (``vllm:spec_decode_*``): drafts
(verification steps that had at least one draft), draft tokens, accepted tokens, acceptance per
draft position, and the histogram of accepted lengths (tokens a verification step emits)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_tokens: int  # k
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i
    # [k + 2]: verification steps that emitted j tokens (accepted + the target's own), j = 0..k+1
    accepted_length_counts: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.num_tokens
        self.accepted_length_counts = self.accepted_length_counts or [0] * (self.num_tokens + 2)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One verification step of one request: ``num_drafts`` proposed, the first
        ``num_accepted`` kept (the target then added one token)."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        self.accepted_length_counts[num_accepted + 1] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification step (vLLM's mean acceptance length: 1 + accepted / drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        n = self.num_drafts
        return {"spec_num_drafts": n, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_acceptance_rate": self.acceptance_rate,
                "spec_mean_accepted_length": self.mean_accepted_length,
                "spec_acceptance_rate_per_pos": [a / n if n else 0.0 for a in self.accepted_per_pos],
                "spec_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
                "spec_accepted_length_counts": list(self.accepted_length_counts)}
