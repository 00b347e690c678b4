"""Paged attention in plain PyTorch: runs on the CPU and on a GPU.

Decodes (one query token) run as one batch: their pages are gathered through a padded page
table into [B, kv_heads, L, head_dim] and attended with one SDPA call under a length mask.
Prefill chunks run per sequence, each as one 4-D SDPA call with ``enable_gqa`` (the fused
kernel). Grouped-query attention never repeats K/V: decodes lay the ``group`` query heads that
share a KV head along the query axis of their batched matmuls; SDPA does the same inside.
A latent cache (MLA) is the same computation with one KV head and the values a slice of the
keys (``_kv``): the latent is read once per step for every query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.attention import register
from models.attention.base import AttentionBackend, AttentionBatch, page_table, write_slots


@dataclass
class _Prefill:
    start: int  # first query token in the flat batch
    end: int
    pages: torch.Tensor  # [num_pages_of_seq] long
    kv_len: int
    mask: torch.Tensor | None  # [q_len, kv_len] bool (True: attend), or None: plain causal (q_len == kv_len)


@dataclass
class TorchAttentionMeta:
    write_pages: torch.Tensor  # [T] long: page of each new token
    write_offsets: torch.Tensor  # [T] long: slot within that page
    num_decodes: int
    decode_pages: torch.Tensor | None  # [B * max_pages] long: the padded page table, flattened
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_pages * P] bool, None when B == 1
    decode_kv_len: int  # kv length when B == 1 (no mask needed, keys are sliced)
    prefills: list[_Prefill]


@register("torch")
class TorchAttentionBackend(AttentionBackend):
    supports_latent = True

    def plan(self, batch: AttentionBatch) -> TorchAttentionMeta:
        P, dev, W = self.kv.page_size, self.kv.device, self.sliding_window
        table = page_table(batch.page_ids, dev)
        write_pages, write_offsets = write_slots(batch, table, P)
        nd = batch.num_decodes
        decode_pages = decode_mask = None
        decode_kv_len = batch.kv_lens[0] if nd else 0
        if nd:
            max_pages = max(len(p) for p in batch.page_ids[:nd])
            decode_pages = table[:nd, :max_pages].reshape(-1)  # [B * max_pages], row-major
            needs_window = W is not None and max(batch.kv_lens[:nd]) > W
            if nd > 1 or needs_window:
                kv_lens = torch.tensor(batch.kv_lens[:nd], device=dev)
                key = torch.arange(max_pages * P, device=dev)
                mask = key[None, :] < kv_lens[:, None]
                if needs_window:
                    mask &= key[None, :] > (kv_lens[:, None] - 1 - W)
                decode_mask = mask[:, None, None, :]
        prefills, start = [], nd
        for q_len, kv_len, pages in zip(batch.q_lens[nd:], batch.kv_lens[nd:], batch.page_ids[nd:]):
            mask = None
            if q_len != kv_len or (W is not None and kv_len > W):
                q_pos = torch.arange(kv_len - q_len, kv_len, device=dev)[:, None]
                k_pos = torch.arange(kv_len, device=dev)[None, :]
                mask = k_pos <= q_pos
                if W is not None:
                    mask &= k_pos > q_pos - W
            prefills.append(_Prefill(start, start + q_len, torch.tensor(pages, dtype=torch.long, device=dev),
                                     kv_len, mask))
            start += q_len
        return TorchAttentionMeta(
            write_pages=write_pages, write_offsets=write_offsets,
            num_decodes=nd, decode_pages=decode_pages, decode_mask=decode_mask,
            decode_kv_len=decode_kv_len, prefills=prefills)

    def fresh_prefill_spans(self, meta: TorchAttentionMeta) -> list[tuple[int, int]] | None:
        """[(start, end)] of every sequence when the step is only first prefill chunks (each
        sequence's keys are exactly its new tokens), else None. MLA attends such a step
        decompressed (models/mla.py) after ``write``."""
        if meta.num_decodes or any(p.kv_len != p.end - p.start for p in meta.prefills):
            return None
        return [(p.start, p.end) for p in meta.prefills]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor | None, meta: TorchAttentionMeta) -> None:
        """Writes the step's new k (and v; None for a latent) into the cache, without attending."""
        cache = self.kv.layer(layer)
        if self.kv.layout == "HND":
            cache[meta.write_pages, 0, :, meta.write_offsets] = k
            if v is not None:
                cache[meta.write_pages, 1, :, meta.write_offsets] = v
        else:
            cache[meta.write_pages, 0, meta.write_offsets] = k
            if v is not None:
                cache[meta.write_pages, 1, meta.write_offsets] = v

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TorchAttentionMeta) -> torch.Tensor:
        cache = self.kv.layer(layer)
        hnd = self.kv.layout == "HND"
        self._write(cache, k, v, meta, hnd)
        if v is None:  # latent: the value is the latent's first value_dim entries
            v = k[..., :self.value_dim]
        T, Hkv, G, Dv = q.shape[0], self.num_kv_heads, self.group, self.value_dim
        if not meta.prefills:
            return self._decode(cache, q, meta, hnd)
        out = torch.empty(T, Hkv * G * Dv, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            out[:meta.num_decodes] = self._decode(cache, q[:meta.num_decodes], meta, hnd)
        for p in meta.prefills:
            out[p.start:p.end] = self._prefill(cache, q, k, v, p, hnd)
        return out

    @staticmethod
    def _write(cache, k, v, meta, hnd) -> None:
        """The step's new K/V into their pages."""
        if hnd:  # cache[page, kv, head, slot, dim]
            cache[meta.write_pages, 0, :, meta.write_offsets] = k
            if v is not None:  # None: a latent cache (MLA) holds only the latent
                cache[meta.write_pages, 1, :, meta.write_offsets] = v
        else:  # cache[page, kv, slot, head, dim]
            cache[meta.write_pages, 0, meta.write_offsets] = k
            if v is not None:
                cache[meta.write_pages, 1, meta.write_offsets] = v

    def _prefill(self, cache, q, k, v, p: _Prefill, hnd) -> torch.Tensor:
        """One prefill chunk's rows → [n, Hq * Dv]."""
        qs = q[p.start:p.end]  # [n, Hq, D]
        n = qs.shape[0]
        if p.kv_len == n:  # a first chunk: its keys are exactly the new ones, skip the gather
            keys, values = k[p.start:p.end].transpose(0, 1), v[p.start:p.end].transpose(0, 1)
        else:
            keys, values = self._gather(cache, p.pages, p.kv_len, hnd)  # [Hkv, L, D]
        # NOTE: both calls are 4-D [1, heads, len, D] with enable_gqa, which SDPA's fused CPU
        # kernel (flash) takes, mask or not. A 3-D call (e.g. the G query heads of a KV head laid
        # along the query axis) falls back to the math kernel, which materializes the scores
        # in float32: on a later chunk that made the step slower than prefilling the whole
        # prompt at once (issue 20; tests/engine/test_chunk_attention.py pins it).
        qh = qs.transpose(0, 1)[None]  # [1, Hq, n, D]
        if p.mask is None:
            o = F.scaled_dot_product_attention(qh, keys[None], values[None], is_causal=True, scale=self.scale,
                                               enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qh, keys[None], values[None], attn_mask=p.mask, scale=self.scale,
                                               enable_gqa=True)
        return o[0].transpose(0, 1).reshape(n, -1)

    @staticmethod
    def _heads_view(cache, hnd):
        """The cache as a strided view [parts, Hkv, num_pages, P, D] (no copy), so one index_select
        over pages lands K/V directly in the [.., Hkv, pages * P, D] order SDPA wants."""
        return cache.permute(1, 2, 0, 3, 4) if hnd else cache.permute(1, 3, 0, 2, 4)

    def _kv(self, g):
        """Gathered [parts, ...] → (keys, values); a latent's values are a view of its keys."""
        return (g[0], g[0][..., :self.value_dim]) if self.latent else (g[0], g[1])

    def _gather(self, cache, pages, kv_len, hnd):
        """One sequence's keys and values: [Hkv, kv_len, D] and [Hkv, kv_len, Dv]."""
        g = self._heads_view(cache, hnd).index_select(2, pages)  # [parts, Hkv, n, P, D] contiguous
        keys, values = self._kv(g.view(g.shape[0], self.num_kv_heads, -1, self.head_dim))
        return keys[:, :kv_len], values[:, :kv_len]

    def _decode(self, cache, q, meta, hnd):
        """q: [B, Hq, D] one token per sequence → [B, Hq * Dv]."""
        B, Hkv, G, D, Dv = q.shape[0], self.num_kv_heads, self.group, self.head_dim, self.value_dim
        g = self._heads_view(cache, hnd).index_select(2, meta.decode_pages)  # [parts, Hkv, B*maxp, P, D]
        parts = g.shape[0]
        if meta.decode_mask is None:  # one sequence: slice its keys, no mask
            keys, values = self._kv(g.view(parts, Hkv, -1, D)[:, :, :meta.decode_kv_len])
            o = F.scaled_dot_product_attention(q.view(1, Hkv, G, D), keys[None], values[None], scale=self.scale)
            return o.reshape(1, Hkv * G * Dv)
        # Many sequences: batched matmuls in the gathered [Hkv, B, L, D] order (no transpose copy
        # of K/V); on the CPU this beats SDPA's masked path by ~30% at batch 32.
        keys, values = self._kv(g.view(parts, Hkv, B, -1, D))
        qh = q.view(B, Hkv, G, D).transpose(0, 1)  # [Hkv, B, G, D]
        scores = torch.matmul(qh, keys.transpose(-1, -2)).float() * self.scale  # [Hkv, B, G, L]
        scores.masked_fill_(~meta.decode_mask.view(1, B, 1, -1), float("-inf"))
        o = torch.matmul(scores.softmax(-1).to(q.dtype), values)  # [Hkv, B, G, Dv]
        return o.transpose(0, 1).reshape(B, Hkv * G * Dv)
