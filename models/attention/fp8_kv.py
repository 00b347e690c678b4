"""An FP8 KV cache (``kv_cache.dtype: fp8_e4m3``): K/V (or MLA's latent) stored as float8_e4m3fn
divided by a per-layer, per-tensor scale (``KVCache.kv_scales``: the checkpoint's k_scale /
v_scale, a configured value, or 1.0), as vLLM and SGLang store an fp8 cache.

Every reader sees the stored values: the attention of a first prefill chunk uses the new K/V
after their round trip through e4m3, exactly what a later step (a decode, a cached prefix, a
speculative verification, the decode node after a transfer) reads back from the pages, so
prefix caching and speculation give the same tokens as a run without them.
"""

from __future__ import annotations

import torch

FP8 = getattr(torch, "float8_e4m3fn", None)
E4M3_MAX = 448.0  # the largest finite e4m3fn value: larger ones are clamped, not NaN


def is_fp8(dtype: torch.dtype) -> bool:
    return FP8 is not None and dtype == FP8


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    y = x.float() if scale == 1.0 else x.float() / scale
    return y.clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    y = x.to(dtype)
    return y if scale == 1.0 else y.mul_(scale)


def dequantize_parts(g: torch.Tensor, scales: tuple[float, float], dtype: torch.dtype) -> torch.Tensor:
    """Gathered pages [parts, ...] (K then V, or a latent's one part) → ``dtype``."""
    y = g.to(dtype)
    for i in range(y.shape[0]):
        if scales[i] != 1.0:
            y[i].mul_(scales[i])
    return y
