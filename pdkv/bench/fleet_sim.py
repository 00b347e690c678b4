"""`python -m pdkv.bench fleet-sim`: a trace through N prefill and M decode nodes, simulated, with
the planner's real decision code (pdkv/planner/decide.py) sizing the managed fleet.

    python -m pdkv.bench fleet-sim --trace azure_conv --capacities docs/fleet/capacity-local-cpu.json \\
        --ttft-ms 30000 --itl-ms 100 --loads 1,10,100,1000 --out docs/fleet/azure_conv-local.json

Traces: ``mooncake_conversation``, ``mooncake_synthetic``, ``azure_code``, ``azure_conv`` (the
files in ../shared/traces, found from --traces-dir) or a path to a file of either format.

The model (discrete events, one heap):

- a request arrives at the trace's time; the prefill node with the fewest queued prompt tokens
  takes it (what the decode nodes' chooser does, pdkv/disagg/choice.py); a prefill node computes
  one prompt at a time, first come first served, at its saturation rate (the capacity curve's
  highest tokens/s), so TTFT = its queue + its own prompt / rate + ``--transfer-ms``;
- then the decode node with the fewest streams takes it; a decode node advances all its streams
  together, one token every ITL(b) for b streams (the capacity curve, interpolated), at most
  ``max_streams`` at once (KV memory), the rest wait; a request's ITL is its mean gap;
- the planner's fleet: every ``--interval-s`` the simulator hands ``Planner.decide`` what the
  live planner reads from /load and /metrics (prompt tokens/s admitted, queued prompt tokens,
  decode streams, the interval's p90 TTFT and ITL); a node it adds serves after ``--startup-s``,
  a node it removes takes nothing new, finishes its work, then goes. Node-hours count every node
  from its start to its exit (loading and draining included).

Load: ``1x`` is the rate at which the trace's mean demand fills one prefill + one decode node to
their capacity at the SLOs (the busier of the two roles); ``Kx`` multiplies the arrival rate by
that factor: each request becomes floor(m) or floor(m)+1 requests (m = the multiplier), copies
shifted by up to ``--jitter-s`` (uniform, seeded), so the trace's shape (bursts, lengths, hours)
is kept. Requests still unfinished ``--tail-s`` after the last arrival count as missing the SLO.

Outputs: a table on stdout, ``--out`` JSON, ``--plot`` PNG (matplotlib) of attainment and
node-hours per load and the managed fleet's node counts over time.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import json
import math
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from pdkv.planner.capacity import Capacities, load_capacities
from pdkv.planner.decide import Observation, Planner, Policy

TRACES = {"mooncake_conversation": "mooncake_conversation_trace.jsonl",
          "mooncake_synthetic": "mooncake_synthetic_trace.jsonl",
          "azure_code": "azure_llm_2023_code.csv", "azure_conv": "azure_llm_2023_conv.csv"}


def load_trace(name: str, traces_dir: Path) -> list[tuple[float, int, int]]:
    """[(arrival s from the first, prompt tokens, output tokens)], sorted by arrival."""
    path = Path(name) if Path(name).exists() else traces_dir / TRACES.get(name, name)
    if not path.exists():
        raise SystemExit(f"fleet-sim: no trace {name!r} (known: {', '.join(TRACES)}; or a file path); "
                         f"looked for {path}")
    rows = []
    if path.suffix == ".jsonl":
        with open(path) as f:
            for line in f:
                if line.strip():
                    d = json.loads(line)
                    rows.append((d["timestamp"] / 1000.0, int(d["input_length"]), int(d["output_length"])))
    else:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                ts = r["TIMESTAMP"].strip()
                head, _, frac = ts.partition(".")
                t = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp() + float("0." + (frac or "0"))
                rows.append((t, int(r["ContextTokens"]), int(r["GeneratedTokens"])))
    rows.sort()
    t0 = rows[0][0]
    return [(t - t0, i, o) for t, i, o in rows]


def unit_rate(trace, caps: Capacities, ttft_ms: float, itl_ms: float) -> tuple[float, dict]:
    """The multiplier of the trace's rate at which one prefill + one decode node are at their
    capacity at the SLOs on average (the busier role), and each role's share at 1x."""
    span = max(1.0, trace[-1][0] - trace[0][0])
    prompt_tps = sum(r[1] for r in trace) / span
    decode_tps = sum(max(0, r[2] - 1) for r in trace) / span
    p_units = prompt_tps / caps.prefill_tokens_per_s(ttft_ms)
    streams = caps.decode_streams(itl_ms)
    d_units = decode_tps / (streams / (caps.decode_itl_ms(streams) / 1000.0))
    m1 = 1.0 / max(p_units, d_units)
    return m1, {"prefill_nodes_at_native_rate": round(p_units, 3), "decode_nodes_at_native_rate": round(d_units, 3),
                "bottleneck": "prefill" if p_units >= d_units else "decode"}


def scale_trace(trace, mult: float, jitter_s: float, seed: int) -> list[tuple[float, int, int]]:
    rng = random.Random(seed)
    out = []
    whole, frac = int(mult), mult - int(mult)
    for t, i, o in trace:
        n = whole + (1 if rng.random() < frac else 0)
        for k in range(n):
            out.append((t + (rng.random() * jitter_s if k or mult < 1 else 0.0), i, o))
    out.sort()
    return out


@dataclass
class Req:
    arrival: float
    prompt: int
    out: int
    first: float = math.nan
    done: float = math.nan
    itl: float = 0.0
    activated: float = math.nan


@dataclass
class PNode:
    ready_at: float
    started: float
    queue: deque = field(default_factory=deque)
    busy: Req | None = None
    busy_until: float = 0.0
    queued_tokens: float = 0.0
    draining: bool = False
    gone: float | None = None


@dataclass
class DNode:
    ready_at: float
    started: float
    v: float = 0.0  # tokens every active stream has advanced
    t: float = 0.0
    active: list = field(default_factory=list)  # heap of (v at which it finishes, seq, Req)
    waiting: deque = field(default_factory=deque)
    version: int = 0
    draining: bool = False
    gone: float | None = None


class FleetSim:
    def __init__(self, caps: Capacities, fleet: dict | None, policy: Policy | None, startup_s: float,
                 transfer_ms: float, interval_s: float):
        self.caps = caps
        self.rate = max(caps.prefill.loads)  # a prefill node's saturation tokens/s
        self.max_streams = caps.max_streams or int(max(caps.decode.loads))
        self.startup_s = startup_s
        self.transfer_s = transfer_ms / 1000.0
        self.interval_s = interval_s
        self.planner = Planner(policy, caps, initial=fleet) if policy is not None else None
        init = fleet or {"prefill": 1, "decode": 1}
        self.p = [PNode(0.0, 0.0) for _ in range(init["prefill"])]
        self.d = [DNode(0.0, 0.0) for _ in range(init["decode"])]
        self.events: list = []
        self.seq = 0
        self.timeline: list[tuple[float, int, int]] = []
        self._win_prompt = 0
        self._win_ttft: list[float] = []
        self._live_cache: dict = {}
        self.rng = random.Random(1)
        self.warm = True
        self.initial = dict(init)

    def push(self, t: float, kind: str, a=None, b=None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    # ---- choosing a node: the exact least loaded of a small fleet, else the lesser of CHOICES drawn
    # at random (the power of d choices: a router's O(1) answer, and the simulator's at 1000s of nodes)
    CHOICES = 4

    def _live(self, nodes: list, now: float) -> list:
        key = id(nodes)
        cached = self._live_cache.get(key)
        if cached is None or cached[0] > now or (cached[1] is not None and cached[1] <= now):
            live = [n for n in nodes if n.gone is None and not n.draining]
            ready = [n for n in live if n.ready_at <= now]
            if not ready:  # every node still loading: the first to be ready takes it
                ready = [min(live, key=lambda n: n.ready_at)]
            pending = [n.ready_at for n in live if n.ready_at > now]
            cached = self._live_cache[key] = (now, min(pending) if pending else None, ready)
        return cached[2]

    def _pick(self, nodes: list, now: float, load):
        live = self._live(nodes, now)
        if len(live) > 2 * self.CHOICES:
            live = [live[self.rng.randrange(len(live))] for _ in range(self.CHOICES)]
        return min(live, key=load)

    # ---- prefill ----

    def _start_prefill(self, n: PNode, now: float) -> None:
        if n.busy is None and n.queue:
            r = n.queue.popleft()
            n.busy = r
            n.busy_until = now + r.prompt / self.rate
            self.push(n.busy_until, "pdone", n, r)

    def arrive(self, r: Req, now: float) -> None:
        self._win_prompt += r.prompt
        n = self._pick(self.p, now, lambda n: n.queued_tokens)
        n.queue.append(r)
        n.queued_tokens += r.prompt
        if n.ready_at <= now:
            self._start_prefill(n, now)

    def prefill_done(self, n: PNode, r: Req, now: float) -> None:
        n.busy = None
        n.queued_tokens -= r.prompt
        r.first = now + self.transfer_s
        self._win_ttft.append(r.first - r.arrival)
        self._start_prefill(n, now)
        if n.draining and n.busy is None and not n.queue:
            n.gone = now
        if r.out <= 1:
            r.done = r.first
        else:
            self.push(r.first, "decode_in", r)

    # ---- decode ----
    def _advance(self, n: DNode, now: float) -> None:
        if n.active and now > n.t:
            n.v += (now - n.t) / (self.caps.decode_itl_ms(len(n.active)) / 1000.0)
        n.t = now

    def _reschedule(self, n: DNode, now: float) -> None:
        n.version += 1
        if n.active:
            itl = self.caps.decode_itl_ms(len(n.active)) / 1000.0
            self.push(now + max(0.0, n.active[0][0] - n.v) * itl, "ddone", n, n.version)

    def _activate(self, n: DNode, r: Req, now: float) -> None:
        r.activated = now
        self.seq += 1
        heapq.heappush(n.active, (n.v + (r.out - 1), self.seq, r))

    def decode_in(self, r: Req, now: float) -> None:
        n = self._pick(self.d, now, lambda n: len(n.active) + len(n.waiting))
        self._advance(n, now)
        if len(n.active) < self.max_streams and n.ready_at <= now:
            self._activate(n, r, now)
        else:
            n.waiting.append(r)
            if n.ready_at > now:
                self.push(n.ready_at, "dready", n)
        self._reschedule(n, now)

    def decode_check(self, n: DNode, version: int, now: float) -> None:
        if version != n.version:
            return
        self._advance(n, now)
        while n.active and n.active[0][0] <= n.v + 1e-9:
            _, _, r = heapq.heappop(n.active)
            r.done = now
            r.itl = (now - r.first) / max(1, r.out - 1)
        while n.waiting and len(n.active) < self.max_streams:
            self._activate(n, n.waiting.popleft(), now)
        if n.draining and not n.active and not n.waiting:
            n.gone = now
        self._reschedule(n, now)

    def dready(self, n: DNode, now: float) -> None:
        self._advance(n, now)
        while n.waiting and len(n.active) < self.max_streams:
            self._activate(n, n.waiting.popleft(), now)
        self._reschedule(n, now)

    # ---- the planner in the loop ----
    def tick(self, now: float) -> None:
        streams = sum(len(n.active) + len(n.waiting) for n in self.d if n.gone is None)
        queued = sum(n.queued_tokens for n in self.p if n.gone is None)
        if self.planner is not None:
            ttft = sorted(self._win_ttft)
            itls = [self.caps.decode_itl_ms(len(n.active)) for n in self.d if n.gone is None and n.active]
            prompts = sum(len(n.queue) + (n.busy is not None) for n in self.p if n.gone is None)
            obs = Observation(t=now, prompt_tokens_per_s=self._win_prompt / self.interval_s,
                              queued_prompt_tokens=int(queued), queued_prompts=prompts, decode_streams=streams,
                              ttft_ms=ttft[int(0.9 * (len(ttft) - 1))] * 1000.0 if ttft else None,
                              itl_ms=sorted(itls)[int(0.9 * (len(itls) - 1))] if itls else None)
            plan = self.planner.decide(obs)
            self._apply(plan.desired, now)
        self._win_prompt, self._win_ttft = 0, []
        self.timeline.append((now, sum(1 for n in self.p if n.gone is None), sum(1 for n in self.d if n.gone is None)))

    def _apply(self, desired: dict, now: float) -> None:
        self._live_cache.clear()
        for role, nodes, cls in (("prefill", self.p, PNode), ("decode", self.d, DNode)):
            live = [n for n in nodes if n.gone is None and not n.draining]
            for _ in range(desired[role] - len(live)):
                nodes.append(cls(now + self.startup_s, now, t=now) if cls is DNode else cls(now + self.startup_s, now))
                if cls is PNode:
                    self.push(now + self.startup_s, "pready", nodes[-1])
            extra = len(live) - desired[role]
            if extra > 0:
                load = (lambda n: n.queued_tokens) if cls is PNode else (lambda n: len(n.active) + len(n.waiting))
                for n in sorted(live, key=lambda n: (load(n), -n.started))[:extra]:
                    n.draining = True
                    if (cls is PNode and n.busy is None and not n.queue) or \
                            (cls is DNode and not n.active and not n.waiting):
                        n.gone = now
        # a live node list is never empty: the planner's min_nodes >= 1 keeps one of each

    def warm_start(self, trace, window_s: float = 60.0) -> dict:
        """The managed fleet as the planner sizes it for the trace's first ``window_s`` (ready at 0):
        an hour of a trace is a sample of traffic that was flowing before it, not a cold start
        (without this, every load starts on 1P:1D and waits --startup-s for its first nodes)."""
        head = [r for r in trace if r[0] < window_s] or trace[:1]
        span = max(1.0, min(window_s, trace[-1][0] if trace else 1.0))
        tps = sum(r[1] for r in head) / span
        streams = sum(max(0, r[2] - 1) for r in head) / span * self.caps.decode_itl_ms(
            self.planner.cap["decode"]) / 1000.0  # Little: arrivals/s x tokens x ITL at the SLO's load
        plan = self.planner.decide(Observation(t=-1.0, prompt_tokens_per_s=tps, queued_prompt_tokens=0,
                                               decode_streams=streams))
        self.p = [PNode(0.0, 0.0) for _ in range(plan.desired["prefill"])]
        self.d = [DNode(0.0, 0.0) for _ in range(plan.desired["decode"])]
        return plan.desired

    def run(self, trace, tail_s: float) -> dict:
        reqs = [Req(t, i, o) for t, i, o in trace]
        if self.planner is not None and self.warm:
            self.initial = self.warm_start(trace)
        end = (trace[-1][0] if trace else 0.0) + tail_s
        for k in range(int(end / self.interval_s) + 1):
            self.push(k * self.interval_s + 1e-6, "tick")
        ai = 0
        now = 0.0
        while True:
            nxt_arr = reqs[ai].arrival if ai < len(reqs) else math.inf
            nxt_ev = self.events[0][0] if self.events else math.inf
            if min(nxt_arr, nxt_ev) > end or (nxt_arr == math.inf and nxt_ev == math.inf):
                break
            if nxt_arr <= nxt_ev:
                now = nxt_arr
                self.arrive(reqs[ai], now)
                ai += 1
                continue
            now, _, kind, a, b = heapq.heappop(self.events)
            if kind == "pdone":
                self.prefill_done(a, b, now)
            elif kind == "decode_in":
                self.decode_in(a, now)
            elif kind == "ddone":
                self.decode_check(a, b, now)
            elif kind == "dready":
                self.dready(a, now)
            elif kind == "pready":
                self._start_prefill(a, now)
            elif kind == "tick":
                self.tick(now)
        stop = end  # every fleet is counted over the same window: the trace plus the tail
        node_s = 0.0
        for n in self.p + self.d:
            node_s += max(0.0, (n.gone if n.gone is not None else stop) - n.started)
        return self._report(reqs, node_s, stop)

    def _report(self, reqs, node_s: float, stop: float) -> dict:
        return {"requests": len(reqs), "node_hours": node_s / 3600.0, "span_s": stop, "reqs": reqs}


def summarize(reqs, ttft_ms: float, itl_ms: float, rate: float, transfer_ms: float = 0.0) -> dict:
    ttft = sorted((r.first - r.arrival) * 1000.0 if r.first == r.first else math.inf for r in reqs)
    itl = sorted(r.itl * 1000.0 if r.done == r.done else math.inf for r in reqs if r.out > 1)
    ok = sum(1 for r in reqs if r.done == r.done and (r.first - r.arrival) * 1000.0 <= ttft_ms
             and (r.out <= 1 or r.itl * 1000.0 <= itl_ms))
    unfinished = sum(1 for r in reqs if r.done != r.done)
    # prompts that alone, on an idle node, take longer than the TTFT SLO: no count of nodes helps them
    infeasible = sum(1 for r in reqs if r.prompt / rate * 1000.0 + transfer_ms > ttft_ms)

    def p(xs, q):
        if not xs:
            return None
        v = xs[min(len(xs) - 1, int(q * len(xs)))]
        return None if math.isinf(v) else round(v, 1)
    return {"slo_attainment": round(ok / max(1, len(reqs)), 4), "ttft_p50_ms": p(ttft, 0.5),
            "ttft_p99_ms": p(ttft, 0.99), "itl_p50_ms": p(itl, 0.5), "itl_p99_ms": p(itl, 0.99),
            "unfinished": unfinished, "infeasible_share": round(infeasible / max(1, len(reqs)), 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdkv.bench fleet-sim", description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="azure_conv")
    ap.add_argument("--traces-dir", default=None, help="default: ../shared/traces from the repository")
    ap.add_argument("--capacities", required=True, help="JSON of python -m pdkv.bench capacity, or a GPU's numbers")
    ap.add_argument("--ttft-ms", type=float, required=True)
    ap.add_argument("--itl-ms", type=float, required=True)
    ap.add_argument("--loads", default="1,10,100,1000", help="multiples of 1x (see the module doc)")
    ap.add_argument("--unit-rate", type=float, default=None,
                    help="1x as a multiple of the trace's native rate (default: one pair of --capacities' nodes "
                         "filled; give this machine's 1x to run GPU capacities at multiples of this machine's load)")
    ap.add_argument("--fleets", default="1p1d,1p3d,planner")
    ap.add_argument("--cold-start", action="store_true",
                    help="the managed fleet starts at 1P:1D (default: sized by the planner for the first minute)")
    ap.add_argument("--max-nodes", type=int, default=4096, help="the planner's max_nodes per role")
    ap.add_argument("--interval-s", type=float, default=10.0)
    ap.add_argument("--startup-s", type=float, default=60.0, help="a new node's time to serve")
    ap.add_argument("--transfer-ms", type=float, default=0.0, help="KV transfer added to every TTFT")
    ap.add_argument("--scale-down-cooldown-s", type=float, default=120.0)
    ap.add_argument("--scale-down-stable-s", type=float, default=60.0)
    ap.add_argument("--jitter-s", type=float, default=3.0)
    ap.add_argument("--tail-s", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    root = Path(__file__).resolve().parents[2]
    # ../shared/traces beside the checkout (a worktree one level deeper: beside its parent)
    tdir = Path(a.traces_dir) if a.traces_dir else next(
        (p / "shared" / "traces" for p in (root.parent, root.parent.parent) if (p / "shared" / "traces").is_dir()),
        root.parent / "shared" / "traces")
    from pdkv.config import ConfigError

    try:  # a capacities file that is not one, or an SLO no count of these nodes meets: one line, status 2
        caps = load_capacities(a.capacities)
        trace = load_trace(a.trace, tdir)
        m1, share = unit_rate(trace, caps, a.ttft_ms, a.itl_ms)
    except ConfigError as e:
        print(f"fleet-sim: {e}", file=sys.stderr)
        return 2
    if a.unit_rate is not None:
        share["one_pair_of_these_nodes_at"] = f"{m1:.4g} x native"
        m1 = a.unit_rate
    policy = Policy(ttft_ms=a.ttft_ms, itl_ms=a.itl_ms, min_nodes={"prefill": 1, "decode": 1},
                    max_nodes={"prefill": a.max_nodes, "decode": a.max_nodes}, interval_s=a.interval_s,
                    scale_down_cooldown_s=a.scale_down_cooldown_s, scale_down_stable_s=a.scale_down_stable_s)
    fleets = {"1p1d": {"prefill": 1, "decode": 1}, "1p3d": {"prefill": 1, "decode": 3}, "planner": None}
    results = []
    timelines = {}
    print(f"fleet-sim: trace {a.trace}: {len(trace)} requests over {trace[-1][0] / 3600:.2f} h; 1x = "
          f"{m1:.4g} x its native rate ({share}); capacities: {caps.source or a.capacities}; SLO TTFT "
          f"{a.ttft_ms:g} ms, ITL {a.itl_ms:g} ms", flush=True)
    print(f"{'load':>6} {'fleet':>8} {'requests':>9} {'attain':>7} {'node-h':>9} {'ttft p99 ms':>12} "
          f"{'itl p99 ms':>11} {'unfinished':>10} {'peak P/D':>10} {'sim s':>6} {'infeasible':>10}")
    for k in [float(x) for x in a.loads.split(",")]:
        scaled = scale_trace(trace, k * m1, a.jitter_s, a.seed)
        for name in a.fleets.split(","):
            t0 = time.perf_counter()
            sim = FleetSim(caps, fleets[name], policy if name == "planner" else None, a.startup_s, a.transfer_ms,
                           a.interval_s)
            sim.warm = not a.cold_start
            rep = sim.run(scaled, a.tail_s)
            s = summarize(rep["reqs"], a.ttft_ms, a.itl_ms, sim.rate, a.transfer_ms)
            peak = (max(t[1] for t in sim.timeline), max(t[2] for t in sim.timeline)) if sim.timeline else (0, 0)
            row = {"load": k, "fleet": name, "initial": sim.initial, "requests": rep["requests"],
                   "node_hours": round(rep["node_hours"], 2),
                   "peak_prefill": peak[0], "peak_decode": peak[1], **s,
                   "sim_wall_s": round(time.perf_counter() - t0, 1)}
            results.append(row)
            if name == "planner":
                step = max(1, len(sim.timeline) // 400)
                timelines[str(k)] = sim.timeline[::step]
            fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
            print(f"{k:>5g}x {name:>8} {row['requests']:>9} {row['slo_attainment']:>7.3f} {row['node_hours']:>9.2f} "
                  f"{fmt(row['ttft_p99_ms']):>12} {fmt(row['itl_p99_ms']):>11} {row['unfinished']:>10} "
                  f"{peak[0]:>4}/{peak[1]:<5} {row['sim_wall_s']:>6} {row['infeasible_share']:>10.3f}", flush=True)
    out = {"trace": a.trace, "requests_native": len(trace), "hours": round(trace[-1][0] / 3600, 3),
           "unit_rate_multiplier": m1, "unit_share": share, "capacities": a.capacities,
           "capacities_source": caps.source, "slo": {"ttft_ms": a.ttft_ms, "itl_ms": a.itl_ms},
           "args": vars(a), "load_average": os.getloadavg()[0], "results": results, "planner_timeline": timelines}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    if a.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("fleet-sim: matplotlib is not installed: no plot", file=sys.stderr)
            return 0
        fig, ax = plt.subplots(1, 3, figsize=(15, 4))
        for name in a.fleets.split(","):
            rows = [r for r in results if r["fleet"] == name]
            ax[0].plot([r["load"] for r in rows], [r["slo_attainment"] for r in rows], "o-", label=name)
            ax[1].plot([r["load"] for r in rows], [r["node_hours"] for r in rows], "o-", label=name)
        for a_ in ax[:2]:
            a_.set_xscale("log")
            a_.set_xlabel("load (x one 1P:1D pair's capacity)")
            a_.legend()
        ax[0].set_ylabel("SLO attainment")
        ax[1].set_ylabel("node-hours")
        ax[1].set_yscale("log")
        for k, tl in timelines.items():
            ax[2].plot([t[0] / 3600 for t in tl], [t[1] + t[2] for t in tl], label=f"{k}x: P+D")
        ax[2].set_yscale("log")
        ax[2].set_xlabel("hours")
        ax[2].set_ylabel("planner's nodes (prefill + decode)")
        ax[2].legend()
        fig.suptitle(f"fleet-sim {a.trace}: SLO TTFT {a.ttft_ms:g} ms, ITL {a.itl_ms:g} ms")
        fig.tight_layout()
        fig.savefig(a.plot, dpi=90)
    return 0
