"""Continuous batching with a per-step token budget and chunked prefill.

Each step: running requests first (their next decode token or next prefill chunk), then waiting
requests in arrival order while the budget, ``max_num_seqs`` and free pages allow. Prefill
chunks and decodes share a step. A request whose next tokens need pages that are not free
preempts the newest running request (its pages are freed and it is recomputed later from its
prompt + outputs), so a full cache makes requests wait, never fail.

The scheduler sees request ids, token counts and page ids, never tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdkv.engine.request import Request, RequestStatus
from pdkv.kv.allocator import PageAllocator


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    token_ids: list[int]  # tokens fed this step
    start_pos: int  # position of token_ids[0] (= tokens already in the cache)
    sample: bool  # this step reaches the request's last known token: sample the next one
    num_draft: int = 0  # speculative drafts at the end of token_ids, verified this step


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


class Scheduler:
    def __init__(self, allocator: PageAllocator, page_size: int, max_num_batched_tokens: int,
                 chunk_size: int, max_num_seqs: int):
        for name, v in (("max_num_batched_tokens", max_num_batched_tokens), ("chunk_size", chunk_size),
                        ("max_num_seqs", max_num_seqs)):
            if v < 1:
                raise ValueError(f"scheduler.{name} must be >= 1, got {v}")
        self.allocator, self.page_size = allocator, page_size
        self.budget, self.chunk_size, self.max_num_seqs = max_num_batched_tokens, chunk_size, max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV
        self.num_preemptions = 0

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- admission -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def add_remote(self, req: Request, num_tokens: int | None = None) -> list[int]:
        """Reserves pinned pages for the prompt's first ``num_tokens`` tokens (default: all but
        the last; a remote prefill fills them); raises OutOfPages and changes nothing when they
        are not free."""
        num_tokens = req.num_prompt_tokens - 1 if num_tokens is None else num_tokens
        pages = self.allocator.allocate(self.pages_for(num_tokens), pinned=True)
        req.pages = pages
        req.num_external_tokens = num_tokens
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.remote[req.request_id] = req
        return pages

    def remote_ready(self, req: Request) -> None:
        """The remote KV landed: the last prompt token runs as a decode step, first in line."""
        del self.remote[req.request_id]
        self.allocator.unpin(req.pages)
        req.num_computed_tokens = req.num_external_tokens
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def add_prefill(self, req: Request) -> None:
        """Disaggregated prefill: all of the prompt's pages up front (raises OutOfPages and
        changes nothing when they are not free), so the request never grows and is never a
        preemption victim whose pages an in-flight write could still be reading."""
        req.pages = self.allocator.allocate(self.pages_for(req.num_prompt_tokens))
        req.prefill_only = True
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def detach(self, req: Request) -> list[int]:
        """Removes ``req`` from scheduling and hands its pages to the caller WITHOUT freeing
        them (a remote writer may still write them, or a local write may still read them);
        the caller frees them exactly once later (LLMEngine.release)."""
        self._remove(req)
        pages, req.pages = req.pages, []
        return pages

    # ---- exits (each frees pages exactly once) -----------------------------------------------
    def _release(self, req: Request) -> None:
        pages, req.pages = req.pages, []
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self.allocator.unpin(pages)
        self.allocator.free(pages)

    def finish(self, req: Request, reason: str) -> None:
        if req.status.is_done:
            return
        self._remove(req)
        self._release(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason

    def abort(self, req: Request) -> None:
        if req.status.is_done:
            return
        self._remove(req)
        self._release(req)
        req.status, req.finish_reason = RequestStatus.ABORTED, "abort"

    def _remove(self, req: Request) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.remote[req.request_id]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.allocator.free(req.pages)
        req.pages = []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    # ---- the step ------------------------------------------------------------------------------
    def _grow(self, req: Request, num_new: int) -> bool:
        """Allocates the pages ``num_new`` more tokens need; False if they are not free."""
        need = self.pages_for(req.num_computed_tokens + num_new) - len(req.pages)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            return False
        req.pages.extend(self.allocator.allocate(need))
        return True

    def _plan(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, self.chunk_size, budget)
        if req.spec_token_ids and n == 1 and req.num_computed_tokens == req.num_tokens - 1:
            n = min(1 + len(req.spec_token_ids), budget)  # a decode that verifies drafts
        return n

    def _seq(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        if start + n > req.num_tokens:  # the last token + drafts (speculative decoding)
            drafts = req.spec_token_ids[:n - 1]
            return ScheduledSeq(req, req.token_ids(start, start + 1) + drafts, start, True, len(drafts))
        last = start + n == req.num_tokens
        return ScheduledSeq(req, req.token_ids(start, start + n), start, last and not req.prefill_only)

    def truncate_computed(self, req: Request, num_tokens: int) -> int:
        """Rolls ``req``'s cache back to its first ``num_tokens`` tokens (KV of rejected drafts
        is dropped) and frees the pages past them; returns how many were freed."""
        req.num_computed_tokens = min(req.num_computed_tokens, num_tokens)
        keep = self.pages_for(req.num_computed_tokens)
        extra = req.pages[keep:]
        if extra:
            del req.pages[keep:]
            self.allocator.free(extra)
        return len(extra)

    def schedule(self) -> SchedulerOutput:
        out, budget = SchedulerOutput(), self.budget
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._plan(req, budget)
            while not self._grow(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break
            out.seqs.append(self._seq(req, n))
            budget -= n
            i += 1
        # Admit waiting requests only when nothing was preempted this step (it would just thrash).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            # NOTE: a prefill-only request holds all its pages already, so _grow never fails for
            # it and it never needs a victim (see add_prefill).
            req = self.waiting[0]
            n = self._plan(req, budget)
            if not self._grow(req, n):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.seqs.append(self._seq(req, n))
            budget -= n
        return out

    def update_computed(self, out: SchedulerOutput) -> None:
        for s in out.seqs:
            s.request.num_computed_tokens += len(s.token_ids)
