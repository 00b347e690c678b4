"""Prometheus metrics of one server, in the vocabulary users of vLLM/SGLang dashboards know.

Each app owns its own ``CollectorRegistry`` (not prometheus-client's global one) so several
servers in one process — tests start many — never clash. The engine thread records latencies
and sets the gauges; the ``/metrics`` handler only renders. prometheus-client's metric objects
are thread-safe, so no extra lock is needed.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets (seconds): from sub-millisecond decode steps on a GPU to long CPU prefills.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0)


class ServerMetrics:
    """All metrics of one server; ``render()`` gives the Prometheus text exposition."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.engine_stats: dict = {}
        self.model_name = model_name
        self._dp_gauges = None  # per data-parallel rank, made on a group's first stats
        labels = ["model_name"]
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        self.time_to_first_token = hist("pdkv_time_to_first_token_seconds",
                                        "Arrival of a request to its first generated token.", _TTFT_BUCKETS)
        self.inter_token_latency = hist("pdkv_inter_token_latency_seconds",
                                        "Time between two consecutive generated tokens of one request "
                                        "(tokens delivered together: the delta's gap, then 0 each).",
                                        _ITL_BUCKETS)
        self.queue_wait = hist("pdkv_request_queue_time_seconds",
                               "Arrival of a request to the first engine step that schedules it.", _TTFT_BUCKETS)
        self.e2e_latency = hist("pdkv_e2e_request_latency_seconds",
                                "Arrival of a request to its last token.", _E2E_BUCKETS)
        self.num_running = gauge("pdkv_num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("pdkv_num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_pages_used = gauge("pdkv_kv_cache_pages_used", "KV cache pages held by requests.")
        self.kv_pages_total = gauge("pdkv_kv_cache_pages_total", "KV cache pages in the pool.")
        self.kv_usage = gauge("pdkv_kv_cache_usage_ratio", "Share of KV cache pages in use (0..1).")
        self.prompt_tokens = counter("pdkv_prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("pdkv_generation_tokens", "Generated tokens.")
        # vLLM's prefix cache counters, in tokens: each lookup's request tokens and those found cached
        self.prefix_cache_queries = counter("pdkv_prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("pdkv_prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._prefix_seen = (0, 0)  # the engine's totals at the last copy (counters only go up)
        self._finished = Counter("pdkv_request_success", "Finished requests by finish reason.",
                                 labels + ["finished_reason"], registry=r)
        # Speculative decoding (vLLM's vllm:spec_decode_*): counters follow the engine's totals.
        self.spec_num_drafts = counter("pdkv_spec_decode_num_drafts",
                                       "Verification steps of a request that had at least one draft.")
        self.spec_num_draft_tokens = counter("pdkv_spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_num_accepted_tokens = counter("pdkv_spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_per_pos = Counter("pdkv_spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted at each draft position (0 = the first draft).",
                                     labels + ["position"], registry=r)
        self.spec_accepted_length = hist("pdkv_spec_decode_accepted_length",
                                         "Tokens one verification step emitted (accepted drafts + 1).",
                                         tuple(float(i) for i in range(1, 18)))
        self._spec_seen: dict = {}
        self._model_name = model_name
        for reason in ("stop", "length", "abort", "error"):  # visible at 0 before the first one
            self._finished.labels(model_name, reason)

    def tokens_delivered(self, gap: float | None, n: int) -> None:
        """ITL accounting of one delta of ``n`` tokens that arrived ``gap`` seconds after the
        request's previous token (None: the delta that carries the first token, whose wait is
        TTFT). Per token: every token after a request's first contributes one gap, the delta's
        first its whole gap and the others 0 (they arrived with it), so count = tokens - 1 per
        request and sum = first-to-last-token time, with or without speculative decoding, and a
        stalled step shows as one long gap, not smeared over the tokens it carried. This is the
        A/B harness's client-side definition (pdkv/bench/ab/metrics.py ``itl_gaps``), so its
        exact-count agreement holds when chunks carry several tokens.

        vLLM differs: ``vllm:inter_token_latency_seconds`` gets one observation per engine step
        that gave the request tokens (vllm/v1/metrics/stats.py ``IterationStats
        .update_from_output``: the whole gap since the last step, however many tokens), and its
        per-token view is the per-request ``vllm:request_time_per_output_token_seconds``
        (decode time / (tokens - 1)). Without speculation (one token per step after the first)
        the two count alike."""
        if n <= 0:
            return
        if gap is not None:
            self.inter_token_latency.observe(gap)
        for _ in range(n - 1):
            self.inter_token_latency.observe(0.0)

    def request_finished(self, reason: str | None) -> None:
        self._finished.labels(self._model_name, reason or "unknown").inc()

    def set_engine_stats(self, stats: dict) -> None:
        """Copy the engine's ``stats()`` (num_running, num_waiting, num_pages_*) into the gauges."""
        self.engine_stats = stats  # the last copy, for gauges of other parts (read, never mutated)
        self.num_running.set(stats.get("num_running", 0))
        self.num_waiting.set(stats.get("num_waiting", 0))
        used, total = stats.get("num_pages_used", 0), stats.get("num_pages_total", 0)
        self.kv_pages_used.set(used)
        self.kv_pages_total.set(total)
        self.kv_usage.set(used / total if total else 0.0)
        queries, hits = stats.get("prefix_cache_queries", 0), stats.get("prefix_cache_hits", 0)
        self.prefix_cache_queries.inc(max(0, queries - self._prefix_seen[0]))
        self.prefix_cache_hits.inc(max(0, hits - self._prefix_seen[1]))
        self._prefix_seen = (queries, hits)
        if "spec_num_drafts" in stats:
            self._spec(stats)
        if "ranks" in stats:  # a data-parallel group (pdkv/dp): the gauges above are summed; each rank's too
            self._dp_ranks(stats["ranks"])

    def _dp_ranks(self, ranks: list[dict]) -> None:
        if self._dp_gauges is None:
            names = {"num_running": "Requests running on this data-parallel rank",
                     "num_waiting": "Requests waiting on this data-parallel rank",
                     "num_pages_used": "KV pages in use on this data-parallel rank",
                     "num_pages_total": "KV pages of this data-parallel rank"}
            self._dp_gauges = {k: Gauge(f"pdkv_dp_rank_{k}", doc, ["model_name", "dp_rank"], registry=self.registry)
                               for k, doc in names.items()}
        for r, st in enumerate(ranks):
            for k, g in self._dp_gauges.items():
                g.labels(self.model_name, str(r)).set(st.get(k, 0))

    def _spec(self, stats: dict) -> None:
        """Counters advance by what the engine's totals grew since the last copy."""
        seen = self._spec_seen

        def grow(key: str, counter) -> None:
            delta = stats[key] - seen.get(key, 0)
            if delta > 0:
                counter.inc(delta)

        grow("spec_num_drafts", self.spec_num_drafts)
        grow("spec_num_draft_tokens", self.spec_num_draft_tokens)
        grow("spec_num_accepted_tokens", self.spec_num_accepted_tokens)
        last = seen.get("spec_num_accepted_tokens_per_pos") or []
        for i, n in enumerate(stats["spec_num_accepted_tokens_per_pos"]):
            delta = n - (last[i] if i < len(last) else 0)
            self._spec_per_pos.labels(self._model_name, str(i)).inc(max(0, delta))
        last = seen.get("spec_accepted_length_counts") or []
        for length, n in enumerate(stats["spec_accepted_length_counts"]):
            for _ in range(n - (last[length] if length < len(last) else 0)):
                self.spec_accepted_length.observe(length)
        self._spec_seen = {k: (list(v) if isinstance(v, list) else v) for k, v in stats.items()
                           if k.startswith("spec_")}

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
