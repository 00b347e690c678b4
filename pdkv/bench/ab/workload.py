"""From a trace slice to the replayed workload: time scaling, length scaling, clipping, classes.

    arrival'  = arrival x time_scale            (or rescaled so the slice's mean rate is --rate)
    input'    = round(input x length_scale)     output' = round(output x output_scale)
    clip      = only with --clip: prompts cut so input' + output' <= max_model_len

Without --clip, a request that still does not fit is an error naming it and the largest length
scale that would fit every request. Ties in arrival time (the Mooncake traces quantise arrivals
into ~3 s buckets) can be spread evenly over the gap to the next distinct arrival, so a bucket
becomes a ramp rather than one burst; both are reported.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdkv.bench.ab.traces import Trace, TraceError


@dataclass(frozen=True)
class Scaling:
    time_scale: float | None = None  # multiply arrival offsets; None: derived from rate (or 1)
    rate: float | None = None  # mean requests/s of the replay; wins over time_scale
    length_scale: float = 1.0
    output_scale: float = 1.0
    max_model_len: int = 2048
    clip: bool = False
    spread_ties: bool = True
    long_prompt: int = 256  # prompts of at least this many tokens (after scaling) are "long"


@dataclass(frozen=True)
class WorkItem:
    id: str
    row: int  # the trace row it came from
    offset_s: float  # scheduled send time after the replay's start
    prompt_len: int
    max_tokens: int
    prompt_class: str  # short | long
    hash_ids: tuple[int, ...]
    clipped: bool


@dataclass(frozen=True)
class Workload:
    items: tuple[WorkItem, ...]
    time_scale: float
    block_tokens: int  # tokens per hash_id after length scaling
    num_clipped: int
    num_ties_spread: int

    @property
    def duration_s(self) -> float:
        return self.items[-1].offset_s if self.items else 0.0


def _spread(arrivals: list[float]) -> tuple[list[float], int]:
    out, i, n, spread = list(arrivals), 0, len(arrivals), 0
    gaps = [b - a for a, b in zip(sorted(set(arrivals)), sorted(set(arrivals))[1:])]
    default_gap = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
    while i < n:
        j = i
        while j + 1 < n and arrivals[j + 1] == arrivals[i]:
            j += 1
        if j > i:
            gap = (arrivals[j + 1] - arrivals[i]) if j + 1 < n else default_gap
            for k in range(i, j + 1):
                out[k] = arrivals[i] + gap * (k - i) / (j - i + 1)
            spread += j - i + 1
        i = j + 1
    return out, spread


def build_workload(trace: Trace, s: Scaling) -> Workload:
    reqs = trace.requests
    arrivals = [r.arrival_s for r in reqs]
    spread = 0
    if s.spread_ties:
        arrivals, spread = _spread(arrivals)
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
    if s.rate is not None:
        if s.rate <= 0:
            raise TraceError(f"--rate must be positive, got {s.rate}")
        # n requests over the span: n-1 gaps at the target rate
        ts = (len(reqs) - 1) / s.rate / span if span > 0 else 1.0
    else:
        ts = 1.0 if s.time_scale is None else s.time_scale
        if ts <= 0:
            raise TraceError(f"--time-scale must be positive, got {ts}")
    block = max(1, round(trace.block_tokens * s.length_scale))
    items, misfits, clipped = [], [], 0
    for r, t in zip(reqs, arrivals):
        inp = max(1, round(r.input_len * s.length_scale))
        out = max(1, round(r.output_len * s.output_scale))
        fits = inp + out <= s.max_model_len
        if not fits and s.clip:
            out = min(out, s.max_model_len - 1)
            inp = s.max_model_len - out
            clipped += 1
        elif not fits:
            misfits.append((r, inp, out))
        items.append(WorkItem(f"r{len(items):05d}", r.index, (t - arrivals[0]) * ts, inp, out,
                              "long" if inp >= s.long_prompt else "short", r.hash_ids, not fits))
    if misfits:
        raise TraceError(_misfit_message(trace, s, misfits))
    return Workload(tuple(items), ts, block, clipped, spread)


def _misfit_message(trace: Trace, s: Scaling, misfits: list) -> str:
    shown = "; ".join(f"row {r.index}: {inp} prompt + {out} output tokens" for r, inp, out in misfits[:5])
    more = f" and {len(misfits) - 5} more" if len(misfits) > 5 else ""
    # the largest length scale that fits every request, with outputs as they are now
    fit = [(s.max_model_len - max(1, round(r.output_len * s.output_scale))) / r.input_len for r in trace.requests]
    best = min(fit)
    fix = (f"use --length-scale {best:.4g} or smaller" if best > 0 else
           "lower --output-scale (some outputs alone exceed the context)")
    return (f"{trace.source}: {len(misfits)} of {len(trace.requests)} requests do not fit the model's context "
            f"of {s.max_model_len} tokens after --length-scale {s.length_scale:g} and --output-scale "
            f"{s.output_scale:g} ({shown}{more}); {fix}, or pass --clip to cut prompts to fit, or pick a "
            f"window with shorter prompts")
