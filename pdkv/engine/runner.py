"""The model runner: scheduled sequences in, sampled token ids out. The only engine part that
builds tensors.

Sequences go in order of their new tokens: decodes (and 1-token chunks) first, then short
continuations (speculative verifications), so the attention backend can run the leading ones as
one batch; logits are computed only for rows that sample.
"""

from __future__ import annotations

import time

import torch

from pdkv.models import cpu_kernels
from pdkv.models.attention import AttentionBatch
from pdkv.engine import logits as proc
from pdkv.engine.connector import BatchEntry, ForwardBatch, KVConnector
from pdkv.engine.request import TokenLogprob
from pdkv.engine.sampler import Sampler
from pdkv.engine.scheduler import ScheduledSeq
from pdkv.engine.threads import ThreadTuner


# Steps with at most this many rows are memory-bound; their thread count is tuned by measuring
# (see pdkv/engine/threads.py). Larger steps are compute-bound and use every thread unless those
# measurements found the other cores busy (ThreadTuner.choose_large: on the busy 2-core
# box a 132-token mixed step took 7x longer on 2 threads than on 1).
SMALL_STEP_TOKENS = 4
# Steps up to this many tokens (a verification of k + 1 drafts at batch 1, a few decodes beside
# one) are memory-bound as well: they take the small steps' verdict (ThreadTuner.best) without
# being probed or recorded. Before, a 5-row verification counted as large and ran on every
# thread while the decodes beside it had measured one thread faster.
MEMORY_BOUND_TOKENS = 16


class ModelRunner:
    def __init__(self, model, backend, device, sampler: Sampler, num_threads: int | None = None,
                 followers=None):
        """``followers``: with tensor parallelism, the pdkv.tp.TPLeader that ranks 1.. follow
        (``run_step`` announces each forward pass, which they then run with us); None: one rank."""
        self.model, self.backend, self.device, self.sampler = model, backend, torch.device(device), sampler
        self.eos_token_ids = getattr(sampler, "eos_token_ids", ())  # what min_tokens holds back
        self.followers = followers
        self.num_threads = num_threads or torch.get_num_threads()
        self.tuner = ThreadTuner(self.num_threads)
        # (logits [k + 1, V], request, drafts) -> tokens kept: set by the engine when speculative
        # decoding is on (pdkv.engine.spec.SpecDecoder.verify)
        self.verify = None
        self.last_forward = None  # (ForwardBatch, hidden [T, H]) of the last forward pass
        # {request_id: [TokenLogprob per new token]} of the last step's requests that ask for them
        self.last_logprobs: dict[str, list[TokenLogprob]] = {}
        # pdkv.engine.cuda_graphs.DecodeGraphs (model.cuda_graphs): decode-only steps replay a
        # captured graph; None: every step runs eagerly
        self.graphs = None
        # Fill the step's grammar masks on a worker thread during the forward pass: None where
        # that pays (pdkv.engine.logits.start_masks), True always, False never (after the
        # forward, on this thread: the benchmark's "before")
        self.overlap_masks: bool | None = None

    @staticmethod
    def _set_threads(n: int) -> None:
        if torch.get_num_threads() != n:  # asked each step: another user may have changed it
            torch.set_num_threads(n)
        cpu_kernels.set_threads(n)  # the CPU kernels' own threads: the same cores as torch's

    @torch.inference_mode()
    def execute(self, seqs: list[ScheduledSeq], connector: KVConnector) -> dict[str, list[int]]:
        """Runs one forward pass over ``seqs``, calling ``connector`` before it, after each
        layer and after it; returns {request_id: new tokens} for the sequences whose ``sample``
        is set: one sampled token, or for a sequence with drafts what ``self.verify`` kept of
        them plus the target's next token (speculative decoding, pdkv/engine/spec)."""
        seqs = sorted(seqs, key=lambda s: len(s.token_ids))  # stable: decodes first, then verifications
        num_decodes = sum(1 for s in seqs if len(s.token_ids) == 1)
        ids, positions, q_lens, kv_lens, sample_rows, sampled, entries = [], [], [], [], [], [], []
        prompt_rows = []  # (row, request, position): rows scoring the prompt token after them
        self.last_logprobs = {}
        for s in seqs:
            n = len(s.token_ids)
            if s.request.params.prompt_logprobs is not None:
                last = s.request.num_prompt_tokens - 1  # that row scores the first output token
                if s.request.prompt_next_token is not None:  # ... unless that token is known
                    last += 1
                prompt_rows += [(len(ids) + j, s.request, s.start_pos + j)
                                for j in range(n) if s.start_pos + j < last]
            entries.append(BatchEntry(s.request, s.start_pos, n, len(ids), s.sample, s.num_draft))
            ids.extend(s.token_ids)
            positions.extend(range(s.start_pos, s.start_pos + n))
            q_lens.append(n)
            kv_lens.append(s.start_pos + n)
            if s.sample:  # a verifying sequence needs the logits of its last token and every draft
                sample_rows.extend(range(len(ids) - 1 - s.num_draft, len(ids)))
                sampled.append(s)
        tuned = self.device.type == "cpu" and len(ids) <= SMALL_STEP_TOKENS
        if self.device.type == "cpu":
            if tuned:
                threads = self.tuner.choose()
            elif len(ids) <= MEMORY_BOUND_TOKENS:
                threads = self.tuner.best()
            else:
                threads = self.tuner.choose_large()
            self._set_threads(threads)
            t0 = time.perf_counter()
        batch = AttentionBatch(q_lens, kv_lens, [s.request.pages for s in seqs], num_decodes)
        layout = ForwardBatch(tuple(entries), len(ids))
        groups = _groups(sampled)
        vocab = getattr(getattr(self.model, "cfg", None), "vocab_size", None)
        # the grammar masks of this step fill on their worker while the forward pass runs
        masks = proc.start_masks(groups, vocab, self.device, self.overlap_masks) if vocab else None
        try:
            hidden = self._forward(seqs, ids, positions, batch, layout, connector)
            if prompt_rows:
                self.prompt_logprobs(hidden, prompt_rows)
            if not sampled:
                return {}
            if len(sample_rows) != hidden.shape[0]:
                hidden = hidden[torch.tensor(sample_rows, device=self.device)]
            logits = self.model.compute_logits(hidden)  # [rows, V] float32
            tokens = self._tokens(logits, sampled, groups, masks)
        except BaseException:
            if masks is not None:  # no matcher is left being filled behind the failed step
                masks.wait()
            raise
        if tuned:
            # Per step, not per row: a memory-bound step costs the same for 1 to 4 rows.
            self.tuner.record(threads, time.perf_counter() - t0)
        return tokens

    def _forward(self, seqs, ids, positions, batch, layout, connector) -> torch.Tensor:
        connector.before_forward(layout)
        graphed = self.graphs is not None and self.graphs.fallback_reason(seqs, connector) is None
        try:
            if self.followers is not None:
                self.followers.run_step(ids, positions, batch)
            if graphed:  # the replay bumps a capturable hook once per layer, as the eager hook would
                hidden = self.graphs.run(batch, ids, positions, connector)
            else:
                hidden = self.model(self._tensor(ids), self._tensor(positions), self.backend,
                                    self.backend.plan(batch), connector.after_layer)  # [T, H]
        except BaseException:
            connector.after_forward(layout, None)
            raise
        connector.after_forward(layout, hidden)
        self.last_forward = (layout, hidden)  # the MTP proposer reads the target's hidden states
        return hidden

    def prompt_logprobs(self, hidden: torch.Tensor, rows: list) -> None:
        """Appends to each request's ``prompt_logprobs`` the prompt token after each of ``rows``
        ((row of ``hidden``, request, position)), from the model's raw distribution; a position
        already scored (a preempted request's recomputation) is skipped."""
        rows = [(r, req, pos) for r, req, pos in rows if pos >= len(req.prompt_logprobs)]
        if not rows:
            return
        idx = torch.tensor([r for r, _, _ in rows], device=hidden.device)
        lp = torch.log_softmax(self.model.compute_logits(hidden[idx]).float(), dim=-1).cpu()
        for j, (_, req, pos) in enumerate(rows):
            ids = req.prompt_token_ids
            token = ids[pos + 1] if pos + 1 < len(ids) else req.prompt_next_token
            req.prompt_logprobs.append(_record(lp[j], token, req.params.prompt_logprobs))

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _tokens(self, logits: torch.Tensor, sampled: list[ScheduledSeq], groups=None,
                masks=None) -> dict[str, list[int]]:
        """logits: each sampled sequence's rows in order (num_draft + 1 of them); ``groups``:
        ``_groups(sampled)``; ``masks``: their bitmask begun before the forward pass."""
        last, row = [], -1
        for s in sampled:
            row += s.num_draft + 1
            last.append(row)
        if len(last) != logits.shape[0]:
            self.last_logits = logits[torch.tensor(last, device=logits.device)]
        else:
            self.last_logits = logits  # kept for tests and debugging (each request's last row only)
        self.last_sampled_ids = [s.request.request_id for s in sampled]
        groups = _groups(sampled) if groups is None else groups
        processed = proc.process(logits, groups, self.eos_token_ids, masks)
        if processed is not logits:
            logits = processed
            last_rows = logits[torch.tensor(last, device=logits.device)]
        else:
            last_rows = self.last_logits
        plain = [i for i, s in enumerate(sampled) if not s.num_draft]
        out = {}
        if plain:
            rows = last_rows if len(plain) == len(sampled) else last_rows[plain]
            for i, t in zip(plain, self.sampler(rows, [sampled[i].request for i in plain])):
                out[sampled[i].request.request_id] = [t]
        verifying = [(s, end) for s, end in zip(sampled, last) if s.num_draft]
        if verifying:
            # NOTE: one thread: verification is many ops on [k + 1, V] rows, and waking a second
            # thread for each costs more than the op (~1 ms on a loaded CPU).
            threads = torch.get_num_threads()
            self._set_threads(1)
            for s, end in verifying:
                out[s.request.request_id] = self.verify(logits[end - s.num_draft:end + 1], s.request,
                                                        s.token_ids[-s.num_draft:])
            self._set_threads(threads)
        for s, end in zip(sampled, last):
            p = s.request.params
            if p.logprobs is not None:  # row j scored new token j (the drafts accepted before it)
                tokens = out[s.request.request_id]
                lp = proc.logprobs(logits[end - s.num_draft:end - s.num_draft + len(tokens)], p.temperature).cpu()
                self.last_logprobs[s.request.request_id] = [_record(lp[j], t, p.logprobs)
                                                            for j, t in enumerate(tokens)]
        return out


def _groups(sampled: list[ScheduledSeq]) -> list:
    """(request, drafts) of each sampled sequence: what pdkv.engine.logits processes."""
    return [(s.request, s.token_ids[len(s.token_ids) - s.num_draft:] if s.num_draft else []) for s in sampled]


def _record(lp: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    """lp: [V] log-probabilities -> ``token``'s and the ``num_top`` best."""
    top = ()
    if num_top:
        v, i = torch.topk(lp, num_top)
        top = tuple(zip(i.tolist(), v.tolist()))
    return TokenLogprob(token, float(lp[token]), top)
