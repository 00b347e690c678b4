"""One soak: launch a disaggregated pair (pdkv.bench.ab's launcher: one ``pdkv serve`` per node,
free loopback ports, the prefill node restarted on the same control port so the decode node
redials it), run the load against the decode node while sampling both nodes and restarting the
prefill node on schedule, drain, check the page pools, and judge.

Three asyncio tasks share one loop; everything that blocks (/proc reads, a node's start-up wait)
runs in a worker thread so the client's sends stay on schedule.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdkv.bench.ab.archs import builtin, with_pd
from pdkv.bench.ab.launch import Deployment, LaunchError
from pdkv.bench.soak.load import LoadSpec, plan, run_load
from pdkv.bench.soak.probe import sample_node
from pdkv.bench.soak import verdict as V

SERVED = "soak-model"


@dataclass(frozen=True)
class SoakOptions:
    minutes: float
    model_dir: str
    out_dir: Path
    budget: list[int]
    load: LoadSpec = LoadSpec()
    restart_every_s: float = 300.0  # 0: never
    sample_s: float = 5.0
    slack_s: float = 1.0
    transport: str = "tcp"
    sets: list[str] = field(default_factory=list)
    seed: int = 0
    progress: bool = True
    argv: list[str] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0


def restart_times(duration_s: float, every_s: float) -> list[float]:
    """k * every for k >= 1, none in the last half interval (its outage must end inside the load)."""
    if every_s <= 0:
        return []
    out, k = [], 1
    while k * every_s <= duration_s - every_s / 2:
        out.append(k * every_s)
        k += 1
    return out


class Soak:
    def __init__(self, opts: SoakOptions, dep: Deployment):
        self.opts, self.dep = opts, dep
        self.prefill = dep.by_role("prefill")[0]
        self.decode = dep.by_role("decode")[0]
        self.samples: list[dict] = []
        self.restarts: list[dict] = []
        self.counts = {"ok": 0, "aborted": 0, "failed": 0}
        self.t0 = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def _sample_all(self) -> None:
        for n in self.dep.nodes:
            s = await asyncio.to_thread(sample_node, n, self.now())
            self.samples.append(s.as_dict())

    async def sampler(self, stop: asyncio.Event) -> None:
        next_progress = 60.0
        while not stop.is_set():
            await self._sample_all()
            if self.opts.progress and self.now() >= next_progress:
                next_progress += 60.0
                last = {s["node"]: s for s in self.samples[-len(self.dep.nodes):]}
                rss = ", ".join(f"{n} {((s['rss_bytes'] or 0) >> 20)} MiB/{s['fds']} fds/{s['threads']} thr"
                                for n, s in last.items())
                print(f"[soak {self.now() / 60:5.1f} min] {self.counts} restarts {len(self.restarts)}; {rss}",
                      file=sys.stderr, flush=True)
            try:
                await asyncio.wait_for(stop.wait(), self.opts.sample_s)
            except asyncio.TimeoutError:
                pass

    async def restarter(self) -> None:
        up_since = 0.0
        for at in restart_times(self.opts.duration_s, self.opts.restart_every_s):
            # a node is up at least half an interval between two kills, however slow its start-up
            at = max(at, up_since + self.opts.restart_every_s / 2)
            if at > self.opts.duration_s - self.opts.restart_every_s / 2:
                return
            if at > self.now():
                await asyncio.sleep(at - self.now())
            # the kill is issued now: "scheduled_s" is never before it (the verdict's outage starts here)
            r = {"node": self.prefill.name, "scheduled_s": min(at, self.now())}
            await asyncio.to_thread(self.prefill.kill)
            r["kill_s"] = self.now()
            self.restarts.append(r)
            try:
                self.prefill.start()
                await asyncio.to_thread(self.prefill.wait_ready, 300.0)
                await asyncio.to_thread(self.decode.wait_ready, 300.0)  # it redialled
                r["ready_s"] = self.now()
                r["down_s"] = r["ready_s"] - r["kill_s"]
                up_since = r["ready_s"]
            except LaunchError as e:
                r["error"] = str(e)
                return

    async def main(self) -> dict:
        o = self.opts
        planned = plan(o.load, o.duration_s, o.seed)
        self.t0 = time.perf_counter() + 0.5
        stop = asyncio.Event()
        sampler = asyncio.create_task(self.sampler(stop))
        restarter = asyncio.create_task(self.restarter())

        def done(out) -> None:
            self.counts[out.status] += 1

        outcomes = await run_load(self.decode.url, SERVED, planned, self.t0, o.load.timeout_s, done)
        await restarter
        drained_s = self.now()
        pools = await asyncio.to_thread(self.dep.wait_pools_full, 60.0)
        await self._sample_all()
        stop.set()
        await sampler
        return {"outcomes": [asdict(x) | {"chunk_s": None} for x in outcomes], "drained_s": drained_s,
                "pools_after": pools, "num_planned": len(planned)}


def summary(samples: list[dict]) -> dict:
    out = {}
    for name in dict.fromkeys(s["node"] for s in samples):
        up = [s for s in samples if s["node"] == name and s["up"]]
        if not up:
            continue
        row = {}
        for m in V.METRICS + ("pages_used", "pages_held"):
            vals = [s[m] for s in up if s[m] is not None]
            if vals:
                row[m] = {"first": vals[0], "last": vals[-1], "min": min(vals), "max": max(vals)}
        row["pages_total"] = up[-1]["pages_total"]
        out[name] = row
    return out


def run_soak(opts: SoakOptions) -> dict:
    arch = with_pd(builtin("disagg"), "1:1", opts.transport)
    # the defaults an operator runs (configs/ab/disagg.yaml tightens them for short replays)
    sets = ["messenger.lease_s=5.0", "messenger.heartbeat_s=1.0"] + list(opts.sets)
    dep = Deployment(arch, opts.budget, opts.out_dir / "logs", opts.model_dir, SERVED, sets)
    t = time.monotonic()
    dep.start()
    startup_s = time.monotonic() - t
    try:
        soak = Soak(opts, dep)
        res = asyncio.run(soak.main())
    finally:
        dep.stop()
    restarted = {r["node"] for r in soak.restarts}
    flat = V.flatness(soak.samples, opts.duration_s, restarted, V.outages_of(soak.restarts, res["drained_s"]))
    fails = V.failures(res["outcomes"], soak.restarts, opts.slack_s)
    pools_ok = all(p["free"] is not None and p["free"] == p["total"] for p in res["pools_after"].values())
    restarts_ok = all("error" not in r for r in soak.restarts)
    return {
        "command": "python -m pdkv.bench soak " + " ".join(opts.argv), "minutes": opts.minutes,
        "duration_s": opts.duration_s, "startup_s": startup_s, "drained_s": res["drained_s"],
        "config": {"load": asdict(opts.load), "restart_every_s": opts.restart_every_s,
                   "restart_times_s": restart_times(opts.duration_s, opts.restart_every_s),
                   "sample_s": opts.sample_s, "transport": opts.transport, "sets": sets,
                   "model": opts.model_dir, "cpus": opts.budget, "seed": opts.seed, "pid": os.getpid()},
        "nodes": [{"name": n.name, "role": n.role, "starts": n.num_starts, "log": str(n.log_path)} for n in dep.nodes],
        "restarts": soak.restarts, "samples": soak.samples, "summary": summary(soak.samples),
        "outcomes": res["outcomes"], "failures": fails, "pools_after": res["pools_after"],
        "verdict": {"flat": flat["flat"], "flatness": flat, "failures_ok": fails["ok"], "pools_ok": pools_ok,
                    "restarts_ok": restarts_ok,
                    "pass": flat["flat"] and fails["ok"] and pools_ok and restarts_ok},
    }
