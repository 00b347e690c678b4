"""`python -m pdkv.bench capacity -c CONFIG [-o capacity.json]`: what one node of this model and
config sustains within a latency budget, as the planner reads it (pdkv/planner/capacity.py).

The engine of the role config is built in this process (its model, KV cache, scheduler; the
shipped default model when model.path is empty) and driven directly, without HTTP:

- prefill: for each concurrency C in --prefill-concurrency, C prompts of --prompt-len tokens
  arrive together, one output token each; TTFT of each is the time to its first token; a point
  is (C * prompt_len / time to the last first token = prefill tokens/s, TTFT p90);
- decode: for each stream count B in --decode-streams, B short prompts decode --new-tokens
  tokens each; a point is (B, ITL p90 over the B streams' mean gaps, tokens/s).

The JSON holds both curves (the planner reads the capacity at its own SLOs off them) plus, with
--ttft-ms / --itl-ms, the capacities at those SLOs. Each point runs --repeats times and keeps the
best (the fastest run: on a shared machine the others waited for a core).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


def _p90(xs: list[float]) -> float:
    xs = sorted(xs)
    if not xs:
        return 0.0
    k = 0.9 * (len(xs) - 1)
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _prompt(engine, n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    vocab = engine.model_config_vocab if hasattr(engine, "model_config_vocab") else 1000
    return [rng.randrange(10, max(11, vocab - 1)) for _ in range(n)]


def prefill_point(engine, c: int, prompt_len: int, seed: int) -> tuple[float, float]:
    from pdkv.engine import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    for i in range(c):
        engine.add_request(f"p{seed}-{i}", _prompt(engine, prompt_len, seed * 1000 + i), params)
    first: dict[str, float] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id not in first and o.output_token_ids:
                first[o.request_id] = time.perf_counter() - t0
    span = max(first.values())
    return c * prompt_len / span, _p90(list(first.values())) * 1000.0


def decode_point(engine, b: int, new_tokens: int, seed: int) -> tuple[float, float]:
    from pdkv.engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i in range(b):
        engine.add_request(f"d{seed}-{i}", _prompt(engine, 16, seed * 1000 + i), params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    t_start = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            first.setdefault(o.request_id, now)
            last[o.request_id] = now
            counts[o.request_id] = len(o.output_token_ids)
    gaps = [(last[r] - first[r]) / max(1, counts[r] - 1) for r in first]
    tokens = sum(counts.values())
    return _p90(gaps) * 1000.0, tokens / (time.perf_counter() - t_start)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdkv.bench capacity", description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--config", default=None, help="role config (default: built-in colocated defaults)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--prefill-concurrency", default="1,2,4,8")
    ap.add_argument("--decode-streams", default="1,4,16,32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ttft-ms", type=float, default=None, help="also report the capacity at this TTFT SLO")
    ap.add_argument("--itl-ms", type=float, default=None, help="also report the capacity at this ITL SLO")
    ap.add_argument("-o", "--out", default=None, help="write the JSON here (default: stdout only)")
    a = ap.parse_args(argv)

    import torch

    from pdkv.config import ConfigError, load_config
    from pdkv.engine import build_engine
    from pdkv.planner.capacity import InfeasibleSLO, capacities_from_dict

    try:
        sets = list(a.overrides)
        if a.config is None or "role=" not in " ".join(sets):
            sets.append("role=colocated")  # the engine alone: no peers to dial
        cfg = load_config(a.config, sets)
    except ConfigError as e:
        print(f"bench capacity: {e}", file=sys.stderr)
        return 2
    if not cfg.model.path:
        from pdkv.default_model import ensure_default_model

        cfg = load_config(a.config, sets + [f"model.path={ensure_default_model()}"])
    engine = build_engine(cfg)
    engine.model_config_vocab = int(engine.vocab_size)
    if a.prompt_len + 2 > engine.max_model_len:
        print(f"bench capacity: --prompt-len {a.prompt_len} does not fit max_model_len {engine.max_model_len}",
              file=sys.stderr)
        return 2
    prefill_point(engine, 1, min(64, a.prompt_len), 0)  # warm-up
    pre, dec = [], []
    seed = 1
    for c in _ints(a.prefill_concurrency):
        runs = []
        for _ in range(a.repeats):
            seed += 1
            runs.append(prefill_point(engine, c, a.prompt_len, seed))
        tps, ttft = max(runs)
        pre.append({"concurrency": c, "tokens_per_s": round(tps, 1), "ttft_ms": round(ttft, 2)})
        print(f"prefill C={c:3d}: {tps:9.0f} tokens/s, TTFT p90 {ttft:8.1f} ms", file=sys.stderr)
    for b in _ints(a.decode_streams):
        runs = []
        for _ in range(a.repeats):
            seed += 1
            runs.append(decode_point(engine, b, a.new_tokens, seed))
        itl, tps = min(runs)
        dec.append({"streams": b, "itl_ms": round(itl, 3), "tokens_per_s": round(tps, 1)})
        print(f"decode  B={b:3d}: ITL p90 {itl:7.2f} ms, {tps:8.0f} tokens/s", file=sys.stderr)
    # a curve must not get faster with more load (noise on a shared host): keep each latency >= the last
    for pts, key in ((pre, "ttft_ms"), (dec, "itl_ms")):
        for i in range(1, len(pts)):
            pts[i][key] = max(pts[i][key], pts[i - 1][key])
    stats = engine.stats()
    max_streams = cfg.scheduler.max_num_seqs
    out = {"source": f"python -m pdkv.bench capacity -c {a.config or '<defaults>'} on {platform.node()} "
                     f"({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, torch threads "
                     f"{torch.get_num_threads()}) at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
           "model": engine.model_name, "device": cfg.model.device, "prompt_tokens": a.prompt_len,
           "new_tokens": a.new_tokens, "kv_pages": stats.get("num_pages_total"),
           "prefill": {"points": pre}, "decode": {"points": dec, "max_streams": max_streams}}
    caps = capacities_from_dict(out)
    at = {}
    try:
        if a.ttft_ms:
            at["prefill_tokens_per_s"] = round(caps.prefill_tokens_per_s(a.ttft_ms), 1)
        if a.itl_ms:
            at["decode_streams"] = round(caps.decode_streams(a.itl_ms), 2)
    except InfeasibleSLO as e:
        at["infeasible"] = str(e)
    if at:
        out["at_slo"] = {"ttft_ms": a.ttft_ms, "itl_ms": a.itl_ms, **at}
    text = json.dumps(out, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0
