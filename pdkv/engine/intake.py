"""The engine's intake: a new request checked and submitted, then admitted (engine thread).

Every request goes through the same two steps. ``submit`` checks the prompt (``check_prompt``;
``validate`` is the full check of a request that samples, pure, so the server calls it from the
event loop before submitting anything) and queues the request in the scheduler's ``pending``
queue. ``reserve`` is admission, one try, called by ``Scheduler.admit`` for the request at the
head: it asks the KV connector (pdkv/engine/connector.py) what to reserve — all local, KV from
elsewhere (``num_external_tokens``) or prefill only — takes those pages from the scheduler, lets
the connector reserve its own per-request resources, and answers with a typed Answer: RESERVE,
NOT_YET (pages or a connector resource not free: nothing kept, the request keeps its place) or a
refusal (final: the connector's, or whatever check raised).

Before the connector is asked, ``req.num_cached_tokens`` holds what the local prefix cache has
of the prompt (a peek: whole pages, at most all but the last token); whether the request really
takes those pages is the connector's ``Admission.reuse_cached``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdkv.engine.connector import NOT_YET, RESERVE, Answer, KVConnector, Verdict
from pdkv.engine.logits import join_masks
from pdkv.engine.params import SamplingParams
from pdkv.engine.request import Request, RequestStatus
from pdkv.errors import InvalidRequest


class Intake:
    def __init__(self, tokenizer, scheduler, allocator, vocab_size: int, max_model_len: int, page_size: int,
                 connector: Callable[[], KVConnector], requests: dict[str, Request], held: dict):
        """``connector``: the engine's current KV connector (it may be replaced before the first
        request); ``requests`` / ``held``: the engine's live requests and held pages (an id in
        either is in use), the same dicts, not copies: a submitted request is added to ``requests``."""
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

    def check_priority(self, priority) -> None:
        """Pure: ``priority`` must be an integer, and 0 unless the scheduler's policy is
        ``priority`` (vLLM refuses a non-zero priority without priority scheduling too)."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequest(f"priority must be an integer, got {priority!r} ({type(priority).__name__})")
        policy = self.scheduler.policy.name
        if priority != 0 and policy != "priority":
            raise InvalidRequest(f"priority {priority} needs priority scheduling: this server's "
                                 f"scheduler.policy is {policy} (give 0 or leave it out)")

    # ---- submission and admission ---------------------------------------------------------------
    def submit(self, request_id: str, prompt, params: SamplingParams, arrival: float | None,
               priority: int = 0) -> Request:
        self.check_priority(priority)
        req = self._new_request(request_id, prompt, params, arrival)
        self.check_prompt(req.prompt_token_ids, 0)  # before hashing it
        req.priority = priority
        self.scheduler.submit(req)
        self.requests[req.request_id] = req  # an id in use from now on; pending until admitted
        return req

    def reserve(self, req: Request) -> Answer:
        """One admission try for ``req`` (Scheduler.admit): reserves what the connector asks for
        and answers; anything but RESERVE leaves nothing reserved."""
        try:
            answer = self._reserve(req)
        except Exception as e:  # noqa: BLE001 - a check or the connector refused: the client hears why
            answer = Answer.refused_by(e)
        if answer.verdict is not Verdict.RESERVE and req.status is not RequestStatus.PENDING:
            self.scheduler.unreserve(req)  # pages back (unpinned); nobody saw the request
        if answer.verdict is Verdict.REFUSE:
            self.requests.pop(req.request_id, None)
        return answer

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

    def _reserve(self, req: Request) -> Answer:
        ids, params = req.prompt_token_ids, req.params
        # Prompt logprobs need every prompt position's logits: nothing is taken from the cache.
        req.num_cached_tokens = 0 if params.prompt_logprobs is not None else self.scheduler.cached_prefix(req)
        plan = self.connector().admission(req)
        if isinstance(plan, Answer):
            return plan
        if plan.prefill_only:
            self.check_prompt(ids, 0)
        else:
            self.validate(ids, params)
            # Any integer is a valid seed (negative too): fold it into the generator's 64-bit range.
            req.generator = torch.Generator().manual_seed(params.seed & (2**64 - 1)) if params.seed is not None else None
            skip = req.healing.healing.removed_text if req.healing is not None else ""
            resume = params.resume
            if resume is not None:  # the detokenizer as the first node's was after these tokens
                skip = resume.skip_prefix
            req.detok = self.tokenizer.detokenizer(ids[:resume.prompt_len] if resume is not None else ids,
                                                   params.stop, params.skip_special_tokens, skip_prefix=skip)
            if resume is not None:
                for t in req.resumed_ids:
                    req.detok.add(t)
                req.detok.sent = min(resume.sent_chars, len(req.detok.text))
                # the seeded generator needs nothing: each draw is seeded from its position
        reuse = plan.reuse_cached if plan.reuse_cached is not None else \
            not (plan.prefill_only or plan.num_external_tokens)
        reuse = reuse and params.prompt_logprobs is None
        req.reuse_cache = reuse
        num_cached = req.num_cached_tokens if reuse else 0
        req.num_cached_tokens = num_cached
        if plan.prefill_only:
            if not self.scheduler.add_prefill(req, num_cached):
                return NOT_YET  # pages not free: nothing changed
        elif plan.num_external_tokens:
            if not self.scheduler.add_remote(req, plan.num_external_tokens, num_cached):
                return NOT_YET
        else:
            self.scheduler.add(req)  # a local request takes its cached pages when scheduled
        cache = self.scheduler.cache
        if cache is not None and reuse and (plan.prefill_only or plan.num_external_tokens):
            cache.record_query(req.num_prompt_tokens, num_cached)
        if not plan.prefill_only:
            # one TokenMask seam (pdkv/engine/logits.py) for the grammar and token healing's
            # first tokens; closed when the request leaves (LLMEngine._left), or below if it is
            # not admitted now (healing's part holds nothing: joined again at the next try)
            grammar = None
            if params.constraint is not None:
                resumed = req.resumed_ids
                grammar = params.constraint.new_mask(req.prompt_token_ids[:len(ids) - len(resumed)])
                for t in resumed:  # a resume: the matcher is where the first node's was (the
                    grammar.accept(t)  # server checked that the tokens follow it, pdkv/server/generate.py)
            req.mask = join_masks(grammar, req.healing)
        try:
            answer = self.connector().admit(req)
        except BaseException:
            self._close_mask(req)
            raise
        if answer.verdict is not Verdict.RESERVE:
            self._close_mask(req)
        return answer

    @staticmethod
    def _close_mask(req: Request) -> None:
        if req.mask is not None:
            req.mask.close()
            req.mask = None
