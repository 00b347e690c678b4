"""pdkv's CPU kernels (pdkv/kernels/*.c through pdkv._kernels) for the models: the few rows of
a decode step, float32, on CPUs with AVX2+FMA.

- ``linear`` / ``bmm``: GEMMs of up to KERNEL_ROWS (``bmm``: MAX_ROWS) rows. A decode step
  multiplies a handful of rows by each weight, so it costs one read of every weight from memory;
  MKL's GEMV/GEMM for so few rows reads a cold weight at 5-14 GB/s on the machines this runs on,
  the kernel (one contiguous pass over each weight row, the rows of x in L1) at 19-27 GB/s, about
  a 1-thread ``sum``. Every result row is the same float operations whatever else is in the
  batch. More rows (large decode batches, prefill chunks): oneDNN's GEMM where torch has it.
- ``gated_mlp``, ``moe_one_token``: the gated MLP, and a one-token MoE step's k experts, each in
  one call; ``route``: MoE routing (softmax, or DeepSeek's grouped sigmoid); ``rms_norm``;
  ``norm_rope``: Qwen3's q/k norm and rope; ``argmax``: the greedy rows' token ids (the
  sampler's). Attention: models/attention/cpu_decode.py.

The GEMMs need weights stored with the input dimension contiguous (the Hugging Face [out, in]
layout of a Linear's weight), which the loader keeps when ``model.cpu_kernels`` is on (the
default); off, it stores them [in, out], the layout MKL's own GEMV prefers, and turns every
module's kernels off. Each front checks shapes, strides, dtypes, devices and autograd and
hands anything it does not take to torch unchanged (or returns None for its caller's torch
path); `python -m pdkv.bench kernels` measures the kernels against torch.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

try:
    from pdkv import _kernels as _k
except ImportError:  # the extension is not built (a source tree without build_ext): torch only
    _k = None

AVAILABLE = _k is not None and _k.SUPPORTED
# The GEMM kernel's ISA path, picked at run time by what the CPU has (pdkv/kernels/gemm_small.h):
# "avx512" / "avx2" (blocked over rows: each weight read once per call) or "pairs" (the first
# kernel: once per pair of rows); PDKV_GEMM_PATH=pairs|avx2|avx512 overrides it.
GEMM_PATH = _k.gemm_path() if AVAILABLE else "none"
# Above this many rows MKL's blocked GEMM is as fast or faster on one thread: 16 for the pairs
# kernel; the blocked ones were 1.5-2.5x faster than MKL at 32 and 64 rows (bench kernels).
# NOTE: outputs are made with torch.empty(ints..., dtype=...): a torch.Size argument costs ~2 us
# more per call, and a decode step makes ~100 of them.
MAX_ROWS = 64 if GEMM_PATH in ("avx512", "avx2") else 16


def _onednn_linear():
    """torch's oneDNN linear over a plain [out, in] weight (the op inductor's CPU fusions call;
    no packed copy of the weight), or None where this torch build lacks it or it fails."""
    import os  # noqa: PLC0415

    if os.environ.get("PDKV_LINEAR_ONEDNN", "0") != "1":
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise
        if not torch.backends.mkldnn.is_available():
            return None
        x, w = torch.ones(2, 8), torch.ones(3, 8)
        with torch.inference_mode():
            if not torch.equal(op(x, w, None, "none", [], ""), torch.full((2, 3), 8.0)):
                return None
        return op
    except (AttributeError, RuntimeError):
        return None


# PDKV_LINEAR_ONEDNN=1: float32 linears of more than KERNEL_ROWS (16) rows go to oneDNN's GEMM,
# which beat both the kernel and MKL from 17-24 rows up on 1 and 2 threads (8-64 rows, cold
# weights of a 144M model's four shapes, AMD EPYC with AVX-512: oneDNN 0.58-0.83x MKL's time,
# the kernel 0.82-1.0x oneDNN's at 8-16 rows and 1.07-1.41x at 24-64; 512 rows, a prefill chunk:
# 0.70x MKL). Off by default: oneDNN builds and caches a primitive per row count it meets, so a
# server's memory grows with every new prompt length (a prefill node's RSS by ~36 MB in 8 s of
# the soak, against 0.05 MB with MKL); it needs the row counts bucketed first. Off: MKL
# (F.linear) past the kernel's MAX_ROWS.
_ONEDNN = _onednn_linear()
ONEDNN = _ONEDNN is not None
KERNEL_ROWS = min(16, MAX_ROWS) if ONEDNN else MAX_ROWS
# bfloat16 weights (model.dtype: bfloat16) on CPUs with AVX512-BF16: float32 sums, one rounding.
BF16 = AVAILABLE and _k.BF16
# The most rows the bf16 kernel takes: at 64 oneDNN's bf16 GEMM was as fast on AVX512-BF16 alone
# (1.10 vs 0.97 ms at 3072 x 768, one thread).
BF16_KERNEL_ROWS = 32


def _amx_bf16() -> bool:
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False


# Where the CPU has AMX tiles, torch's bf16 GEMM (oneDNN) runs on them and reads a weight as fast
# for 32 rows as for one: a 144M layer's four weights on 2 threads took 1.43-1.61 ms at 1-32
# rows, the kernel 0.77-0.80x that at 1-4 rows, 1.08x at 8, 1.79x at 16, 2.72x at 32 (Sapphire
# Rapids). There the kernel takes up to 4 rows; the choice follows the CPU, so it is the same in
# every process on it.
AMX_BF16 = BF16 and _amx_bf16()
MAX_ROWS_BF16 = 4 if AMX_BF16 else BF16_KERNEL_ROWS
_FP8 = getattr(torch, "float8_e4m3fn", None)  # block-quantized weights: models/fp8.py
# The GEMM-type kernels (linear, bmm, gated_mlp, moe_one_token, decode attention) split each call
# across OpenMP threads (pdkv/kernels/pool.h: by output columns, or by sequence and KV head),
# as many as ``set_threads`` last asked for; the runner asks for the thread count it gives torch
# for the step (pdkv/engine/threads.py measures one thread against all of them), so the kernels
# and torch's own ops run on the same cores. Every output is the same float operations whatever
# the thread count. Norms, rope and routing (no threading to gain) run on the caller.


# (op, n, k, rows bucket, threads) that torch ran faster than the kernel on this machine
# (models/gemm_tuner.py measures them at load); a set lookup per call, none while it is empty.
_TORCH: frozenset = frozenset()


def prefer_torch(keys: set[tuple[str, int, int, int]], threads: int) -> None:
    """Send these (op, n, k, rows bucket) to torch at ``threads``, replacing that thread count's
    earlier choice (op: "linear" for a weight [n, k], "mlp" for a gated MLP of intermediate
    size n over k inputs; the bucket: the row count rounded up to a power of two)."""
    global _TORCH
    _TORCH = frozenset({t for t in _TORCH if t[4] != threads} | {(*key, threads) for key in keys})


@contextlib.contextmanager
def untuned():
    """Every call on the kernel while the tuner times it against torch."""
    global _TORCH
    saved, _TORCH = _TORCH, frozenset()
    try:
        yield
    finally:
        _TORCH = saved


def _torch_wins(op: str, n: int, k: int, m: int) -> bool:
    return (op, n, k, 1 << (m - 1).bit_length(), _k.threads()) in _TORCH


def set_threads(n: int) -> None:
    """The threads each kernel call may use (the caller's included)."""
    if AVAILABLE:
        _k.set_threads(n)


def threads() -> int:
    return _k.threads() if AVAILABLE else 1


def _takes(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """x: [M, K] and w: [N, K] (or their batched forms' last two dims) the kernel can read."""
    return (x.dtype is dtype and w.dtype is dtype and x.is_cpu and w.is_cpu
            and x.stride(-1) == 1 and w.stride(-1) == 1
            and not ((x.requires_grad or w.requires_grad) and torch.is_grad_enabled()))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x: [M, K], weight: [N, K] (FP8 with block scales: models/fp8.py)."""
    if weight.dtype is _FP8:
        from pdkv.models.fp8 import linear_fp8  # noqa: PLC0415 - it calls back here for the float GEMM

        return linear_fp8(x, weight, bias)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return F.linear(x, weight, bias)
    # float32 on every kernel path, bfloat16 where the CPU has AVX512-BF16: the same checks
    if AVAILABLE and x.dtype is torch.float32:
        if x.shape[0] > KERNEL_ROWS:
            return _large(x, weight, bias)
        if _TORCH and x.shape[0] > 0 and _torch_wins("linear", weight.shape[0], x.shape[1], x.shape[0]):
            return F.linear(x, weight, bias)
        gemm, max_rows = _k.gemm, KERNEL_ROWS
    elif BF16 and x.dtype is torch.bfloat16:
        gemm, max_rows = _k.gemm_bf16, MAX_ROWS_BF16
    else:
        return F.linear(x, weight, bias)
    if (0 < x.shape[0] <= max_rows and _takes(x, weight, x.dtype)
            and (bias is None or (bias.dtype is x.dtype and bias.is_cpu and bias.dim() == 1
                                  and bias.shape[0] == weight.shape[0] and bias.stride(0) == 1))):
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty(m, n, dtype=x.dtype)
        gemm(x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
             0 if bias is None else bias.data_ptr(), y.data_ptr(), n, m, k, n)
        return y
    return F.linear(x, weight, bias)


def _large(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 x [M, K] of more than KERNEL_ROWS rows: oneDNN where it takes the tensors, else MKL."""
    if (ONEDNN and weight.dtype is torch.float32 and x.is_contiguous() and weight.is_contiguous()
            and x.is_cpu and weight.is_cpu and (bias is None or (bias.dtype is torch.float32 and bias.dim() == 1
                                                                and bias.is_contiguous()
                                                                and bias.shape[0] == weight.shape[0]))
            and not ((x.requires_grad or weight.requires_grad) and torch.is_grad_enabled())):
        return _ONEDNN(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """torch.bmm(x, w) for x: [B, M, K], w: [B, K, N] stored with K contiguous (w.stride(1) == 1)."""
    if (AVAILABLE and x.dim() == 3 and w.dim() == 3 and 0 < x.shape[1] <= MAX_ROWS
            and x.shape[0] == w.shape[0] and x.shape[2] == w.shape[1] and w.stride(1) == 1
            and x.dtype is torch.float32 and w.dtype is torch.float32 and x.is_cpu and w.is_cpu
            and x.stride(2) == 1 and not ((x.requires_grad or w.requires_grad) and torch.is_grad_enabled())):
        b, m, k = x.shape
        n = w.shape[2]
        y = torch.empty(b, m, n, dtype=torch.float32)
        _k.gemm_batched(b, x.data_ptr(), x.stride(0), x.stride(1), w.data_ptr(), w.stride(0), w.stride(2),
                           y.data_ptr(), m * n, n, m, k, n)
        return y
    return torch.bmm(x, w)


def gated_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, inter: int) -> torch.Tensor:
    """down(silu(x Wg^T) * (x Wu^T)) for x: [M, H], gate_up: [2 * inter, H] (gate rows, then up
    rows), down: [H, inter], no biases: one kernel call for up to KERNEL_ROWS rows."""
    if (AVAILABLE and x.dim() == 2 and 0 < x.shape[0] <= KERNEL_ROWS and gate_up.dim() == 2 and down.dim() == 2
            and gate_up.shape[0] == 2 * inter and gate_up.shape[1] == x.shape[1]
            and down.shape[0] == x.shape[1] and down.shape[1] == inter and _takes(x, gate_up) and _takes(x, down)):
        m, h = x.shape
        if _TORCH and _torch_wins("mlp", inter, h, m):
            return torch_gated_mlp(x, gate_up, down, inter)
        y = torch.empty(m, h, dtype=torch.float32)
        _k.gated_mlp(x.data_ptr(), x.stride(0), gate_up.data_ptr(), gate_up.stride(0), down.data_ptr(),
                        down.stride(0), y.data_ptr(), h, m, h, inter)
        return y
    gu = linear(x, gate_up)  # [M, 2 * inter]
    return linear(F.silu(gu[:, :inter]) * gu[:, inter:], down)


def torch_gated_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, inter: int) -> torch.Tensor:
    """gated_mlp on torch's GEMMs alone."""
    gu = F.linear(x, gate_up)
    return F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], down)


def moe_one_token(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, num_experts: int, first: int) -> torch.Tensor | None:
    """One token through its routed experts in one kernel call: x [1, H], this rank's experts
    gate_up [n, 2I, H] and down [n, H, I] (global ids first .. first + n - 1), ids / weights
    [1, k] → [1, H], the sum in ascending expert order (models/moe.py ``_one_token``); None when
    the kernel does not take these tensors (the caller runs its own loop)."""
    if not (AVAILABLE and x.dim() == 2 and x.shape[0] == 1 and gate_up.dim() == 3 and down.dim() == 3
            and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == x.shape[1] == down.shape[1]
            and gate_up.shape[0] == down.shape[0] and _takes(x, gate_up[0]) and _takes(x, down[0])
            and ids.dtype is torch.long and weights.dtype is torch.float32 and ids.is_cpu and weights.is_cpu
            and ids.is_contiguous() and weights.is_contiguous() and ids.shape == weights.shape
            and ids.dim() == 2 and ids.shape[0] == 1 and ids.shape[1] <= 64):
        return None
    h, inter = x.shape[1], down.shape[2]
    out = torch.empty(1, h, dtype=torch.float32)
    _k.moe_one_token(x.data_ptr(), gate_up.data_ptr(), gate_up.stride(0), gate_up.stride(1), down.data_ptr(),
                        down.stride(0), down.stride(1), ids.data_ptr(), weights.data_ptr(), ids.shape[1],
                        num_experts, first, gate_up.shape[0], h, inter, out.data_ptr())
    return out


def argmax(logits: torch.Tensor) -> list[int]:
    """logits: [N, V] -> each row's first index of its maximum, as ``logits.argmax(-1).tolist()``
    gives (torch's own for what the kernel does not take, or a row with a NaN)."""
    if (AVAILABLE and logits.dtype is torch.float32 and logits.is_cpu and logits.dim() == 2
            and logits.shape[0] > 0 and logits.shape[1] > 0 and logits.stride(1) == 1):
        out = torch.empty(logits.shape[0], dtype=torch.long)
        rows, n = logits.shape
        if _k.argmax_rows(logits.data_ptr(), logits.stride(0), rows, n, out.data_ptr()):
            return out.tolist()
    return logits.argmax(-1).tolist()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm over the last dim of a float32 x: [R, D] or [T, H, D] (any row strides, D
    contiguous) → a new contiguous tensor; None when the kernel does not take x."""
    if not (AVAILABLE and x.dtype is torch.float32 and weight.dtype is torch.float32 and x.is_cpu and weight.is_cpu
            and x.stride(-1) == 1 and weight.dim() == 1 and weight.stride(0) == 1 and x.shape[-1] == weight.shape[0]
            and 2 <= x.dim() <= 3 and x.numel() > 0
            and not ((x.requires_grad or weight.requires_grad) and torch.is_grad_enabled())):
        return None
    if x.dim() == 2:
        rows, dim = x.shape
        y = torch.empty(rows, dim, dtype=torch.float32)
        _k.rms_norm(x.data_ptr(), x.stride(0), 0, weight.data_ptr(), y.data_ptr(), rows, 1, dim, eps)
    else:
        outer, inner, dim = x.shape
        y = torch.empty(outer, inner, dim, dtype=torch.float32)
        _k.rms_norm(x.data_ptr(), x.stride(0), x.stride(1), weight.data_ptr(), y.data_ptr(), outer, inner, dim,
                       eps)
    return y


def norm_rope(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor | None:
    """x: [T, heads, D] (D contiguous, heads D apart, any row stride; T <= MAX_ROWS) → rope(norm(x))
    as a new [T, heads, D] (norm: a per-head RMSNorm with ``norm_weight`` [D], or none); cos/sin:
    [T, 1, D] from models/rope.py RotaryEmbedding.table. None when the kernel does not take them."""
    T, heads, D = x.shape
    if not (AVAILABLE and 0 < T <= MAX_ROWS and D % 2 == 0 and D <= 1024 and x.dtype is torch.float32 and x.is_cpu
            and x.stride(2) == 1 and x.stride(1) == D and cos.dtype is torch.float32 and sin.dtype is torch.float32
            and cos.is_cpu and sin.is_cpu and cos.is_contiguous() and sin.is_contiguous()
            and cos.shape == (T, 1, D) and sin.shape == (T, 1, D)
            and (norm_weight is None or (norm_weight.dtype is torch.float32 and norm_weight.is_cpu
                                         and norm_weight.shape == (D,) and norm_weight.stride(0) == 1))):
        return None
    out = torch.empty(T, heads, D, dtype=torch.float32)
    _k.norm_rope(x.data_ptr(), x.stride(0), T, heads, D, 0 if norm_weight is None else norm_weight.data_ptr(),
                    eps, cos.data_ptr(), sin.data_ptr(), out.data_ptr())
    return out


MAX_EXPERTS = 1024  # route.c MAX_EXPERTS: a model with more is routed by torch


def route(logits: torch.Tensor, moe, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Router logits [T, E] float32 → (ids [T, k] long, weights [T, k] float32) by ``moe``'s scheme
    (models/config_moe.py: softmax, or sigmoid with groups, correction bias and scaling), as
    models/moe.py's Router computes them with torch; None when the kernel does not take them."""
    if not (AVAILABLE and moe.num_experts <= MAX_EXPERTS and moe.top_k <= moe.num_experts
            and logits.dtype is torch.float32 and logits.is_cpu and logits.dim() == 2
            and logits.is_contiguous() and logits.shape[1] == moe.num_experts
            and not (logits.requires_grad and torch.is_grad_enabled())
            and (bias is None or (bias.dtype is torch.float32 and bias.is_contiguous()
                                  and bias.shape == (moe.num_experts,)))):
        return None
    T, k = logits.shape[0], moe.top_k
    ids = torch.empty(T, k, dtype=torch.long)
    weights = torch.empty(T, k, dtype=torch.float32)
    sigmoid = moe.scoring == "sigmoid"
    _k.route(logits.data_ptr(), T, moe.num_experts, sigmoid, 0 if bias is None else bias.data_ptr(),
                moe.num_groups if sigmoid else 1, moe.topk_groups if sigmoid else 1, k, moe.norm_topk_prob,
                moe.routed_scaling_factor if sigmoid else 1.0, ids.data_ptr(), weights.data_ptr())
    return ids, weights
