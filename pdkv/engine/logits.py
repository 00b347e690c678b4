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

    # Optional: ``allows_all``, True while the mask allows every token (its rows are skipped);
    # ``terminated``, True once it accepted its stop token (the request ends there, ignore_eos or
    # not: a grammar that is done has no next token to allow).


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

    @property
    def allows_all(self) -> bool:
        return getattr(self.first, "allows_all", False) and getattr(self.second, "allows_all", False)

    @property
    def terminated(self) -> bool:
        return getattr(self.first, "terminated", False) or getattr(self.second, "terminated", False)


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


def process(logits: torch.Tensor, groups: list, eos_token_ids=(),
            masks: PendingMasks | None = None) -> torch.Tensor:
    """logits: [R, V] float32, consecutive rows per group; ``groups``: (request, drafts) pairs in
    row order, each with len(drafts) + 1 rows (row i after the request's output + drafts[:i]).
    ``masks``: what ``start_masks`` began for the same groups before the forward pass (None:
    the masks are filled here). Returns the processed logits (a new tensor), or ``logits``
    itself when nothing applies."""
    procs = any(req.params.needs_processing for req, _ in groups)
    if masks is None and any(getattr(req, "mask", None) is not None for req, _ in groups):
        masks = PendingMasks(fill_masks(groups, logits.shape[1]))
    bitmask, masked = masks.result() if masks is not None else (None, [])
    if masked and bitmask.shape[1] != bitmask_width(logits.shape[1]):  # filled for another width
        bitmask, masked = fill_masks(groups, logits.shape[1])
    if not (procs or masked):
        return logits
    logits = logits.clone()
    if procs:
        rows = []  # (row, request, tokens before it: output + drafts[:i], draft index i)
        r = 0
        for req, drafts in groups:
            for i in range(len(drafts) + 1):
                rows.append((r, req, drafts[:i]))
                r += 1
        _penalise(logits, [x for x in rows if x[1].params.needs_processing], eos_token_ids)
    if masked:
        apply_bitmask(logits, bitmask, masked)
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
        hist = req.resumed_ids + out if p.resume is not None else out  # a resume: all the output
        if p.allowed_token_ids is not None:
            only.append((row, p.allowed_token_ids))
        if p.min_tokens and len(out) < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            ban_r += [row] * len(stops)
            ban_t += list(stops)
        for w in p.bad_words_ids:
            if len(w) == 1 or (len(hist) >= len(w) - 1 and hist[len(hist) - len(w) + 1:] == w[:-1]):
                ban_r.append(row)
                ban_t.append(w[-1])
        if p.logit_bias:
            bias_r += [row] * len(p.logit_bias)
            bias_t += list(p.logit_bias)
            bias_v += list(p.logit_bias.values())
        if p.frequency_penalty or p.presence_penalty:
            pen_rows.append(row)
            cnt_r += [len(pen_rows) - 1] * len(hist)
            cnt_t += hist
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


def fill_masks(groups: list, vocab: int, pin: bool = False) -> tuple[torch.Tensor, list[int]]:
    """The bitmask of every row of ``groups`` ([R, ceil(vocab / 32)] int32, CPU; pinned memory
    when ``pin``, for a copy to the device that does not wait) and the rows it restricts.

    Each masked request's rows: its mask as it is, then after each draft it accepts; after a
    draft it refuses, the rows repeat the last mask (verification rejects that draft there, so
    those rows are never sampled). The mask is rolled back to where it was. A row whose mask
    says it ``allows_all`` now (a reasoning gate still thinking, healing given back) is left out."""
    R = sum(len(d) + 1 for _, d in groups)
    bitmask = torch.full((R, bitmask_width(vocab)), -1, dtype=torch.int32, pin_memory=pin)
    masked, r = [], 0
    for req, drafts in groups:
        mask = getattr(req, "mask", None)
        if mask is not None:
            advanced, ok = 0, True
            for i in range(len(drafts) + 1):
                if ok:
                    if not getattr(mask, "allows_all", False):
                        mask.fill(bitmask, r + i)
                        masked.append(r + i)
                    if i < len(drafts):
                        ok = mask.accept(drafts[i])
                        advanced += ok
                else:
                    bitmask[r + i] = bitmask[r + i - 1]
                    if masked and masked[-1] == r + i - 1:
                        masked.append(r + i)
            if advanced:
                mask.rollback(advanced)
        r += len(drafts) + 1
    return bitmask, masked


class PendingMasks:
    """A step's bitmask, being filled (a Future of ``fill_masks``) or filled."""

    def __init__(self, value, future=None):
        self._value, self._future = value, future

    def result(self) -> tuple[torch.Tensor, list[int]]:
        if self._future is not None:
            self._value, self._future = self._future.result(), None  # re-raises the fill's error
        return self._value

    def wait(self) -> None:
        """Waits for the fill and drops it (the step failed): no matcher is left mid-fill."""
        if self._future is not None:
            self._future.exception()
            self._future = None


_WORKER: list = []
# On a CPU, below this much mask work (rows x vocabulary) the hand-off to the worker costs more
# than the fill it hides: the default model's 4,096 tokens at B = 32 measured slower overlapped.
OVERLAP_MIN_CPU_WORK = 1 << 20


def start_masks(groups: list, vocab: int, device, overlap: bool | None = None) -> PendingMasks | None:
    """Begins filling the bitmask of ``groups`` on the mask worker thread, to be read by
    ``process`` after the forward pass: vLLM's and SGLang's overlap. The fills need only the
    tokens already accepted (and the step's drafts), not the step's logits; xgrammar's fill
    releases the GIL and so do the forward pass's torch ops, so on a CPU the two share the
    cores and on a GPU the fill is hidden behind the kernels. None: no request of ``groups``
    has a mask, or the fill is too small to hide (``overlap`` None, on a CPU: see
    OVERLAP_MIN_CPU_WORK; True: always; False: never): ``process`` fills the masks itself. The
    caller must not touch the masks until ``result()`` or ``wait()``."""
    if overlap is False or not any(getattr(req, "mask", None) is not None for req, _ in groups):
        return None
    device = torch.device(device)
    if overlap is None and device.type == "cpu":
        rows = sum(len(d) + 1 for req, d in groups if getattr(req, "mask", None) is not None)
        if rows * vocab < OVERLAP_MIN_CPU_WORK:
            return None
    if not _WORKER:
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

        _WORKER.append(ThreadPoolExecutor(1, thread_name_prefix="pdkv-masks"))
    pin = device.type == "cuda"
    return PendingMasks(None, _WORKER[0].submit(fill_masks, groups, vocab, pin))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """-inf in ``rows`` of ``logits`` outside ``bitmask`` (``fill_masks``'s), in place, in one
    batched op: xgrammar's C++ kernel for float32 logits on a CPU (~2x the best torch ops here),
    torch ops on any other device (``apply_bitmask_torch``)."""
    kernel = _cpu_kernel() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if kernel is not None:
        kernel(logits, bitmask, indices=rows)
        return
    apply_bitmask_torch(logits, bitmask, rows)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """The device path of ``apply_bitmask``, in torch ops on ``logits``' device (a GPU: no
    kernel to compile, nothing imported). The rows' bitmask is copied there (without waiting when
    it is pinned), unpacked to [n, V] and applied with one masked_fill over the gathered rows;
    on a CPU the same ops run as its stand-in (tests)."""
    dev, V = logits.device, logits.shape[1]
    idx = torch.tensor(rows, dtype=torch.long)
    words = bitmask if len(rows) == bitmask.shape[0] else bitmask[idx]
    if dev.type != "cpu":  # a pinned source copies without a wait; a gathered one is small
        words, idx = words.to(dev, non_blocking=words.is_pinned()), idx.to(dev)
    banned = ~allowed_from_bitmask(words, V)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(banned, NEG_INF)
    else:
        logits[idx] = logits[idx].masked_fill(banned, NEG_INF)


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
