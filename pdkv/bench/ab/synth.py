"""Synthetic traces: Poisson arrivals with lognormal prompt and output lengths, in three presets.

    short   chat turns: prompts ~64 tokens, outputs ~64
    long    document / RAG prompts: prompts ~768 tokens, outputs ~24 (prefill-heavy)
    mixed   75% short and 25% long, interleaved at random (the case where phases interfere)

Lengths are model tokens already (``--length-scale`` still applies). Deterministic per seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pdkv.bench.ab.traces import Trace, TraceError, TraceRequest


@dataclass(frozen=True)
class LengthDist:
    median: int
    sigma: float  # of log(length)
    lo: int
    hi: int

    def draw(self, rng: random.Random) -> int:
        return int(min(self.hi, max(self.lo, round(self.median * math.exp(rng.gauss(0.0, self.sigma))))))


SHORT = (LengthDist(64, 0.5, 8, 256), LengthDist(64, 0.5, 4, 256))
LONG = (LengthDist(768, 0.3, 256, 1536), LengthDist(24, 0.4, 4, 96))
PRESETS = {"short": ((1.0, SHORT),), "long": ((1.0, LONG),), "mixed": ((0.75, SHORT), (0.25, LONG))}


def synth_trace(preset: str, num_requests: int = 100, rate: float = 2.0, seed: int = 0) -> Trace:
    """``num_requests`` Poisson arrivals at ``rate`` requests/s drawn from ``preset``."""
    if preset not in PRESETS:
        raise TraceError(f"synth:{preset}: unknown preset; choose one of {', '.join(PRESETS)}")
    if num_requests < 1 or rate <= 0:
        raise TraceError(f"synth:{preset}: needs at least one request and a positive rate, got "
                         f"{num_requests} requests at {rate} req/s")
    rng = random.Random(f"pdkv-ab-synth-{preset}-{seed}")
    t, out = 0.0, []
    for i in range(num_requests):
        u, mix, acc = rng.random(), PRESETS[preset], 0.0
        prompt, output = mix[-1][1]
        for share, dists in mix:
            acc += share
            if u < acc:
                prompt, output = dists
                break
        out.append(TraceRequest(i, t, prompt.draw(rng), output.draw(rng)))
        t += rng.expovariate(rate)
    return Trace(f"synth-{preset}", f"synth:{preset}", "synth", tuple(out))
