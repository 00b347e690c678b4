"""The decode connector of a node whose engine is a data-parallel group (pdkv/dp/group.py): the
group's front calls it in the engine thread, the ranks' own connectors
(pdkv/dp/remote.py RankRemoteConnector) do the page reservation on the one rank that decodes
the request.

- ``route``: at placement (the group chose the rank by load and prefix affinity): whether the
  prompt is prefilled remotely (the chooser's ``decide``, as DecodeConnector's admission; with
  no prefill node and no local fallback the request still goes "remote" and ``send_prefill``
  fails it with the 503 the TP path gives);
- ``reserved``: the rank admitted the request and pinned its uncached pages: a hidden-state row
  (the front's, none free: a 503), the prefill peer, and the coordinator's ``send_prefill`` with
  the rank (``RemoteAsk.dp_rank``) and the request's priority (the prefill node's order, as
  DecodeConnector sends it): the grants are made on that rank's KV region alone and PREFILL
  names the rank and carries those ranges' keys;
- ``finished``: a client that left while its KV may still arrive: the transfer is cancelled and
  its pages released once no write can land (as DecodeConnector.finished).
"""

from __future__ import annotations

from pdkv.disagg.choice import Where
from pdkv.disagg.decode_connector import RemoteAsk
from pdkv.engine.loop import FailRequest, ReleasePages


class DPDecodeConnector:
    def __init__(self, coordinator):
        self.coordinator = coordinator

    def route(self, num_prompt_tokens: int) -> bool:
        c = self.coordinator
        where = c.chooser.decide(num_prompt_tokens, 0)
        if where is Where.REMOTE or where is Where.REFUSED_NO_PEER:
            return True
        c.metrics.decided(where)
        return False

    def reserved(self, rid: str, rank: int, prompt: list[int], cached: int, pages: list[int],
                 priority: int = 0) -> None:
        c = self.coordinator
        row = c.rows.take()
        if row is None:  # every row is in flight: bounded like any remote request's resources
            c.commands(FailRequest(rid, "every hidden-state row of this decode node is in use by a transfer; "
                                        "retry shortly", 503, 2))
            c.commands(ReleasePages(rid))  # nothing was sent: no write can land
            return
        tokens = list(prompt[:-1])
        c.metrics.decided(Where.REMOTE)
        c.post(c.send_prefill, rid, tokens, pages, row, c.chooser.pick(tokens), cached,
               RemoteAsk(priority=priority, dp_rank=rank))

    def finished(self, rid: str, reason: str) -> None:
        if reason == "abort":
            self.coordinator.post(self.coordinator.client_aborted, rid)

    def group_failed(self, error) -> None:
        pass  # its final "error" outputs end the requests, as any failed request ends
