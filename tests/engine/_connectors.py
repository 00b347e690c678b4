"""Small KV connectors for engine tests that need KV from outside or prefill-only requests:
the same admission path the disaggregated connectors (pdkv/disagg) take, without a peer."""

from __future__ import annotations

from pdkv.engine.connector import LOCAL, Admission, KVConnector


class RemoteKV(KVConnector):
    """Requests whose id is in ``ids`` (all when None) get the prompt's KV from outside: pinned
    pages for all but the last prompt token, WAITING_FOR_REMOTE_KV until ``remote_kv_ready``.
    ``reuse_cached``: the locally cached prefix is taken and only the pages after it are filled."""

    def __init__(self, ids=None, reuse_cached: bool = False):
        self.ids, self.reuse_cached = ids, reuse_cached

    def admission(self, req):
        if self.ids is not None and req.request_id not in self.ids:
            return LOCAL
        cached = req.num_cached_tokens if self.reuse_cached else 0
        return Admission(num_external_tokens=req.num_prompt_tokens - 1 - cached, reuse_cached=self.reuse_cached)


class PrefillOnly(KVConnector):
    """Every request is prefill-only (a prefill node's): its KV computed, never sampled, pages
    held after the last chunk until ``release``; ``reuse_cached``: the cached prefix is taken."""

    def __init__(self, reuse_cached: bool = False):
        self.reuse_cached = reuse_cached

    def admission(self, req):
        return Admission(prefill_only=True, reuse_cached=self.reuse_cached)


def remote_pages(engine, request_id: str) -> list[int]:
    """The pages a remote prefill fills for an admitted RemoteKV request (after its cached prefix)."""
    req = engine.requests[request_id]
    return req.pages[req.num_cached_tokens // engine.kv.page_size:]
