"""`python -m pdkv.bench prefix`: a window of the Mooncake conversation trace replayed through
the engine in-process, with automatic prefix caching on and off, in the same run.

The trace has no text: each request lists ``hash_ids``, one per 512-token block, equal ids
meaning an equal prefix. Each id maps deterministically to ``--block-tokens`` token ids (a
random.Random seeded by the id), the last block scaled by its share of 512; outputs are scaled
the same way (at least 1, at most ``--max-output``). Arrivals keep the trace's timestamps,
compressed ``--speedup`` times. The engine (pdkv.tiny_model, page size = block size so blocks
and pages align) is stepped in this thread; requests are added when their arrival time passed.

Reported per run: prompt tokens computed (fed to the model for prompt positions, recomputes
after preemption included), prefix cache hits, TTFT p50/p99 (arrival to first token), wall time;
and the window's ideal hit rate: the share of its blocks whose hash id an earlier request of the
window already had (token-weighted, the last partial block counting its scaled size). Target:
the fall in computed prompt tokens is at least 80% of that ideal. Greedy outputs of the two runs
are compared token for token.

The disaggregated half (``--mode disagg`` or ``both``, pdkv/bench/prefix_disagg.py) replays the
same window through a prefill node and a decode node, caching on and off on both, and adds the
KV bytes the decode node received; its target: computed prompt tokens and transferred KV bytes
both fall by at least 80% of the ideal hit rate.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

TRACE = Path("/work/shared/traces/mooncake_conversation_trace.jsonl")
BLOCK = 512  # tokens per hash id in the trace


def load_window(path: Path, start: int, num: int, block_tokens: int, max_output: int, vocab: int):
    """[(arrival_s, prompt ids, output len, [(hash_id, scaled block len)])] of rows [start, start+num)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()[start:start + num]]
    t0 = rows[0]["timestamp"]
    out = []
    for r in rows:
        ids, blocks = [], []
        for k, h in enumerate(r["hash_ids"]):
            size = min(BLOCK, r["input_length"] - k * BLOCK)
            n = max(1, -(-size * block_tokens // BLOCK))
            rng = random.Random(h)
            ids += [rng.randrange(3, vocab) for _ in range(block_tokens)][:n]
            blocks.append((h, n))
        n_out = max(1, min(max_output, r["output_length"] * block_tokens // BLOCK))
        out.append(((r["timestamp"] - t0) / 1000.0, ids, n_out, blocks))
    return out


def ideal_hit_rate(window) -> float:
    """Token-weighted share of blocks whose hash id an earlier request of the window had."""
    seen, total, repeated = set(), 0, 0
    for _, _, _, blocks in window:
        for h, n in blocks:
            total += n
            repeated += n if h in seen else 0
            seen.add(h)
    return repeated / total


def replay(engine, window, speedup: float) -> dict:
    from pdkv.engine import SamplingParams  # noqa: PLC0415

    fed = {"prompt": 0}
    execute = engine.runner.execute

    def counting(seqs, connector):  # prompt positions fed to the model this step
        for s in seqs:
            fed["prompt"] += max(0, min(s.start_pos + len(s.token_ids), s.request.num_prompt_tokens) - s.start_pos)
        return execute(seqs, connector)
    engine.runner.execute = counting
    t0 = time.perf_counter()
    arrival, first, outputs, i = {}, {}, {}, 0
    while i < len(window) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while i < len(window) and window[i][0] / speedup <= now:
            at, ids, n_out, _ = window[i]
            rid = f"t{i}"
            engine.add_request(rid, ids, SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True))
            arrival[rid] = t0 + at / speedup
            i += 1
        if not engine.has_work():
            time.sleep(min(0.002, max(0.0, window[i][0] / speedup - now)) if i < len(window) else 0)
            continue
        for out in engine.step():
            t = time.perf_counter()
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = t
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
    wall = time.perf_counter() - t0
    engine.runner.execute = execute
    ttft = sorted(first[r] - arrival[r] for r in first)
    st = engine.stats()
    return {"prompt_tokens_computed": fed["prompt"], "wall_s": wall,
            "ttft_p50_ms": 1000 * statistics.median(ttft),
            "ttft_p99_ms": 1000 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "prefix_cache_hits": st["prefix_cache_hits"], "prefix_cache_queries": st["prefix_cache_queries"],
            "num_preemptions": st["num_preemptions"], "outputs": outputs}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdkv.bench prefix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--start", type=int, default=0, help="first row of the window")
    ap.add_argument("--num", type=int, default=600, help="requests in the window")
    ap.add_argument("--block-tokens", type=int, default=4, help="tokens per 512-token trace block")
    ap.add_argument("--max-output", type=int, default=8)
    ap.add_argument("--speedup", type=float, default=10.0, help="trace time / replay time")
    ap.add_argument("--num-pages", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mode", choices=("colocated", "disagg", "both"), default="both",
                    help="one engine, a prefill + decode pair (tcp loopback), or both, on the same window")
    ap.add_argument("--model", type=Path, default=None, help="an HF folder (default: pdkv.tiny_model)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = ap.parse_args(argv)

    import torch  # noqa: PLC0415

    from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig  # noqa: PLC0415
    from pdkv.engine import LLMEngine  # noqa: PLC0415
    from pdkv.tiny_model import make_tiny_model  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    model = args.model or make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", max_position_embeddings=4096)
    window = load_window(args.trace, args.start, args.num, args.block_tokens, args.max_output, 512)
    ideal = ideal_hit_rate(window)
    longest = max(len(w[1]) + w[2] for w in window)
    runs = {}  # (mode, "off" | "on") -> result
    for on in (False, True):
        key = "on" if on else "off"
        if args.mode != "disagg":
            engine = LLMEngine(ModelConfig(path=str(model), max_model_len=max(longest, 64)),
                               KVCacheConfig(page_size=args.block_tokens, num_pages=args.num_pages, prefix_caching=on),
                               SchedulerConfig(), num_threads=args.threads)
            runs["colocated", key] = replay(engine, window, args.speedup)
        if args.mode != "colocated":
            from pdkv.bench.prefix_disagg import replay_disagg  # noqa: PLC0415

            runs["disagg", key] = replay_disagg(model, window, args.speedup, args.block_tokens, args.num_pages, on,
                                                max(longest, 64), args.threads)
    modes = [m for m in ("colocated", "disagg") if (m, "off") in runs]
    ref = runs[modes[0], "off"]["outputs"]
    summary = {"window": [args.start, args.start + len(window)], "requests": len(window),
               "prompt_tokens": sum(len(w[1]) for w in window), "ideal_hit_rate": ideal}
    for m in modes:
        off, on = runs[m, "off"], runs[m, "on"]
        fall = 1 - on["prompt_tokens_computed"] / off["prompt_tokens_computed"]
        same = sum(ref.get(r) == o for run in (off, on) for r, o in run["outputs"].items())
        summary[m] = {"computed_fall": fall, "fall_over_ideal": fall / ideal if ideal else float("nan"),
                      "outputs_identical": f"{same}/{2 * len(window)}",
                      **{f"{k}_{name}": v for name, r in (("off", off), ("on", on)) for k, v in r.items()
                         if k != "outputs"}}
        met = fall >= 0.8 * ideal
        if m == "disagg":
            kv_fall = 1 - on["kv_bytes"] / off["kv_bytes"] if off["kv_bytes"] else float("nan")
            summary[m].update(kv_bytes_fall=kv_fall, kv_fall_over_ideal=kv_fall / ideal if ideal else float("nan"))
            met = met and kv_fall >= 0.8 * ideal
        summary[m]["target_met"] = met
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"Mooncake conversation rows [{args.start}, {args.start + len(window)}): {len(window)} requests, "
          f"{summary['prompt_tokens']} prompt tokens ({args.block_tokens} per 512-token block), "
          f"replayed {args.speedup:g}x faster")
    print(f"ideal hit rate (repeated blocks): {ideal:.1%}")
    print(f"{'':20}{'computed':>10}{'KV bytes':>12}{'TTFT p50':>11}{'TTFT p99':>11}{'wall':>8}")
    for (m, name), r in runs.items():
        kv = f"{r['kv_bytes']:>12.0f}" if "kv_bytes" in r else f"{'-':>12}"
        print(f"{m:<10}cache {name:<4}{r['prompt_tokens_computed']:>10}{kv}"
              f"{r['ttft_p50_ms']:>9.1f}ms{r['ttft_p99_ms']:>9.1f}ms{r['wall_s']:>7.1f}s")
    for (m, name), r in runs.items():
        for e in r.get("errors", [])[:3]:
            print(f"{m} cache {name}: request failed: {e}")
    for m in modes:
        s, off, on = summary[m], runs[m, "off"], runs[m, "on"]
        line = (f"{m}: computed prompt tokens fall {s['computed_fall']:.1%} = {s['fall_over_ideal']:.0%} of the ideal")
        if m == "disagg":
            line += (f", KV bytes fall {s['kv_bytes_fall']:.1%} = {s['kv_fall_over_ideal']:.0%} of the ideal "
                     f"(prefill node sent {off['bytes_prefill']:.0f} / {on['bytes_prefill']:.0f} B off / on; "
                     f"pages moved {on['pages_decode']:.0f} vs {off['pages_decode']:.0f}, skipped "
                     f"{on['pages_skipped_decode']:.0f}; errors {len(off['errors']) + len(on['errors'])})")
        print(line + f" (target >= 80%: {'met' if s['target_met'] else 'NOT met'}); TTFT p50 on/off "
              f"{on['ttft_p50_ms'] / off['ttft_p50_ms']:.2f}, p99 {on['ttft_p99_ms'] / off['ttft_p99_ms']:.2f}; "
              f"greedy outputs identical to {modes[0]} off: {s['outputs_identical']}")
    return 0
