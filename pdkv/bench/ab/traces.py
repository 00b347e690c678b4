"""Request traces: the public Mooncake (JSONL) and Azure 2023 (CSV) formats, read into one shape.

    mooncake  {"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [512-token blocks]}
    azure     TIMESTAMP (YYYY-MM-DD HH:MM:SS.fffffff), ContextTokens, GeneratedTokens

Arrivals are seconds from the trace's first request. A window (trace seconds) and a first-N cut
select a slice; a slice that selects nothing is an error that says what the trace spans.
Synthetic traces (``synth:short|long|mixed``) come from pdkv.bench.ab.synth.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash_id in the Mooncake traces
FORMATS = ("mooncake", "azure", "synth")


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file and what was wrong."""


@dataclass(frozen=True)
class TraceRequest:
    index: int  # row in the source file (0-based), kept through slicing so a report can point at it
    arrival_s: float  # seconds after the trace's (or slice's) first arrival
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()  # Mooncake prefix blocks; () = no prefix information


@dataclass(frozen=True)
class Trace:
    name: str
    source: str  # file path or synth:preset
    format: str  # one of FORMATS
    requests: tuple[TraceRequest, ...]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS  # tokens per hash_id

    @property
    def span_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0


def detect_format(path: Path) -> str:
    """'mooncake' or 'azure', from the first line; TraceError otherwise."""
    try:
        with open(path, newline="") as f:
            first = f.readline().strip()
    except OSError as e:
        raise TraceError(f"{path}: cannot read the trace: {e.strerror or e}") from None
    if first.startswith("{"):
        try:
            row = json.loads(first)
        except json.JSONDecodeError:
            row = {}
        if {"timestamp", "input_length", "output_length"} <= set(row):
            return "mooncake"
    elif {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= {c.strip() for c in first.split(",")}:
        return "azure"
    raise TraceError(f"{path}: unknown trace format (first line {first[:80]!r}); expected a Mooncake JSONL "
                     f"(timestamp, input_length, output_length, hash_ids), an Azure 2023 CSV (TIMESTAMP, "
                     f"ContextTokens, GeneratedTokens) or synth:short|long|mixed")


def read_trace(path: str | Path, fmt: str | None = None) -> Trace:
    """Read a whole trace file; ``fmt`` None: detect it."""
    path = Path(path)
    fmt = fmt or detect_format(path)
    if fmt not in ("mooncake", "azure"):
        raise TraceError(f"{path}: trace format must be mooncake or azure, got {fmt!r}")
    rows = _read_mooncake(path) if fmt == "mooncake" else _read_azure(path)
    if not rows:
        raise TraceError(f"{path}: the trace holds no request")
    t0 = rows[0].arrival_s
    reqs = tuple(replace(r, arrival_s=r.arrival_s - t0) for r in rows)
    for a, b in zip(reqs, reqs[1:]):
        if b.arrival_s < a.arrival_s:
            raise TraceError(f"{path}: arrivals go backwards at row {b.index} ({b.arrival_s:.3f} s after "
                             f"{a.arrival_s:.3f} s); a trace must be sorted by time")
    return Trace(path.stem, str(path), fmt, reqs)


def _bad(path: Path, line: int, what: str) -> TraceError:
    return TraceError(f"{path}: line {line}: {what}")


def _read_mooncake(path: Path) -> list[TraceRequest]:
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                r = TraceRequest(len(out), float(row["timestamp"]) / 1000.0, int(row["input_length"]),
                                 int(row["output_length"]), tuple(int(h) for h in row.get("hash_ids", ())))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise _bad(path, i + 1, f"not a Mooncake row ({type(e).__name__}: {e})") from None
            if r.input_len < 1 or r.output_len < 1:
                raise _bad(path, i + 1, f"input_length and output_length must be positive, got "
                                        f"{r.input_len}, {r.output_len}")
            out.append(r)
    return out


def _azure_time(text: str) -> float:
    # 7 fractional digits (100 ns ticks); datetime's %f takes at most 6
    date, _, frac = text.strip().partition(".")
    return datetime.strptime(date, "%Y-%m-%d %H:%M:%S").timestamp() + (float("0." + frac) if frac else 0.0)


def _read_azure(path: Path) -> list[TraceRequest]:
    out = []
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            try:
                r = TraceRequest(len(out), _azure_time(row["TIMESTAMP"]), int(row["ContextTokens"]),
                                 int(row["GeneratedTokens"]))
            except (KeyError, TypeError, ValueError) as e:
                raise _bad(path, i + 2, f"not an Azure 2023 row ({type(e).__name__}: {e})") from None
            if r.input_len < 1 or r.output_len < 1:
                raise _bad(path, i + 2, "ContextTokens and GeneratedTokens must be positive")
            out.append(r)
    return out


def select(trace: Trace, window: tuple[float, float] | None = None, first: int | None = None) -> Trace:
    """The requests arriving in ``window`` = [start, end) trace seconds, then the first ``first`` of
    them, with arrivals re-based to the slice's first request. TraceError when nothing is left."""
    reqs = trace.requests
    if window is not None:
        a, b = window
        reqs = tuple(r for r in reqs if a <= r.arrival_s < b)
        if not reqs:
            raise TraceError(f"{trace.source}: the window {a:g}:{b:g} s selects no request (the trace's "
                             f"arrivals span 0 to {trace.span_s:.1f} s, {len(trace.requests)} requests)")
    if first is not None:
        if first < 1:
            raise TraceError(f"{trace.source}: --first must be at least 1, got {first}")
        reqs = reqs[:first]
    t0 = reqs[0].arrival_s
    return replace(trace, requests=tuple(replace(r, arrival_s=r.arrival_s - t0) for r in reqs))


def parse_window(text: str) -> tuple[float, float]:
    """'600:660' -> (600.0, 660.0) trace seconds; ValueError says the expected form."""
    a, sep, b = text.partition(":")
    try:
        lo, hi = float(a), float(b)
    except ValueError:
        raise ValueError(f"--window must be START:END in trace seconds (e.g. 600:660), got {text!r}") from None
    if not sep or hi <= lo or lo < 0:
        raise ValueError(f"--window must be START:END with 0 <= START < END, got {text!r}")
    return lo, hi
