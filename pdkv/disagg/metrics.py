"""Disaggregation metrics, registered in a node's own Prometheus registry (server.metrics).

Both clocks are the same host's on loopback; across hosts ``exposed transfer`` compares the
prefill node's wall clock (stamped in DONE_AT) with the decode node's, so it is only as good as
their clock sync (NTP/PTP): the assumption is documented, not hidden.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

WHERE = ("remote", "local_short", "local_saturated", "local_no_peer", "refused_no_peer",  # choice.Where values
         "local_slo", "refused_slo")
RETRY_CAUSES = ("peer_dead", "granting")
_T = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class DisaggMetrics:
    def __init__(self, registry, model_name: str, role: str):
        lab = ["model_name", "role"]

        def h(name, doc):
            return Histogram(name, doc, lab, buckets=_T, registry=registry).labels(model_name, role)

        def c(name, doc):
            return Counter(name, doc, lab, registry=registry).labels(model_name, role)

        def g(name, doc):
            return Gauge(name, doc, lab, registry=registry).labels(model_name, role)

        self.kv_bytes = c("pdkv_kv_transfer_bytes", "KV-cache and hidden-state bytes sent (prefill) or "
                                                   "received (decode).")
        # prefix caching across the pair: the pages the decode node held already are not sent
        self.kv_pages = c("pdkv_kv_transfer_pages", "Prompt KV pages sent (prefill) or received (decode); each "
                                                   "page once, whatever the layers and ranks it spans.")
        self.kv_pages_skipped = c("pdkv_kv_transfer_pages_skipped", "Prompt KV pages not transferred because the "
                                                                   "decode node's prefix cache held them already.")
        self.kv_writes = c("pdkv_kv_transfer_writes", "Immediate-carrying writes completed without error "
                                                     "(prefill) or landed and counted (decode): page writes "
                                                     "per layer and shard pair, plus the hidden-state row.")
        self.transfer_time = h("pdkv_kv_transfer_seconds", "Per request: first write queued (prefill) or "
                                                          "PREFILL sent (decode) to all writes done / landed.")
        self.exposed_transfer = h("pdkv_kv_transfer_exposed_seconds", "End of the last prefill forward to "
                                                                      "the decode node seeing the KV ready.")
        self.failures = Counter("pdkv_kv_transfer_failures", "Requests whose transfer failed, by reason.",
                                lab + ["reason"], registry=registry)
        self._lab = (model_name, role)
        self.queue_admission = h("pdkv_queue_admission_seconds", "Decode: arrival to pages reserved.")
        self.queue_prefill = h("pdkv_queue_prefill_seconds", "Prefill: PREFILL received to first chunk "
                                                             "computed (queue wait on the prefill node).")
        self.ttft_transfer = h("pdkv_ttft_remote_seconds", "Decode: PREFILL sent to the KV landed (prefill "
                                                           "queue + compute + transfer, as seen by decode).")
        self.pages_pinned = g("pdkv_kv_pages_pinned_remote", "Pages reserved for remote writes or held "
                                                            "until a peer quiesced.")
        self.grants = c("pdkv_kv_grants", "Decode: ranges granted to prefill peers, one per KV rank, layer and run "
                                          "of pages plus the hidden row (verbs: MRs registered).")
        self.grant_time = h("pdkv_kv_grant_seconds", "Decode: granting one request's ranges (verbs: "
                                                     "registering its MRs).")
        # staged nodes only (pdkv/disagg/staged.py): the ring's slots in use, and (prefill) the
        # copies waiting for a free slot -- the backpressure, visible
        self.staging_slots = g("pdkv_kv_staging_slots_in_use", "Staging ring slots held (copying, waiting "
                                                               "for their writes, or reserved as landing zones).")
        self.staging_waiting = g("pdkv_kv_staging_copies_waiting", "Prefill: staging copies waiting for a "
                                                                   "free ring slot.")
        for reason in ("timeout", "peer_dead", "prefill_failed", "cancelled", "write_error", "grant_limit",
                       "staging_copy"):
            self.failures.labels(*self._lab, reason)
        self.decisions = Counter("pdkv_disagg_prefill_decisions", "Decode: where each prompt was prefilled "
                                 "(remote, or here: local_short, local_saturated, local_no_peer; "
                                 "refused_no_peer: a 503, disagg.local_fallback false; server.admission shed: "
                                 "local_slo, refused_slo: expected TTFT over server.ttft_slo_ms).",
                                 lab + ["where"], registry=registry)
        self.prefill_retries = Counter("pdkv_disagg_prefill_retries", "Decode: prefills given up on a dead prefill "
                                       "node and done again (disagg.prefill_retries), by cause: peer_dead (it died "
                                       "mid-transfer), granting (it died while the pages were granted to it); "
                                       "to: remote (another prefill node), local (here, none other live).",
                                       lab + ["cause", "to"], registry=registry)
        if role == "decode":
            for cause in RETRY_CAUSES:
                for to in ("remote", "local"):
                    self.prefill_retries.labels(*self._lab, cause, to)
            for where in WHERE:
                self.decisions.labels(*self._lab, where)

    def transferred(self, pages: int, skipped: int, writes: int) -> None:
        self.kv_pages.inc(pages)
        self.kv_pages_skipped.inc(skipped)
        self.kv_writes.inc(writes)

    def failed(self, reason: str) -> None:
        self.failures.labels(*self._lab, reason).inc()

    def retried(self, cause: str, to: str = "remote") -> None:
        """A prefill done again (``cause`` a RETRY_CAUSES value) on another prefill node or here."""
        self.prefill_retries.labels(*self._lab, cause, to).inc()

    def decided(self, where) -> None:
        """A prefill decision (pdkv.disagg.choice.Where) for one request."""
        self.decisions.labels(*self._lab, where.value).inc()
