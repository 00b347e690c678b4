"""The engine's intake: a new request checked, then admitted (engine thread).

Every kind of request goes through the same two steps. ``check_prompt`` (and, for a request that
samples, ``validate``) refuses what can never run with an InvalidRequest naming what is wrong;
``validate`` is pure, so the server calls it from the event loop before submitting anything.
Admission then asks the KV connector (pdkv/engine/connector.py) what to reserve — all local, KV
from elsewhere (``num_external_tokens``) or prefill only — takes those pages from the scheduler,
and lets the connector reserve its own per-request resources. A refusal at any point leaves
nothing behind: OutOfPages / ResourceBusy mean "not now, nothing changed" (the engine loop tries
again), anything else is final.

Before the connector is asked, ``req.num_cached_tokens`` holds what the local prefix cache has
of the prompt (a peek: whole pages, at most all but the last token); whether the request really
takes those pages is the connector's ``Admission.reuse_cached``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdkv.engine.connector import Admission, KVConnector
from pdkv.engine.logits import join_masks
from pdkv.engine.params import SamplingParams
from pdkv.engine.request import Request
from pdkv.errors import InvalidRequest, ResourceBusy


class Intake:
    def __init__(self, tokenizer, scheduler, allocator, vocab_size: int, max_model_len: int, page_size: int,
                 connector: Callable[[], KVConnector], requests: dict[str, Request], held: dict):
        """``connector``: the engine's current KV connector (it may be replaced before the first
        request); ``requests`` / ``held``: the engine's live requests and held pages (an id in
        either is in use), the same dicts, not copies: an admitted request is added to ``requests``."""
        self.tokenizer, self.scheduler, self.allocator = tokenizer, scheduler, allocator
        self.vocab_size, self.max_model_len, self.page_size = vocab_size, max_model_len, page_size
        self.connector, self.requests, self.held = connector, requests, held

    # ---- checks --------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Pure and thread-safe: raises InvalidRequest naming what is wrong."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        for name, ids in params.token_ids_used().items():
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(f"{name}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        self.check_prompt(prompt_token_ids, params.max_tokens)

    def check_prompt(self, ids: list[int], max_tokens: int) -> None:
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

    # ---- the kinds of request (LLMEngine.add_*: their contracts are documented there) ---------
    def add(self, request_id: str, prompt, params: SamplingParams, arrival: float | None) -> None:
        req = self._new_request(request_id, prompt, params, arrival)
        self.check_prompt(req.prompt_token_ids, 0)  # before hashing it
        # Prompt logprobs need every prompt position's logits: nothing is taken from the cache.
        req.num_cached_tokens = 0 if params.prompt_logprobs is not None else self.scheduler.cached_prefix(req)
        self._admit(req, self.connector().admission(req))

    def add_remote(self, request_id: str, prompt, params: SamplingParams, reuse_cached: bool) -> list[int]:
        req = self._new_request(request_id, prompt, params)
        self.check_prompt(req.prompt_token_ids, 0)
        cached = self.scheduler.cached_prefix(req) if reuse_cached else 0
        req.num_cached_tokens = cached
        self._admit(req, Admission(num_external_tokens=req.num_prompt_tokens - 1 - cached, reuse_cached=reuse_cached))
        return req.pages[cached // self.page_size:]

    def add_prefill(self, request_id: str, prompt_token_ids: list[int], reuse_cached: bool) -> int:
        req = self._new_request(request_id, list(prompt_token_ids), SamplingParams(max_tokens=1))
        self.check_prompt(req.prompt_token_ids, 0)
        req.num_cached_tokens = self.scheduler.cached_prefix(req) if reuse_cached else 0
        self._admit(req, Admission(prefill_only=True, reuse_cached=reuse_cached))
        return req.num_cached_tokens

    def cached_prefix_tokens(self, prompt_token_ids: list[int]) -> int:
        self.check_prompt(list(prompt_token_ids), 0)
        return self.scheduler.cached_prefix(Request("peek", list(prompt_token_ids), SamplingParams(), detok=None))

    # ---- shared --------------------------------------------------------------------------------
    def _new_request(self, request_id: str, prompt, params: SamplingParams, arrival: float | None = None) -> Request:
        if request_id in self.requests or request_id in self.held:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise InvalidRequest(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        healing = None
        if isinstance(params, SamplingParams) and params.token_healing is True:
            ids, healing = self._heal(ids)
        req = Request(request_id, ids, params, detok=None, healing=healing)
        if arrival is not None:
            req.arrival = arrival
        return req

    def _heal(self, ids: list[int]):
        """The prompt with token healing's tokens taken off, and the request's HealingState
        (None when nothing was taken). Before the prompt is checked or hashed, so the prefix
        cache, the KV connector and a remote prefill all see the shortened prompt."""
        from pdkv.tokenizer_healing import HealingState  # noqa: PLC0415 - only a healing request needs it

        healer = getattr(self.tokenizer, "healer", None)
        if healer is None:
            raise InvalidRequest("token_healing: this engine's tokenizer has no vocabulary index "
                                 "to heal with")
        index = healer()
        ids, done = index.heal(ids)
        return ids, None if done is None else HealingState(index, done)

    def _admit(self, req: Request, plan: Admission) -> None:
        ids, params = req.prompt_token_ids, req.params
        if plan.prefill_only:
            self.check_prompt(ids, 0)
        else:
            self.validate(ids, params)
            # Any integer is a valid seed (negative too): fold it into the generator's 64-bit range.
            req.generator = torch.Generator().manual_seed(params.seed & (2**64 - 1)) if params.seed is not None else None
            skip = req.healing.healing.removed_text if req.healing is not None else ""
            req.detok = self.tokenizer.detokenizer(ids, params.stop, params.skip_special_tokens,
                                                   skip_prefix=skip)
        reuse = plan.reuse_cached if plan.reuse_cached is not None else \
            not (plan.prefill_only or plan.num_external_tokens)
        reuse = reuse and params.prompt_logprobs is None
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
        if not self.connector().admit(req):
            self.scheduler.abort(req)  # gives the pages back (unpinned); nobody saw the request
            raise ResourceBusy(f"request {req.request_id!r}: the KV connector has no free resources for it now")
        if not plan.prefill_only:
            # one TokenMask seam (pdkv/engine/logits.py) for the grammar and token healing's
            # first tokens; closed when the request leaves (LLMEngine._left)
            grammar = params.constraint.new_mask(req.prompt_token_ids) if params.constraint is not None else None
            req.mask = join_masks(grammar, req.healing)
        self.requests[req.request_id] = req
