"""Per-request logits processing, batched over the rows of a step: what a request's parameters
change in its logits before the sampler draws (pdkv/engine/params.py has their meanings).

Every row is processed with the tokens that come before it: a plain row after the request's
output, the rows of a speculative verification (pdkv/engine/spec/verify.py) after the output
plus the drafts before that row, so penalties, bans, min_tokens and masks see exactly what
decoding the accepted drafts one by one would have seen.

Order (vLLM's): allowed_token_ids, bad words and min_tokens (banned tokens -> -inf), logit_bias,
the repetition, frequency and presence penalties, then the request's TokenMask. A request with
none of these costs nothing: the step's logits are returned unchanged.

The mask seam is ``Request.mask``: any object with the ``TokenMask`` methods. Structured output
(pdkv/engine/structured.py) is one; anything else that restricts a request's next tokens (token
healing's first token) plugs in the same way.
"""

from __future__ import annotations

from typing import Protocol

import torch

NEG_INF = float("-inf")
_SHIFTS = torch.arange(32, dtype=torch.int32)


class TokenMask(Protocol):
    """The tokens a request may take next; the sampler asks once per row it samples."""

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes row ``row`` of ``bitmask`` ([R, ceil(V / 32)] int32, CPU): bit t % 32 of word
        t // 32 set = token t allowed now."""

    def accept(self, token_id: int) -> bool:
        """Advances past ``token_id``; False (and unchanged) when it is not allowed."""

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepts."""

    def close(self) -> None:
        """The request left: let go of what the mask holds."""


class BothMasks:
    """Two TokenMasks at once (a token is allowed where both allow it): how a second restriction
    (token healing's first token) joins a request that already has one (structured output)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.first.fill(bitmask, row)
        mine = bitmask[row].clone()
        self.second.fill(bitmask, row)
        bitmask[row] &= mine

    def accept(self, token_id: int) -> bool:
        if not self.first.accept(token_id):
            return False
        if not self.second.accept(token_id):
            self.first.rollback(1)
            return False
        return True

    def rollback(self, num_tokens: int) -> None:
        self.first.rollback(num_tokens)
        self.second.rollback(num_tokens)

    def close(self) -> None:
        self.first.close()
        self.second.close()


def join_masks(current, new):
    """``Request.mask`` with ``new`` added (None: nothing to add)."""
    if new is None:
        return current
    return new if current is None else BothMasks(current, new)


def bitmask_width(vocab: int) -> int:
    return (vocab + 31) // 32


def allowed_from_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab] bool, True where allowed."""
    bits = (bitmask[:, :, None] >> _SHIFTS.to(bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def process(logits: torch.Tensor, groups: list, eos_token_ids=()) -> torch.Tensor:
    """logits: [R, V] float32, consecutive rows per group; ``groups``: (request, drafts) pairs in
    row order, each with len(drafts) + 1 rows (row i after the request's output + drafts[:i]).
    Returns the processed logits (a new tensor), or ``logits`` itself when nothing applies."""
    procs = any(req.params.needs_processing for req, _ in groups)
    masks = any(getattr(req, "mask", None) is not None for req, _ in groups)
    if not (procs or masks):
        return logits
    logits = logits.clone()
    R, V = logits.shape
    rows = []  # (row, request, tokens before it: output + drafts[:i], draft index i)
    r = 0
    for req, drafts in groups:
        for i in range(len(drafts) + 1):
            rows.append((r, req, drafts[:i]))
            r += 1
    if procs:
        _penalise(logits, [x for x in rows if x[1].params.needs_processing], eos_token_ids)
    if masks:
        _mask(logits, groups)
    return logits


def _penalise(logits: torch.Tensor, rows: list, eos_token_ids) -> None:
    V, dev = logits.shape[1], logits.device
    ban_r, ban_t, bias_r, bias_t, bias_v = [], [], [], [], []
    cnt_r, cnt_t, seen_r, seen_t = [], [], [], []
    only = []  # (row, allowed ids)
    freq, pres, rep, pen_rows, rep_rows = [], [], [], [], []
    for row, req, drafts in rows:
        p = req.params
        out = req.output_token_ids + drafts
        if p.allowed_token_ids is not None:
            only.append((row, p.allowed_token_ids))
        if p.min_tokens and len(out) < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            ban_r += [row] * len(stops)
            ban_t += list(stops)
        for w in p.bad_words_ids:
            if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == w[:-1]):
                ban_r.append(row)
                ban_t.append(w[-1])
        if p.logit_bias:
            bias_r += [row] * len(p.logit_bias)
            bias_t += list(p.logit_bias)
            bias_v += list(p.logit_bias.values())
        if p.frequency_penalty or p.presence_penalty:
            pen_rows.append(row)
            cnt_r += [len(pen_rows) - 1] * len(out)
            cnt_t += out
            freq.append(p.frequency_penalty)
            pres.append(p.presence_penalty)
        if p.repetition_penalty != 1.0:
            rep_rows.append(row)
            both = req.prompt_token_ids + out
            seen_r += [len(rep_rows) - 1] * len(both)
            seen_t += both
            rep.append(p.repetition_penalty)

    def t(v, dtype=torch.long):
        return torch.tensor(v, dtype=dtype, device=dev)

    for row, allowed in only:
        keep = logits[row, allowed].clone()
        logits[row] = NEG_INF
        logits[row, allowed] = keep
    if ban_r:
        logits[t(ban_r), t(ban_t)] = NEG_INF
    if bias_r:
        logits.index_put_((t(bias_r), t(bias_t)), t(bias_v, torch.float32).to(logits.dtype), accumulate=True)
    if rep_rows:
        idx = t(rep_rows)
        seen = torch.zeros(len(rep_rows), V, dtype=torch.bool, device=dev)
        if seen_r:
            seen[t(seen_r), t(seen_t)] = True
        x, rp = logits[idx], t(rep, torch.float32)[:, None].to(logits.dtype)
        logits[idx] = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    if pen_rows:
        idx = t(pen_rows)
        counts = torch.zeros(len(pen_rows), V, dtype=logits.dtype, device=dev)
        if cnt_r:
            counts.index_put_((t(cnt_r), t(cnt_t)), torch.ones(len(cnt_r), dtype=logits.dtype, device=dev),
                              accumulate=True)
        f = t(freq, torch.float32)[:, None].to(logits.dtype)
        pr = t(pres, torch.float32)[:, None].to(logits.dtype)
        logits[idx] -= f * counts + pr * (counts > 0).to(logits.dtype)


def _mask(logits: torch.Tensor, groups: list) -> None:
    """Each masked request's rows: its mask as it is, then after each draft it accepts; after a
    draft it refuses, the rows repeat the last mask (verification rejects that draft there, so
    those rows are never sampled). The mask is rolled back to where it was."""
    R, V = logits.shape
    bitmask = torch.full((R, bitmask_width(V)), -1, dtype=torch.int32)
    masked, r = [], 0
    for req, drafts in groups:
        mask = getattr(req, "mask", None)
        if mask is not None:
            advanced, ok = 0, True
            for i in range(len(drafts) + 1):
                if ok:
                    mask.fill(bitmask, r + i)
                    if i < len(drafts):
                        ok = mask.accept(drafts[i])
                        advanced += ok
                else:
                    bitmask[r + i] = bitmask[r + i - 1]
                masked.append(r + i)
            if advanced:
                mask.rollback(advanced)
        r += len(drafts) + 1
    kernel = _cpu_kernel() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if kernel is not None:  # xgrammar's C++ loop: ~5x the torch ops below on a CPU
        kernel(logits, bitmask, indices=masked)
        return
    idx = torch.tensor(masked, dtype=torch.long)
    allowed = allowed_from_bitmask(bitmask[idx], V).to(logits.device)
    dev_idx = idx.to(logits.device)
    logits[dev_idx] = logits[dev_idx].masked_fill(~allowed, NEG_INF)


_KERNEL: list = []


def _cpu_kernel():
    """xgrammar's apply_token_bitmask_inplace where xgrammar is installed (structured output
    needs it anyway), else None: the torch ops serve any TokenMask."""
    if not _KERNEL:
        try:
            from xgrammar import apply_token_bitmask_inplace  # noqa: PLC0415
        except ImportError:
            apply_token_bitmask_inplace = None
        _KERNEL.append(apply_token_bitmask_inplace)
    return _KERNEL[0]


def logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[n, V] processed logits -> the log-probabilities sampled from, before top-k / top-p
    (greedy rows: temperature 1)."""
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / t, dim=-1)
