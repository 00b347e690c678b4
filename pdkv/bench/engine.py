"""`python -m pdkv.bench engine`: prefill and decode throughput of the pdkv engine against
Hugging Face `generate` on the same model, prompts and machine, in the same run; plus the floor
of a decode step (weight bytes over the memory read bandwidth measured now).

Model: a seeded random ~57M-parameter Llama (hidden 512, 8 layers, 8 heads / 2 KV heads,
intermediate 1536, vocab 32000, float32) written by pdkv.tiny_model unless --model is given;
``--model-kind qwen3_moe|deepseek_v3`` builds a MoE model of the same trunk instead
(pdkv/bench/_moe.py), whose floor counts only the parameters a decode step reads: attention,
dense and shared MLPs, the router and top_k routed experts per layer.
Workload per batch size B: B prompts of --prompt-len random tokens, --new-tokens greedy tokens
each (eos ignored). Prefill tok/s = B * prompt_len / time to every request's first token;
decode tok/s = B * (new_tokens - 1) / time of the remaining steps. Hugging Face is timed the same
way inside one `generate` call (a streamer notes the first new token). Each system runs
``--repeats`` times per batch size, interleaved; the best time of each is kept.
With ``--threads 1`` each system is also timed in CPU seconds of the one thread that computes
(``time.thread_time``; "cpu" columns): on a shared machine a niced bench waits for a core a
large and varying part of its wall time, which moves both systems' wall-clock figures by 2-10x
between repeats; the thread's own CPU time leaves that wait out (memory contention stays in).
``--dtype bfloat16`` runs pdkv's model in bfloat16 (its floor counts 2-byte weights).
``--profile`` prints, per batch size, where the decode steps' CPU time went: cProfile's functions
by their own time (pdkv._kernels calls are the C kernels, ``{method ...}`` / ``{built-in ...}``
torch's ops), so GEMMs, attention, sampling, scheduling and the Python between them are
separate rows; then the same time summed by part of the engine (pdkv/bench/_profile.py: GEMMs,
attention, layers, sampler, runner inputs, scheduler, engine outputs). The kernels' GEMM path is
printed and chosen by PDKV_GEMM_PATH (pdkv/kernels/gemm_small.h); run one process per path to
compare them. Besides the weights' floor, each batch size has a weights+KV floor: the weights
and the KV its rows read at the middle of their decode, over the same bandwidth.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import tempfile
import time
from pathlib import Path

import torch

from pdkv.bench._profile import print_parts

def measure_read_bandwidth(threads: int, nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Bytes/s of reading a buffer larger than any cache, best over 1 thread and ``threads``
    threads and ``reps`` tries (the best makes the floor strictest)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        x.sum()
        for _ in range(reps):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
    torch.set_num_threads(threads)
    return nbytes / best


def decode_weight_bytes(model) -> int:
    """Bytes a decode step must read: every parameter except the embedding table (only B rows of
    it are gathered), unless the LM head is tied to it."""
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters())
    emb = model.model.embed_tokens.weight
    return total - (0 if model.lm_head is None else emb.numel() * emb.element_size())


def bench_pdkv(engine, prompts, new_tokens, profile=None):
    from pdkv.engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    t0, c0 = time.perf_counter(), time.thread_time()
    first = set()
    while len(first) < len(prompts):
        first.update(o.request_id for o in engine.step())
    t1, c1 = time.perf_counter(), time.thread_time()
    steps = 0
    outs = {}
    if profile is not None:
        profile.enable()
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.output_token_ids
        steps += 1
    t2, c2 = time.perf_counter(), time.thread_time()
    if profile is not None:
        profile.disable()
    return (t1 - t0, t2 - t1, steps, [outs[f"b{i}"] for i in range(len(prompts))],
            (c1 - c0, c2 - c1))


class _TokenClock:
    """A transformers streamer that notes when generate emits its first new token, so HF's
    prefill and decode are split inside one `generate` call, the way ours are."""

    def __init__(self):
        self.calls, self.first, self.first_cpu = 0, None, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:  # call 1 is the prompt, call 2 the first sampled token
            self.first, self.first_cpu = time.perf_counter(), time.thread_time()

    def end(self):
        pass


def bench_hf(model, prompts, new_tokens, threads):
    """Returns (seconds to first token, seconds of the remaining tokens, tokens, (the same two
    in thread CPU seconds))."""
    torch.set_num_threads(threads)  # our runner may have left it at 1 after a decode step
    ids = torch.tensor(prompts)
    clock = _TokenClock()
    with torch.inference_mode():
        t0, c0 = time.perf_counter(), time.thread_time()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=clock)
        end, c_end = time.perf_counter(), time.thread_time()
    return (clock.first - t0, end - clock.first, out[:, ids.shape[1]:].tolist(),
            (clock.first_cpu - c0, c_end - clock.first_cpu))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _print_profile(prof, b: int, steps: int, top: int = 14) -> None:
    """The decode steps' functions by own time, per step (cProfile's overhead included)."""
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # (cc, nc, tt, ct, callers)
    total = sum(v[2] for _, v in rows)
    print(f"  profile B={b}: {total / max(steps, 1) * 1e3:.2f} ms/step CPU under cProfile; "
          "own CPU time per step:")
    for (file, line, name), (_, calls, tt, _, _) in rows[:top]:
        where = name if file == "~" else f"{Path(file).name}:{line} {name}"
        print(f"    {tt / max(steps, 1) * 1e3:7.3f} ms {tt / total:6.1%} {calls // max(steps, 1):5d} calls  {where}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdkv.bench engine", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model folder (default: build the 57M bench model)")
    ap.add_argument("--model-kind", default="llama", choices=("llama", "qwen3_moe", "deepseek_v3"),
                    help="the bench model to build when --model is not given")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layout", default="HND")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="torch threads for both systems (default: the cores this process may use)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per system and batch; best kept")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="pdkv's model dtype (Hugging Face's stays float32)")
    ap.add_argument("--profile", action="store_true",
                    help="print where each batch size's decode steps spent their time (cProfile)")
    ap.add_argument("--gemm-choice", default="kernel", choices=("kernel", "measure"),
                    help="model.gemm_choice: every small GEMM on pdkv's kernel, or the faster of it and "
                         "torch's per shape, timed at load (models/gemm_tuner.py)")
    ap.add_argument("--out", default="bench-results/engine.json")
    ap.add_argument("--dp", type=int, default=1,
                    help="with --ep: a DP-EP group of this many ranks vs TP of as many vs as many TP1 engines "
                         "(pdkv/bench/dp.py; MoE model kinds only)")
    ap.add_argument("--ep", action="store_true", help="expert parallelism across the --dp ranks")
    ap.add_argument("--tp", type=int, default=1,
                    help="with --dp and --ep: each DP rank a TP group of this many (tp x dp) vs DP-EP and TP "
                         "over as many processes")
    a = ap.parse_args(argv)
    if a.dp > 1 or a.ep:
        from pdkv.bench.dp import run  # noqa: PLC0415

        if a.out == "bench-results/engine.json":
            a.out = "bench-results/engine-dp.json"
        return run(a)

    from pdkv.models import cpu_kernels
    from pdkv.models.footprint import kv_bytes_per_token
    from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig
    from pdkv.engine import LLMEngine

    threads = a.threads
    torch.set_num_threads(threads)
    tmp = None
    if a.model is None and a.model_kind != "llama":
        from pdkv.bench._moe import make_moe_model

        tmp = tempfile.TemporaryDirectory(prefix="pdkv-bench-")
        a.model = str(make_moe_model(a.model_kind, Path(tmp.name) / f"bench-{a.model_kind}"))
    elif a.model is None:
        from pdkv.tiny_model import make_tiny_model

        tmp = tempfile.TemporaryDirectory(prefix="pdkv-bench-")
        a.model = str(make_tiny_model(Path(tmp.name) / "bench-57m", hidden_size=512, num_layers=8,
                                      num_heads=8, num_kv_heads=2, intermediate_size=1536,
                                      vocab_size=32000, max_position_embeddings=4096, seed=0))
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    max_b = max(sizes)
    num_pages = max_b * (-(-(a.prompt_len + a.new_tokens) // a.page_size)) + 8
    # NOTE: no prefix cache: the repeats must compute every prompt, not find the last round's pages
    engine = LLMEngine(ModelConfig(path=a.model, dtype=a.dtype, gemm_choice=a.gemm_choice),
                       KVCacheConfig(page_size=a.page_size, num_pages=num_pages, layout=a.layout,
                                     prefix_caching=False),
                       SchedulerConfig(max_num_batched_tokens=max_b * a.prompt_len, chunk_size=a.prompt_len,
                                       max_num_seqs=max_b), num_threads=threads)
    nparams = sum(p.numel() for p in engine.loaded.model.parameters())
    bw = measure_read_bandwidth(threads)
    if engine.loaded.arch.moe is not None:
        from pdkv.bench._moe import active_decode_bytes

        wbytes = active_decode_bytes(engine.loaded.model)  # the active-parameter floor (batch 1)
    else:
        wbytes = decode_weight_bytes(engine.loaded.model)
    floor_s = wbytes / bw
    kv_token = kv_bytes_per_token(engine.loaded.arch, 1, getattr(torch, a.dtype).itemsize)
    hf = None
    if not a.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    vocab = engine.loaded.arch.vocab_size
    bench_pdkv(engine, [[1] * 16], 4)  # warm-up
    results = []
    print(f"model {a.model}: {nparams / 1e6:.1f}M params, {threads} threads, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f}, {a.dtype}, GEMM path {cpu_kernels.GEMM_PATH} "
          f"(up to {cpu_kernels.KERNEL_ROWS} rows, {cpu_kernels.threads()} kernel threads; more rows: "
          f"{'oneDNN' if cpu_kernels.ONEDNN else 'MKL'}), CPU {_cpu_model()}")
    print(f"memory read bandwidth {bw / 1e9:.1f} GB/s; decode reads {wbytes / 1e6:.0f} MB of weights "
          f"-> floor {floor_s * 1e3:.2f} ms/step ({1 / floor_s:.1f} steps/s)")
    for b in sizes:
        # ids inside this model's vocabulary: --model may name one smaller than the bench model's
        prompts = [torch.randint(0, vocab, (a.prompt_len,), generator=gen).tolist() for _ in range(b)]
        # The machine is shared: run both systems `repeats` times, interleaved, and keep the best.
        pre = dec = hpre = hdec = cpre = cdec = hcpre = hcdec = float("inf")
        parts = None
        for rep in range(a.repeats):
            prof = cProfile.Profile(time.thread_time) if a.profile and rep == a.repeats - 1 else None
            p_, d_, steps, ours, cpu = bench_pdkv(engine, prompts, a.new_tokens, prof)
            if prof is not None:
                _print_profile(prof, b, steps)
                parts = print_parts(pstats.Stats(prof), b, steps)
            pre, dec, cpre, cdec = min(pre, p_), min(dec, d_), min(cpre, cpu[0]), min(cdec, cpu[1])
            if hf is not None:
                hp_, hd_, theirs, hcpu = bench_hf(hf, prompts, a.new_tokens, threads)
                hpre, hdec, hcpre, hcdec = min(hpre, hp_), min(hdec, hd_), min(hcpre, hcpu[0]), min(hcdec, hcpu[1])
        row = {"batch": b, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
               "pdkv_prefill_tok_s": b * a.prompt_len / pre,
               "pdkv_decode_tok_s": b * (a.new_tokens - 1) / dec,
               "pdkv_decode_ms_per_step": dec / steps * 1e3,
               "floor_ms_per_step": floor_s * 1e3,
               # + the KV a step reads: every row's context, at the middle of its decode
               "kv_floor_ms_per_step": (wbytes + b * kv_token * (a.prompt_len + a.new_tokens // 2)) / bw * 1e3}
        row["decode_step_over_floor"] = row["pdkv_decode_ms_per_step"] / row["floor_ms_per_step"]
        row["decode_step_over_kv_floor"] = row["pdkv_decode_ms_per_step"] / row["kv_floor_ms_per_step"]
        if parts is not None:
            row["profile_ms_per_step"] = parts
        if threads == 1:  # the computing thread's CPU time (see the module docstring)
            row["pdkv_decode_cpu_ms_per_step"] = cdec / steps * 1e3
            row["cpu_step_over_floor"] = row["pdkv_decode_cpu_ms_per_step"] / row["floor_ms_per_step"]
        if hf is not None:
            row.update({"hf_prefill_tok_s": b * a.prompt_len / hpre,
                        "hf_decode_tok_s": b * (a.new_tokens - 1) / hdec})
            row["prefill_ratio"] = row["pdkv_prefill_tok_s"] / row["hf_prefill_tok_s"]
            row["decode_ratio"] = row["pdkv_decode_tok_s"] / row["hf_decode_tok_s"]
            row["same_tokens_as_hf"] = sum(x == y for x, y in zip(ours, theirs)) / b
            if threads == 1:
                row["hf_decode_cpu_ms_per_step"] = hcdec / (a.new_tokens - 1) * 1e3
                row["decode_cpu_ratio"] = hcdec / cdec  # the same tokens: a tok/s ratio
                row["prefill_cpu_ratio"] = hcpre / cpre
        results.append(row)
        line = (f"B={b:>3}  pdkv prefill {row['pdkv_prefill_tok_s']:8.0f} tok/s  decode "
                f"{row['pdkv_decode_tok_s']:7.1f} tok/s ({row['pdkv_decode_ms_per_step']:.2f} ms/step, "
                f"{row['decode_step_over_floor']:.2f}x floor, {row['decode_step_over_kv_floor']:.2f}x "
                f"weights+KV floor {row['kv_floor_ms_per_step']:.2f} ms)")
        if threads == 1:
            cpu_ms = row["pdkv_decode_cpu_ms_per_step"]
            line += (f" cpu {cpu_ms:.2f} ms/step ({row['cpu_step_over_floor']:.2f}x, "
                     f"{cpu_ms / row['kv_floor_ms_per_step']:.2f}x weights+KV)")
        if hf is not None:
            line += (f" | HF prefill {row['hf_prefill_tok_s']:8.0f} decode {row['hf_decode_tok_s']:7.1f} | "
                     f"ratio prefill {row['prefill_ratio']:.2f}x decode {row['decode_ratio']:.2f}x "
                     f"| same tokens {row['same_tokens_as_hf']:.0%}")
            if threads == 1:
                line += (f" | cpu ms/step HF {row['hf_decode_cpu_ms_per_step']:.2f} "
                         f"ratio decode {row['decode_cpu_ratio']:.2f}x prefill {row['prefill_cpu_ratio']:.2f}x")
        print(line, flush=True)
    report = {"bench": "engine", "model": a.model, "params": nparams, "threads": threads, "dtype": a.dtype,
              "gemm_path": cpu_kernels.GEMM_PATH, "cpu": _cpu_model(),
              "torch": torch.__version__, "load_average_1m": os.getloadavg()[0], "machine": platform.machine(), "read_bandwidth_GBps": bw / 1e9,
              "decode_weight_bytes": wbytes, "results": results}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    if tmp is not None:
        tmp.cleanup()
    return 0
