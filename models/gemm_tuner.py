"""Which GEMM runs a decode step's float32 linear: pdkv's kernel or torch's (MKL), per weight
shape and row count, chosen by timing both at load over the model's own weights.

A GEMM of a few rows is bound by reading the weight, and which implementation reads it faster
depends on the CPU, its caches and the thread count: on an AMD EPYC (AVX2 or AVX-512) the kernel
was ahead of MKL at every row count to 64 on one thread; on a Xeon with AVX-512, on two
threads, MKL was ahead at 33-64 rows and level at one, the kernel ahead in between. Only the
engine that builds the model measures (a tensor-parallel follower keeps the kernel). No fixed rule
holds on every machine, so the engine measures: for each weight shape of the model's linears
(and each gated MLP's pair), for rows 1, 2, 4, ... up to the kernel's limit, the kernel and
torch alternate over the same weights (as many as a step would read in a row, so each timing
reads them from memory as a step does), best of ``reps``. Where torch is faster by more than
``margin``, ``models/cpu_kernels.py`` sends that shape and row bucket to torch at that thread
count; everything else stays on the kernel. One thread is not measured: there the kernel won
everywhere it was measured, and the thread tuner (pdkv/engine/threads.py) picks one thread
only when the cores are busy, when a timing at load would say little.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdkv.models import cpu_kernels

log = logging.getLogger("pdkv.models.gemm_tuner")

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MAX_WEIGHTS = 8  # weights per shape timed in a row: enough to leave the caches, bounded load time


@dataclass(frozen=True)
class Timing:
    op: str  # "linear" | "mlp" (a gated MLP's gate_up and down: one kernel call)
    n: int  # linear: the weight's rows (outputs); mlp: the intermediate size
    k: int  # the inputs
    rows: int  # a bucket of BUCKETS
    kernel_s: float
    torch_s: float


def _groups(model: torch.nn.Module) -> dict[tuple[str, int, int], list]:
    """The model's float32 linears the kernel takes, by (op, n, k): weights, or MLP pairs."""
    from pdkv.models.layers import MLP  # noqa: PLC0415 - layers import cpu_kernels, which this sits beside

    groups: dict[tuple[str, int, int], list] = {}
    in_mlp = set()
    for m in model.modules():
        if isinstance(m, MLP) and m.gate_up_proj.bias is None and m.down_proj.bias is None:
            gu, down = m.gate_up_proj.weight, m.down_proj.weight
            if gu.dtype is torch.float32 and gu.is_contiguous() and down.is_contiguous():
                groups.setdefault(("mlp", m.inter, gu.shape[1]), []).append((gu, down, m.inter))
                in_mlp.update((id(gu), id(down)))
    for m in model.modules():
        w = getattr(m, "weight", None)
        if (isinstance(m, torch.nn.Linear) and id(w) not in in_mlp and w.dtype is torch.float32
                and w.dim() == 2 and w.is_contiguous()):
            groups.setdefault(("linear", w.shape[0], w.shape[1]), []).append(w)
    return groups


def _time(fn, items: list, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    for it in items:
        fn(x, it)
    return time.perf_counter() - t0


def measure(model: torch.nn.Module, threads: int, reps: int = 3) -> list[Timing]:
    """Both implementations at ``threads`` for every shape group and row bucket the kernel takes.
    torch's and the kernels' thread counts are set for the measurement and put back."""
    kernel_fns = {"linear": lambda x, w: cpu_kernels.linear(x, w),
                  "mlp": lambda x, p: cpu_kernels.gated_mlp(x, *p)}
    torch_fns = {"linear": lambda x, w: F.linear(x, w), "mlp": lambda x, p: cpu_kernels.torch_gated_mlp(x, *p)}
    before = torch.get_num_threads(), cpu_kernels.threads()
    out = []
    try:
        torch.set_num_threads(threads)
        cpu_kernels.set_threads(threads)
        with torch.inference_mode(), cpu_kernels.untuned():
            for (op, n, k), items in sorted(_groups(model).items()):
                items = items[:MAX_WEIGHTS]
                for rows in (b for b in BUCKETS if b <= cpu_kernels.KERNEL_ROWS):
                    x = torch.randn(rows, k)
                    best_k = best_t = float("inf")
                    for _ in range(reps):  # alternated, so a burst of noise hits both
                        best_k = min(best_k, _time(kernel_fns[op], items, x))
                        best_t = min(best_t, _time(torch_fns[op], items, x))
                    out.append(Timing(op, n, k, rows, best_k / len(items), best_t / len(items)))
    finally:
        torch.set_num_threads(before[0])
        cpu_kernels.set_threads(before[1])
    return out


def tune(model: torch.nn.Module, threads: int, margin: float = 0.9, reps: int = 3) -> list[Timing]:
    """Measures and installs the choice (cpu_kernels.prefer_torch): torch where it took less
    than ``margin`` x the kernel's time. Returns the timings (the log and the tests read them)."""
    if not cpu_kernels.AVAILABLE or threads < 2:
        return []
    t0 = time.perf_counter()
    timings = measure(model, threads, reps)
    wins = [t for t in timings if t.torch_s < margin * t.kernel_s]
    cpu_kernels.prefer_torch({(t.op, t.n, t.k, t.rows) for t in wins}, threads)
    log.info("GEMM choice at %d threads (%d shapes x rows measured in %.1f s): torch for %s, the kernel for the rest",
             threads, len(timings), time.perf_counter() - t0,
             ", ".join(f"{t.op} {t.n}x{t.k} <={t.rows} rows ({t.torch_s / t.kernel_s:.2f}x)" for t in wins) or "none")
    return timings
