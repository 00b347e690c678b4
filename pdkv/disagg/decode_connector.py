"""The decode side's KV connector: a prompt's KV comes from a prefill node (engine thread).

- ``admission``: a prompt of more than one token has its first n-1 tokens' KV computed
  remotely, less the whole pages this node's prefix cache holds (``req.num_cached_tokens``, a
  peek the engine made); a one-token prompt, or one whose every page before its last token is
  cached here, runs locally (nothing to transfer). Otherwise where the rest is prefilled is the
  chooser's ``decide`` (pdkv/disagg/choice.py: a short uncached part, every prefill node
  saturated or none connected: here, through the engine's normal chunked path, LOCAL; with
  ``disagg.local_fallback`` false no prefill node is a 503). Remote: the engine takes the cached
  pages, reserves pinned pages for the rest and parks the request in WAITING_FOR_REMOTE_KV;
- ``admission`` refuses (``Answer.refuse``) a request no prefill node can take: none connected
  without ``disagg.local_fallback`` (503), or more pages than the staging ring holds (400);
- ``admit``: counts the decision; for remote KV reserves the request's hidden-state slot row
  and, with a speculative hand-off, its proposer's pages (none free: NOT_YET, the request waits;
  with a hand-off nothing is reused from this node's cache: the proposer's cache holds no
  prefix) and the prefill node the chooser picks (none live any more: NOT_YET too, and its next
  admission decides again), then asks the coordinator (on the event loop) to send PREFILL with
  the cached count and the ids of the pages after it (only those are granted and written);
- ``finished``: a client that left while its KV may still be arriving: the coordinator cancels
  the transfer and releases the (quarantined) pages once no write can land;
- ``released``: those pages were freed: the request's proposer pages go back too, only now (a late
  write could land in them until then; pdkv/disagg/spec_handoff.py).

The forward-pass points are not used: once the KV landed the request decodes like any other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdkv.disagg.choice import Where
from pdkv.disagg.rows import HiddenRows
from pdkv.engine.connector import LOCAL, NOT_YET, RESERVE, Admission, Answer, KVConnector
from pdkv.engine.request import RequestStatus


@dataclass(frozen=True)
class RemoteAsk:
    """What a remote request's PREFILL asks beyond its KV: the speculative hand-off's proposer
    pages and held-back token, echo + logprobs' alternatives and the prompt's last token, and
    on a DP group the rank whose pool the pages are in."""

    spec_pages: tuple[int, ...] | None = None
    next_token: int | None = None
    prompt_logprobs: int | None = None
    last_token: int | None = None
    priority: int = 0  # the request's (scheduler.policy: priority), for the prefill node's order
    dp_rank: int | None = None  # a DP group's rank that decodes it (its region alone is granted)


class DecodeConnector(KVConnector):
    def __init__(self, coordinator, rows: HiddenRows, landing=None, page_size: int = 0, spec=None):
        """``coordinator``: the pdkv.disagg.decode.DecodeCoordinator (event loop) it posts to;
        ``landing``: its pdkv.disagg.staged_decode.Landing when the KV is staged (None: direct);
        ``spec``: the speculative hand-off's pdkv.disagg.spec_handoff.DecodeHandoff (None: none)."""
        self.coordinator, self.rows, self.spec = coordinator, rows, spec
        self.landing, self.page_size = landing, page_size or coordinator.engine.kv.page_size
        self._remote: set[str] = set()  # admitted with remote KV, not finished
        # NOTE: the engine calls admit right after admission for the same request, on this thread
        # (a failed reservation in between calls admission again): one decision in flight at a time
        self._decided: tuple[str, Where] | None = None

    def admission(self, req) -> Admission | Answer:
        rid = req.request_id
        if req.num_prompt_tokens <= 1:
            self._decided = (rid, Where.LOCAL_SHORT)
            return LOCAL  # a one-token prompt has no KV to compute before its decode
        cached = self._cached(req)  # whole pages, at most n - 1 tokens
        if cached >= req.num_prompt_tokens - 1:  # every page before the last token is here
            self._decided = (rid, Where.LOCAL_SHORT)
            self.coordinator.metrics.transferred(0, cached // self.page_size, 0)
            return LOCAL  # takes the cached pages when scheduled, computes the last token
        where = self.coordinator.chooser.decide(req.num_prompt_tokens, cached)
        self._decided = (rid, where)
        if where is Where.REFUSED_NO_PEER:
            self.coordinator.metrics.decided(where)  # final: admit never runs for it
            return Answer.refuse("no prefill node is connected to this decode node (it keeps dialling its "
                                 "prefill peers; retry shortly; disagg.local_fallback is false)",
                                 status=503, retry_after=2)
        slo = getattr(self.coordinator, "ttft", None)  # server.admission (pdkv/fleet/admission.py)
        if where is Where.REMOTE and slo is not None and slo.shed:
            short = slo.over_budget(self.coordinator.chooser.least_queue() + req.num_prompt_tokens - cached)
            if short is not None and self.coordinator.cfg.disagg.local_fallback:
                where = Where.LOCAL_SLO
                self._decided = (rid, where)
            elif short is not None:
                self._decided = (rid, Where.REFUSED_SLO)
                self.coordinator.metrics.decided(Where.REFUSED_SLO)  # final: admit never runs for it
                return Answer.refuse(f"the expected time to first token is {short * 1000:.0f} ms over this "
                                     f"node's budget (server.ttft_slo_ms {slo.slo_s * 1000:.0f}); retry shortly",
                                     status=503, retry_after=slo.retry_after(short))
        if where is not Where.REMOTE:
            return LOCAL  # prefilled here, chunked like colocated
        landing = self.landing
        if landing is not None:  # staged: every page sent needs a landing slot at once
            need = -(-req.num_prompt_tokens // self.page_size) - cached // self.page_size
            if need > landing.num_slots:
                return Answer.refuse(f"the prompt's KV needs {need} staging slots and this decode node's "
                                     f"ring has {landing.num_slots} (messenger.staging_mib); send a shorter "
                                     "prompt", status=400)
        return Admission(num_external_tokens=req.num_prompt_tokens - 1 - cached, reuse_cached=self.spec is None)

    def _cached(self, req) -> int:
        """The leading tokens this node's cache gives the request: none with a speculative
        hand-off (the prefill node streams the proposer's KV for every position it computes)."""
        return 0 if self.spec is not None else req.num_cached_tokens

    def admit(self, req) -> Answer:
        c = self.coordinator
        decided, self._decided = self._decided, None
        where = decided[1] if decided is not None and decided[0] == req.request_id else Where.LOCAL_SHORT
        if not req.num_external_tokens:
            c.metrics.decided(where)
            return RESERVE
        row = self.rows.take()
        if row is None:
            return NOT_YET
        cached = self._cached(req)  # what the engine took from the cache: only the pages after it come
        sent = list(req.pages[cached // self.page_size:])
        landing = self.landing
        if landing is not None and not landing.reserve(req.request_id, len(sent)):
            self.rows.give_back(row)  # the ring is full: the request waits (bounded staging memory)
            return NOT_YET
        spec_pages = next_token = None
        if self.spec is not None:  # the proposer's pages for the KV the prefill node streams into them
            spec_pages = self.spec.reserve(req.request_id, req.num_external_tokens)
            if spec_pages is None:
                self.rows.give_back(row)
                return NOT_YET
            spec_pages, next_token = tuple(spec_pages), req.prompt_token_ids[-1]
        tokens = list(req.prompt_token_ids[:-1])
        lps = req.params.prompt_logprobs  # not None: the prefill node's forward computes them
        ask = None
        if spec_pages is not None or lps is not None or req.priority:
            ask = RemoteAsk(spec_pages, next_token, lps, req.prompt_token_ids[-1] if lps is not None else None,
                            req.priority)
        peer = c.chooser.pick(tokens)
        if peer is None:  # every prefill node died since admission: decide again next time
            self.rows.give_back(row)
            if landing is not None:
                landing.release(req.request_id)
            if self.spec is not None:
                self.spec.release(req.request_id)  # nothing was sent: no write can land
            return NOT_YET
        c.metrics.decided(Where.REMOTE)
        self._remote.add(req.request_id)
        c.metrics.queue_admission.observe(time.perf_counter() - req.arrival)
        # the coordinator wraps the row (and the landing slots, the grants, the pages) in the
        # request's Reservation (pdkv/disagg/reservation.py): from there on one release ends them
        c.post(c.send_prefill, req.request_id, tokens, sent, row, peer, cached, ask)
        return RESERVE

    def finished(self, req) -> None:
        if req.request_id not in self._remote:
            return
        self._remote.discard(req.request_id)
        if self.spec is not None:
            self.spec.finished(req.request_id)
        if req.status == RequestStatus.ABORTED and req.finish_reason == "abort":
            # NOTE: a write may still land in its pages (the engine quarantined them if so):
            # the coordinator cancels the transfer and releases them once none can.
            self.coordinator.post(self.coordinator.client_aborted, req.request_id)

    def released(self, request_id: str) -> None:
        if self.spec is not None:  # no write of it can land any more
            self.spec.release(request_id)
