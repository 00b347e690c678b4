"""What the planner reads from the fleet each interval: every node's ``/load`` and ``/metrics``.

- ``/load`` (a few integers, pdkv/server/app.py): queued prompt tokens (prompts not yet
  prefilled), running and waiting requests, of which waiting for remote KV (``num_remote``);
- ``/metrics`` (Prometheus text): the prompt-token counter (the offered prefill work: counted on
  the nodes that take requests, decode and colocated, so a prompt prefilled remotely is not
  counted twice) and the TTFT and ITL histograms, whose bucket deltas since the last interval
  give the interval's quantiles.

A node that does not answer is left out of this interval (and counted in ``unreachable``); its
counters' baseline is kept, so its next answer yields a delta again. A counter that went down
(the node restarted) starts a new baseline.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from pdkv.planner.decide import Observation

TTFT = "pdkv_time_to_first_token_seconds"
ITL = "pdkv_inter_token_latency_seconds"
PROMPT = "pdkv_prompt_tokens"


def parse_metrics(text: str) -> dict:
    """{'prompt_tokens': float, 'ttft': {le: cumulative count}, 'itl': {...}} from exposition text."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"prompt_tokens": 0.0, "ttft": {}, "itl": {}}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == PROMPT + "_total":
                out["prompt_tokens"] += s.value
            elif s.name in (TTFT + "_bucket", ITL + "_bucket"):
                key = "ttft" if s.name.startswith(TTFT) else "itl"
                le = float(s.labels["le"])
                out[key][le] = out[key].get(le, 0.0) + s.value
    return out


def hist_delta(now: dict, before: dict | None) -> dict:
    if not before:
        return {}
    d = {le: now[le] - before.get(le, 0.0) for le in now}
    return {} if any(v < 0 for v in d.values()) else d  # a restart: no delta this time


def quantile(buckets: dict, q: float) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets {le: count}; None without samples."""
    if not buckets:
        return None
    les = sorted(buckets)
    total = buckets[les[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le in les:
        c = buckets[le]
        if c >= rank:
            if math.isinf(le):
                return prev_le  # past the last finite bucket: its bound, as Prometheus does
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return les[-1]


@dataclass
class NodeSample:
    url: str
    role: str
    load: dict
    metrics: dict


@dataclass
class Observer:
    """Turns successive samples into Observations (keeps each node's last counters)."""

    quantile: float = 0.9
    _last: dict = field(default_factory=dict)  # url -> (t, metrics)

    def observe(self, t: float, samples: list[NodeSample], unreachable: int = 0) -> Observation:
        tps = 0.0
        queued = prompts = 0
        streams = 0.0
        ttft: dict = {}
        itl: dict = {}
        ready: dict = {}
        for s in samples:
            ready[s.role] = ready.get(s.role, 0) + 1
            ld = s.load
            queued += int(ld.get("queued_prompt_tokens", 0))
            if s.role == "prefill":  # waiting and computing jobs
                prompts += int(ld.get("num_waiting", 0)) + int(ld.get("num_running", 0))
            elif s.role in ("decode", "colocated"):  # prompts it prefills itself (remote ones wait for KV)
                prompts += max(0, int(ld.get("num_waiting", 0)) - int(ld.get("num_remote", 0)))
            if s.role in ("decode", "colocated"):
                remote = int(ld.get("num_remote", 0))
                streams += int(ld.get("num_running", 0)) + max(0, int(ld.get("num_waiting", 0)) - remote)
            last = self._last.get(s.url)
            self._last[s.url] = (t, s.metrics)
            if last is None or s.role == "prefill":  # prefill nodes' counters would count prompts twice
                continue
            t0, m0 = last
            dt = t - t0
            dp = s.metrics["prompt_tokens"] - m0["prompt_tokens"]
            if dt > 0 and dp >= 0:
                tps += dp / dt
            for key, acc in (("ttft", ttft), ("itl", itl)):
                for le, v in hist_delta(s.metrics[key], m0[key]).items():
                    acc[le] = acc.get(le, 0.0) + v
        q_ttft, q_itl = quantile(ttft, self.quantile), quantile(itl, self.quantile)
        if unreachable:
            ready["unreachable"] = unreachable
        return Observation(t=t, prompt_tokens_per_s=tps, queued_prompt_tokens=queued, queued_prompts=prompts,
                           decode_streams=streams,
                           ttft_ms=None if q_ttft is None else q_ttft * 1000.0,
                           itl_ms=None if q_itl is None else q_itl * 1000.0, ready=ready)


async def sample_node(session, url: str, role: str, timeout_s: float) -> NodeSample | None:
    """GET /load and /metrics of one node; None if either fails (the node is left out)."""
    import aiohttp

    to = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(url + "/load", timeout=to) as r:
            if r.status != 200:
                return None
            load = await r.json()
        async with session.get(url + "/metrics", timeout=to) as r:
            if r.status != 200:
                return None
            metrics = parse_metrics(await r.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):
        return None
    return NodeSample(url, load.get("role", role) if isinstance(load, dict) else role,
                      load if isinstance(load, dict) else {}, metrics)
