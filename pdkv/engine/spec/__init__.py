"""Speculative decoding: proposers draft tokens, the target verifies them in one forward pass.

    end of step N:  proposer.propose(running decodes) ──► req.spec_token_ids (≤ k drafts)
    step N + 1:     scheduler feeds [last token] + drafts (k + 1 rows, one causal query block)
                    runner: logits of all k + 1 rows ──► verify.py (greedy match / rejection
                    sampling) ──► accepted drafts + one target token
                    engine: appends them (stop / EOS / max_tokens may end the run early), then
                    rolls the KV back to the accepted length (scheduler.truncate_computed)

Proposers (``speculative.method``): ``ngram`` (prompt lookup, ngram.py), ``draft`` (a small
model with its own paged KV, draft.py). ``build_spec_decoder`` (decoder.py) checks the config
and builds the one the engine uses.
"""

from pdkv.engine.spec.decoder import SpecDecoder, build_spec_decoder
from pdkv.engine.spec.stats import SpecStats

__all__ = ["SpecDecoder", "SpecStats", "build_spec_decoder"]
