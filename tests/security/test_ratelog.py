"""Repeated errors are logged once per interval per kind, with a count of the suppressed ones."""
import logging

from pdkv.disagg.ratelog import RateLimitedLog


def test_a_flood_of_one_error_is_one_line_per_interval(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr("pdkv.disagg.ratelog.time.monotonic", lambda: now[0])
    r = RateLimitedLog(logging.getLogger("t"), interval=10.0, max_keys=4)
    with caplog.at_level("WARNING", logger="t"):
        logged = [r.warning("refuse", "refused %s", i) for i in range(1000)]
        assert logged.count(True) == 1
        assert r.warning("other", "other kind")  # kinds are separate
        now[0] += 10.5
        assert r.warning("refuse", "refused %s", "again")
    lines = [rec.getMessage() for rec in caplog.records]
    assert lines == ["refused 0", "other kind", "refused again (999 similar message(s) suppressed in the last 10 s)"]
    for i in range(100):  # the table of kinds is bounded
        r.warning(f"k{i}", "x")
    assert len(r._last) <= 4
