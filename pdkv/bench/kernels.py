"""pdkv's CPU kernels against torch's, in the same run: ``python -m pdkv.bench kernels``.

GEMMs: for each weight shape of the bench models (`python -m pdkv.bench engine --model-kind
...`) and each row count, the time of F.linear with the weight stored [out, in] (Hugging Face's
layout, what transformers runs) and [in, out] (what pdkv's loader stores when the kernels are
off), and of pdkv's kernel (models/cpu_kernels.py) on [out, in]; weights cold (a ring of copies
larger than the last-level cache, each read once per round, like a decode step's layers), one
thread. Each printed with the read bandwidth it reached and the kernel's speed-up over the
faster torch layout; a 1-thread ``sum`` over 512 MB is the bandwidth baseline.

Decode attention: one decode row over C cached tokens (the bench models' heads: 8 query / 2 KV
heads of 64, the default model's 4 query / 2 KV heads of 32, and the MLA latent of 8 heads over
160 values), the torch backend's own path
(gather the pages, SDPA) against the kernel over the pages (models/attention/cpu_decode.py),
both through TorchAttentionBackend.forward.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pdkv.bench.engine import measure_read_bandwidth

# (out, in) of the Qwen3-MoE / DeepSeek-V3 bench models' GEMMs: an expert's gate_up and o_proj,
# an expert's down_proj, Qwen3's qkv, MLA's fused input projection, the LM head.
SHAPES = [(512, 512), (512, 256), (768, 512), (416, 512), (32000, 512)]


def _best(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_gemm(rows: list[int], rounds: int, ring_bytes: int) -> list[dict]:
    from pdkv.models import cpu_kernels  # noqa: PLC0415

    out = []
    for n, k in SHAPES:
        copies = max(2, ring_bytes // (n * k * 4))
        g = torch.Generator().manual_seed(0)
        ring = [torch.randn(n, k, generator=g) * 0.02 for _ in range(copies)]  # [out, in]
        ring_t = [w.t().contiguous().t() for w in ring]  # the same values stored [in, out]
        for m in rows:
            x = torch.randn(m, k, generator=g)
            with torch.inference_mode():
                t_hf = _best(lambda: [F.linear(x, w) for w in ring], rounds) / copies
                t_t = _best(lambda: [F.linear(x, w) for w in ring_t], rounds) / copies
                t_k = (_best(lambda: [cpu_kernels.linear(x, w) for w in ring], rounds) / copies
                       if cpu_kernels.AVAILABLE and m <= cpu_kernels.MAX_ROWS else None)
            nbytes = n * k * 4
            row = {"out": n, "in": k, "rows": m, "torch_out_in_us": t_hf * 1e6, "torch_in_out_us": t_t * 1e6,
                   "torch_out_in_gbs": nbytes / t_hf / 1e9, "torch_in_out_gbs": nbytes / t_t / 1e9}
            line = (f"{n:5d}x{k:<4d} M={m:<2d} torch[out,in] {t_hf * 1e6:8.1f} us {nbytes / t_hf / 1e9:5.1f} GB/s"
                    f"  torch[in,out] {t_t * 1e6:8.1f} us {nbytes / t_t / 1e9:5.1f} GB/s")
            if t_k is not None:
                row.update(kernel_us=t_k * 1e6, kernel_gbs=nbytes / t_k / 1e9, speedup=min(t_hf, t_t) / t_k)
                line += f"  kernel {t_k * 1e6:8.1f} us {nbytes / t_k / 1e9:5.1f} GB/s  x{min(t_hf, t_t) / t_k:.2f}"
            print(line, flush=True)
            out.append(row)
    return out


def bench_attention(contexts: list[int], rounds: int) -> list[dict]:
    from pdkv.models.attention.base import AttentionBatch  # noqa: PLC0415
    from pdkv.models.attention.torch_backend import TorchAttentionBackend  # noqa: PLC0415
    from pdkv.kv import KVCache  # noqa: PLC0415

    P, out = 16, []
    for label, (hq, hkv, d, dv, parts) in {"gqa": (8, 2, 64, 64, 2), "gqa2": (4, 2, 32, 32, 2), "mla": (8, 1, 160, 128, 1)}.items():
        for ctx in contexts:
            pages = -(-ctx // P)
            kv = KVCache(1, pages + 1, P, hkv, d, torch.float32, "HND", "cpu", kv_parts=parts)
            kv.layer(0).normal_()
            table = torch.randperm(pages + 1)[:pages].tolist()
            q, k = torch.randn(1, hq, d), torch.randn(1, hkv, d)
            v = None if parts == 1 else torch.randn(1, hkv, d)
            times = {}
            for use in (False, True):
                be = TorchAttentionBackend(kv, hq, hkv, d, d ** -0.5, None, value_dim=dv)
                be.use_cpu_kernel = use
                meta = be.plan(AttentionBatch([1], [ctx], [table], 1))
                with torch.inference_mode():
                    be.forward(0, q, k, v, meta)
                    times[use] = _best(lambda: [be.forward(0, q, k, v, meta) for _ in range(20)], rounds) / 20
            row = {"heads": label, "context": ctx, "torch_us": times[False] * 1e6, "kernel_us": times[True] * 1e6,
                   "speedup": times[False] / times[True]}
            print(f"attention {label} context {ctx:5d}: torch {times[False] * 1e6:7.1f} us  kernel "
                  f"{times[True] * 1e6:7.1f} us  x{times[False] / times[True]:.2f}", flush=True)
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdkv.bench kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32", help="rows of x per GEMM")
    ap.add_argument("--contexts", default="128,1024,4096", help="cached tokens per decode row")
    ap.add_argument("--rounds", type=int, default=5, help="timed passes over the ring; best kept")
    ap.add_argument("--ring-mb", type=int, default=256,
                    help="MB of weight copies cycled through (more than the last-level cache: cold reads)")
    ap.add_argument("--out", default="bench-results/kernels.json")
    a = ap.parse_args(argv)
    from pdkv.models import cpu_kernels  # noqa: PLC0415

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernels' (models/cpu_kernels.py one_thread) and MKL's on one thread
    try:
        return _run(a, cpu_kernels)
    finally:
        torch.set_num_threads(threads)


def _run(a, cpu_kernels) -> int:
    bw = measure_read_bandwidth(1)
    print(f"1 thread, torch {torch.__version__}, kernels {'available' if cpu_kernels.AVAILABLE else 'NOT available'}, "
          f"load average {os.getloadavg()[0]:.1f}; read bandwidth (1-thread sum over 512 MB) {bw / 1e9:.1f} GB/s",
          flush=True)
    result = {"read_gbs": bw / 1e9, "load_average": os.getloadavg()[0],
              "gemm": bench_gemm([int(r) for r in a.rows.split(",")], a.rounds, a.ring_mb << 20),
              "attention": bench_attention([int(c) for c in a.contexts.split(",")], a.rounds)
              if cpu_kernels.AVAILABLE else []}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return 0
