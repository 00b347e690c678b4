"""`python -m pdkv.bench engine --dp 2 --ep`: a data-parallel expert-parallel group (pdkv/dp)
against TP2 and against two independent TP1 engines, at equal total cores (one thread per rank or
engine), on the bench MoE model (pdkv/bench/_moe.py, ``--model-kind``), B requests per rank.

Per system and B: decode tokens/s over all ranks (tokens after each request's first, over the
time of those steps) and prefill tokens/s (prompt tokens to every first token). For DP-EP also
the all-to-all's share of a decode step: the ranks' seconds inside the dispatcher's collectives
over the decode time (mean of the ranks). Two TP1 engines run as two processes at once, each its
own B requests; their tokens/s add up. The model is the same folder for every system.

``--dp N --tp M --ep`` (``run_tp``): the tp x dp group (N DP ranks, each TP-M) against a DP-EP
group of N*M ranks and a TP-(N*M) engine: the same N*M one-thread processes, the same N*B requests.
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


def _group(m, kv, s, n: int, tp: int, prompts, T: int) -> dict:
    """A DP-EP group of n ranks, each a TP-``tp`` engine, one thread per process; the prompts
    spread evenly over the ranks."""
    from pdkv.config import ParallelConfig
    from pdkv.dp.group import DPGroup

    g = DPGroup(m, kv, s, ParallelConfig(dp=n, tp=tp, ep=True, timeout_s=600.0), num_threads=1)
    try:
        _drive(g, prompts[:n], 2, ranks=list(range(n)))  # warm-up
        before = g.load()["ranks"]
        pre, dec = _drive(g, prompts, T, ranks=[i % n for i in range(len(prompts))])
        after = g.load()["ranks"]
    finally:
        g.close()
    comm = sum(a["comm_s"] - x["comm_s"] for a, x in zip(after, before)) / n
    P = len(prompts[0])
    return {"prefill_tok_s": len(prompts) * P / pre, "decode_tok_s": len(prompts) * (T - 1) / dec,
            "a2a_s_per_rank": comm, "a2a_share": comm / (pre + dec)}


def run(args) -> int:
    from pdkv.bench._moe import make_moe_model

    if not args.ep:
        raise SystemExit("--dp needs --ep: data-parallel ranks share the MoE layers by expert parallelism")
    if args.tp > 1:
        return run_tp(args)
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
            row["dp_ep"] = _group(m, kv, s, n, 1, prompts, T)
            row[f"tp{n}"] = _tp_engine(m, kv, s, n, prompts, T)  # one engine, n ranks of one thread
            # n independent TP1 engines at once, one thread each, b requests each.
            env = dict(os.environ)
            procs = [subprocess.Popen([sys.executable, "-m", "pdkv.bench.dp", "single", model, str(b), str(P), str(T),
                                       str(r)], stdout=subprocess.PIPE, text=True, env=env) for r in range(n)]
            outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
            row[f"{n}x_tp1"] = {"prefill_tok_s": sum(b * P / o["prefill_s"] for o in outs),
                                "decode_tok_s": sum(b * (T - 1) / o["decode_s"] for o in outs)}
            results.append(row)
            print(json.dumps(row), flush=True)
        _report(args.out, f"DP{n}-EP vs TP{n} vs {n}x TP1 ({kind}, prompt {P}, {T} new tokens, one thread per rank",
                results, kind, "B_per_rank", "dp_ep", [f"tp{n}", f"{n}x_tp1"])
    return 0


def _report(out: str, title: str, results: list, kind: str, bkey: str, main: str, others: list) -> None:
    """Prints decode tok/s of ``main`` and ``others`` per B, ``main`` over each, its all-to-all
    share, with the load average now; writes the rows to ``out`` (JSON)."""
    load = os.getloadavg()
    print(f"\n{title}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f})")
    print(" | ".join([f"{bkey:>13}", f"{main + ' dec tok/s':>16}", *(f"{o:>9}" for o in others),
                      *(f"{'/' + o:>9}" for o in others), "a2a share"]))
    for r in results:
        d = r[main]["decode_tok_s"]
        print(" | ".join([f"{r[bkey]:>13}", f"{d:>16.1f}", *(f"{r[o]['decode_tok_s']:>9.1f}" for o in others),
                          *(f"{d / r[o]['decode_tok_s']:>9.2f}" for o in others), f"{r[main]['a2a_share']:>8.0%}"]))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"rows": results, "loadavg": load, "kind": kind}, indent=1))


def _tp_engine(m, kv, s, tp: int, prompts, T: int) -> dict:
    from pdkv.config import ParallelConfig
    from pdkv.engine import LLMEngine

    eng = LLMEngine(m, kv, s, num_threads=tp, parallel=ParallelConfig(tp=tp, timeout_s=600.0))
    try:
        _drive(eng, prompts[:1], 2)
        pre, dec = _drive(eng, prompts, T)
    finally:
        eng.close()
    return {"prefill_tok_s": len(prompts) * len(prompts[0]) / pre, "decode_tok_s": len(prompts) * (T - 1) / dec}


def run_tp(args) -> int:
    """``--dp N --tp M --ep``: the tp x dp group (N DP ranks of M TP processes) against a pure
    DP-EP group of N*M ranks and one TP-(N*M) engine: the same N*M processes of one thread each and
    the same N*B requests (B per DP rank of the tp x dp group)."""
    from pdkv.bench._moe import make_moe_model

    kind = args.model_kind if args.model_kind != "llama" else "qwen3_moe"
    n, tp, P, T = args.dp, args.tp, args.prompt_len, args.new_tokens
    procs = n * tp
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_moe_model(kind, Path(tmp) / kind))
        results = []
        for b in [int(x) for x in args.batch_sizes.split(",")]:
            m, kv, s = _configs(model, b, P, T)
            prompts = _prompts(n * b, P, 32000 if args.model is None else 1000, 0)
            row = {"B_per_dp_rank": b, "dp": n, "tp": tp,
                   "dp_tp": _group(m, kv, s, n, tp, prompts, T),
                   f"dp{procs}_ep": _group(m, kv, s, procs, 1, prompts, T),
                   f"tp{procs}": _tp_engine(m, kv, s, procs, prompts, T)}
            results.append(row)
            print(json.dumps(row), flush=True)
        _report(args.out, f"DP{n}xTP{tp}-EP vs DP{procs}-EP vs TP{procs} ({kind}, prompt {P}, {T} new tokens, "
                f"{n}*B requests, one thread per process", results, kind, "B_per_dp_rank", "dp_tp",
                [f"dp{procs}_ep", f"tp{procs}"])
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "single":
        sys.exit(single(sys.argv[2:]))
    sys.exit("run it as: python -m pdkv.bench engine --dp 2 --ep")
