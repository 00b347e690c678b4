"""LLMEngine: the Python API over the scheduler, the model runner and the sampler.

One thread owns an engine and calls ``submit`` / ``admit`` / ``abort`` / ``step`` (``add_request``
is submit + admit, for callers that drive the engine themselves); only ``validate_request`` is
meant to be called from other threads (it is pure), and the server's ``/load`` reads the
scheduler's queue lengths from its event loop without a lock (a count one step stale). A step is
``schedule → run → update``: one forward pass in which prefill chunks and decodes share a batch.
Everything outside the engine that takes part in a request's KV (disaggregated prefill and
decode) does so through one KV connector (pdkv/engine/connector.py), called at named points of
admission, the forward pass and exit; prefix caching (pdkv/kv/prefix_cache.py, through the
scheduler) and speculative decoding (pdkv/engine/spec) are the engine's own.

New requests are checked and submitted by the engine's intake (pdkv/engine/intake.py) and wait
in the scheduler's ``pending`` queue until ``admit`` reserves what they need (the connector's
typed answer: reserve / not yet / refuse, pdkv/engine/scheduler.py); a step's
sampled tokens are kept up to the first that ends the request by ``Request.append`` and reported
as ``RequestOutput.delta`` (pdkv/engine/request.py); what is left here is the step and a
request's exits (finish, abort, the held pages' release).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator

from pdkv.config import Config, KVCacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from pdkv.engine.connector import Answer, KVConnector
from pdkv.engine.factory import build_parts
from pdkv.engine.intake import Intake
from pdkv.engine.params import SamplingParams
from pdkv.engine.request import Request, RequestOutput, RequestStatus
from pdkv.engine.spec import build_spec_decoder
from pdkv.errors import AdmissionRefused, InvalidRequest

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: ModelConfig, kv_cache: KVCacheConfig, scheduler: SchedulerConfig,
                 progress: Callable[[int, int], None] | None = None, kv_buffer=None,
                 num_threads: int | None = None, parallel=None, speculative: SpeculativeConfig | None = None,
                 spec_drafts: bool = True, ep=None):
        """Loads the model and wires the parts (pdkv/engine/factory.py: ``kv_buffer``,
        ``num_threads``, ``parallel``, ``ep`` are explained there); ``build_engine(cfg)`` is the usual way.
        ``speculative``: speculative decoding (pdkv/engine/spec); None: off. ``spec_drafts``:
        False on a prefill node (its proposer only computes what it hands off)."""
        p = build_parts(model, kv_cache, scheduler, progress, kv_buffer, num_threads, parallel, ep)
        self.spec = build_spec_decoder(speculative, p, p.runner.sampler.generator, spec_drafts)  # None: off
        if self.spec is not None:
            p.runner.verify = self.spec.verify
        self.model_config, self.kv_config, self.scheduler_config = model, kv_cache, scheduler
        self.loaded, self.tokenizer, self.tp = p.loaded, p.tokenizer, p.tp
        self.config = p.loaded.hf_config
        self.model_name, self.max_model_len, self.vocab_size = p.model_name, p.max_model_len, p.loaded.arch.vocab_size
        self.kv, self.allocator, self.runner, self.scheduler = p.kv, p.allocator, p.runner, p.scheduler
        self.connector = KVConnector()  # colocated: no-op; a disaggregated node installs its own
        self.requests: dict[str, Request] = {}
        # Pages that left scheduling but may not be reused yet (a remote write may still land in
        # them, or a local write may still read them): freed exactly once by release().
        self._held: dict[str, tuple[list[int], bool]] = {}  # rid -> (pages, pinned)
        self._pending: list[RequestOutput] = []  # outputs of aborts, returned by the next step
        self._refused: list[tuple[str, Answer]] = []  # refused while admitting another's: for admit()
        self._ids = itertools.count()
        self.intake = Intake(self.tokenizer, self.scheduler, self.allocator, self.vocab_size, self.max_model_len,
                             self.kv.page_size, lambda: self.connector, self.requests, self._held)

    @classmethod
    def from_config(cls, cfg: Config, progress: Callable[[int, int], None] | None = None, **kw) -> LLMEngine:
        kw.setdefault("parallel", cfg.parallel)
        kw.setdefault("speculative", cfg.speculative)
        kw.setdefault("spec_drafts", cfg.role != "prefill")
        return cls(cfg.model, cfg.kv_cache, cfg.scheduler, progress, **kw)

    def set_connector(self, connector: KVConnector | None) -> None:
        """Installs the KV connector (None: the no-op one). Call it before any request is added."""
        self.connector = connector if connector is not None else KVConnector()

    # ---- requests (checked and admitted by pdkv/engine/intake.py) -------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Pure and thread-safe: raises InvalidRequest naming what is wrong."""
        self.intake.check_priority(priority)
        self.intake.validate(prompt_token_ids, params)

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               arrival: float | None = None, priority: int = 0) -> None:
        """Queues a request for admission (``admit``); raises InvalidRequest (a bad request:
        nothing queued). ``priority``: lower runs first under ``scheduler.policy: priority``
        (non-zero is refused otherwise, as vLLM does)."""
        self.intake.submit(request_id, prompt, params, arrival, priority)

    def admit(self) -> list[tuple[str, Answer]]:
        """Admits queued requests in the scheduler's order: the connector says what to reserve
        (pdkv/engine/connector.py) and then reserves its own resources. One whose pages or
        connector resources are not free waits at the head (nothing changed; the engine loop
        calls this again after every command and step). Returns the requests refused meanwhile
        (gone from the engine, nothing held) with the connector's or the check's answer."""
        refused, self._refused = self._refused, []
        refused += [(r.request_id, a) for r, a in self.scheduler.admit(self.intake.reserve)]
        return refused

    @property
    def num_pending(self) -> int:
        """Requests queued for admission."""
        return len(self.scheduler.pending)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival: float | None = None, priority: int = 0) -> None:
        """``submit`` then ``admit``, for callers that drive the engine themselves. Raises
        InvalidRequest (a bad request) or the refusal (AdmissionRefused, or the check's own error)
        if the request is refused now; one that must wait for resources stays queued (the next
        ``admit`` tries again; ``generate`` / ``stream`` do)."""
        self.submit(request_id, prompt, params, arrival, priority)
        refused = self.admit()
        mine = next((a for rid, a in refused if rid == request_id), None)
        self._refused += [(rid, a) for rid, a in refused if rid != request_id]  # the next admit() reports them
        if mine is not None:
            raise mine.error if mine.error is not None else AdmissionRefused(mine.reason, mine.status,
                                                                             mine.retry_after)

    def cached_prefix_tokens(self, prompt_token_ids: list[int]) -> int:
        """How many leading tokens of this prompt the local prefix cache holds now (whole pages,
        at most all but the last token). A peek for routing decisions; engine thread only."""
        return self.intake.cached_prefix_tokens(prompt_token_ids)

    def remote_kv_ready(self, request_id: str, prompt_logprobs: list | None = None) -> None:
        """The remote prefill's writes for ``request_id`` have all landed: its full pages are
        published to the prefix cache (this is the one step that makes remotely written pages
        visible: never earlier, and never for a request aborted before it) and its decode is
        scheduled. ``prompt_logprobs``: the prompt's, from the prefill node (echo + logprobs)."""
        req = self.requests.get(request_id)
        if req is None:
            raise InvalidRequest(f"unknown request id {request_id!r}")
        if req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise InvalidRequest(f"request {request_id!r} is {req.status.value}, not waiting for remote KV")
        if prompt_logprobs is not None:  # before its first token: the first output carries them
            req.prompt_logprobs = list(prompt_logprobs)
        self.scheduler.remote_ready(req)
        if self.spec is not None:  # the first decode step verifies drafts already
            self.spec.draft([req])

    def prefill_here(self, request_id: str) -> None:
        """The remote prefill of ``request_id`` was given up and no write to its pages can land
        any more: its prompt after the cached prefix is computed here, chunked as any other
        (its pages' contents are overwritten; none of them was published)."""
        req = self.requests.get(request_id)
        if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise InvalidRequest(f"request {request_id!r} is not waiting for remote KV")
        self.scheduler.remote_here(req)

    def in_transfer(self, request_id: str) -> bool:
        """Whether a transfer may still touch the request's pages (remote KV still arriving, or a
        prefill whose chunks' writes may still be leaving): an abort must hold them then."""
        req = self.requests.get(request_id)
        return req is not None and (req.prefill_only or req.status == RequestStatus.WAITING_FOR_REMOTE_KV)

    def abort(self, request_id: str, quarantine: bool = False, reason: str = "abort") -> None:
        """Frees the request's pages exactly once; unknown or finished ids are a no-op. The
        request's final output (finish_reason ``reason``) comes out of the next ``step``.
        ``quarantine``: the pages are held instead (a write to or from them may still be in
        flight) until ``release(request_id)``."""
        req = self.requests.pop(request_id, None)
        if req is None or req.status.is_done:
            return
        if req.status == RequestStatus.PENDING:  # never admitted: nothing reserved, no output
            self.scheduler.abort(req)
            return
        if quarantine:
            pinned = req.status == RequestStatus.WAITING_FOR_REMOTE_KV
            self._held[request_id] = (self.scheduler.detach(req), pinned)
            req.status = RequestStatus.ABORTED
        else:
            self.scheduler.abort(req)
        req.finish_reason = reason
        self._left(req)
        self._pending.append(RequestOutput.delta(req, []) if req.detok is not None else RequestOutput.prefilled(req))

    def release(self, request_id: str) -> int:
        """Frees the pages held for ``request_id`` (quarantined or prefilled); returns how many.
        NOTE: call it only when no write to or from those pages can still be in flight."""
        self.connector.released(request_id)
        entry = self._held.pop(request_id, None)
        if entry is None:
            return 0
        pages, pinned = entry
        if pinned:
            self.allocator.unpin(pages)
        self.allocator.free(pages)
        return len(pages)

    def release_all(self) -> None:
        """Frees every held page: only when the process is going away (nothing reuses them)."""
        for rid in list(self._held):
            self.release(rid)

    @property
    def num_held_pages(self) -> int:
        return sum(len(p) for p, _ in self._held.values())

    def has_work(self) -> bool:
        """Something a ``step`` can compute or report now (requests parked waiting for remote KV
        are not work: stepping for them would spin)."""
        s = self.scheduler
        return bool(s.running or s.waiting or self._pending)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if not sched.seqs:
            return outputs
        try:
            sampled = self.runner.execute(sched.seqs, self.connector)
        except Exception:  # a failed forward pass must not take the engine (or pages) with it
            log.exception("forward pass failed; finishing the step's requests with 'error'")
            for s in sched.seqs:
                outputs.append(self._finish(s.request, "error"))
            return outputs
        self.scheduler.update_computed(sched)
        for s in sched.seqs:
            req = s.request
            if req.prefill_only and req.num_computed_tokens == req.num_prompt_tokens:
                outputs.append(self._finish(req, "prefilled"))
            elif req.request_id in sampled:
                outputs.append(self._append(req, sampled[req.request_id],
                                            self.runner.last_logprobs.get(req.request_id)))
                if s.num_draft and not req.status.is_done:
                    # KV of the rejected drafts goes (the last new token is never in the cache)
                    self.scheduler.truncate_computed(req, req.num_tokens - 1)
                    self.scheduler.publish(req)  # pages the accepted drafts completed
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self.runner.last_forward)
        return outputs

    def _finish(self, req: Request, reason: str) -> RequestOutput:
        """Ends ``req`` with ``reason``. A prefill-only request's pages are held: its chunks'
        writes may still be reading them (release() frees them)."""
        self.requests.pop(req.request_id, None)
        if req.prefill_only:
            self._held[req.request_id] = (self.scheduler.detach(req), False)
            req.status, req.finish_reason = RequestStatus.FINISHED, reason
        else:
            self.scheduler.finish(req, reason)
        self._left(req)
        return RequestOutput.prefilled(req) if req.prefill_only else RequestOutput.delta(req, [])

    def _append(self, req: Request, tokens: list[int], logprobs: list | None = None) -> RequestOutput:
        """Appends the step's new tokens up to the first that ends the request (Request.append)."""
        new, reason = req.append(tokens, self.tokenizer.eos_token_ids, self.max_model_len, logprobs)
        if reason is not None:
            if len(tokens) > 1:  # accepted drafts: their KV is final now, cache it before the pages go
                self.scheduler.truncate_computed(req, req.num_tokens - 1)
                self.scheduler.publish(req)
            self.scheduler.finish(req, reason)
            self.requests.pop(req.request_id, None)
            self._left(req)
        return RequestOutput.delta(req, new)

    def _left(self, req: Request) -> None:
        """``req`` left the engine: everything that holds per-request state hears it."""
        self.connector.finished(req)
        if self.spec is not None:
            self.spec.finished(req)
        if req.mask is not None:
            req.mask.close()
            req.mask = None

    # ---- conveniences ----------------------------------------------------------------------------
    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Runs ``prompts`` (strings or token id lists) to completion; one final output each, in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        logprobs: dict[str, list] = {r: [] for r in ids}
        while len(final) < len(ids):
            for out in self._admit_and_step():
                if out.request_id in logprobs:
                    logprobs[out.request_id] += out.new_logprobs
                if out.finished and out.request_id in ids:
                    final[out.request_id] = out
        return [final[r].whole(logprobs[r]) for r in ids]

    def stream(self, prompt, params: SamplingParams, request_id: str | None = None) -> Iterator[RequestOutput]:
        """Yields this request's deltas as steps run; closing the iterator early aborts it.
        Outputs of other requests stepped meanwhile are dropped: a server with many requests
        calls ``step`` itself and routes outputs by request id."""
        rid = request_id or f"stream-{next(self._ids)}"
        self.add_request(rid, prompt, params)
        try:
            while True:
                for out in self._admit_and_step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.abort(rid)

    def _admit_and_step(self) -> list[RequestOutput]:
        """``admit`` then ``step``, raising a refusal (the conveniences above have no one else to
        tell) or a wait that nothing running can end."""
        for _rid, a in self.admit():
            raise a.error if a.error is not None else AdmissionRefused(a.reason, a.status, a.retry_after)
        if self.scheduler.pending and not self.has_work():
            raise RuntimeError(f"{self.num_pending} requests wait for admission and nothing runs that could "
                               "free what they need")
        return self.step()

    def close(self) -> None:
        """Stops the tensor-parallel ranks (if any); idempotent. Also runs at interpreter exit."""
        if self.tp is not None:
            self.tp.close()

    def stats(self) -> dict:
        s = self.scheduler
        # waiting counts the requests not yet admitted too (vLLM's num_requests_waiting: all of them)
        return {"num_running": len(s.running), "num_waiting": len(s.waiting) + len(s.pending),
                "num_pending": len(s.pending), "num_waiting_remote_kv": len(s.remote), "num_pages_total": self.allocator.num_total,
                "num_pages_free": self.allocator.num_free, "num_pages_used": self.allocator.num_used,
                "num_preemptions": s.num_preemptions, "page_size": self.kv.page_size,
                "num_pages_held": self.num_held_pages, "num_pages_cached": self.allocator.num_evictable,
                "prefix_caching": s.cache is not None,
                # vLLM's counting, in tokens: every lookup's request tokens, and those found cached
                "prefix_cache_queries": s.cache.num_queried_tokens if s.cache is not None else 0,
                "prefix_cache_hits": s.cache.num_hit_tokens if s.cache is not None else 0,
                # reserved for remote writes or held until no transfer can touch them
                "num_pages_pinned": self.num_held_pages + sum(len(r.pages) for r in s.remote.values()),
                **(self.spec.stats.as_dict() if self.spec is not None else {}),
                **(self.runner.graphs.stats.as_dict() if self.runner.graphs is not None else {})}


def build_engine(cfg: Config, progress: Callable[[int, int], None] | None = None, **kw) -> LLMEngine:
    """The engine of a pdkv.config.Config (its model, kv_cache, scheduler and parallel sections);
    ``kw``: kv_buffer, num_threads (see pdkv/engine/factory.py)."""
    return LLMEngine.from_config(cfg, progress, **kw)
