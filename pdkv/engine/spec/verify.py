"""Verification of drafts against the target's logits: which drafts are kept, and the one token
the target adds after them.

Greedy requests keep drafts while they equal the target's argmax; the first mismatch is replaced
by the argmax (a "bonus" argmax follows when every draft matched). Output is then token for
token what decoding without drafts gives.

Sampled requests use rejection sampling (Leviathan et al. 2023, Chen et al. 2023), which keeps
the target's distribution exactly: draft ``d`` drawn from ``q`` is accepted with probability
``min(1, p(d) / q(d))``; on rejection the token is drawn from the residual ``(p - q)+`` normalised;
after k acceptances a bonus token is drawn from ``p`` at the last row. ``p`` is the target's
distribution after the request's temperature, top-k and top-p (pdkv.engine.sampler.filter_logits,
the same as plain sampling), and the draws use the request's own generator when it has a seed.
A deterministic proposer (ngram, a greedy draft model) has ``q = one-hot(d)``: accept with
probability p(d), on rejection sample ``p`` with d removed.

Why it is exact: P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) (p(x) - q(x))+ / Z
= min(q(x), p(x)) + (p(x) - q(x))+ = p(x), since Z = sum (p - q)+ = 1 - sum min(p, q).
"""

from __future__ import annotations

import torch

from pdkv.engine.request import Request
from pdkv.engine.sampler import filter_logits


class Verifier:
    def __init__(self, generator: torch.Generator):
        """``generator``: draws for requests without a seed (the engine sampler's)."""
        self.generator = generator

    def __call__(self, logits: torch.Tensor, req: Request, drafts: list[int],
                 draft_probs: torch.Tensor | None = None) -> list[int]:
        """logits: [len(drafts) + 1, V] float32, row i scored after draft i-1 (row 0 after the
        request's last token); draft_probs: [len(drafts), V] the proposer's q, None for a
        deterministic proposer. Returns the accepted drafts followed by one target token. The
        rows come masked by the request's TokenMask (pdkv/engine/logits.py: a grammar, token
        healing), each after the drafts before it: a draft outside a row's mask has target
        probability 0 there and is never kept."""
        if req.params.greedy:
            return self.greedy(logits, drafts)
        probs = self.target_probs(logits, req)
        gen = req.generator if req.generator is not None else self.generator
        out: list[int] = []
        for i, d in enumerate(drafts):
            p = probs[i]
            q = draft_probs[i].to(p.dtype) if draft_probs is not None else None
            q_d = float(q[d]) if q is not None else 1.0
            u = float(torch.rand((), generator=gen))
            if q_d > 0 and u < min(1.0, float(p[d]) / q_d):
                out.append(d)
                continue
            out.append(self._draw(self.residual(p, q, d), gen))
            return out
        out.append(self._draw(probs[len(drafts)], gen))
        return out

    @staticmethod
    def greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
        target = logits.argmax(-1).tolist()
        for i, d in enumerate(drafts):
            if d != target[i]:
                return drafts[:i] + [target[i]]
        return drafts + [target[len(drafts)]]

    @staticmethod
    def target_probs(logits: torch.Tensor, req: Request) -> torch.Tensor:
        """[n, V] the target's sampling distribution per row (what plain sampling draws from)."""
        p, n, V = req.params, logits.shape[0], logits.shape[-1]
        k = min(p.top_k, V) if p.top_k > 0 else V
        x = filter_logits(logits.float().cpu(), torch.full((n,), float(p.temperature)),
                          torch.full((n,), k, dtype=torch.long), torch.full((n,), float(p.top_p)))
        # NOTE: softmax spelled out: torch's softmax kernel opens a parallel region even for a
        # few rows, which costs ~1 ms on a loaded CPU; these element-wise ops stay serial.
        e = (x - x.max(-1, keepdim=True).values).exp()
        return e / e.sum(-1, keepdim=True)

    @staticmethod
    def residual(p: torch.Tensor, q: torch.Tensor | None, d: int) -> torch.Tensor:
        """(p - q)+, unnormalised (torch.multinomial normalises); q None: one-hot(d)."""
        if q is None:
            r = p.clone()
            r[d] = 0.0
        else:
            r = (p - q).clamp_min(0.0)
        # p(d) == 1 and q == one-hot(d) always accepts, so r is never all zero when it is used;
        # rounding could still make it so with a real q: fall back to p.
        return r if float(r.sum()) > 0 else p

    @staticmethod
    def _draw(probs: torch.Tensor, gen: torch.Generator) -> int:
        return int(torch.multinomial(probs, 1, generator=gen))
