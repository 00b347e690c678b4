"""The engine's side of speculative decoding: how many drafts each request may take, asking the
proposer for them, verifying them and counting (see the package docstring for the step)."""

from __future__ import annotations

import torch

from pdkv.config import MAX_SPEC_TOKENS, SPEC_METHODS, ConfigError, SpeculativeConfig
from pdkv.engine.request import Request, RequestStatus
from pdkv.engine.spec.stats import SpecStats
from pdkv.engine.spec.verify import Verifier


# A request is drafted for while it decodes; WAITING covers a disaggregated request whose
# prompt KV has landed (pdkv.engine.scheduler.remote_ready) and whose first decode step is next.
_DRAFTABLE = (RequestStatus.RUNNING, RequestStatus.WAITING)


class SpecDecoder:
    def __init__(self, proposer, num_tokens: int, generator: torch.Generator, max_model_len: int,
                 verifier: Verifier | None = None):
        self.proposer, self.k, self.max_model_len = proposer, num_tokens, max_model_len
        self.verifier = verifier or Verifier(generator)
        self.stats = SpecStats(num_tokens)

    def num_drafts_for(self, req: Request) -> int:
        """Drafts ``req`` may take now: none unless it is decoding (only its last token is not
        in the cache: running, or waiting right after its remote KV landed); never so many that
        an all-accepted run passes max_tokens or the context."""
        if req.status not in _DRAFTABLE or req.prefill_only or req.num_computed_tokens != req.num_tokens - 1:
            return 0
        left = min(req.params.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens)
        return max(0, min(self.k, left - 1))

    def propose(self, running: list[Request], last_forward=None) -> None:
        """Sets ``spec_token_ids`` of every running request (empty: decode it plainly).
        ``last_forward``: (ForwardBatch, hidden) of the step's forward pass, for proposers that
        read the target's hidden states (mtp), after the step's tokens were appended."""
        if last_forward is not None and hasattr(self.proposer, "observe"):
            self.proposer.observe(*last_forward)
        self.draft(running)

    def draft(self, requests: list[Request]) -> None:
        """Sets ``spec_token_ids`` of each of ``requests`` from the proposer's state as it is
        (no forward pass is observed). The engine calls it for a request whose remote KV just
        landed (disaggregated decode): its first decode step, the held-back last prompt token,
        then verifies drafts already."""
        want = [self.num_drafts_for(r) for r in requests]
        asked = [(r, n) for r, n in zip(requests, want) if n > 0]
        for r in requests:
            r.spec_token_ids = []
        if not asked:
            return
        drafts = self.proposer.propose([r for r, _ in asked], [n for _, n in asked])
        for (r, n), d in zip(asked, drafts):
            r.spec_token_ids = _allowed_prefix(r, list(d[:n]))

    def verify(self, logits: torch.Tensor, req: Request, drafts: list[int]) -> list[int]:
        """logits: [len(drafts) + 1, V] → the tokens the step emits (accepted drafts + one)."""
        tokens = self.verifier(logits, req, drafts)
        self.stats.record(len(drafts), len(tokens) - 1)
        return tokens

    def finished(self, req: Request) -> None:
        req.spec_token_ids = []
        self.proposer.finished(req)


def _allowed_prefix(req: Request, drafts: list[int]) -> list[int]:
    """The drafts up to the first that ``req.mask`` (structured output) refuses: a refused draft
    would be rejected in verification anyway, and its rows would cost a forward pass."""
    if req.mask is None or not drafts:
        return drafts
    n = 0
    while n < len(drafts) and req.mask.accept(drafts[n]):
        n += 1
    if n:
        req.mask.rollback(n)
    return drafts[:n]


def check_config(sc: SpeculativeConfig) -> None:
    """The same checks pdkv.config.validate makes, for engines built without a Config file."""
    if sc.method not in SPEC_METHODS:
        raise ConfigError(f"speculative.method must be one of {', '.join(SPEC_METHODS)} or null, got {sc.method!r}")
    if isinstance(sc.num_tokens, bool) or not isinstance(sc.num_tokens, int) \
            or not 1 <= sc.num_tokens <= MAX_SPEC_TOKENS:
        raise ConfigError(f"speculative.num_tokens must be an integer in [1, {MAX_SPEC_TOKENS}], got {sc.num_tokens!r}")
    if not 1 <= sc.ngram_min <= sc.ngram_max:
        raise ConfigError(f"speculative.ngram_min must be in [1, speculative.ngram_max ({sc.ngram_max})], "
                          f"got {sc.ngram_min!r}")


def build_spec_decoder(sc: SpeculativeConfig | None, parts, generator: torch.Generator,
                       drafts: bool = True) -> SpecDecoder | None:
    """The engine's SpecDecoder for ``sc`` (None or method None: speculative decoding off).
    ``parts``: the engine's pdkv.engine.factory.EngineParts (the target, its tokenizer, device);
    ``drafts``: False on a prefill node, whose proposer only prefills what it hands off
    (pdkv/disagg/spec_handoff.py): it runs on rank 0 alone, so tensor parallelism is fine."""
    if sc is None or sc.method is None:
        return None
    check_config(sc)
    if parts.tp is not None and (drafts or sc.method == "ngram"):
        raise ConfigError("speculative.method is not supported with parallel.tp > 1 yet (except on a "
                          "prefill node handing off mtp or draft)")
    if sc.method == "ngram":
        from pdkv.engine.spec.ngram import NgramProposer  # noqa: PLC0415

        proposer = NgramProposer(sc.ngram_min, sc.ngram_max)
    elif sc.method == "draft":
        from pdkv.engine.spec.draft import DraftProposer  # noqa: PLC0415

        proposer = DraftProposer.build(sc, parts)
    else:
        from pdkv.engine.spec.mtp import MTPProposer  # noqa: PLC0415

        proposer = MTPProposer.build(sc, parts)
    return SpecDecoder(proposer, sc.num_tokens, generator, parts.max_model_len)
