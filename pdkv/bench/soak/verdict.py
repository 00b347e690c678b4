"""The soak's verdicts, computed from its samples and outcomes only.

**Flat after warm-up.** For each node and each of resident memory, file descriptors and threads,
the judged window is the second half of the run for a node that was never restarted, and the
second half of each incarnation for a node that was (a restarted node warms up again). Over the
window the trend is the Theil-Sen slope (the median of the pairwise slopes: a spike of open HTTP
connections or a burst of allocations moves it little, a steady climb moves it fully); the
window's *growth* is that slope times the window's length. The node is flat when the growth stays
within the bound for every metric:

    rss_bytes  max(32 MiB, 5% of the window's median)
    fds        max(4, 10% of the median)
    threads    max(2, 10% of the median)

A window of fewer than MIN_SAMPLES samples is reported and not judged. A leak that costs a few
bytes per request is below any bound a 30-minute run can resolve on a shared machine; what this
catches is the kind that matters in operation: per-request or per-reconnect growth of memory,
descriptors or threads.

**Failures.** A failed request is *excused* when its lifetime overlaps a restart's outage (from
the kill's scheduled time, when the kill was issued, until the decode node was connected again,
plus ``slack_s``); every other failure counts against the run. The outage starts at the
scheduled time, not the kill's recorded one: that is taken after the kill returned, and a request
the dying node failed in between was hit by the restart all the same.
"""

from __future__ import annotations

from statistics import median

MIB = 1 << 20
MIN_SAMPLES = 6
BOUNDS = {"rss_bytes": (32 * MIB, 0.05), "fds": (4, 0.10), "threads": (2, 0.10)}
METRICS = tuple(BOUNDS)
RULE = ("Theil-Sen growth over the second half of the load (of each incarnation if restarted; outages "
        "excluded) within rss <= max(32 MiB, 5% of median), fds <= max(4, 10% of median), "
        "threads <= max(2, 10% of median)")


def theil_sen(ts: list[float], ys: list[float]) -> float:
    """Median of the slopes between every pair of points with distinct times."""
    slopes = [(ys[j] - ys[i]) / (ts[j] - ts[i]) for i in range(len(ts)) for j in range(i + 1, len(ts))
              if ts[j] != ts[i]]
    return median(slopes) if slopes else 0.0


def bound(metric: str, med: float) -> float:
    floor, share = BOUNDS[metric]
    return max(floor, share * med)


def judge_window(metric: str, ts: list[float], ys: list[float]) -> dict:
    if len(ts) < MIN_SAMPLES:
        return {"samples": len(ts), "judged": False}
    slope = theil_sen(ts, ys)
    span = ts[-1] - ts[0]
    med = median(ys)
    growth, limit = slope * span, bound(metric, med)
    return {"samples": len(ts), "judged": True, "from_s": ts[0], "to_s": ts[-1], "median": med,
            "slope_per_s": slope, "growth": growth, "bound": limit, "per_hour": slope * 3600,
            "flat": growth <= limit}


def _in_outage(t: float, outages: list[tuple[float, float]]) -> bool:
    return any(a <= t <= b for a, b in outages)


def windows(samples: list[dict], duration_s: float, restarted: bool,
            outages: list[tuple[float, float]] = ()) -> list[list[dict]]:
    """The judged windows of one node's samples: ``up``, taken while the load ran (after it the
    clients' connections close and the levels drop, which would hide a climb) and outside the
    outages (with its peer gone a node holds fewer connections and threads: another regime)."""
    up = [s for s in samples if s["up"] and s["t_s"] <= duration_s and not _in_outage(s["t_s"], outages)]
    if not restarted:
        return [[s for s in up if s["t_s"] >= duration_s / 2]]
    out = []
    for start in sorted({s["start"] for s in up}):
        life = [s for s in up if s["start"] == start]
        if life:
            mid = (life[0]["t_s"] + life[-1]["t_s"]) / 2
            out.append([s for s in life if s["t_s"] >= mid])
    return out


def down_from(r: dict) -> float:
    """When a restart's outage starts: its scheduled kill (never later than the recorded one)."""
    return min(r.get("scheduled_s", r["kill_s"]), r["kill_s"])


def outages_of(restarts: list[dict], end_s: float) -> list[tuple[float, float]]:
    return [(down_from(r), r["ready_s"] if r.get("ready_s") is not None else end_s) for r in restarts]


def flatness(samples: list[dict], duration_s: float, restarted_nodes: set[str],
             outages: list[tuple[float, float]] = ()) -> dict:
    """{"flat": bool, "nodes": {node: {"flat", "windows": [{metric: judge_window}]}}}; ``flat`` is
    True when every judged window of every node is flat and at least one window was judged."""
    nodes: dict[str, dict] = {}
    judged_any = False
    for name in dict.fromkeys(s["node"] for s in samples):
        mine = [s for s in samples if s["node"] == name]
        rows = []
        for w in windows(mine, duration_s, name in restarted_nodes, outages):
            ts = [s["t_s"] for s in w]
            row = {m: judge_window(m, ts, [float(s[m]) for s in w]) for m in METRICS}
            if w:
                row["start"] = w[0]["start"]
            rows.append(row)
        judged = [r[m] for r in rows for m in METRICS if r[m]["judged"]]
        judged_any = judged_any or bool(judged)
        nodes[name] = {"flat": all(j["flat"] for j in judged), "judged_windows": len(judged),
                       "windows": rows, "restarted": name in restarted_nodes}
    return {"flat": judged_any and all(n["flat"] for n in nodes.values()), "nodes": nodes,
            "rule": RULE}


def hit_by_restart(o: dict, restarts: list[dict], slack_s: float) -> bool:
    end = o["end_s"] or float("inf")
    for r in restarts:
        back = r.get("ready_s")
        back = float("inf") if back is None else back + slack_s
        if o["sent_s"] <= back and end >= down_from(r):
            return True
    return False


def failures(outcomes: list[dict], restarts: list[dict], slack_s: float) -> dict:
    failed = [o for o in outcomes if o["status"] == "failed"]
    for o in failed:
        o["hit_by_restart"] = hit_by_restart(o, restarts, slack_s)
    unexcused = [o for o in failed if not o["hit_by_restart"]]
    return {"num_requests": len(outcomes), "num_ok": sum(o["status"] == "ok" for o in outcomes),
            "num_aborted": sum(o["status"] == "aborted" for o in outcomes), "num_failed": len(failed),
            "num_failed_hit_by_restart": len(failed) - len(unexcused), "num_failed_unexcused": len(unexcused),
            "all_failures_have_errors": all(bool(o["error"]) for o in failed), "slack_s": slack_s,
            "ok": not unexcused and all(bool(o["error"]) for o in failed),
            "failed": [{k: o[k] for k in ("id", "kind", "stream", "sent_s", "end_s", "error", "hit_by_restart")}
                       for o in failed]}
