"""The nodes' own view of a replay, and how well the client's view agrees with it.

``numbers`` turns /metrics deltas (scrape.py) of the API nodes (colocated or decode) and of the
prefill nodes into the report's ``server`` section; ``agreement`` compares the client's TTFT and
inter-token gaps with the servers' histograms for the same requests, within a stated tolerance.
"""

from __future__ import annotations

from pdkv.bench.ab import metrics, scrape


def numbers(api: dict, pre: dict) -> dict:
    """Numbers from the nodes' own /metrics deltas: API nodes (colocated or decode) and prefill nodes."""
    kv_recv = scrape.value(api, "pdkv_kv_transfer_bytes_total")
    kv_sent = scrape.value(pre, "pdkv_kv_transfer_bytes_total")
    failures = {dict(lab)["reason"]: v for (n, lab), v in api.items()
                if n == "pdkv_kv_transfer_failures_total" and v}
    return {
        "ttft": scrape.histogram(api, "pdkv_time_to_first_token_seconds"),
        "itl": scrape.histogram(api, "pdkv_inter_token_latency_seconds"),
        "queue_wait": scrape.histogram(api, "pdkv_request_queue_time_seconds"),
        "prefill_queue_wait": scrape.histogram(pre, "pdkv_queue_prefill_seconds"),
        "e2e": scrape.histogram(api, "pdkv_e2e_request_latency_seconds"),
        "kv_bytes_received": kv_recv, "kv_bytes_sent": kv_sent,
        # the prefill node times each request's writes: first queued -> all done
        "kv_transfer_time": scrape.histogram(pre, "pdkv_kv_transfer_seconds"),
        "remote_prefill": scrape.histogram(api, "pdkv_ttft_remote_seconds"),
        "kv_transfer_exposed": scrape.histogram(api, "pdkv_kv_transfer_exposed_seconds"),
        "kv_transfer_failures": failures,
        "prompt_tokens": scrape.value(api, "pdkv_prompt_tokens_total"),
        "generation_tokens": scrape.value(api, "pdkv_generation_tokens_total"),
    }


# Client and server see the same tokens; the client adds HTTP, SSE and its own event loop's delay
# on top (typically 5-15 ms here, more when the shared machine is busy). The ITL mean shifts by
# the difference between a request's first- and last-token delivery delays, spread over its gaps.
# NOTE: the server's clock starts when its handler runs, after its event loop (busy streaming
# other requests' tokens on a 2-core machine) got to the new connection: 40 ms + 10% held on a
# quiet run but a loaded test run saw 120 ms at a 0.6 s mean. The counts must still agree exactly.
AGREE_TTFT_ABS_S, AGREE_ITL_ABS_S = 0.150, 0.010
AGREE_TTFT_REL, AGREE_ITL_REL = 0.25, 0.25


def agreement(results, server: dict) -> dict | None:
    """Client-side TTFT/ITL against the servers' own histograms for the same requests."""
    ok = [r for r in results if r.status == "ok"]
    if not ok or not server.get("ttft") or not server.get("itl"):
        return None
    c_ttft = sum(r.ttft_s for r in ok) / len(ok)
    gaps = [g for r in ok for g in metrics.itl_gaps(r)]
    c_itl = sum(gaps) / len(gaps) if gaps else 0.0
    s_ttft, s_itl = server["ttft"]["mean_s"], server["itl"]["mean_s"]
    tol_t = AGREE_TTFT_ABS_S + AGREE_TTFT_REL * s_ttft
    tol_i = AGREE_ITL_ABS_S + AGREE_ITL_REL * s_itl
    return {"tolerance": f"|client - server| <= {AGREE_TTFT_ABS_S * 1e3:g} ms + {AGREE_TTFT_REL:.0%} (TTFT mean), "
                         f"{AGREE_ITL_ABS_S * 1e3:g} ms + {AGREE_ITL_REL:.0%} (ITL mean); counts equal",
            "ttft_mean_client_s": c_ttft, "ttft_mean_server_s": s_ttft, "ttft_ok": abs(c_ttft - s_ttft) <= tol_t,
            "ttft_count_client": len(ok), "ttft_count_server": server["ttft"]["count"],
            "itl_mean_client_s": c_itl, "itl_mean_server_s": s_itl, "itl_ok": abs(c_itl - s_itl) <= tol_i,
            "itl_count_client": len(gaps), "itl_count_server": server["itl"]["count"],
            "counts_ok": len(ok) == server["ttft"]["count"] and len(gaps) == server["itl"]["count"]}
