"""The decode side's KV connector: a prompt's KV comes from a prefill node (engine thread).

- ``admission``: a prompt of more than one token has its first n-1 tokens' KV computed
  remotely: the engine reserves pinned pages for them and parks the request in
  WAITING_FOR_REMOTE_KV (a one-token prompt runs locally; with no prefill node connected the
  request is refused, rather than silently colocated);
- ``admit``: reserves the request's hidden-state slot row (none free: the request waits), then
  asks the coordinator (on the event loop) to send PREFILL with the page ids;
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
    def __init__(self, coordinator, rows: HiddenRows, landing=None, page_size: int = 0):
        """``coordinator``: the pdkv.disagg.decode.DecodeCoordinator (event loop) it posts to;
        ``landing``: its pdkv.disagg.staged_decode.Landing when the KV is staged (None: direct)."""
        self.coordinator, self.rows = coordinator, rows
        self.landing, self.page_size = landing, page_size
        self._remote: set[str] = set()  # admitted with remote KV, not finished

    def admission(self, req) -> Admission:
        if req.num_prompt_tokens <= 1:
            return LOCAL  # a one-token prompt has no KV to compute before its decode
        if not self.coordinator.can_route():  # a racy read is fine: a dead peer fails the request
            raise AdmissionRefused("no prefill node is connected to this decode node (it keeps dialling its "
                                   "prefill peers; retry shortly)", status=503, retry_after=2)
        landing = self.landing
        if landing is not None:  # staged: every page needs a landing slot at once
            need = -(-req.num_prompt_tokens // self.page_size)
            if need > landing.num_slots:
                raise AdmissionRefused(f"the prompt's KV needs {need} staging slots and this decode node's ring has "
                                       f"{landing.num_slots} (messenger.staging_mib); send a shorter prompt",
                                       status=400)
        return Admission(num_external_tokens=req.num_prompt_tokens - 1)

    def admit(self, req) -> bool:
        if not req.num_external_tokens:
            return True
        row = self.rows.take()
        if row is None:
            return False
        landing = self.landing
        if landing is not None and not landing.reserve(req.request_id, len(req.pages)):
            self.rows.give_back(row)  # the ring is full: the request waits (bounded staging memory)
            return False
        self._remote.add(req.request_id)
        c = self.coordinator
        c.metrics.queue_admission.observe(time.perf_counter() - req.arrival)
        c.post(c.send_prefill, req.request_id, list(req.prompt_token_ids[:-1]), list(req.pages), row)
        return True

    def finished(self, req) -> None:
        if req.request_id not in self._remote:
            return
        self._remote.discard(req.request_id)
        if req.status == RequestStatus.ABORTED and req.finish_reason == "abort":
            # NOTE: a write may still land in its pages (the engine quarantined them if so):
            # the coordinator cancels the transfer and releases them once none can.
            self.coordinator.post(self.coordinator.client_aborted, req.request_id)
