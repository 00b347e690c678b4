"""/metrics deltas: histogram quantiles interpolated like Prometheus, counter resets after a restart."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdkv.bench.ab import scrape


def _sample(reg) -> scrape.Sample:
    """What scrape.scrape returns for this registry's exposition text."""
    out: scrape.Sample = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for x in fam.samples:
            if not x.name.endswith("_created"):
                out[(x.name, tuple(sorted((k, v) for k, v in x.labels.items() if k != "model_name")))] = x.value
    return out


def test_histogram_delta_and_quantiles():
    reg = CollectorRegistry()
    h = Histogram("t_seconds", "x", ["model_name"], buckets=(0.1, 0.2, 0.4), registry=reg).labels("m")
    h.observe(5.0)  # before the replay: must not count
    before = _sample(reg)
    for v in (0.05, 0.15, 0.15, 0.3):
        h.observe(v)
    d = scrape.delta(before, _sample(reg))
    st = scrape.histogram(d, "t_seconds")
    assert st["count"] == 4 and st["sum_s"] == pytest.approx(0.65)
    assert st["p50_s"] == pytest.approx(0.15)  # rank 2 of 4: halfway through the (0.1, 0.2] bucket
    assert st["p99_s"] == pytest.approx(0.2 + 0.2 * (3.96 - 3) / 1)
    assert scrape.histogram(scrape.delta(before, before), "t_seconds") is None


def test_a_counter_that_went_down_is_a_restart():
    reg = CollectorRegistry()
    c = Counter("kv_bytes", "x", ["model_name"], registry=reg).labels("m")
    c.inc(100)
    before = _sample(reg)
    reg2 = CollectorRegistry()  # the node restarted: its counters start again from 0
    Counter("kv_bytes", "x", ["model_name"], registry=reg2).labels("m").inc(30)
    assert scrape.value(scrape.delta(before, _sample(reg2)), "kv_bytes_total") == 30
    c.inc(5)
    assert scrape.value(scrape.delta(before, _sample(reg)), "kv_bytes_total") == 5
