"""Turns the logits of the sampled rows into token ids: greedy, temperature, top-k, top-p, with a
per-request generator when the request has a seed (same seed → same tokens, whatever the batch).

Temperature, top-k and top-p are applied to the whole batch at once (one sort at most), and the
rows without a seed draw in one call; only a seeded request's draw runs on its own, because it
owns its generator. A seeded request's generator is seeded afresh for each token from (seed, the
token's position in the output): the draw for output token k does not depend on the draws before
it, so a stream resumed on another node after k tokens (request migration) draws exactly what
the undisturbed run would, at no cost (replaying k draws over the vocabulary would be k x V
random numbers on the engine thread).

What a request may not take (bans, biases, penalties, its TokenMask: structured output's
grammar, token healing's first tokens) is already in the logits it gets (pdkv/engine/logits.py).
"""

from __future__ import annotations

import torch

from pdkv.models import cpu_kernels


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """logits: [N, V] float32; temperature, top_p: [N] float; top_k: [N] long (V = off).
    Returns temperature-scaled logits with -inf outside each row's top-k / top-p set."""
    V = logits.shape[-1]
    x = logits / temperature[:, None]
    if bool((top_k < V).any()):
        k_max = int(top_k.max())
        kth = torch.topk(x, k_max, dim=-1).values.gather(1, (top_k - 1).clamp(max=k_max - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    if bool((top_p < 1.0).any()):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # Drop a token when the tokens strictly before it already reach top_p (keeps at least one).
        drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
        x = torch.empty_like(x).scatter_(1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x


_M64 = 2**64 - 1


def draw_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's output token ``position`` (splitmix64 of the
    pair: nearby seeds and positions give unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids=()):
        """``eos_token_ids``: what min_tokens holds back (pdkv/engine/logits.py)."""
        self.generator = torch.Generator().manual_seed(seed)
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(self, logits: torch.Tensor, requests: list) -> list[int]:
        """logits: [N, V] float32, row i for requests[i], already processed by the requests'
        penalties and masks (pdkv/engine/logits.py) → N token ids."""
        greedy = cpu_kernels.argmax(logits)
        rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if not rows:
            return greedy
        V = logits.shape[-1]
        params = [requests[i].params for i in rows]
        x = filter_logits(
            logits[rows].float().cpu(),
            torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([min(p.top_k, V) if p.top_k > 0 else V for p in params], dtype=torch.long),
            torch.tensor([p.top_p for p in params], dtype=torch.float32))
        probs = x.softmax(-1)
        # the rows without a seed of their own: one draw for all of them from the sampler's stream
        shared = [j for j, i in enumerate(rows) if requests[i].generator is None]
        if shared:
            picked = probs if len(shared) == len(rows) else probs[shared]
            drawn = torch.multinomial(picked, 1, generator=self.generator)[:, 0].tolist()
            for j, t in zip(shared, drawn):
                greedy[rows[j]] = t
        if len(shared) < len(rows):
            for j, i in enumerate(rows):
                r = requests[i]
                if r.generator is not None:  # a resume's tokens count: the position is in the whole output
                    position = len(r.resumed_ids) + len(r.output_token_ids)
                    r.generator.manual_seed(draw_seed(r.params.seed & _M64, position))
                    greedy[i] = int(torch.multinomial(probs[j], 1, generator=r.generator))
        return greedy
