"""What a model's KV cache and attention backend look like, computed from its ArchConfig: the one
place that knows a GQA cache (K and V, ``num_kv_heads`` heads of ``head_dim``) from an MLA latent
cache (DeepSeek-V3: one vector of kv_lora_rank + qk_rope_head_dim per token and layer, read as
one KV head whose values are its first kv_lora_rank entries, replicated on every TP rank).

The engine and the tensor-parallel ranks build their cache, size their pages and make their
backend through ``kv_layout(arch)``; the handshake's shard spec comes from ``kv_geometry``:

    lay = kv_layout(arch)                       # arch: this rank's share
    lay.page_bytes(page_size, dtype)            # one page of one layer on this rank
    kv = lay.make_cache(num_layers, num_pages, page_size, dtype, layout, device, buffer)
    backend = lay.make_backend("torch", kv)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdkv.models.config import ArchConfig
from pdkv.models.rope import yarn_mscale
from pdkv.errors import BackendUnavailable
from pdkv.shard.spec import KVGeometry


@dataclass(frozen=True)
class KVLayout:
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # heads in this rank's cache (1 for a latent)
    head_dim: int  # width of one cached key vector (the whole latent for MLA)
    value_dim: int  # width of a value: head_dim, or kv_lora_rank (the latent's first entries)
    kv_parts: int  # 2: K and V; 1: one latent vector
    scale: float  # softmax scale of q . k
    sliding_window: int | None = None

    @property
    def is_latent(self) -> bool:
        return self.kv_parts == 1

    def page_bytes(self, page_size: int, dtype: torch.dtype) -> int:
        """Bytes of one page of one layer on this rank."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.kv_parts * self.num_kv_heads * page_size * self.head_dim * itemsize

    def make_cache(self, num_layers: int, num_pages: int, page_size: int, dtype: torch.dtype, layout: str,
                   device, buffer=None):
        from pdkv.kv import KVCache  # noqa: PLC0415

        return KVCache(num_layers, num_pages, page_size, self.num_kv_heads, self.head_dim, dtype, layout,
                       device, buffer=buffer, kv_parts=self.kv_parts)

    def make_backend(self, name: str, kv_cache):
        from pdkv.models.attention import get_backend  # noqa: PLC0415

        cls = get_backend(name)
        if self.is_latent and not getattr(cls, "supports_latent", False):
            raise BackendUnavailable(f"model.attention_backend: {name!r} cannot attend over an MLA latent "
                                     "cache (DeepseekV3ForCausalLM); use 'torch'")
        return cls(kv_cache, self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.sliding_window,
                   value_dim=self.value_dim)


def mla_softmax_scale(arch: ArchConfig) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) squared under a scaled rope
    (DeepSeek's YaRN correction of the attention temperature), as transformers computes it."""
    m, scaling = arch.mla, arch.rope_scaling
    scale = m.qk_head_dim ** -0.5
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= mscale * mscale
    return scale


def kv_layout(arch: ArchConfig) -> KVLayout:
    if arch.mla is not None:
        m = arch.mla
        return KVLayout(arch.num_heads, 1, m.latent_dim, m.kv_lora_rank, 1, mla_softmax_scale(arch))
    return KVLayout(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim, 2, arch.head_dim ** -0.5,
                    arch.sliding_window)


def kv_geometry(full_arch: ArchConfig, page_size: int, dtype: str, layout: str) -> KVGeometry:
    """The whole model's cache for the shard planner (``full_arch``: the checkpoint's, not a rank's)."""
    if full_arch.mla is not None:
        return KVGeometry(1, full_arch.mla.latent_dim, page_size, dtype, layout, replicated=True, kv_parts=1)
    return KVGeometry(full_arch.num_kv_heads, full_arch.head_dim, page_size, dtype, layout)
