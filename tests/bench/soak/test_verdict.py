"""The soak's judge, fed synthetic samples: a steady node passes, every kind of leak the soak is
for is flagged (memory per request, descriptors per reconnect, threads), a restarted node is
judged per incarnation (its warm-up is not a leak), and only failures in an outage are excused."""
from __future__ import annotations

import random
import xml.etree.ElementTree as ET

from pdkv.bench.soak import verdict as V
from pdkv.bench.soak.plot import _svg

MIB = 1 << 20


def samples(node="decode", n=120, period=5.0, rss=700 * MIB, fds=40, threads=12, rss_slope=0.0,
            fd_steps=(), start=1, t0=0.0, seed=0):
    """n samples of a node, with noise (HTTP connections come and go), an optional RSS climb
    (bytes/s) and fd steps (time, +k) as a leak per reconnect would make."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = t0 + i * period
        f = fds + rng.randint(-6, 6) + sum(k for at, k in fd_steps if t >= at)
        out.append({"t_s": t, "node": node, "start": start, "up": True,
                    "rss_bytes": rss + rss_slope * t + rng.randint(-4, 4) * MIB, "fds": f,
                    "threads": threads + rng.choice((0, 0, 0, 1)), "pages_used": 0, "pages_held": 0})
    return out


def test_steady_noisy_node_is_flat():
    v = V.flatness(samples(), 600.0, set())
    assert v["flat"], v
    w = v["nodes"]["decode"]["windows"][0]
    assert w["rss_bytes"]["judged"] and w["rss_bytes"]["from_s"] >= 300  # second half only
    assert abs(w["fds"]["growth"]) <= 4


def test_growing_rss_is_flagged():
    # 0.2 MiB/s: +60 MiB over the judged half, the shape of a per-request leak at 1 req/s
    v = V.flatness(samples(rss_slope=0.2 * MIB), 600.0, set())
    assert not v["flat"]
    w = v["nodes"]["decode"]["windows"][0]
    assert not w["rss_bytes"]["flat"] and w["fds"]["flat"] and w["threads"]["flat"]
    assert w["rss_bytes"]["per_hour"] > 500 * MIB


def test_descriptors_leaked_per_reconnect_are_flagged():
    # three prefill restarts in the second half, each leaving 3 descriptors behind on the decode node
    leaky = samples(fd_steps=((320, 3), (420, 3), (520, 3)))
    w = V.flatness(leaky, 600.0, set())["nodes"]["decode"]["windows"][0]
    assert not w["fds"]["flat"], w["fds"]


def test_growing_threads_are_flagged():
    s = samples()
    for x in s:
        x["threads"] += int(x["t_s"] // 60)  # one more thread a minute
    assert not V.flatness(s, 600.0, set())["flat"]


def test_warm_up_before_the_judged_window_is_not_a_leak():
    s = samples()
    for x in s:
        if x["t_s"] < 200:  # the first third climbs (allocator, caches warm up), then stays
            x["rss_bytes"] -= (200 - x["t_s"]) * MIB
    assert V.flatness(s, 600.0, set())["flat"]


def test_restarted_node_is_judged_per_incarnation():
    # each life starts lower (a fresh process) and warms up; judged on the second half of each life
    lives = []
    for k in range(3):
        life = samples("prefill", n=40, start=k + 1, t0=k * 200.0, seed=k)
        for x in life:
            age = x["t_s"] - k * 200.0
            x["rss_bytes"] -= max(0.0, 60 - age) * MIB
        lives += life
    v = V.flatness(lives, 600.0, {"prefill"})
    assert v["flat"] and len(v["nodes"]["prefill"]["windows"]) == 3, v
    # the same lives judged as one never-restarted node would look like a sawtooth, not a trend;
    # a leak inside one life is still caught
    for x in lives:
        if x["start"] == 3:
            x["rss_bytes"] += (x["t_s"] - 400) * 0.5 * MIB
    assert not V.flatness(lives, 600.0, {"prefill"})["flat"]


def test_outages_and_the_drain_are_not_judged():
    s = samples()
    for x in s:
        if 400 <= x["t_s"] <= 430 or x["t_s"] > 590:  # peer gone / clients gone: fewer descriptors
            x["fds"] -= 30
    outages = [(400.0, 430.0)]
    assert V.flatness(s, 590.0, set(), outages)["flat"]
    w = V.windows(s, 590.0, False, outages)[0]
    assert all(not (400 <= x["t_s"] <= 430) and x["t_s"] <= 590 for x in w)


def test_too_few_samples_are_not_judged_and_no_judgement_is_not_flat():
    v = V.flatness(samples(n=8), 40.0, set())
    assert not v["flat"] and v["nodes"]["decode"]["judged_windows"] == 0


def test_only_failures_in_an_outage_are_excused():
    restarts = [{"kill_s": 100.0, "ready_s": 115.0}]
    outs = [{"id": "a", "kind": "short", "stream": True, "status": "failed", "sent_s": 99.0, "end_s": 100.5,
             "error": "error event after 3 of 8 tokens: the prefill node died"},
            {"id": "b", "kind": "long", "stream": False, "status": "failed", "sent_s": 115.6, "end_s": 115.7,
             "error": "HTTP 503: no prefill node is connected"},
            {"id": "c", "kind": "short", "stream": False, "status": "failed", "sent_s": 200.0, "end_s": 201.0,
             "error": "HTTP 500: boom"},
            {"id": "d", "kind": "short", "stream": True, "status": "ok", "sent_s": 1.0, "end_s": 2.0, "error": None}]
    f = V.failures(outs, restarts, slack_s=1.0)
    assert f["num_failed"] == 3 and f["num_failed_hit_by_restart"] == 2 and f["num_failed_unexcused"] == 1
    assert not f["ok"] and [x["id"] for x in f["failed"] if not x["hit_by_restart"]] == ["c"]
    assert V.failures(outs[:2] + outs[3:], restarts, 1.0)["ok"]
    assert not V.failures(outs[:2] + outs[3:], restarts, 0.0)["ok"]  # b came 0.6 s after recovery


def test_a_failure_between_the_scheduled_and_the_recorded_kill_is_excused():
    """soak-802: failed at 270.027 s by the dying node; the kill, scheduled at 270.0 s, was
    recorded at 270.034 s (after it returned)."""
    restarts = [{"node": "prefill", "scheduled_s": 270.0, "kill_s": 270.034, "ready_s": 290.0}]
    o = {"id": "soak-802", "kind": "short", "stream": False, "status": "failed", "sent_s": 269.5,
         "end_s": 270.027, "error": "HTTP 503: the prefill node died during the KV transfer"}
    early = {**o, "id": "soak-801", "end_s": 269.99}  # ended before the kill was issued: not excused
    f = V.failures([o, early], restarts, slack_s=1.0)
    assert [x["id"] for x in f["failed"] if x["hit_by_restart"]] == ["soak-802"], f["failed"]
    assert V.outages_of(restarts, 400.0) == [(270.0, 290.0)]


def test_svg_plot_without_matplotlib(tmp_path):
    rep = {"samples": samples(n=20), "restarts": [{"kill_s": 30.0, "ready_s": 45.0}], "minutes": 1.0}
    path = _svg(rep, tmp_path / "soak.svg")
    root = ET.parse(path).getroot()
    lines = [e for e in root.iter() if e.tag.endswith("polyline")]
    assert len(lines) >= 4 and all(len(e.get("points").split()) == 20 for e in lines[:3])


def test_restart_schedule_leaves_the_last_outage_inside_the_load():
    from pdkv.bench.soak.run import restart_times

    assert restart_times(1800, 300) == [300, 600, 900, 1200, 1500]
    assert restart_times(36, 16) == [16] and restart_times(36, 0) == []
