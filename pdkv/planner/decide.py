"""The planner's decision: how many prefill and decode nodes the offered load needs (pure code).

Nothing here does I/O or reads a clock: :meth:`Planner.decide` is handed an :class:`Observation`
(what the fleet measured over the last interval, with its time) and returns a :class:`Plan`.
The live planner (pdkv/planner/service.py) and the fleet simulator (pdkv/bench/fleet_sim.py)
call the same code, so what the simulator shows is what the planner does.

Per role, as Dynamo's SLA planner does, the load is divided by what one node sustains within the
SLO (pdkv/planner/capacity.py):

- prefill: offered prompt tokens/s (averaged over ``rate_window_s``) plus the backlog (prompt
  tokens queued, not yet computed) drained over ``backlog_horizon_s`` -- but no more than its
  prompts can use, one node each --, over one node's prefill tokens/s at ``slo.ttft_ms``;
- decode: concurrent streams (running + waiting on decode nodes) over one node's streams at
  ``slo.itl_ms``.

Hysteresis: a role grows when its load needs more nodes at ``target_utilization`` of their
capacity; it shrinks only when the load would fit the smaller fleet at the lower
``scale_down_utilization``, has done so for ``scale_down_stable_s`` without a break, and the
role's last change is ``scale_down_cooldown_s`` old; by one node, or ``scale_down_fraction`` of a
big fleet, never below what the load needs at that lower band. Growth reads the
larger of the latest sample and its moving average (react at once), shrinking the average
only. A measured latency over its SLO while the capacity model says the fleet suffices adds a
node (the model is wrong somewhere: trust the measurement) and blocks any shrink.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdkv.planner.capacity import Capacities

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Policy:
    ttft_ms: float
    itl_ms: float
    min_nodes: dict = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    max_nodes: dict = field(default_factory=lambda: {"prefill": 8, "decode": 8})
    target_utilization: float = 0.8
    scale_down_utilization: float = 0.6
    scale_up_cooldown_s: float = 0.0
    scale_down_cooldown_s: float = 60.0
    scale_down_stable_s: float = 30.0
    max_step_up: int = 1 << 20
    scale_down_fraction: float = 0.25  # a shrink removes max(1, this share of the role's nodes), never
    # below what the load needs at scale_down_utilization: one at a time for a few nodes, a quarter of a big fleet
    backlog_horizon_s: float | None = None  # None: max(ttft, 2 intervals)
    rate_window_s: float = 30.0  # prompt tokens/s averaged over this window (a lone long prompt is no trend)
    interval_s: float = 5.0
    smoothing: float = 0.3  # weight of the newest sample in the moving averages


@dataclass(frozen=True)
class Observation:
    t: float  # seconds on any monotonic clock
    prompt_tokens_per_s: float  # prompt tokens admitted per second over the last interval
    queued_prompt_tokens: int  # prompt tokens waiting to be prefilled, all nodes
    decode_streams: float  # requests running or waiting on decode nodes
    queued_prompts: int | None = None  # prompts not prefilled yet, computing ones included (None: unknown);
    # k prompts use at most k nodes
    ttft_ms: float | None = None  # measured TTFT quantile over the last interval (None: no sample)
    itl_ms: float | None = None
    ready: dict = field(default_factory=dict)  # role -> nodes that answered (for the report)


@dataclass
class Plan:
    t: float
    desired: dict
    previous: dict
    reasons: dict
    demand: dict
    capacity: dict
    changed: bool

    def to_json(self) -> dict:
        return {"t": self.t, "desired": dict(self.desired), "previous": dict(self.previous),
                "changed": self.changed, "reasons": {r: list(v) for r, v in self.reasons.items()},
                "demand": self.demand, "capacity_per_node": self.capacity}


class Planner:
    """Stateful across intervals (averages, cool-downs); one ``decide`` per interval."""

    def __init__(self, policy: Policy, caps: Capacities, initial: dict | None = None):
        for r in ROLES:
            lo, hi = policy.min_nodes[r], policy.max_nodes[r]
            if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi and hi >= 1):
                raise ValueError(f"planner: {r} needs 0 <= min_nodes <= max_nodes (>= 1), got {lo}..{hi}")
        if not 0 < policy.scale_down_utilization < policy.target_utilization <= 1:
            raise ValueError("planner: need 0 < scale_down_utilization < target_utilization <= 1, got "
                             f"{policy.scale_down_utilization} and {policy.target_utilization}")
        self.policy = policy
        self.caps = caps
        # raises InfeasibleSLO (a ConfigError) naming the role when no count can meet an SLO
        self.cap = {"prefill": caps.prefill_tokens_per_s(policy.ttft_ms), "decode": caps.decode_streams(policy.itl_ms)}
        start = initial or {}
        self.desired = {r: min(max(int(start.get(r, policy.min_nodes[r])), policy.min_nodes[r]),
                               policy.max_nodes[r]) for r in ROLES}
        self._avg: dict[str, float | None] = {r: None for r in ROLES}
        self._last_change = {r: -math.inf for r in ROLES}
        self._fits_smaller_since: dict[str, float | None] = {r: None for r in ROLES}
        self.last: Plan | None = None
        self._window: list[tuple[float, float]] = []  # (t, prompt tokens/s) of the last rate_window_s

    def _smooth(self, role: str, x: float) -> float:
        a = self._avg[role]
        self._avg[role] = x if a is None else a + self.policy.smoothing * (x - a)
        return self._avg[role]

    def decide(self, obs: Observation) -> Plan:
        p = self.policy
        horizon = p.backlog_horizon_s or max(p.ttft_ms / 1000.0, 2 * p.interval_s)
        win = self._window
        win.append((obs.t, obs.prompt_tokens_per_s))
        while len(win) > 1 and obs.t - win[0][0] >= max(p.rate_window_s, p.interval_s):
            win.pop(0)
        rate = sum(x for _, x in win) / len(win)
        backlog = obs.queued_prompt_tokens / horizon
        if obs.queued_prompts is not None:  # one prompt is computed by one node: k queued use k at most
            backlog = min(backlog, obs.queued_prompts * self.cap["prefill"] * p.target_utilization)
        now_load = {"prefill": rate + backlog, "decode": float(obs.decode_streams)}
        avg = {r: self._smooth(r, now_load[r]) for r in ROLES}
        over = {"prefill": obs.ttft_ms is not None and obs.ttft_ms > p.ttft_ms,
                "decode": obs.itl_ms is not None and obs.itl_ms > p.itl_ms}
        measured = {"prefill": ("TTFT", obs.ttft_ms, p.ttft_ms), "decode": ("ITL", obs.itl_ms, p.itl_ms)}
        units = {"prefill": "prompt tokens/s", "decode": "streams"}
        previous = dict(self.desired)
        reasons: dict[str, list[str]] = {r: [] for r in ROLES}
        for r in ROLES:
            cur, cap = self.desired[r], self.cap[r]
            up_load = max(now_load[r], avg[r])
            need_up = math.ceil(up_load / (cap * p.target_utilization) - 1e-9) if up_load > 0 else 0
            need_down = math.ceil(avg[r] / (cap * p.scale_down_utilization) - 1e-9) if avg[r] > 0 else 0
            name, val, slo = measured[r]
            why = reasons[r]
            want = cur
            if need_up > cur:
                want = need_up
                why.append(f"load {up_load:.1f} {units[r]} needs {need_up} node(s) at {p.target_utilization:.0%} of "
                           f"{cap:.1f} per node (have {cur})")
            elif over[r] and r == "prefill" and obs.queued_prompts is not None and obs.queued_prompts <= cur:
                # every unfinished prompt has a node to itself: a TTFT over the SLO is the prompts' own
                # length, which no further node shortens (it still blocks shrinking)
                why.append(f"measured TTFT {val:.0f} ms > SLO {slo:g} ms with no prompt waiting behind another "
                           f"({obs.queued_prompts} on {cur} node(s)): long prompts, not too few nodes")
            elif over[r]:
                want = cur + 1
                why.append(f"measured {name} {val:.0f} ms > SLO {slo:g} ms although the load ({up_load:.1f} "
                           f"{units[r]}) fits {cur} node(s): one more")
            if want > cur:
                self._fits_smaller_since[r] = None
                if obs.t - self._last_change[r] < p.scale_up_cooldown_s:
                    why.append(f"held: scale-up cool-down ({p.scale_up_cooldown_s:g} s) since the last change")
                    continue
                hi = p.max_nodes[r]
                new = min(want, cur + p.max_step_up, hi)
                if want > hi:
                    why.append(f"SLO not met: {want} node(s) needed, max_nodes is {hi}")
                if new != cur:
                    self.desired[r] = new
                    self._last_change[r] = obs.t
                continue
            # shrink? only below the lower band, measured latency within its SLO, stable and cooled down
            if need_down < cur and cur > p.min_nodes[r] and not over[r]:
                since = self._fits_smaller_since[r]
                if since is None:
                    since = self._fits_smaller_since[r] = obs.t
                if obs.t - since < p.scale_down_stable_s:
                    why.append(f"load {avg[r]:.1f} {units[r]} fits {max(need_down, p.min_nodes[r])} node(s) for "
                               f"{obs.t - since:.0f} s of the {p.scale_down_stable_s:g} s needed to shrink")
                elif obs.t - self._last_change[r] < p.scale_down_cooldown_s:
                    why.append(f"held: scale-down cool-down ({p.scale_down_cooldown_s:g} s) since the last change")
                else:
                    step = max(1, int(cur * p.scale_down_fraction))
                    new = max(need_down, p.min_nodes[r], cur - step)
                    self.desired[r] = new
                    self._last_change[r] = obs.t
                    self._fits_smaller_since[r] = obs.t  # the next step down waits its own stable span
                    why.append(f"load {avg[r]:.1f} {units[r]} fits {max(need_down, p.min_nodes[r])} node(s) at "
                               f"{p.scale_down_utilization:.0%}: {cur - new} fewer")
            else:
                self._fits_smaller_since[r] = None
                if not why:
                    why.append(f"steady: load {up_load:.1f} {units[r]} on {cur} node(s) of {cap:.1f}")
        plan = Plan(obs.t, dict(self.desired), previous, reasons,
                    {"prefill_tokens_per_s": round(now_load["prefill"], 2),
                     "decode_streams": round(now_load["decode"], 2),
                     "prefill_avg": round(avg["prefill"], 2), "decode_avg": round(avg["decode"], 2),
                     "ttft_ms": obs.ttft_ms, "itl_ms": obs.itl_ms, "ready": dict(obs.ready)},
                    {"prefill_tokens_per_s": round(self.cap["prefill"], 2),
                     "decode_streams": round(self.cap["decode"], 2)},
                    self.desired != previous)
        self.last = plan
        return plan
