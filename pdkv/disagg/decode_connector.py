"""The decode side's KV connector: a prompt's KV comes from a prefill node (engine thread).

- ``admission``: a prompt of more than one token has its first n-1 tokens' KV computed
  remotely, less the whole pages this node's prefix cache holds (``req.num_cached_tokens``, a
  peek the engine made): the engine takes those cached pages, reserves pinned pages for the rest
  and parks the request in WAITING_FOR_REMOTE_KV. A one-token prompt, or one whose every page
  before its last token is cached here, runs locally (nothing to transfer: it computes its last
  token as any local request would). With no prefill node connected the request is refused,
  rather than silently colocated;
- ``admit``: reserves the request's hidden-state slot row (none free: the request waits), then
  asks the coordinator (on the event loop) to send PREFILL with the cached count and the ids of
  the pages after it (only those are granted and written);
- ``finished``: a client that left while its KV may still be arriving: the coordinator cancels
  the transfer and releases the (quarantined) pages once no write can land.

The forward-pass points are not used: once the KV landed the request decodes like any other.
"""

from __future__ import annotations

import time

from pdkv.disagg.rows import HiddenRows
from pdkv.engine.connector import LOCAL, Admission, KVConnector
from pdkv.engine.request import RequestStatus
from pdkv.errors import AdmissionRefused


class DecodeConnector(KVConnector):
    def __init__(self, coordinator, rows: HiddenRows):
        """``coordinator``: the pdkv.disagg.decode.DecodeCoordinator (event loop) it posts to."""
        self.coordinator, self.rows = coordinator, rows
        self.page_size = coordinator.engine.kv.page_size
        self._remote: set[str] = set()  # admitted with remote KV, not finished

    def admission(self, req) -> Admission:
        if req.num_prompt_tokens <= 1:
            return LOCAL  # a one-token prompt has no KV to compute before its decode
        cached = req.num_cached_tokens  # whole pages, at most n - 1 tokens
        if cached >= req.num_prompt_tokens - 1:  # every page before the last token is here
            self.coordinator.metrics.transferred(0, cached // self.page_size, 0)
            return LOCAL  # takes the cached pages when scheduled, computes the last token
        if not self.coordinator.can_route():  # a racy read is fine: a dead peer fails the request
            raise AdmissionRefused("no prefill node is connected to this decode node (it keeps dialling its "
                                   "prefill peers; retry shortly)", status=503, retry_after=2)
        return Admission(num_external_tokens=req.num_prompt_tokens - 1 - cached, reuse_cached=True)

    def admit(self, req) -> bool:
        if not req.num_external_tokens:
            return True
        row = self.rows.take()
        if row is None:
            return False
        self._remote.add(req.request_id)
        c = self.coordinator
        c.metrics.queue_admission.observe(time.perf_counter() - req.arrival)
        cached = req.num_cached_tokens  # what the engine took from the cache: only the pages after it come
        c.post(c.send_prefill, req.request_id, list(req.prompt_token_ids[:-1]),
               list(req.pages[cached // self.page_size:]), row, cached)
        return True

    def finished(self, req) -> None:
        if req.request_id not in self._remote:
            return
        self._remote.discard(req.request_id)
        if req.status == RequestStatus.ABORTED and req.finish_reason == "abort":
            # NOTE: a write may still land in its pages (the engine quarantined them if so):
            # the coordinator cancels the transfer and releases them once none can.
            self.coordinator.post(self.coordinator.client_aborted, req.request_id)
