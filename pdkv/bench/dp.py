"""`python -m pdkv.bench engine --dp 2 --ep`: a data-parallel expert-parallel group (pdkv/dp)
against TP2 and against two independent TP1 engines, at equal total cores (one thread per rank or
engine), on the bench MoE model (pdkv/bench/_moe.py, ``--model-kind``), B requests per rank.

Per system and B: decode tokens/s over all ranks (tokens after each request's first, over the
time of those steps) and prefill tokens/s (prompt tokens to every first token). For DP-EP also
the all-to-all's share of a decode step: the ranks' seconds inside the dispatcher's collectives
over the decode time (mean of the ranks). Two TP1 engines run as two processes at once, each its
own B requests; their tokens/s add up. The model is the same folder for every system.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _drive(engine, prompts, new_tokens, ranks=None) -> tuple[float, float]:
    """(prefill seconds to every first token, decode seconds of the rest)."""
    from pdkv.engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        if ranks is None:
            engine.add_request(f"b{i}", p, params)
        else:
            engine.add_request(f"b{i}", p, params, rank=ranks[i])
    t0 = time.perf_counter()
    first: set = set()
    while len(first) < len(prompts):
        first.update(o.request_id for o in engine.step() if o.new_token_ids)
    t1 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return t1 - t0, time.perf_counter() - t1


def _configs(model: str, b: int, prompt_len: int, new_tokens: int):
    from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig

    pages = b * (-(-(prompt_len + new_tokens) // 16)) * 2 + 8
    return (ModelConfig(path=model), KVCacheConfig(page_size=16, num_pages=pages),
            SchedulerConfig(max_num_batched_tokens=max(2048, b * prompt_len), chunk_size=2048, max_num_seqs=max(b, 1)))


def single(argv: list[str]) -> int:
    """One TP1 engine on one thread (a child of the bench): prints its JSON result."""
    from pdkv.engine import LLMEngine

    model, b, prompt_len, new_tokens, seed = argv[0], *map(int, argv[1:5])
    m, kv, s = _configs(model, b, prompt_len, new_tokens)
    eng = LLMEngine(m, kv, s, num_threads=1)
    prompts = _prompts(b, prompt_len, eng.vocab_size, seed)
    _drive(eng, prompts[:1], 2)  # warm-up
    pre, dec = _drive(eng, prompts, new_tokens)
    print(json.dumps({"prefill_s": pre, "decode_s": dec}), flush=True)
    return 0


def run(args) -> int:
    from pdkv.bench._moe import make_moe_model
    from pdkv.config import ParallelConfig
    from pdkv.dp.group import DPGroup
    from pdkv.engine import LLMEngine

    if not args.ep:
        raise SystemExit("--dp needs --ep: data-parallel ranks share the MoE layers by expert parallelism")
    kind = args.model_kind if args.model_kind != "llama" else "qwen3_moe"
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_moe_model(kind, Path(tmp) / kind))
        sizes = [int(x) for x in args.batch_sizes.split(",")]
        n, P, T = args.dp, args.prompt_len, args.new_tokens
        results = []
        for b in sizes:
            m, kv, s = _configs(model, b, P, T)
            row = {"B_per_rank": b, "ranks": n}
            prompts = _prompts(n * b, P, 32000 if args.model is None else 1000, 0)
            # DP-EP: n ranks of one thread each, requests spread evenly.
            g = DPGroup(m, kv, s, ParallelConfig(dp=n, ep=True, timeout_s=600.0), num_threads=1)
            try:
                _drive(g, prompts[:n], 2, ranks=list(range(n)))  # warm-up
                before = g.load()["ranks"]
                pre, dec = _drive(g, prompts, T, ranks=[i % n for i in range(n * b)])
                after = g.load()["ranks"]
            finally:
                g.close()
            comm = sum(a["comm_s"] - x["comm_s"] for a, x in zip(after, before)) / n
            row["dp_ep"] = {"prefill_tok_s": n * b * P / pre, "decode_tok_s": n * b * (T - 1) / dec,
                            "a2a_s_per_rank": comm, "a2a_share": comm / (pre + dec)}
            # TP-n: one engine, n ranks of one thread.
            eng = LLMEngine(m, kv, s, num_threads=n, parallel=ParallelConfig(tp=n, timeout_s=600.0))
            try:
                _drive(eng, prompts[:1], 2)
                pre, dec = _drive(eng, prompts, T)
            finally:
                eng.close()
            row[f"tp{n}"] = {"prefill_tok_s": n * b * P / pre, "decode_tok_s": n * b * (T - 1) / dec}
            # n independent TP1 engines at once, one thread each, b requests each.
            env = dict(os.environ)
            procs = [subprocess.Popen([sys.executable, "-m", "pdkv.bench.dp", "single", model, str(b), str(P), str(T),
                                       str(r)], stdout=subprocess.PIPE, text=True, env=env) for r in range(n)]
            outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
            row[f"{n}x_tp1"] = {"prefill_tok_s": sum(b * P / o["prefill_s"] for o in outs),
                                "decode_tok_s": sum(b * (T - 1) / o["decode_s"] for o in outs)}
            results.append(row)
            print(json.dumps(row), flush=True)
        load = os.getloadavg()
        print(f"\nDP{n}-EP vs TP{n} vs {n}x TP1 ({kind}, prompt {P}, {T} new tokens, one thread per rank; "
              f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f})")
        print(f"{'B/rank':>6} | {'DP-EP dec tok/s':>15} | {f'TP{n} dec':>9} | {f'{n}xTP1 dec':>10} | "
              f"{'DP/TP':>6} | {'DP/indep':>8} | {'a2a share':>9}")
        for r in results:
            d, t, i = r["dp_ep"], r[f"tp{n}"], r[f"{n}x_tp1"]
            print(f"{r['B_per_rank']:>6} | {d['decode_tok_s']:>15.1f} | {t['decode_tok_s']:>9.1f} | "
                  f"{i['decode_tok_s']:>10.1f} | {d['decode_tok_s'] / t['decode_tok_s']:>6.2f} | "
                  f"{d['decode_tok_s'] / i['decode_tok_s']:>8.2f} | {d['a2a_share']:>8.0%}")
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"rows": results, "loadavg": load, "kind": kind}, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "single":
        sys.exit(single(sys.argv[2:]))
    sys.exit("run it as: python -m pdkv.bench engine --dp 2 --ep")
