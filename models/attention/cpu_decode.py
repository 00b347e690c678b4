"""Decode attention straight over the paged cache on the CPU (pdkv/kernels/attention_decode.c).

The torch backend's decode path gathers every sequence's K/V pages into a contiguous copy per
layer (``index_select``) and then runs SDPA or batched matmuls over it; at batch 1 with ~150
cached tokens that is ~100 us per layer, most of it the copy and the calls. The kernel reads
each key and value once through the page table, for the g query heads of a KV head together,
in one call per layer. It takes steps whose every batched row is a single new token (plain
decodes) over a float32 cache on the CPU; anything else keeps the torch path.
"""

from __future__ import annotations

import torch

from pdkv.models.cpu_kernels import AVAILABLE, _k

MAX_GROUP = 128  # query heads per KV head (attention_decode.c MAX_GROUP)
MAX_VALUE = 1024  # value width (MAX_VALUE)


def takes(cache: torch.Tensor, group: int, value_dim: int) -> bool:
    """Whether a step of single-token rows over ``cache`` can run in the kernel."""
    return (AVAILABLE and cache.dtype is torch.float32 and cache.is_cpu and cache.stride(-1) == 1
            and group <= MAX_GROUP and value_dim <= MAX_VALUE)


def decode(cache: torch.Tensor, hnd: bool, q: torch.Tensor, pages: torch.Tensor, kv_lens: torch.Tensor,
           window: int | None, num_kv_heads: int, group: int, value_dim: int, scale: float,
           new: tuple | None = None) -> torch.Tensor:
    """cache: one layer [pages, parts, Hkv, P, D] (HND) or [pages, parts, P, Hkv, D] (NHD), a
    latent's parts == 1 with its values the first value_dim entries of its keys; q: [B, Hq, D]
    (one row per sequence); pages: [B, max_pages] long; kv_lens: [B] long → [B, Hq * value_dim].
    ``new``: (k [B, Hkv, D], v [B, Hkv, D] or None for a latent, slot pages [B], slot offsets
    [B]): the rows' new K/V, stored in the cache by the same call before they attend."""
    B, Hq, D = q.shape
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    if pages.dtype is not torch.long or not pages.is_contiguous():
        raise ValueError("decode attention: the page table must be a contiguous long tensor")
    if kv_lens.dtype is not torch.long or not kv_lens.is_contiguous() or kv_lens.shape[0] != B:
        raise ValueError("decode attention: kv_lens must be a contiguous long tensor, one per row")
    if pages.dim() != 2 or pages.shape[0] != B or cache.shape[-1] != D or Hq != num_kv_heads * group:
        raise ValueError(f"decode attention: q {tuple(q.shape)}, pages {tuple(pages.shape)} and the "
                         f"cache {tuple(cache.shape)} do not agree")
    page_size = cache.shape[3] if hnd else cache.shape[2]
    head_stride, slot_stride = (cache.stride(2), cache.stride(3)) if hnd else (cache.stride(3), cache.stride(2))
    v_offset = cache.stride(1) if cache.shape[1] == 2 else 0  # a latent: values inside the keys
    out = torch.empty(B, Hq * value_dim, dtype=torch.float32)
    write = () if new is None else _write_args(new, cache.shape[1] == 2, B, num_kv_heads, D)
    _k.decode_attention(q.data_ptr(), q.stride(0), cache.data_ptr(), cache.stride(0), head_stride, slot_stride,
                           v_offset, cache.shape[0], page_size, pages.data_ptr(), pages.shape[1],
                           kv_lens.data_ptr(), window or 0, out.data_ptr(), Hq * value_dim,
                           B, num_kv_heads, group, D, value_dim, scale, *write)
    return out


def _write_args(new: tuple, two_parts: bool, B: int, hkv: int, D: int) -> tuple:
    """decode_attention's k_new .. slot_offsets for ``new`` (see ``decode``), every shape checked."""
    k, v, slot_pages, slot_offsets = new
    for name, t in (("k", k), ("v", v)):
        if t is None:
            continue
        if t.dtype is not torch.float32 or not t.is_cpu or t.dim() != 3 or tuple(t.shape) != (B, hkv, D) \
                or t.stride(2) != 1:
            raise ValueError(f"decode attention: new {name} {tuple(t.shape)} is not a float32 [{B}, {hkv}, {D}] "
                             "with contiguous rows")
    if (v is None) == two_parts:
        raise ValueError("decode attention: a K/V cache needs the new v, a latent cache takes none")
    for name, t in (("slot pages", slot_pages), ("slot offsets", slot_offsets)):
        if t.dtype is not torch.long or not t.is_contiguous() or tuple(t.shape) != (B,):
            raise ValueError(f"decode attention: {name} must be a contiguous long tensor of {B}")
    return (k.data_ptr(), k.stride(0), k.stride(1), 0 if v is None else v.data_ptr(),
            0 if v is None else v.stride(0), 0 if v is None else v.stride(1), slot_pages.data_ptr(),
            slot_offsets.data_ptr())


def mla_decode(cache: torch.Tensor, hnd: bool, q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, kv_norm: torch.Tensor, eps: float, w_uk: torch.Tensor, w_uv: torch.Tensor,
               scale: float, slots: tuple, pages: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor | None:
    """One MLA layer's decode step after its input projections (pdkv/kernels/mla_decode.h): q [T, H,
    N + R] (after q_b_proj), kv [T, L + R] (kv_a_proj_with_mqa's output, before its norm), cos/sin
    [T, 1, R]; w_uk [H, N, L] / w_uv [H, L, V] stored with the input dimension contiguous; the
    latent cache layer [pages, 1, 1, P, L + R] (HND) or [pages, 1, P, 1, L + R]; slots: (pages [T],
    offsets [T]) of the rows' new latents → [T, H * V] (before o_proj), or None when the kernel does
    not take these tensors."""
    T, H, NR = q.shape
    L, V = w_uv.shape[1], w_uv.shape[2]
    N = w_uk.shape[1]
    R = NR - N
    slot_pages, slot_offsets = slots
    f32 = torch.float32
    if not (AVAILABLE and cache.dtype is f32 and cache.is_cpu and cache.shape[1] == 1 and cache.shape[-1] == L + R
            and (cache.shape[2] if hnd else cache.shape[3]) == 1 and cache.stride(-1) == 1 and R % 2 == 0
            and H <= MAX_GROUP and L <= MAX_VALUE
            and q.dtype is f32 and q.is_cpu and q.stride(2) == 1 and q.stride(1) == NR
            and kv.dtype is f32 and kv.is_cpu and kv.dim() == 2 and kv.shape == (T, L + R) and kv.stride(1) == 1
            and cos.dtype is f32 and sin.dtype is f32 and cos.is_contiguous() and sin.is_contiguous()
            and cos.shape == (T, 1, R) and sin.shape == (T, 1, R)
            and kv_norm.dtype is f32 and kv_norm.shape == (L,) and kv_norm.stride(0) == 1
            and w_uk.dtype is f32 and w_uk.shape == (H, N, L) and w_uk.stride(1) == 1
            and w_uv.dtype is f32 and w_uv.shape == (H, L, V) and w_uv.stride(1) == 1
            and pages.dtype is torch.long and pages.is_contiguous() and pages.dim() == 2 and pages.shape[0] == T
            and kv_lens.dtype is torch.long and kv_lens.is_contiguous() and kv_lens.shape == (T,)
            and slot_pages.dtype is torch.long and slot_offsets.dtype is torch.long
            and slot_pages.is_contiguous() and slot_offsets.is_contiguous()
            and slot_pages.shape == (T,) and slot_offsets.shape == (T,)):
        return None
    page_size, slot_stride = (cache.shape[3], cache.stride(3)) if hnd else (cache.shape[2], cache.stride(2))
    out = torch.empty(T, H * V, dtype=f32)
    _k.mla_decode(q.data_ptr(), q.stride(0), kv.data_ptr(), kv.stride(0), cos.data_ptr(), sin.data_ptr(),
                     kv_norm.data_ptr(), eps, w_uk.data_ptr(), w_uk.stride(0), w_uk.stride(2), w_uv.data_ptr(),
                     w_uv.stride(0), w_uv.stride(2), H, N, R, L, V, scale, cache.data_ptr(), cache.stride(0),
                     slot_stride, cache.shape[0], page_size, slot_pages.data_ptr(), slot_offsets.data_ptr(),
                     pages.data_ptr(), pages.shape[1], kv_lens.data_ptr(), out.data_ptr(), T)
    return out
