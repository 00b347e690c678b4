"""The JSON report's schema (JSON Schema draft 2020-12), documented field by field in docs/AB.md.

``validate(report)`` raises jsonschema.ValidationError naming the path of the first bad field.
"""

from __future__ import annotations

NUM = {"type": ["number", "null"]}
DIST = {"type": "object", "required": ["p50", "p90", "p99", "mean", "max", "n"],
        "properties": {k: NUM for k in ("p50", "p90", "p99", "mean", "max")} | {"n": {"type": "integer"}}}
HIST = {"type": ["object", "null"], "required": ["count", "sum_s", "mean_s", "p50_s", "p90_s", "p99_s"]}
SUMMARY = {"type": ["object", "null"],
           "required": ["num_requests", "num_ok", "num_failed", "makespan_s", "request_throughput",
                        "prompt_tokens_per_s", "output_tokens_per_s", "ttft_s", "tpot_s", "itl_s", "e2e_s",
                        "goodput_rps", "goodput_fraction"],
           "properties": {"ttft_s": DIST, "tpot_s": DIST, "itl_s": DIST, "e2e_s": DIST,
                          "num_requests": {"type": "integer", "minimum": 1}}}
REQUEST = {"type": "object",
           "required": ["id", "row", "class", "prompt_tokens", "max_tokens", "body_sha256", "scheduled_s", "sent_s",
                        "status", "error", "ttft_s", "e2e_s", "num_tokens", "chunk_s", "chunk_tokens"],
           "properties": {"status": {"enum": ["ok", "error"]}, "class": {"enum": ["short", "long"]},
                          "body_sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                          "error": {"type": ["string", "null"]}},
           # a failed request always says why
           "if": {"properties": {"status": {"const": "error"}}},
           "then": {"properties": {"error": {"type": "string", "minLength": 1}}}}
RUN = {"type": "object",
       "required": ["arch", "rate", "offered_rate_rps", "summary", "client_overhead", "requests", "fault"],
       "properties": {
           "summary": {"type": "object", "required": ["short", "long", "all"],
                       "properties": {"short": SUMMARY, "long": SUMMARY, "all": SUMMARY}},
           "client_overhead": {"type": "object", "required": ["send_lag_s", "cpu_seconds", "cpu_per_request_ms",
                                                              "cpu_per_token_us", "parse_per_chunk_us"]},
           "server": {"type": "object", "required": ["ttft", "itl", "queue_wait", "kv_bytes_received",
                                                     "kv_bytes_sent", "kv_transfer_time"],
                      "properties": {"ttft": HIST, "itl": HIST, "queue_wait": HIST, "kv_transfer_time": HIST}},
           "resources": {"type": "object", "required": ["peak_rss_bytes", "cpu_seconds", "energy"],
                         "properties": {"energy": {"type": "object", "required": ["source", "joules", "note"],
                                                   "properties": {"source": {"enum": ["rapl", "cpu_seconds_proxy"]}}}}},
           "pools_back_to_start": {"type": "boolean"},
           "requests": {"type": "array", "minItems": 1, "items": REQUEST},
       }}
REPORT = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["schema", "argv", "machine", "model", "slo", "trace", "archs", "runs", "identical_requests",
                 "verdict"],
    "properties": {
        "schema": {"const": "pdkv.bench.ab/1"},
        "machine": {"type": "object", "required": ["cpu_model", "num_cpus", "budget_cpus", "loadavg_start"]},
        "model": {"type": "object", "required": ["path", "vocab_size", "max_position_embeddings", "weight_bytes"]},
        "slo": {"type": "object", "required": ["ttft_s", "tpot_s"]},
        "trace": {"type": "object", "required": ["source", "format", "num_requests", "rows", "length_scale",
                                                 "output_scale", "max_model_len", "clip", "num_clipped",
                                                 "time_scale"]},
        "archs": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "kind", "nodes"],
            "properties": {"kind": {"enum": ["colocated", "disagg", "endpoint"]},
                           "nodes": {"type": "array", "items": {"type": "object",
                                                                "required": ["name", "role", "cpus", "config"]}}}}},
        "runs": {"type": "array", "minItems": 1, "items": RUN},
        "identical_requests": {"type": "object", "additionalProperties": {"type": "boolean"}},
        "verdict": {"type": "object", "required": ["overall", "per_rate"],
                    "properties": {"per_rate": {"type": "array", "items": {
                        "type": "object", "required": ["rate", "choice", "text"],
                        "properties": {"choice": {"enum": ["disaggregate", "chunked", "colocated",
                                                           "inconclusive"]}}}}}},
    },
}


def validate(report: dict) -> None:
    import jsonschema

    jsonschema.validate(report, REPORT)
