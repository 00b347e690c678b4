"""LLMEngine: the Python API over the scheduler, the model runner and the sampler.

One thread owns an engine and calls ``add_request`` / ``abort`` / ``step``; only
``validate_request`` is meant to be called from other threads (it is pure). A step is
``schedule → run → update``: one forward pass in which prefill chunks and decodes share a batch.
Everything outside the engine that takes part in a request's KV (disaggregated prefill and
decode; later prefix caching, speculative decoding) does so through one KV connector
(pdkv/engine/connector.py), called at named points of admission, the forward pass and exit.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator

import torch

from pdkv.config import Config, KVCacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from pdkv.engine.connector import LOCAL, Admission, KVConnector
from pdkv.engine.factory import build_parts
from pdkv.engine.params import SamplingParams
from pdkv.engine.request import Request, RequestOutput, RequestStatus
from pdkv.engine.spec import build_spec_decoder
from pdkv.errors import InvalidRequest, ResourceBusy

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: ModelConfig, kv_cache: KVCacheConfig, scheduler: SchedulerConfig,
                 progress: Callable[[int, int], None] | None = None, kv_buffer=None,
                 num_threads: int | None = None, parallel=None, speculative: SpeculativeConfig | None = None,
                 spec_drafts: bool = True):
        """Loads the model and wires the parts (pdkv/engine/factory.py: ``kv_buffer``,
        ``num_threads``, ``parallel`` are explained there); ``build_engine(cfg)`` is the usual way.
        ``speculative``: speculative decoding (pdkv/engine/spec); None: off. ``spec_drafts``:
        False on a prefill node (its proposer only computes what it hands off)."""
        p = build_parts(model, kv_cache, scheduler, progress, kv_buffer, num_threads, parallel)
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
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, cfg: Config, progress: Callable[[int, int], None] | None = None, **kw) -> LLMEngine:
        kw.setdefault("parallel", cfg.parallel)
        kw.setdefault("speculative", cfg.speculative)
        kw.setdefault("spec_drafts", cfg.role != "prefill")
        return cls(cfg.model, cfg.kv_cache, cfg.scheduler, progress, **kw)

    def set_connector(self, connector: KVConnector | None) -> None:
        """Installs the KV connector (None: the no-op one). Call it before any request is added."""
        self.connector = connector if connector is not None else KVConnector()

    # ---- requests ------------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Pure and thread-safe: raises InvalidRequest naming what is wrong."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        self._check_prompt(prompt_token_ids, params.max_tokens)

    def _check_prompt(self, ids: list[int], max_tokens: int) -> None:
        """The prompt's own checks, shared by every kind of request (``max_tokens`` 0: a
        prefill-only request, whose context is the prompt alone)."""
        n = len(ids)
        if n == 0:
            raise InvalidRequest("prompt is empty: give at least one token")
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        what = f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens}" if max_tokens \
            else f"prompt ({n} tokens)"
        if n + max_tokens > self.max_model_len:
            raise InvalidRequest(f"{what} exceeds the model's context of {self.max_model_len} tokens")
        need = self.scheduler.pages_for(n + max_tokens)
        if need > self.allocator.num_total:
            raise InvalidRequest(f"{'prompt + max_tokens need' if max_tokens else 'prompt needs'} {need} KV "
                                 f"pages, the cache has only {self.allocator.num_total}")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival: float | None = None) -> None:
        """Admits a request: the connector says what to reserve (pdkv/engine/connector.py) and
        then reserves its own resources. Raises InvalidRequest (a bad request), ResourceBusy
        (pages or a connector resource not free now: nothing changed, try again later; the
        engine loop does) or the connector's refusal."""
        req = self._new_request(request_id, prompt, params, arrival)
        self._check_prompt(req.prompt_token_ids, 0)  # before hashing it
        req.num_cached_tokens = self.scheduler.cached_prefix(req)  # what admission may reuse (a peek)
        self._admit(req, self.connector.admission(req))

    def add_remote_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                           reuse_cached: bool = False) -> list[int]:
        """Disaggregated decode without a connector deciding: reserves pinned pages for the
        prompt minus its last token and parks the request in WAITING_FOR_REMOTE_KV; returns the
        page ids a remote prefill fills. ``reuse_cached``: the locally cached prefix is taken
        instead (``requests[id].num_cached_tokens`` tokens; only the pages after it are
        returned). Raises OutOfPages (nothing changed); call ``remote_kv_ready`` when the writes
        landed, ``abort`` to give the pages back."""
        req = self._new_request(request_id, prompt, params)
        self._check_prompt(req.prompt_token_ids, 0)
        cached = self.scheduler.cached_prefix(req) if reuse_cached else 0
        req.num_cached_tokens = cached
        self._admit(req, Admission(num_external_tokens=req.num_prompt_tokens - 1 - cached, reuse_cached=reuse_cached))
        return req.pages[cached // self.kv.page_size:]

    def reset_prefix_cache(self) -> int:
        """Forgets every cached page no request holds (vLLM's reset_prefix_cache): for when KV
        memory was changed behind the engine's back. Returns how many pages were dropped."""
        return self.allocator.evict_all()

    def cached_prefix_tokens(self, prompt_token_ids: list[int]) -> int:
        """How many leading tokens of this prompt the local prefix cache holds now (whole pages,
        at most all but the last token). A peek for routing decisions; engine thread only."""
        self._check_prompt(list(prompt_token_ids), 0)
        return self.scheduler.cached_prefix(Request("peek", list(prompt_token_ids), SamplingParams(), detok=None))

    def add_prefill_request(self, request_id: str, prompt_token_ids: list[int], reuse_cached: bool = False) -> int:
        """Disaggregated prefill without a connector deciding: compute the prompt's KV, never
        sample; after its last chunk the request leaves with its pages HELD, ``step`` reports
        it with finish_reason "prefilled" and ``release`` frees the pages. ``reuse_cached``: the
        locally cached prefix is taken, not computed. Returns how many tokens were reused."""
        req = self._new_request(request_id, list(prompt_token_ids), SamplingParams(max_tokens=1))
        self._check_prompt(req.prompt_token_ids, 0)
        req.num_cached_tokens = self.scheduler.cached_prefix(req) if reuse_cached else 0
        self._admit(req, Admission(prefill_only=True, reuse_cached=reuse_cached))
        return req.num_cached_tokens

    def _new_request(self, request_id: str, prompt, params: SamplingParams, arrival: float | None = None) -> Request:
        if request_id in self.requests or request_id in self._held:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise InvalidRequest(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        req = Request(request_id, ids, params, detok=None)
        if arrival is not None:
            req.arrival = arrival
        return req

    def _admit(self, req: Request, plan: Admission) -> None:
        ids, params = req.prompt_token_ids, req.params
        if plan.prefill_only:
            self._check_prompt(ids, 0)
        else:
            self.validate_request(ids, params)
            # Any integer is a valid seed (negative too): fold it into the generator's 64-bit range.
            req.generator = torch.Generator().manual_seed(params.seed & (2**64 - 1)) if params.seed is not None else None
            req.detok = self.tokenizer.detokenizer(ids, params.stop, params.skip_special_tokens)
        reuse = plan.reuse_cached if plan.reuse_cached is not None else \
            not (plan.prefill_only or plan.num_external_tokens)
        req.reuse_cache = reuse
        num_cached = req.num_cached_tokens if reuse else 0
        req.num_cached_tokens = num_cached
        if plan.prefill_only:
            self.scheduler.add_prefill(req, num_cached)  # OutOfPages: nothing changed
        elif plan.num_external_tokens:
            self.scheduler.add_remote(req, plan.num_external_tokens, num_cached)  # OutOfPages: nothing changed
        else:
            self.scheduler.add(req)  # a local request takes its cached pages when scheduled
        cache = self.scheduler.cache
        if cache is not None and reuse and (plan.prefill_only or plan.num_external_tokens):
            cache.record_query(req.num_prompt_tokens, num_cached)
        if not self.connector.admit(req):
            self.scheduler.abort(req)  # gives the pages back (unpinned); nobody saw the request
            raise ResourceBusy(f"request {req.request_id!r}: the KV connector has no free resources for it now")
        self.requests[req.request_id] = req

    def remote_kv_ready(self, request_id: str) -> None:
        """The remote prefill's writes for ``request_id`` have all landed: its full pages are
        published to the prefix cache (this is the one step that makes remotely written pages
        visible: never earlier, and never for a request aborted before it) and its decode is
        scheduled."""
        req = self.requests.get(request_id)
        if req is None:
            raise InvalidRequest(f"unknown request id {request_id!r}")
        if req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise InvalidRequest(f"request {request_id!r} is {req.status.value}, not waiting for remote KV")
        self.scheduler.remote_ready(req)
        if self.spec is not None:  # the first decode step verifies drafts already
            self.spec.draft([req])

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
        if quarantine:
            pinned = req.status == RequestStatus.WAITING_FOR_REMOTE_KV
            self._held[request_id] = (self.scheduler.detach(req), pinned)
            req.status = RequestStatus.ABORTED
        else:
            self.scheduler.abort(req)
        req.finish_reason = reason
        self._left(req)
        self._pending.append(self._output(req, []) if req.detok is not None else self._prefill_output(req))

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
                outputs.append(self._append(req, sampled[req.request_id]))
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
        return self._prefill_output(req) if req.prefill_only else self._output(req, [])

    def _append(self, req: Request, tokens: list[int]) -> RequestOutput:
        """Appends the step's new tokens (several when drafts were accepted) in order, up to
        the first that ends the request (EOS, a stop token or string, max_tokens, the context):
        the rest are dropped, as if they had been decoded one by one."""
        p = req.params
        new, reason = [], None
        for token in tokens:
            req.output_token_ids.append(token)
            req.detok.add(token)
            new.append(token)
            if (token in self.tokenizer.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids \
                    or req.detok.stopped_on is not None:
                reason = "stop"
            elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
            if reason is not None:
                break
        if reason is not None:
            if len(tokens) > 1:  # accepted drafts: their KV is final now, cache it before the pages go
                self.scheduler.truncate_computed(req, req.num_tokens - 1)
                self.scheduler.publish(req)
            self.scheduler.finish(req, reason)
            self.requests.pop(req.request_id, None)
            self._left(req)
        return self._output(req, new)

    def _left(self, req: Request) -> None:
        """``req`` left the engine: everything that holds per-request state hears it."""
        self.connector.finished(req)
        if self.spec is not None:
            self.spec.finished(req)

    @staticmethod
    def _prefill_output(req: Request) -> RequestOutput:
        return RequestOutput(req.request_id, [], "", True, req.finish_reason, req.num_prompt_tokens, 0, [], "")

    def _output(self, req: Request, new_ids: list[int]) -> RequestOutput:
        done = req.status.is_done
        return RequestOutput(req.request_id, new_ids, req.detok.flush(done), done, req.finish_reason,
                             req.num_prompt_tokens, len(req.output_token_ids), list(req.output_token_ids),
                             req.detok.text)

    # ---- conveniences ----------------------------------------------------------------------------
    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Runs ``prompts`` (strings or token id lists) to completion; one final output each, in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished and out.request_id in ids:
                    final[out.request_id] = out
        return [self._final(final[r]) for r in ids]

    @staticmethod
    def _final(out: RequestOutput) -> RequestOutput:
        return RequestOutput(out.request_id, list(out.output_token_ids), out.text, True, out.finish_reason,
                             out.num_prompt_tokens, out.num_output_tokens, out.output_token_ids, out.text)

    def stream(self, prompt, params: SamplingParams, request_id: str | None = None) -> Iterator[RequestOutput]:
        """Yields this request's deltas as steps run; closing the iterator early aborts it.
        Outputs of other requests stepped meanwhile are dropped: a server with many requests
        calls ``step`` itself and routes outputs by request id."""
        rid = request_id or f"stream-{next(self._ids)}"
        self.add_request(rid, prompt, params)
        try:
            while True:
                for out in self.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.abort(rid)

    def close(self) -> None:
        """Stops the tensor-parallel ranks (if any); idempotent. Also runs at interpreter exit."""
        if self.tp is not None:
            self.tp.close()

    def stats(self) -> dict:
        s = self.scheduler
        return {"num_running": len(s.running), "num_waiting": len(s.waiting),
                "num_waiting_remote_kv": len(s.remote), "num_pages_total": self.allocator.num_total,
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
