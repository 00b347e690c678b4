"""Which server runs when, and what the rounds add up to.

Rounds are interleaved and their order alternates (A B, B A, A B, ...): the machine is shared,
so a load that rises or falls during the run lands on both servers instead of on whichever ran
last. Only one server is up at a time; each step starts it, runs every workload, stops it.
A ratio is pdkv / peer of the medians over rounds (below 1: less throughput or lower latency).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

METRICS = (("output_tok_s", "output tok/s", 1.0), ("ttft_p50_s", "TTFT p50", 1e3), ("itl_p50_s", "ITL p50", 1e3))


@dataclass(frozen=True)
class Workload:
    name: str  # c=8 | trace
    client: str  # aiperf | pdkv
    concurrency: int = 0  # 0: the trace slice's own arrivals


@dataclass(frozen=True)
class Step:
    round: int
    system: str
    workloads: tuple[Workload, ...]


@dataclass
class Result:
    """One workload's numbers on one server in one round (times in seconds)."""
    round: int
    system: str
    workload: str
    client: str
    output_tok_s: float | None
    ttft_p50_s: float | None
    itl_p50_s: float | None
    num_requests: int
    num_errors: int
    loadavg_before: tuple[float, float, float]
    loadavg_after: tuple[float, float, float]


def plan(systems: tuple[str, str], workloads: list[Workload], num_rounds: int) -> list[Step]:
    """``num_rounds`` rounds of both systems, the order flipped every round."""
    if num_rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {num_rounds}")
    if not workloads:
        raise ValueError("no workload: give --concurrency and/or --trace")
    steps = []
    for r in range(num_rounds):
        for s in (systems if r % 2 == 0 else systems[::-1]):
            steps.append(Step(r, s, tuple(workloads)))
    return steps


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratios(results: list[Result], a: str, b: str) -> list[dict]:
    """Per workload: each system's median of every metric over rounds and a / b."""
    out = []
    for wl in dict.fromkeys((r.workload, r.client) for r in results):
        row: dict = {"workload": wl[0], "client": wl[1]}
        for key, _, _ in METRICS:
            va = _median([getattr(r, key) for r in results if (r.workload, r.client) == wl and r.system == a])
            vb = _median([getattr(r, key) for r in results if (r.workload, r.client) == wl and r.system == b])
            row[key] = {a: va, b: vb, "ratio": va / vb if va is not None and vb else None}
        out.append(row)
    return out


def fmt(v: float | None, scale: float) -> str:
    if v is None:
        return "n/a"
    x = v * scale
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.3g}"  # 1530, not 1.53e+03


def table(results: list[Result], a: str, b: str) -> str:
    """The ratio table, then every round's numbers with the load average around it (markdown)."""
    lines = [f"{a} / {b} (medians over rounds; below 1: less throughput, or lower latency)", "",
             "| workload | client | " + " | ".join(label for _, label, _ in METRICS) + " |",
             "|---|---|" + "---|" * len(METRICS)]
    for row in ratios(results, a, b):
        cells = []
        for key, _, scale in METRICS:
            m = row[key]
            r = "n/a" if m["ratio"] is None else f"{m['ratio']:.2f}"
            unit = "" if scale == 1.0 else " ms"
            cells.append(f"{r} ({fmt(m[a], scale)} vs {fmt(m[b], scale)}{unit})")
        lines.append(f"| {row['workload']} | {row['client']} | " + " | ".join(cells) + " |")
    lines += ["", "| round | system | workload | output tok/s | TTFT p50 ms | ITL p50 ms | requests (errors) | "
                  "load avg 1/5/15 before -> after |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        la = " ".join(f"{x:.2f}" for x in r.loadavg_before) + " -> " + " ".join(f"{x:.2f}" for x in r.loadavg_after)
        lines.append(f"| {r.round} | {r.system} | {r.workload} ({r.client}) | {fmt(r.output_tok_s, 1)} | "
                     f"{fmt(r.ttft_p50_s, 1e3)} | {fmt(r.itl_p50_s, 1e3)} | {r.num_requests} ({r.num_errors}) "
                     f"| {la} |")
    return "\n".join(lines)
