"""Block-scaled FP8 GEMMs on a CUDA GPU: y = x W^T with W float8_e4m3fn [N, K] and its scales
[ceil(N / bn), ceil(K / bk)] (models/fp8.py), x quantized at run time per token and group of bk
columns (1 x 128: the "dynamic" activation scheme of DeepSeek's reference inference, vLLM and
SGLang). Two kernels, both Triton: the per-token-group quantization of x and the GEMM, whose
inner loop takes one bk-wide slice of K per step and multiplies each partial product by its
activation scale (per row) and weight scale (per bn columns) before accumulating in float32.

Nothing here synchronizes with the host or depends on values (grid and tile sizes come from the
shapes), so a decode step through it can be captured as a CUDA graph. Imported only when an
input is on a CUDA device (models/fp8.py linear_fp8); without Triton the layer dequantizes
and runs torch's GEMM. ``torch._scaled_mm`` with block scales is an alternative where the
installed torch supports it on the device: tools/gpu_check_fp8.py measures both against bf16.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a GPU host without Triton: models/fp8.py's dequantized path
    triton = None

E4M3_MAX = 448.0
BACKEND = "triton"  # or "scaled_mm" (torch._scaled_mm with block scales), "dequant" (bf16 GEMM)


if triton is not None:
    @triton.jit
    def _group_quant(x_ptr, q_ptr, s_ptr, K, stride_x, groups, GROUP: tl.constexpr):
        pid = tl.program_id(0)  # one (row, group of GROUP columns)
        row, g = pid // groups, pid % groups
        offs = g * GROUP + tl.arange(0, GROUP)
        mask = offs < K
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(x)), 1e-10) / 448.0
        q = tl.clamp(x / s, -448.0, 448.0)
        tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row * groups + g, s)

    @triton.jit
    def _block_gemm(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K, bn,
                    stride_bn, stride_cm, stride_bs_n, ks_groups,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n  # tiles ordered in GROUP_M-row bands: weight tiles reused in L2
        first_m = (pid // per_group) * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        am, bn_ = rm % M, rn % N
        a_ptrs = a_ptr + am[:, None] * K + rk[None, :]  # x quantized: [M, K] contiguous
        b_ptrs = b_ptr + bn_[None, :] * stride_bn + rk[:, None]  # W [N, K], K contiguous
        as_ptrs = as_ptr + am * ks_groups
        bs_ptrs = bs_ptr + (bn_ // bn) * stride_bs_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < left, other=0.0)
            a_s = tl.load(as_ptrs + k)
            b_s = tl.load(bs_ptrs + k)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (e4m3 [M, K], float32 scales [M, ceil(K / group)]): amax / 448 per group."""
    M, K = x.shape
    groups = triton.cdiv(K, group)
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, groups, dtype=torch.float32, device=x.device)
    if M:
        _group_quant[(M * groups,)](x, q, s, K, x.stride(0), groups, GROUP=group)
    return q, s


def _tiles(M: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps) by the token count: decode steps are a few rows."""
    if M <= 16:
        return 16, 64, 4
    if M <= 64:
        return 64, 64, 4
    return 128, 128, 8


def block_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ dequant(w)^T → [M, N] ``out_dtype`` (Triton)."""
    bn, bk = block
    M, K = x.shape
    N = w.shape[0]
    xq, xs = quantize_activations(x, bk)
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M == 0:
        return out
    BM, BN, warps = _tiles(M)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    _block_gemm[grid](xq, w, out, xs, scale, M, N, K, bn, w.stride(0), out.stride(0), scale.stride(0),
                      xs.shape[1], BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=bk, GROUP_M=8, num_warps=warps,
                      num_stages=3)
    return out


def scaled_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
              out_dtype: torch.dtype) -> torch.Tensor:
    """The same product through torch._scaled_mm's block-wise scaling (1 x 128 activation
    groups, 128 x 128 weight blocks; cuBLAS on SM90+ in recent torch). Raises where the
    installed torch or the device does not support it (tools/gpu_check_fp8.py reports that)."""
    xq, xs = quantize_activations(x, block[1])
    # cuBLAS wants the activation scales outer-dimension-major and the weight as [K, N] columns.
    return torch._scaled_mm(xq, w.t(), scale_a=xs.t().contiguous().t(), scale_b=scale.t(),
                            out_dtype=out_dtype)


def linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
           bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, dequant(w), bias) for x [..., K] on a CUDA device."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
    if triton is None or BACKEND == "dequant" or w.stride(1) != 1 or block[1] not in (64, 128, 256):
        from pdkv.models.fp8 import dequantize  # noqa: PLC0415

        y = torch.nn.functional.linear(x2, dequantize(w, scale, block).to(x.dtype))
    elif BACKEND == "scaled_mm":
        y = scaled_mm(x2, w, scale, block, out_dtype)
    else:
        y = block_gemm(x2, w, scale, block, out_dtype)
    if bias is not None:
        y = y + bias
    return y.view(*lead, w.shape[0]).to(x.dtype)
