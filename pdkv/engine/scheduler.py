"""Continuous batching with a per-step token budget and chunked prefill.

A request is first submitted to ``pending``: it waits there for admission, which reserves what
it needs before it may be scheduled (``admit``: the engine's intake asks the KV connector,
pdkv/engine/connector.py, and hands back its typed answer: reserve / not yet / refuse). "Not
yet" keeps it at the head of ``pending`` (nothing behind it is admitted first: no starvation),
a refusal takes it out. Admitted requests wait in ``waiting`` (or ``remote`` while their KV
comes from elsewhere).

Each step: running requests first (their next decode token or next prefill chunk), then waiting
requests in the policy's order (pdkv/engine/policy.py: fcfs = arrival, priority = the request's
priority, then arrival) while the budget, ``max_num_seqs`` and free pages allow. Prefill chunks
and decodes share a step. A request whose next tokens need pages that are not free preempts the
policy's victim (fcfs: the newest running request; its pages are freed and it is recomputed
later from its prompt + outputs), so a full cache makes requests wait, never fail.

With a prefix cache (pdkv/kv/prefix_cache.py) a waiting request that holds no pages first takes
the longest chain of cached full pages, so only the rest is computed (and only the rest counts
against the step's budget); after each step every page a request completed is published. The
pages it took are given back if the rest does not fit yet, so a waiting request never sits on
pages it cannot use.

The prefix cache side (cached_prefix, publish and taking / giving back cached pages) is
pdkv/engine/prefix_reuse.py, a mixin of ``Scheduler``. The scheduler sees request ids, token
counts and page ids, never tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdkv.engine.connector import Answer, Verdict
from pdkv.engine.policy import make_policy
from pdkv.engine.prefix_reuse import PrefixReuse
from pdkv.engine.request import Request, RequestStatus
from pdkv.kv.allocator import PageAllocator
from pdkv.kv.prefix_cache import PrefixCache


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


class Scheduler(PrefixReuse):
    def __init__(self, allocator: PageAllocator, page_size: int, max_num_batched_tokens: int,
                 chunk_size: int, max_num_seqs: int, prefix_cache: PrefixCache | None = None,
                 policy: str = "fcfs"):
        for name, v in (("max_num_batched_tokens", max_num_batched_tokens), ("chunk_size", chunk_size),
                        ("max_num_seqs", max_num_seqs)):
            if v < 1:
                raise ValueError(f"scheduler.{name} must be >= 1, got {v}")
        self.allocator, self.page_size, self.cache = allocator, page_size, prefix_cache
        self.budget, self.chunk_size, self.max_num_seqs = max_num_batched_tokens, chunk_size, max_num_seqs
        self.policy = make_policy(policy)
        self.pending: deque[Request] = deque()  # PENDING: submitted, waiting for admission
        self._num_submitted = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV
        self.num_preemptions = 0

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- admission -------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queues ``req`` for admission (``admit``), in the policy's order."""
        self._num_submitted += 1
        req.seq = self._num_submitted
        req.status = RequestStatus.PENDING
        self.policy.insert(self.pending, req)

    def admit(self, reserve: Callable[[Request], Answer]) -> list[tuple[Request, Answer]]:
        """Admits pending requests in order while ``reserve(req)`` (the engine's intake: it asks
        the KV connector and reserves the pages through ``add`` / ``add_remote`` /
        ``add_prefill``) answers RESERVE. NOT_YET: ``reserve`` kept nothing, the request stays at
        the head and admission stops (tried again after the next command or step). A refused
        request is taken out (ABORTED); returns those with their answers."""
        refused = []
        while self.pending:
            req = self.pending.popleft()
            answer = reserve(req)
            if answer.verdict is Verdict.NOT_YET:
                req.status = RequestStatus.PENDING
                self.pending.appendleft(req)  # it was the head: the policy's order holds
                break
            if answer.verdict is Verdict.REFUSE:
                req.status, req.finish_reason = RequestStatus.ABORTED, "error"
                refused.append((req, answer))
        return refused

    def unreserve(self, req: Request) -> None:
        """Undoes ``add`` / ``add_remote`` / ``add_prefill`` (the connector said not yet or
        refused): its pages go back (unpinned), the request is as it was before admission."""
        self._remove(req)
        self._release(req)
        req.num_computed_tokens = req.num_cached_tokens = req.num_published_pages = 0
        req.num_external_tokens, req.prefill_only = 0, False
        req.status = RequestStatus.PENDING

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.policy.insert(self.waiting, req)

    def add_remote(self, req: Request, num_tokens: int | None = None, num_cached: int = 0) -> bool:
        """Reserves the KV of the prompt's first ``num_cached + num_tokens`` tokens: the cached
        pages of the first ``num_cached`` (taken now), pinned pages for the ``num_tokens`` after
        them (default: up to the last prompt token; a remote prefill fills them) in
        ``req.pages``. False and nothing changed when they are not free."""
        num_tokens = req.num_prompt_tokens - 1 - num_cached if num_tokens is None else num_tokens
        if num_tokens < 0 or num_cached + num_tokens > req.num_prompt_tokens - 1:
            raise ValueError(f"request {req.request_id!r}: {num_cached} cached + {num_tokens} remote tokens "
                             f"must be at most the prompt's {req.num_prompt_tokens} tokens minus its last")
        cached = self._take_cached(req, num_cached)
        need = self.pages_for(num_cached + num_tokens) - len(cached)
        if not self.allocator.can_allocate(need):
            self.allocator.free(cached)
            return False
        req.pages = cached + self.allocator.allocate(need, pinned=True)
        req.num_cached_tokens, req.num_computed_tokens = num_cached, num_cached
        req.num_published_pages = len(cached)
        req.num_external_tokens = num_tokens
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.remote[req.request_id] = req
        return True

    def remote_ready(self, req: Request) -> None:
        """The remote KV landed: publish its full pages (only now: a page a remote writer may
        still fill is never visible), then the last prompt token runs as a decode step, first in
        line."""
        del self.remote[req.request_id]
        self.allocator.unpin(req.pages)
        req.num_computed_tokens = req.num_cached_tokens + req.num_external_tokens
        req.status = RequestStatus.WAITING
        self.publish(req)
        self.policy.insert(self.waiting, req, front=True)

    def remote_here(self, req: Request) -> None:
        """The remote prefill was given up (no remote write can land any more): the request
        keeps its pages and computes its prompt after the cached prefix here, first in line."""
        del self.remote[req.request_id]
        self.allocator.unpin(req.pages)
        req.num_computed_tokens = req.num_cached_tokens
        req.num_external_tokens = 0
        req.status = RequestStatus.WAITING
        self.policy.insert(self.waiting, req, front=True)

    def add_prefill(self, req: Request, num_cached: int = 0) -> bool:
        """Disaggregated prefill: all of the prompt's pages up front (False and nothing changed
        when they are not free), so the request never grows and is never a preemption victim
        whose pages an in-flight write could still be reading. The first ``num_cached`` tokens'
        pages come from the prefix cache and are not computed again."""
        cached = self._take_cached(req, num_cached)
        need = self.pages_for(req.num_prompt_tokens) - len(cached)
        if not self.allocator.can_allocate(need):
            self.allocator.free(cached)
            return False
        req.pages = cached + self.allocator.allocate(need)
        req.num_cached_tokens = req.num_computed_tokens = num_cached
        req.num_published_pages = len(cached)
        req.prefill_only = True
        req.status = RequestStatus.WAITING
        self.policy.insert(self.waiting, req)
        return True

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
        elif req.status == RequestStatus.PENDING:
            self.pending.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.remote[req.request_id]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.allocator.free(req.pages)  # its published pages stay cached: recompute finds them
        req.pages = []
        req.num_computed_tokens = req.num_published_pages = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.policy.insert(self.waiting, req, front=True)

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
                victim = self.policy.victim(self.running)
                j = self.running.index(victim)
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
                if j < i:  # scheduled earlier in this step (priority): its tokens go back to the budget
                    seq = next(s for s in out.seqs if s.request is victim)
                    out.seqs.remove(seq)
                    budget += len(seq.token_ids)
                    i -= 1
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
            fresh = self.cache is not None and req.reuse_cache and not req.pages and req.num_computed_tokens == 0
            if fresh:
                self._reuse(req)
            n = self._plan(req, budget)
            if not self._grow(req, n):
                if fresh:
                    self._unreuse(req)
                if self._unblock(req, budget):
                    continue
                break
            if fresh and req.num_preemptions == 0:  # a recompute is not a new query (vLLM counts so too)
                self.cache.record_query(req.num_tokens, req.num_computed_tokens)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.seqs.append(self._seq(req, n))
            budget -= n
        return out

    def _unblock(self, head: Request, budget: int) -> bool:
        """``head`` does not fit and nothing runs. True if the queue was changed so that another
        try can succeed: a waiting request that already holds pages (its remote KV landed) and
        fits now is moved in front of ``head``; if none fits, the newest such request gives its
        pages back (a preemption: its published pages stay cached, it is recomputed later).
        NOTE: strict FIFO deadlocked here (the decode node's 60 s hang): with nothing running no
        page comes free unless the requests sitting on pages run, and decode admission reserves
        only a remote prompt's pages, so landed requests can hold every page while each needs
        one more (or a preempted request at the head needs more than the free pages)."""
        if self.running:
            return False  # they finish and free pages: FIFO order is kept
        holders = [r for r in self.waiting if r.pages and r is not head]
        for r in holders:
            need = self.pages_for(r.num_computed_tokens + self._plan(r, budget)) - len(r.pages)
            if need <= 0 or self.allocator.can_allocate(need):
                self.waiting.remove(r)
                self.waiting.appendleft(r)
                return True
        victims = [r for r in holders if not r.prefill_only]
        if not victims:
            return False
        r = self.policy.victim(victims)
        self.allocator.free(r.pages)  # its published pages stay cached: recompute finds them
        r.pages, r.num_computed_tokens, r.num_published_pages = [], 0, 0
        r.num_preemptions += 1
        self.num_preemptions += 1
        return True

    def update_computed(self, out: SchedulerOutput) -> None:
        for s in out.seqs:
            s.request.num_computed_tokens += len(s.token_ids)
            self.publish(s.request)
