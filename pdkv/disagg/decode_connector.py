"""The decode side's KV connector: a prompt's KV comes from a prefill node (engine thread).

- ``admission``: a prompt of more than one token has its first n-1 tokens' KV computed
  remotely: the engine reserves pinned pages for them and parks the request in
  WAITING_FOR_REMOTE_KV (a one-token prompt runs locally; with no prefill node connected the
  request is refused, rather than silently colocated);
- ``admit``: reserves the request's hidden-state slot row and, with a speculative hand-off,
  its proposer's pages (none free: the request waits), then asks the coordinator (on the event
  loop) to send PREFILL with the page ids;
- ``finished``: a client that left while its KV may still be arriving: the coordinator cancels
  the transfer and releases the (quarantined) pages once no write can land;
- ``released``: those pages were freed: the request's proposer pages go back too, only now (a late
  write could land in them until then; pdkv/disagg/spec_handoff.py).

The forward-pass points are not used: once the KV landed the request decodes like any other.
"""

from __future__ import annotations

import time

from pdkv.disagg.rows import HiddenRows
from pdkv.engine.connector import LOCAL, Admission, KVConnector
from pdkv.engine.request import RequestStatus
from pdkv.errors import AdmissionRefused


class DecodeConnector(KVConnector):
    def __init__(self, coordinator, rows: HiddenRows, spec=None):
        """``coordinator``: the pdkv.disagg.decode.DecodeCoordinator (event loop) it posts to;
        ``spec``: the speculative hand-off's pdkv.disagg.spec_handoff.DecodeHandoff (None: none)."""
        self.coordinator, self.rows, self.spec = coordinator, rows, spec
        self._remote: set[str] = set()  # admitted with remote KV, not finished

    def admission(self, req) -> Admission:
        if req.num_prompt_tokens <= 1:
            return LOCAL  # a one-token prompt has no KV to compute before its decode
        if not self.coordinator.can_route():  # a racy read is fine: a dead peer fails the request
            raise AdmissionRefused("no prefill node is connected to this decode node (it keeps dialling its "
                                   "prefill peers; retry shortly)", status=503, retry_after=2)
        return Admission(num_external_tokens=req.num_prompt_tokens - 1)

    def admit(self, req) -> bool:
        if not req.num_external_tokens:
            return True
        row = self.rows.take()
        if row is None:
            return False
        spec = ()
        if self.spec is not None:  # the proposer's pages for the KV the prefill node streams into them
            spec_pages = self.spec.reserve(req.request_id, req.num_external_tokens)
            if spec_pages is None:
                self.rows.give_back(row)
                return False
            spec = ({"spec_pages": list(spec_pages), "next_token": req.prompt_token_ids[-1]},)
        self._remote.add(req.request_id)
        c = self.coordinator
        c.metrics.queue_admission.observe(time.perf_counter() - req.arrival)
        c.post(c.send_prefill, req.request_id, list(req.prompt_token_ids[:-1]), list(req.pages), row, *spec)
        return True

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
