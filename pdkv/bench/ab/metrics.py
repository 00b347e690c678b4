"""Client-side numbers of one replay: throughput, latency percentiles, goodput, per prompt class.

    TTFT  sent -> first token            TPOT  (e2e - TTFT) / (tokens - 1), per request
    ITL   every gap between two consecutive tokens (a chunk of k tokens gives its gap, then k-1
          zero gaps), so one stalled step shows as one long gap, not as a smeared average
    goodput  requests/s that completed with TTFT <= slo_ttft and TPOT <= slo_tpot (DistServe)

Throughputs divide by the replay's makespan: first send to last answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdkv.bench.ab.client import RequestResult

CLASSES = ("short", "long", "all")  # "all" is the mixed workload as replayed


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float


def pct(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def dist(xs: list[float]) -> dict:
    return {"p50": pct(xs, 50), "p90": pct(xs, 90), "p99": pct(xs, 99),
            "mean": sum(xs) / len(xs) if xs else None, "max": max(xs) if xs else None, "n": len(xs)}


def itl_gaps(r: RequestResult) -> list[float]:
    gaps = []
    for prev, t, k in zip(r.chunk_s, r.chunk_s[1:], r.chunk_tokens[1:]):
        gaps.append(t - prev)
        gaps.extend([0.0] * (k - 1))
    if r.chunk_tokens:
        gaps.extend([0.0] * (r.chunk_tokens[0] - 1))
    return gaps


def interference(results: list[RequestResult]) -> dict:
    """Decode gaps that overlap another request's prefill (its [sent, first token] window) against
    gaps that overlap none: how much the prefill phase slows the decode phase, seen by clients."""
    ok = [r for r in results if r.status == "ok" and r.ttft_s is not None]
    windows = sorted((r.sent_s, r.sent_s + r.ttft_s, r.id) for r in ok)
    during, quiet = [], []
    for r in ok:
        for a, b in zip(r.chunk_s, r.chunk_s[1:]):
            lo, hi = r.sent_s + a, r.sent_s + b
            hit = any(s < hi and e > lo and rid != r.id for s, e, rid in windows)
            (during if hit else quiet).append(b - a)
    d, q = dist(during), dist(quiet)
    return {"itl_during_prefill_s": d, "itl_quiet_s": q,
            "ratio_mean": d["mean"] / q["mean"] if d["mean"] is not None and q["mean"] else None,
            "ratio_p90": d["p90"] / q["p90"] if d["p90"] is not None and q["p90"] else None}


def tpot(r: RequestResult) -> float | None:
    if r.status != "ok" or r.num_tokens < 2 or r.ttft_s is None or r.e2e_s is None:
        return None
    return (r.e2e_s - r.ttft_s) / (r.num_tokens - 1)


def meets(r: RequestResult, slo: SLO) -> bool:
    t = tpot(r)
    return r.status == "ok" and r.ttft_s is not None and r.ttft_s <= slo.ttft_s and (t is None or t <= slo.tpot_s)


def summarize(results: list[RequestResult], prompt_lens: dict[str, int], classes: dict[str, str],
              slo: SLO) -> dict:
    """{class: numbers} for short, long and all."""
    out = {}
    for cls in CLASSES:
        rs = [r for r in results if cls == "all" or classes[r.id] == cls]
        out[cls] = _summary(rs, prompt_lens, slo) if rs else None
    out["all"]["interference"] = interference(results)
    return out


def _summary(rs: list[RequestResult], prompt_lens: dict[str, int], slo: SLO) -> dict:
    ok = [r for r in rs if r.status == "ok"]
    start = min(r.sent_s for r in rs)
    end = max((r.sent_s + r.e2e_s for r in ok if r.e2e_s is not None), default=start)
    span = max(end - start, 1e-9)
    good = [r for r in ok if meets(r, slo)]
    itl = [g for r in ok for g in itl_gaps(r)]
    tp = [t for t in (tpot(r) for r in ok) if t is not None]
    return {
        "num_requests": len(rs), "num_ok": len(ok), "num_failed": len(rs) - len(ok),
        "makespan_s": span,
        "request_throughput": len(ok) / span,
        "prompt_tokens_per_s": sum(prompt_lens[r.id] for r in ok) / span,
        "output_tokens_per_s": sum(r.num_tokens for r in ok) / span,
        "ttft_s": dist([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": dist(tp),
        "itl_s": dist(itl),
        "e2e_s": dist([r.e2e_s for r in ok if r.e2e_s is not None]),
        "goodput_rps": len(good) / span,
        "goodput_fraction": len(good) / len(rs),
    }


def client_overhead(results: list[RequestResult], client_cpu_s: float) -> dict:
    """The client's own cost: send lag against the schedule, chunk handling time, CPU time."""
    lags = [max(0.0, r.sent_s - r.scheduled_s) for r in results]
    chunks = sum(len(r.chunk_s) for r in results)
    tokens = sum(r.num_tokens for r in results)
    parse = sum(r.parse_s for r in results)
    return {"send_lag_s": dist(lags), "cpu_seconds": client_cpu_s,
            "cpu_per_request_ms": 1e3 * client_cpu_s / max(1, len(results)),
            "cpu_per_token_us": 1e6 * client_cpu_s / max(1, tokens),
            "parse_per_chunk_us": 1e6 * parse / max(1, chunks)}
