"""Prompt-lookup decoding (vLLM's ``ngram`` method): the last n tokens of a request are searched
for in its own prompt + output; the tokens that followed their latest earlier occurrence are the
drafts. No weights, no KV: it costs a vectorised scan of the context per request per step.

Longer suffixes are tried first (``ngram_max`` down to ``ngram_min``): a longer match predicts
better. Code editing and summarising repeat spans of the prompt, which is where this pays.
"""

from __future__ import annotations

import numpy as np

from pdkv.engine.request import Request


def lookup(context: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """context: [L] int64 token ids → up to ``k`` tokens that followed the latest earlier
    occurrence of the longest suffix of length in [n_min, n_max] that occurs earlier."""
    L = context.shape[0]
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = context[L - n:]
        # Windows starting at 0 .. L - n - 1: every occurrence except the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(context[:L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return context[start:start + k].tolist()
    return []


class NgramProposer:
    """Stateless: every call looks at the request's tokens as they are now."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        out = []
        for req, k in zip(requests, num_drafts):
            ctx = np.asarray(req.prompt_token_ids + req.output_token_ids, dtype=np.int64)
            out.append(lookup(ctx, self.n_min, self.n_max, k) if k > 0 else [])
        return out

    def finished(self, req: Request) -> None:
        """No per-request state."""
