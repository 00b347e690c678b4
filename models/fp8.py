"""Compute with block-quantized FP8 weights (models/fp8_load.py keeps them as stored).

A weight w [N, K] float8_e4m3fn carries its scale ``w.scale_inv`` [ceil(N / bn), ceil(K / bk)]
float32 and ``w.fp8_block`` (bn, bk); the dequantized weight is w * scale, block by block.

- CPU: each call dequantizes the weight into a float32 buffer reused by every layer (one per
  thread, grown to the largest layer) and runs the float32 GEMM (pdkv's kernel or torch's) over
  it; the result is cast to x's dtype. The model never holds a dequantized copy; the buffer is
  one layer. A bf16 model's FP8 layers thus multiply in float32 (CPUs have no faster bf16 GEMM
  to lose, and it rounds once instead of per block scale).
- GPU: models/fp8_gpu.py (Triton block-scaled FP8 GEMM with dynamic 1 x 128 activation
  quantization), imported only when x is on a CUDA device.
"""

from __future__ import annotations

import threading

import torch

try:
    from pdkv import _kernels as _k
except ImportError:  # not built: torch's conversion
    _k = None

_local = threading.local()


def is_fp8(w: torch.Tensor) -> bool:
    return getattr(w, "scale_inv", None) is not None


def dequantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               out: torch.Tensor | None = None) -> torch.Tensor:
    """w [N, K] FP8 * its block scales → float32 [N, K] (a view into ``out``, a flat float32
    buffer of at least the padded size, when given). Each value is w * s in float32, the
    same single multiply transformers' FP8 dequantization does, so both give the same bits."""
    N, K = w.shape
    bn, bk = block
    nb, kb = scale.shape
    size = nb * bn * kb * bk
    buf = torch.empty(size, dtype=torch.float32, device=w.device) if out is None else out[:size]
    full = buf.view(nb * bn, kb * bk)
    if (_k is not None and w.is_cpu and w.stride(1) == 1 and scale.dtype == torch.float32
            and scale.stride(1) == 1):  # pdkv/kernels/fp8.c: ~10x torch's two passes below
        _k.fp8_dequant(w.data_ptr(), w.stride(0), scale.data_ptr(), scale.stride(0), _lut().data_ptr(),
                       full.data_ptr(), full.stride(0), N, K, bn, bk)
        return full[:N, :K]
    full[:N, :K].copy_(w)  # e4m3 → float32 is exact
    full.view(nb, bn, kb, bk).mul_(scale.to(torch.float32)[:, None, :, None])
    return full[:N, :K]


def _lut() -> torch.Tensor:
    """Every e4m3 byte's float32 value, as torch decodes it (the kernel's table)."""
    lut = getattr(_lut, "table", None)
    if lut is None:
        lut = _lut.table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return lut


def quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → (e4m3 [N, K], float32 scale per block): amax / 448 per block, as DeepSeek's
    FP8 checkpoints are made (pdkv.bench fp8 builds its checkpoint with it)."""
    N, K = w.shape
    bn, bk = block
    nb, kb = -(-N // bn), -(-K // bk)
    pad = torch.zeros(nb * bn, kb * bk, dtype=torch.float32)
    pad[:N, :K] = w
    blocks = pad.view(nb, bn, kb, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(nb * bn, kb * bk)[:N, :K].contiguous(), scale


def _buffer(numel: int) -> torch.Tensor:
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _local.buf = torch.empty(numel, dtype=torch.float32)
    return buf


def linear_fp8(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, dequantize(w), bias) for x [M, K] (or [..., K])."""
    scale, block = w.scale_inv, w.fp8_block
    if x.is_cuda:
        from pdkv.models import fp8_gpu  # noqa: PLC0415 - Triton: GPU hosts only

        return fp8_gpu.linear(x, w, scale, block, bias)
    from pdkv.models.cpu_kernels import linear  # noqa: PLC0415 - cpu_kernels dispatches here

    nb, kb = scale.shape
    wd = dequantize(w, scale, block, _buffer(nb * block[0] * kb * block[1]))
    xf = x if x.dtype == torch.float32 else x.float()
    if xf.dim() != 2:
        xf = xf.reshape(-1, xf.shape[-1])
    b = None if bias is None else bias.float()
    y = linear(xf, wd, b)
    y = y.view(*x.shape[:-1], w.shape[0])
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def dequantize_param(module: torch.nn.Module, attr: str, dtype: torch.dtype) -> None:
    """Replaces FP8 parameter ``attr`` of ``module`` (and its scale) by its dequantized value in
    ``dtype``: for weights a path needs in plain form (MLA's absorbed kv_b_proj)."""
    w = getattr(module, attr)
    if not is_fp8(w):
        return
    value = dequantize(w.detach(), w.scale_inv.detach(), w.fp8_block).to(dtype)
    setattr(module, attr, torch.nn.Parameter(value, requires_grad=False))
    delattr(module, attr + "_scale_inv")


def permute_rows(w: torch.Tensor, groups: list[tuple[int, torch.Tensor]]) -> bool:
    """Applies in place, for each (start, perm), w[start + i] = w[start + perm[i]] to an FP8
    weight when no row leaves its block (the scales stay valid); False (nothing changed)
    when one would."""
    bn = w.fp8_block[0]
    for start, perm in groups:
        rows = start + torch.arange(len(perm))
        if not bool(((rows // bn) == ((start + perm.cpu()) // bn)).all()):
            return False
    raw = w.data.view(torch.uint8)
    for start, perm in groups:
        n = len(perm)
        raw[start:start + n] = raw[start:start + n][perm.to(raw.device)].clone()
    return True
