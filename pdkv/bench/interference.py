"""`python -m pdkv.bench interference`: how long running decodes stall while long prompts are
prefilled, per chunk size and prompt length, with each engine step's time broken down by part.

Workload (per configuration, the same in every one): ``--streams`` decode streams (24-token
prompts, 160 greedy tokens, eos ignored) start together; ``--num-long`` long prompts of P random
tokens (8 new tokens each) arrive while they run: by default right after the streams' token
8, 40, 72, 104 (``--arrive-every-tokens``: the same offered work in every configuration however
fast the machine is at the moment), or ``--arrival-gap-s`` seconds apart as in the HTTP probe
(``--http``).
The engine runs in-process (``LLMEngine.step`` in a loop, a timestamp per step and per token).

Per configuration it prints the streams' inter-token latency (ITL) p50/p99/max, the long
prompts' TTFT (arrival to first token) and its ratio to the whole-prompt TTFT of the same run,
the worst step and the ratio of the worst decode gap to a "C-step" (the median step holding a
*first* chunk of C prompt tokens plus the running decodes: the cost the gap should be bounded
by), and the parts of the worst step, of the median prefill step and of the median step with no
prefill (see pdkv/bench/_steps.py). Configurations run interleaved, ``--repeats`` times; the
median of each number over the repeats is printed (the machine is shared: compare rows of one
run, not runs). "whole" = the whole prompt in one step.

Model: the embedded default model's shape (hidden 256, 4 layers, 8 heads / 4 KV heads, vocab
512, float32, the same seeded weights) with a context of 4608 so that 4,000-token prompts fit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdkv.bench._steps import PARTS, PartClock, percentile


def build_model(out: Path, context: int) -> str:
    from pdkv.default_model import SPEC
    from pdkv.tiny_model import make_tiny_model

    return str(make_tiny_model(out, **{**SPEC, "max_position_embeddings": context}))


def step_shape(seqs) -> dict:
    """What one step computed: decodes, prefill tokens, whether a prefill chunk was a first
    chunk (no cached KV of its own), and the longest KV a chunk attended over."""
    pre = [s for s in seqs if not (len(s.token_ids) == 1 and s.start_pos > 0)]
    return {"decodes": len(seqs) - len(pre), "prefill_tokens": sum(len(s.token_ids) for s in pre),
            "first_chunk": any(s.start_pos == 0 for s in pre), "prefills": len(pre),
            "max_kv": max((s.start_pos + len(s.token_ids) for s in pre), default=0)}


def run_one(engine, clock: PartClock, chunk: int, budget: int, prompts: list[list[int]],
            streams: list[list[int]], a) -> dict:
    """One configuration: returns the streams' ITL samples (ms), the long prompts' TTFTs (ms),
    one record per step and every request's output tokens."""
    from pdkv.engine import SamplingParams

    sched = engine.scheduler
    sched.chunk_size, sched.budget = chunk, budget
    sp = SamplingParams(max_tokens=a.stream_tokens, temperature=0, ignore_eos=True)
    lp = SamplingParams(max_tokens=a.long_new_tokens, temperature=0, ignore_eos=True)
    for i, s in enumerate(streams):
        engine.add_request(f"s{i}", s, sp)
    last = {}
    while len(last) < len(streams):  # the streams' own prefill is not measured
        last.update((o.request_id, time.perf_counter()) for o in engine.step() if o.new_token_ids)
    t0 = time.perf_counter()
    arrival, first = {}, {}
    itl, steps, finals = [], [], {}
    num_stream_tokens = 0  # tokens stream s0 has produced: the clock of token-indexed arrivals

    def due(i: int, now: float) -> bool:
        if a.arrival_gap_s:
            return now >= t0 + i * a.arrival_gap_s
        return num_stream_tokens >= a.first_arrival + i * a.arrive_every_tokens or not engine.has_unfinished()

    clock.take(0.0)
    while engine.has_unfinished() or len(arrival) < len(prompts):
        now = time.perf_counter()
        while len(arrival) < len(prompts) and due(len(arrival), now):
            i = len(arrival)
            arrival[f"L{i}"] = t0 + i * a.arrival_gap_s if a.arrival_gap_s else now
            engine.add_request(f"L{i}", prompts[i], lp)
        if not engine.has_unfinished():
            time.sleep(0.001)
            continue
        start = time.perf_counter()
        out = engine.step()
        end = time.perf_counter()
        steps.append({"ms": (end - start) * 1e3, "threads": torch.get_num_threads(),
                      **step_shape(clock.last_seqs), "parts": clock.take(end - start)})
        for o in out:
            rid = o.request_id
            if o.new_token_ids and rid.startswith("s"):
                if rid in last:
                    itl.append((end - last[rid]) * 1e3)
                last[rid] = end
                num_stream_tokens += rid == "s0"
            elif o.new_token_ids and rid not in first:
                first[rid] = end
            if o.finished:
                finals[rid] = list(o.output_token_ids)
    ttft = [(first[r] - arrival[r]) * 1e3 for r in sorted(arrival)]
    return {"itl": itl, "ttft": ttft, "steps": steps, "outputs": finals}


def summarize(r: dict, chunk: int, prompt_len: int) -> dict:
    steps = r["steps"]
    decode_only = [s for s in steps if s["prefill_tokens"] == 0]
    prefill = [s for s in steps if s["prefill_tokens"] > 0]
    # A C-step: a first chunk of C tokens (or the whole prompt), alone, plus the running decodes.
    c_steps = [s["ms"] for s in prefill if s["first_chunk"] and s["prefills"] == 1 and s["decodes"] > 0
               and s["prefill_tokens"] == min(chunk, prompt_len)]
    worst = max(steps, key=lambda s: s["ms"])

    def parts(group):
        return {p: statistics.median(s["parts"][p] for s in group) for p in PARTS} if group else {}

    def median_step(group):
        return sorted(group, key=lambda s: s["ms"])[len(group) // 2] if group else None

    mp = median_step(prefill)
    return {
        "itl_p50": percentile(r["itl"], 50), "itl_p99": percentile(r["itl"], 99), "itl_max": max(r["itl"]),
        "ttft_mean": statistics.mean(r["ttft"]), "ttft_max": max(r["ttft"]),
        "worst_step_ms": worst["ms"], "worst_step": worst, "median_prefill_step": mp,
        "c_step_ms": statistics.median(c_steps) if c_steps else float("nan"),
        "decode_step_ms": statistics.median(s["ms"] for s in decode_only) if decode_only else float("nan"),
        "decode_step_max_ms": max((s["ms"] for s in decode_only), default=float("nan")),
        "decode_parts": parts(decode_only), "num_steps": len(steps), "num_prefill_steps": len(prefill),
        "threads_prefill": sorted({s["threads"] for s in prefill}),
    }


def _median_of(runs: list[dict], key: str) -> float:
    return statistics.median(x[key] for x in runs)


def _fmt_parts(p: dict) -> str:
    return " ".join(f"{k} {p[k]:.1f}" for k in PARTS if k in p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdkv.bench interference", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model folder (default: the default model's shape, context 4608)")
    ap.add_argument("--chunks", default="whole,1024,512,256,128")
    ap.add_argument("--prompt-lens", default="512,1500,4000")
    ap.add_argument("--budget", default="chunk", help="max_num_batched_tokens: 'chunk' (= chunk + the "
                    "running decodes, so a chunk is never cut by them) or a number")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-prompt", type=int, default=24)
    ap.add_argument("--stream-tokens", type=int, default=160)
    ap.add_argument("--num-long", type=int, default=4)
    ap.add_argument("--long-new-tokens", type=int, default=8)
    ap.add_argument("--first-arrival", type=int, default=8, help="stream token after which the first long prompt arrives")
    ap.add_argument("--arrive-every-tokens", type=int, default=32)
    ap.add_argument("--arrival-gap-s", type=float, default=0.0, help="> 0: arrivals by the clock instead")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--http", action="store_true", help="the HTTP probe instead (what a user sees): `pdkv serve -c "
                    "configs/colocated.yaml` per configuration, SSE streams, arrivals --arrival-gap-s apart "
                    "(default 1.5); ITL and TTFT only")
    ap.add_argument("--causes", action="store_true", help="instead: the SDPA kernel of a later chunk and "
                    "step time on 1 vs all threads per step size (pdkv/bench/_causes.py)")
    ap.add_argument("--out", default="bench-results/interference.json")
    a = ap.parse_args(argv)
    if a.http:
        from pdkv.bench._http_probe import main_http

        return main_http(a)

    from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig
    from pdkv.engine import LLMEngine

    lens = [int(x) for x in a.prompt_lens.split(",")]
    tmp = None
    if a.model is None:
        tmp = tempfile.TemporaryDirectory(prefix="pdkv-bench-")
        a.model = build_model(Path(tmp.name) / "interference", 4608)
    num_live = a.streams + a.num_long
    page = 16
    num_pages = a.streams * -(-(a.stream_prompt + a.stream_tokens) // page) + \
        a.num_long * -(-(max(lens) + a.long_new_tokens) // page) + 16
    # NOTE: no prefix cache: every configuration replays the same prompts and must compute them
    engine = LLMEngine(ModelConfig(path=a.model), KVCacheConfig(page_size=page, num_pages=num_pages,
                                                                prefix_caching=False),
                       SchedulerConfig(max_num_seqs=num_live), num_threads=a.threads)
    if a.causes:
        from pdkv.bench._causes import sdpa_paths, thread_ratios

        sdpa_paths()
        thread_ratios(engine)
        return 0
    lens = [n for n in lens if n + a.long_new_tokens <= engine.max_model_len] or lens[:0]
    clock = PartClock()
    clock.install(engine)
    gen = torch.Generator().manual_seed(0)
    V = engine.vocab_size
    streams = [torch.randint(0, V, (a.stream_prompt,), generator=gen).tolist() for _ in range(a.streams)]
    prompts = {n: [torch.randint(0, V, (n,), generator=gen).tolist() for _ in range(a.num_long)] for n in lens}
    chunks = a.chunks.split(",")

    def sizes(c: str, n: int) -> tuple[int, int]:
        size = n if c == "whole" else int(c)
        return size, size + num_live if a.budget == "chunk" else int(a.budget)

    print(f"model {a.model} (context {engine.max_model_len}), {a.threads} threads, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f}; {a.streams} streams x {a.stream_tokens} tokens, "
          f"{a.num_long} long prompts each", flush=True)
    run_one(engine, clock, 64, 64 + num_live, [prompts[lens[0]][0][:64]], streams[:1], a)  # warm-up
    runs: dict[tuple[int, str], list[dict]] = {}
    reference: dict[int, dict] = {}
    mismatches = 0
    for rep in range(a.repeats):
        for n in lens:
            for c in chunks:
                chunk, budget = sizes(c, n)
                r = run_one(engine, clock, chunk, budget, prompts[n], streams, a)
                reference.setdefault(n, r["outputs"])
                mismatches += r["outputs"] != reference[n]
                runs.setdefault((n, c), []).append(summarize(r, chunk, n))
            print(f"repeat {rep + 1}/{a.repeats} P={n} done (load average {os.getloadavg()[0]:.1f})", flush=True)
    table = []
    for n in lens:
        whole_ttft = _median_of(runs[(n, chunks[0])], "ttft_mean")
        print(f"\nP={n}: {a.num_long} prompts of {n} tokens (median of {a.repeats} runs; ms)")
        print("  chunk  budget | ITL p50   p99    max | TTFT mean  x1st | worst step  C-step  worst/C "
              "| decode step   max | prefill steps")
        for c in chunks:
            rs = runs[(n, c)]
            row = {"prompt_len": n, "chunk": c, "budget": sizes(c, n)[1],
                   **{k: _median_of(rs, k) for k in ("itl_p50", "itl_p99", "itl_max", "ttft_mean", "ttft_max",
                                                   "worst_step_ms", "c_step_ms", "decode_step_ms",
                                                   "decode_step_max_ms")}}
            row["ttft_ratio"] = row["ttft_mean"] / whole_ttft
            row["worst_over_c_step"] = row["itl_max"] / row["c_step_ms"]
            mid = rs[len(rs) // 2]
            row.update(worst_step=mid["worst_step"], median_prefill_step=mid["median_prefill_step"],
                       decode_parts=mid["decode_parts"], num_prefill_steps=mid["num_prefill_steps"],
                       threads_prefill=mid["threads_prefill"])
            table.append(row)
            print(f"  {c:>5} {row['budget']:>6} | {row['itl_p50']:6.1f} {row['itl_p99']:6.1f} {row['itl_max']:6.1f} "
                  f"| {row['ttft_mean']:8.0f} {row['ttft_ratio']:5.2f} | {row['worst_step_ms']:10.1f} "
                  f"{row['c_step_ms']:7.1f} {row['worst_over_c_step']:7.2f} | {row['decode_step_ms']:11.1f} "
                  f"{row['decode_step_max_ms']:5.0f} "
                  f"| {row['num_prefill_steps']} (threads {row['threads_prefill']})")
        for c in chunks:
            row = next(r for r in table if r["prompt_len"] == n and r["chunk"] == c)
            w, m = row["worst_step"], row["median_prefill_step"]
            print(f"  {c:>5} worst step {w['ms']:.1f} ms ({w['prefill_tokens']} prefill tokens to kv {w['max_kv']}, "
                  f"{w['decodes']} decodes): {_fmt_parts(w['parts'])}")
            print(f"  {'':>5} median prefill step {m['ms']:.1f} ms ({m['prefill_tokens']} tokens to kv {m['max_kv']}): "
                  f"{_fmt_parts(m['parts'])}")
        row = next(r for r in table if r["prompt_len"] == n)
        print(f"  no-prefill step {row['decode_step_ms']:.1f} ms: {_fmt_parts(row['decode_parts'])}")
    print(f"\noutputs identical across chunk sizes: {'yes' if not mismatches else f'NO ({mismatches} runs differ)'}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "interference", "threads": a.threads, "torch": torch.__version__,
                               "args": vars(a), "results": table}, indent=2, default=str))
    print(f"wrote {out}")
    if tmp is not None:
        tmp.cleanup()
    return 1 if mismatches else 0

