"""Per-node capacities: what one prefill node and one decode node sustain within a latency budget.

``python -m pdkv.bench capacity`` measures them for a model and config and writes a JSON file of
curves (a few load points per role), or an operator writes one with a GPU's numbers::

    {"source": "...", "model": "...",
     "prefill": {"points": [{"tokens_per_s": 2400, "ttft_ms": 180}, ...], "prompt_tokens": 512},
     "decode":  {"points": [{"streams": 8, "itl_ms": 30, "tokens_per_s": 260}, ...],
                 "max_streams": 64}}

A prefill point says "at this throughput the TTFT's p90 was this"; a decode point "with this
many concurrent streams the ITL's p90 was this". The capacity at an SLO is read off the curve by
linear interpolation between the last point inside the budget and the first one past it, as
Dynamo's SLA planner reads its profiles. A budget below the curve's first point cannot be met
by any number of nodes (a lone request already misses it): ``at_slo`` says so by raising
:class:`InfeasibleSLO` with the numbers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from pdkv.config import ConfigError


class InfeasibleSLO(ConfigError):
    """No number of nodes meets this SLO: one node's lightest load already misses it."""


@dataclass(frozen=True)
class RoleCurve:
    """(load, latency_ms) points sorted by load; load = prefill tokens/s or decode streams."""

    role: str
    loads: tuple[float, ...]
    latencies_ms: tuple[float, ...]

    def at_slo(self, slo_ms: float) -> float:
        """The highest load whose latency is within ``slo_ms`` (interpolated); InfeasibleSLO if
        even the lightest measured load misses it."""
        if slo_ms < self.latencies_ms[0]:
            unit = "prefill tokens/s" if self.role == "prefill" else "decode streams"
            what = "TTFT" if self.role == "prefill" else "ITL"
            raise InfeasibleSLO(
                f"no number of {self.role} nodes can meet a {what} SLO of {slo_ms:g} ms: one node at its "
                f"lightest measured load ({self.loads[0]:g} {unit}) already takes {self.latencies_ms[0]:g} ms")
        best = self.loads[0]
        for i in range(1, len(self.loads)):
            lat0, lat1 = self.latencies_ms[i - 1], self.latencies_ms[i]
            if self.latencies_ms[i] <= slo_ms:
                best = max(best, self.loads[i])
                continue
            if lat0 <= slo_ms < lat1:  # the budget lies between two points: interpolate
                f = (slo_ms - lat0) / (lat1 - lat0)
                best = max(best, self.loads[i - 1] + f * (self.loads[i] - self.loads[i - 1]))
            break
        return best


@dataclass(frozen=True)
class Capacities:
    prefill: RoleCurve
    decode: RoleCurve
    max_streams: int | None = None  # decode: KV memory's bound on concurrent streams, whatever the ITL
    source: str = ""

    def prefill_tokens_per_s(self, ttft_ms: float) -> float:
        return self.prefill.at_slo(ttft_ms)

    def decode_streams(self, itl_ms: float) -> float:
        s = self.decode.at_slo(itl_ms)
        return min(s, self.max_streams) if self.max_streams else s

    def decode_itl_ms(self, streams: float) -> float:
        """ITL of one decode node carrying ``streams`` concurrent streams (the curve,
        interpolated; past its last point, extrapolated along its last segment)."""
        return _interp(self.decode.loads, self.decode.latencies_ms, streams)

    def to_json(self) -> dict:
        return {"source": self.source,
                "prefill": {"points": [{"tokens_per_s": lo, "ttft_ms": la}
                                       for lo, la in zip(self.prefill.loads, self.prefill.latencies_ms)]},
                "decode": {"points": [{"streams": lo, "itl_ms": la}
                                      for lo, la in zip(self.decode.loads, self.decode.latencies_ms)],
                           "max_streams": self.max_streams}}


def _interp(xs, ys, x: float) -> float:
    if len(xs) == 1:
        return ys[0]
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            f = (x - xs[i - 1]) / (xs[i] - xs[i - 1]) if xs[i] > xs[i - 1] else 1.0
            return ys[i - 1] + f * (ys[i] - ys[i - 1])
    x0, x1, y0, y1 = xs[-2], xs[-1], ys[-2], ys[-1]
    slope = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
    return y1 + max(0.0, slope) * (x - x1)


def _num(where: str, v, positive: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ConfigError(f"{where} must be a {'positive' if positive else 'non-negative'} number, got {v!r}")
    return float(v)


def _curve(where: str, role: str, sec, load_key: str, lat_key: str) -> RoleCurve:
    if not isinstance(sec, dict):
        raise ConfigError(f"{where}: {role} must be a mapping with 'points'")
    pts = sec.get("points")
    if not isinstance(pts, list) or not pts:
        raise ConfigError(f"{where}: {role}.points must be a non-empty list of "
                          f"{{{load_key}, {lat_key}}} mappings")
    rows = []
    for i, p in enumerate(pts):
        if not isinstance(p, dict):
            raise ConfigError(f"{where}: {role}.points[{i}] must be a mapping, got {p!r}"[:200])
        rows.append((_num(f"{where}: {role}.points[{i}].{load_key}", p.get(load_key)),
                     _num(f"{where}: {role}.points[{i}].{lat_key}", p.get(lat_key))))
    rows.sort()
    # a point at a higher load with a lower latency (noise, or batching paying off) says the lower
    # loads can do at least as well: each latency becomes the least of it and those past it, so
    # the curve rises with load and the SLO reads off it once
    lats = [r[1] for r in rows]
    for i in range(len(lats) - 2, -1, -1):
        lats[i] = min(lats[i], lats[i + 1])
    return RoleCurve(role, tuple(r[0] for r in rows), tuple(lats))


def capacities_from_dict(d, where: str = "capacities") -> Capacities:
    """Checked Capacities from the JSON/YAML mapping above; ConfigError naming the field."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a mapping with 'prefill' and 'decode'")
    for k in ("prefill", "decode"):
        if k not in d:
            raise ConfigError(f"{where}: missing '{k}'")
    ms = (d["decode"] or {}).get("max_streams") if isinstance(d["decode"], dict) else None
    return Capacities(_curve(where, "prefill", d["prefill"], "tokens_per_s", "ttft_ms"),
                      _curve(where, "decode", d["decode"], "streams", "itl_ms"),
                      None if ms is None else int(_num(f"{where}: decode.max_streams", ms)),
                      str(d.get("source", "")))


def load_capacities(path: str | Path) -> Capacities:
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the capacities file: {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError(f"{p}: not JSON: {e}") from None
    return capacities_from_dict(d, str(p))
