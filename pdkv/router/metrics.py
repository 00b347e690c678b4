"""The router's own Prometheus metrics: per-node requests, outcomes and latencies, node health,
and how each node was chosen (affinity kept or given up for load)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("pdkv_router_requests_total", "Requests proxied, by node and outcome "
                                "(ok: the node answered < 500; error: it answered >= 500; failed: the "
                                "connection to it failed or broke mid-stream)", ["node", "outcome"], registry=r)
        self.first_byte = Histogram("pdkv_router_time_to_first_byte_seconds", "Request in -> the node's first "
                                    "response byte", ["node"], buckets=_BUCKETS, registry=r)
        self.latency = Histogram("pdkv_router_request_seconds", "Request in -> the node's last byte sent on",
                                 ["node"], buckets=_BUCKETS, registry=r)
        self.choices = Counter("pdkv_router_choices_total", "How nodes were chosen (affine: the prefix's "
                               "node; overloaded: affine node over the load bound)", ["choice"], registry=r)
        self.healthy = Gauge("pdkv_router_node_healthy", "1 while the node is in", ["node"], registry=r)
        self.load = Gauge("pdkv_router_node_load", "The node's load as the router sees it", ["node"], registry=r)
        self.in_flight = Gauge("pdkv_router_node_in_flight", "Requests the router has in flight to the node",
                               ["node"], registry=r)
        self.migrations = Counter("pdkv_router_migrations_total", "Streams moved to another node mid-generation, "
                                  "by cause (node_failed: its connection broke; stream_cut: it ended without "
                                  "[DONE]; node_error: it sent an error event) and result (ok, failed)",
                                  ["cause", "result"], registry=r)
        self.retries = Counter("pdkv_router_retries_total", "Requests sent again before anything reached the "
                               "client, by cause (draining: the node refused as draining; unavailable: it "
                               "answered 503)", ["cause"], registry=r)
        self.no_node = Counter("pdkv_router_no_healthy_node_total", "Requests answered 503: no node was in",
                               registry=r)

    def observe_node(self, node) -> None:
        self.healthy.labels(node.url).set(1 if node.healthy else 0)
        self.load.labels(node.url).set(node.load)
        self.in_flight.labels(node.url).set(node.in_flight)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
