"""The paged KV cache: one tensor per layer, cut into pages of P tokens.

Layouts (per layer):
  HND  [num_pages, 2, num_kv_heads, P, head_dim]   (default: a head's slice of a page is contiguous,
                                                    so a tensor-parallel shard moves in one write)
  NHD  [num_pages, 2, P, num_kv_heads, head_dim]
Index 0 of dim 1 is K, 1 is V. A latent cache (MLA: DeepSeek-V3) has ``kv_parts=1``: dim 1 has
the one latent vector per token (the compressed KV and the rope key, no K/V split) and
``num_kv_heads`` is 1, so HND and NHD hold the same bytes in the same order. Page ``p`` of layer ``i`` starts ``p * page_nbytes`` bytes after
``data_ptr(i)``; the messenger registers the memory and computes write offsets from these.

Memory comes from ``torch.empty`` or from a caller buffer (a uint8 tensor or any object with the
buffer protocol, e.g. a shared-memory mmap the messenger registered); with a buffer every layer
tensor is a view into it, layer after layer.
"""

from __future__ import annotations

import torch

from pdkv.config import LAYOUTS


class KVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, layout: str = "HND",
                 device: str | torch.device = "cpu", buffer=None, kv_parts: int = 2):
        if layout not in LAYOUTS:
            raise ValueError(f"kv_cache.layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        for name, value in (("num_layers", num_layers), ("num_pages", num_pages),
                            ("page_size", page_size), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            if int(value) < 1:
                raise ValueError(f"KVCache: {name} must be >= 1, got {value}")
        if kv_parts not in (1, 2):
            raise ValueError(f"KVCache: kv_parts must be 2 (K and V) or 1 (a latent), got {kv_parts}")
        self.kv_parts = kv_parts
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim, self.dtype, self.layout = num_kv_heads, head_dim, dtype, layout
        if layout == "HND":
            self.page_shape = (kv_parts, num_kv_heads, page_size, head_dim)
        else:
            self.page_shape = (kv_parts, page_size, num_kv_heads, head_dim)
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.page_nbytes = kv_parts * num_kv_heads * page_size * head_dim * itemsize
        self.layer_nbytes = self.page_nbytes * num_pages
        self.nbytes = self.layer_nbytes * num_layers
        shape = (num_pages, *self.page_shape)
        if buffer is None:
            self._buffer = None
            self._layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        else:
            flat = buffer if isinstance(buffer, torch.Tensor) else torch.frombuffer(buffer, dtype=torch.uint8)
            flat = flat.reshape(-1).view(torch.uint8)
            if flat.device.type != torch.device(device).type:
                raise ValueError(f"KVCache: buffer is on {flat.device}, the cache was asked for {device}")
            if flat.numel() < self.nbytes:
                raise ValueError(f"KVCache: buffer holds {flat.numel()} bytes, the cache needs "
                                 f"{self.nbytes} ({num_layers} layers x {num_pages} pages x "
                                 f"{self.page_nbytes} bytes)")
            self._buffer = flat  # NOTE: keeps the caller's memory alive as long as the cache
            self._layers = [flat[i * self.layer_nbytes:(i + 1) * self.layer_nbytes].view(dtype).view(shape)
                            for i in range(num_layers)]
        self.device = self._layers[0].device
        # An FP8 cache's per-layer (K, V) scales (models/attention/fp8_kv.py); a latent uses K's.
        self.kv_scales: list[tuple[float, float]] = [(1.0, 1.0)] * num_layers

    def layer(self, i: int) -> torch.Tensor:
        """The layer-``i`` tensor, shaped as the layout says (see module docstring)."""
        return self._layers[i]

    def data_ptr(self, i: int) -> int:
        """Address of page 0 of layer ``i``."""
        return self._layers[i].data_ptr()

    def page_offset(self, layer: int, page: int) -> int:
        """Byte offset of (layer, page) from ``data_ptr(0)`` when built over a caller buffer."""
        return layer * self.layer_nbytes + page * self.page_nbytes

    @property
    def is_latent(self) -> bool:
        return self.kv_parts == 1

    def geometry(self):
        """This cache as the shard planner sees it (pdkv.shard.KVGeometry): a latent cache is one
        KV head replicated on every tensor-parallel rank."""
        from pdkv.shard.spec import KVGeometry  # noqa: PLC0415

        return KVGeometry(self.num_kv_heads, self.head_dim, self.page_size, str(self.dtype).removeprefix("torch."),
                          self.layout, replicated=self.is_latent, kv_parts=self.kv_parts)

    def __repr__(self) -> str:
        return (f"KVCache(layers={self.num_layers}, pages={self.num_pages}, P={self.page_size}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, {self.dtype}, {self.layout}"
                + (", latent)" if self.is_latent else ")"))
