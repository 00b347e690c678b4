"""The nodes' own numbers: Prometheus /metrics scraped before and after a replay, as deltas.

Only what a replay changed counts (counters and histograms are cumulative since a node started).
A node restarted mid-replay (``--fault``) starts from zero again; as Prometheus' rate() does, a
value that went down is taken as a reset, so its delta is the value after it.
"""

from __future__ import annotations

import math
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Sample = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, timeout: float = 5.0) -> Sample:
    """{(sample name, sorted labels without model_name/role): value}; {} when unreachable."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: Sample = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "role")))
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def delta(before: Sample, after: Sample) -> Sample:
    out = {}
    for k, v in after.items():
        b = before.get(k, 0.0)
        out[k] = v - b if v >= b else v  # went down: the node restarted
    return out


def value(s: Sample, name: str, **labels: str) -> float:
    return s.get((name, tuple(sorted(labels.items()))), 0.0)


def histogram(s: Sample, base: str) -> dict | None:
    """{count, sum, mean_s, p50_s, p90_s, p99_s} of a histogram delta; quantiles interpolated
    inside buckets as Prometheus' histogram_quantile does. None when it saw nothing."""
    count = value(s, base + "_count")
    if count <= 0:
        return None
    buckets = sorted((float(dict(lab)["le"]), v) for (n, lab), v in s.items() if n == base + "_bucket")
    out = {"count": int(round(count)), "sum_s": value(s, base + "_sum")}
    out["mean_s"] = out["sum_s"] / count
    for q in (50, 90, 99):
        out[f"p{q}_s"] = _quantile(buckets, count * q / 100.0)
    return out


def _quantile(buckets: list[tuple[float, float]], rank: float) -> float | None:
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le  # beyond the last finite bucket: its bound is all we know
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 1.0)
        prev_le, prev_c = le, c
    return None


def add(a: Sample, b: Sample) -> Sample:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0.0) + v
    return out
