"""Paged attention in plain PyTorch: runs on the CPU and on a GPU.

Decodes (one query token) and short continuations (a speculative verification's k + 1 tokens,
a short chunk over cached keys) run as one batch: their pages are gathered once through a padded
page table into [kv_heads, B, L, head_dim] and every query row attends under its own length
(causal within the sequence's new tokens), with batched matmuls. Longer prefill chunks run per
sequence, each as one 4-D SDPA call with ``enable_gqa`` (the fused kernel). Grouped-query attention never repeats K/V: decodes lay the ``group`` query heads that
share a KV head along the query axis of their batched matmuls; SDPA does the same inside.
A latent cache (MLA) is the same computation with one KV head and the values a slice of the
keys (``_kv``): the latent is read once per step for every query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdkv.models.attention import cpu_decode, fp8_kv, register
from pdkv.models.attention.base import AttentionBackend, AttentionBatch, page_table, write_slots


@dataclass
class _Prefill:
    start: int  # first query token in the flat batch
    end: int
    pages: torch.Tensor  # [num_pages_of_seq] long
    kv_len: int
    mask: torch.Tensor | None  # [q_len, kv_len] bool (True: attend), or None: plain causal (q_len == kv_len)


# A sequence with at most this many new tokens over keys already cached attends in the batched
# ("decode") path. A verification step (k + 1 tokens) took the per-sequence SDPA path with a
# boolean mask built in ``plan`` before, which PyTorch converts to a float mask in every layer;
# now one sequence's mask is a view of a cached buffer (``_tail_bias``) and several sequences'
# K/V are gathered once for all their rows.
# Longer chunks keep SDPA's fused kernel: a [q_len, L] score matrix per head is what that kernel
# avoids materializing.
MULTI_QUERY_MAX = 16


@dataclass
class TorchAttentionMeta:
    write_pages: torch.Tensor  # [T] long: page of each new token
    write_offsets: torch.Tensor  # [T] long: slot within that page
    num_decodes: int  # sequences in the batched path (decodes and short continuations, first)
    decode_tokens: int  # their query rows: the first decode_tokens of the step
    decode_q: int  # query rows per sequence in the batched path (the longest; others padded)
    decode_pages: torch.Tensor | None  # [B * max_pages] long: the padded page table, flattened
    decode_blocked: torch.Tensor | None  # [B, Q, max_pages * P] bool (True: masked out); None when B == 1 (eager)
    decode_masked: bool  # B == 1 and its rows need a mask (Q > 1, or keys beyond the window)
    decode_kv_len: int  # kv length when B == 1 (keys are sliced)
    # Every batched row a single token and a cache the CPU kernel reads (models/attention/cpu_decode.py):
    # the step's [B] kv lengths and its page table [B, max_pages]; None: the torch path.
    decode_lens: torch.Tensor | None
    pad_rows: torch.Tensor | None  # [B * Q] long: query row for each padded slot; None: no padding
    unpad_rows: torch.Tensor | None  # [decode_tokens] long: padded slot of each query row
    prefills: list[_Prefill]


@register("torch")
class TorchAttentionBackend(AttentionBackend):
    supports_latent = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._tails: dict[tuple, torch.Tensor] = {}  # see _tail_bias

    def plan(self, batch: AttentionBatch) -> TorchAttentionMeta:
        P, dev, W = self.kv.page_size, self.kv.device, self.sliding_window
        table = page_table(batch.page_ids, dev)
        write_pages, write_offsets = write_slots(batch, table, P)
        q_lens, kv_lens = batch.q_lens, batch.kv_lens
        nd = 0  # the leading sequences that attend batched (the runner puts short ones first)
        while nd < len(q_lens) and (q_lens[nd] == 1 or (q_lens[nd] <= MULTI_QUERY_MAX and kv_lens[nd] > q_lens[nd])):
            nd += 1
        Q = max(q_lens[:nd], default=0)
        decode_pages = blocked = pad_rows = unpad_rows = decode_lens = None
        decode_kv_len = kv_lens[0] if nd else 0
        masked = False
        if nd and Q == 1 and self._cpu_kernel:
            max_pages = max(len(p) for p in batch.page_ids[:nd])
            decode_pages = table[:nd, :max_pages].contiguous()
            decode_lens = torch.tensor(kv_lens[:nd], dtype=torch.long)
        elif nd:
            max_pages = max(len(p) for p in batch.page_ids[:nd])
            decode_pages = table[:nd, :max_pages].reshape(-1)  # [B * max_pages], row-major
            needs_window = W is not None and max(kv_lens[:nd]) > W
            if nd > 1:
                blocked = self._blocked(q_lens[:nd], kv_lens[:nd], Q, max_pages * P, dev)
            else:  # one sequence: its keys are sliced to kv_len, the mask is a cached view (_tail_bias)
                masked = Q > 1 or needs_window
            if any(n != Q for n in q_lens[:nd]):
                pad, unpad, row = [], [], 0
                for b, n in enumerate(q_lens[:nd]):
                    pad.extend(row + min(r, n - 1) for r in range(Q))  # pads repeat the last row
                    unpad.extend(range(b * Q, b * Q + n))
                    row += n
                pad_rows, unpad_rows = torch.tensor(pad, device=dev), torch.tensor(unpad, device=dev)
        prefills, start = [], sum(q_lens[:nd])
        for q_len, kv_len, pages in zip(q_lens[nd:], kv_lens[nd:], batch.page_ids[nd:]):
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
            write_pages=write_pages, write_offsets=write_offsets, num_decodes=nd,
            decode_tokens=sum(q_lens[:nd]), decode_q=Q, decode_pages=decode_pages, decode_blocked=blocked,
            decode_masked=masked, decode_kv_len=decode_kv_len, decode_lens=decode_lens, pad_rows=pad_rows,
            unpad_rows=unpad_rows, prefills=prefills)

    @property
    def _cpu_kernel(self) -> bool:
        """Single-token rows attend in the CPU kernel (models/attention/cpu_decode.py)."""
        takes = self.__dict__.get("_takes")
        if takes is None:
            takes = self._takes = self.use_cpu_kernel and cpu_decode.takes(self.kv.layer(0), self.group, self.value_dim)
        return takes

    use_cpu_kernel = True  # False (model.cpu_kernels): the torch path for every step

    def graph_decode(self, max_batch: int, max_pages: int, batch_sizes: tuple[int, ...]):
        from pdkv.models.attention.torch_graph import TorchGraphDecode  # noqa: PLC0415

        return TorchGraphDecode(self, max_batch, max_pages)

    def _tail_bias(self, Q: int, L: int, dtype, device) -> torch.Tensor:
        """[Q, L] SDPA additive mask (0 / -inf) of one sequence's last Q rows over its L keys:
        row r sees keys up to L - Q + r (inside the window). The pattern only depends on the
        distance from the end, so it is a view of one cached, right-aligned buffer of
        MULTI_QUERY_MAX rows (its last Q rows, last L columns): a step builds no mask, where SDPA
        would convert a boolean one in every layer. The buffer grows by doubling to the longest
        sequence seen (MULTI_QUERY_MAX x 4 bytes per key in float32)."""
        M, key = MULTI_QUERY_MAX, (dtype, str(device))
        buf = self._tails.get(key)
        if buf is None or buf.shape[1] < L:
            width = max(L, 256, 2 * buf.shape[1] if buf is not None else 0)
            last = torch.arange(width - M, width, device=device)[:, None]  # [M, 1] position of each row
            k = torch.arange(width, device=device)[None, :]
            blocked = k > last
            if self.sliding_window is not None:
                blocked |= k <= last - self.sliding_window
            buf = torch.zeros(M, width, dtype=dtype, device=device).masked_fill_(blocked, float("-inf"))
            self._tails[key] = buf
        return buf[M - Q:, buf.shape[1] - L:]

    def _blocked(self, q_lens, kv_lens, Q, L, dev) -> torch.Tensor:
        """[B, Q, L] bool, True where query row r of sequence b must not see key j: row r sits at
        position kv_len - q_len + r and sees keys up to it (inside the window); padding rows
        (r >= q_len) repeat the last row, so no row is fully masked."""
        last = torch.tensor([[n - q + min(r, q - 1) for r in range(Q)] for q, n in zip(q_lens, kv_lens)],
                            device=dev)  # [B, Q] position of each row
        key = torch.arange(L, device=dev)
        blocked = key > last[..., None]
        if self.sliding_window is not None:
            blocked |= key <= last[..., None] - self.sliding_window
        return blocked

    def fresh_prefill_spans(self, meta: TorchAttentionMeta) -> list[tuple[int, int]] | None:
        """[(start, end)] of every sequence when the step is only first prefill chunks (each
        sequence's keys are exactly its new tokens), else None. MLA attends such a step
        decompressed (models/mla.py) after ``write``."""
        if meta.num_decodes or any(p.kv_len != p.end - p.start for p in meta.prefills):  # batched rows have cached keys
            return None
        return [(p.start, p.end) for p in meta.prefills]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor | None, meta: TorchAttentionMeta):
        """Writes the step's new k (and v; None for a latent) into the cache, without attending.
        Returns k as the cache holds it (an FP8 cache: after the e4m3 round trip), or None when
        that is k itself."""
        self._scales = self.kv.kv_scales[layer]
        k2, _ = self._write(self.kv.layer(layer), k, v, meta, self.kv.layout == "HND")
        return None if k2 is k else k2

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TorchAttentionMeta) -> torch.Tensor:
        cache = self.kv.layer(layer)
        hnd = self.kv.layout == "HND"
        if meta.decode_lens is not None and not meta.prefills:  # the CPU kernel writes and attends in one call
            return self._decode(cache, q, meta, hnd, (k, v, meta.write_pages, meta.write_offsets))
        self._scales = self.kv.kv_scales[layer]
        k, v = self._write(cache, k, v, meta, hnd)
        if v is None:  # latent: the value is the latent's first value_dim entries
            v = k[..., :self.value_dim]
        T, Hkv, G, Dv = q.shape[0], self.num_kv_heads, self.group, self.value_dim
        if not meta.prefills:
            return self._decode(cache, q, meta, hnd)
        out = torch.empty(T, Hkv * G * Dv, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            out[:meta.decode_tokens] = self._decode(cache, q[:meta.decode_tokens], meta, hnd)
        for p in meta.prefills:
            out[p.start:p.end] = self._prefill(cache, q, k, v, p, hnd)
        return out

    def latent_decode(self, layer: int, q, kv, cos, sin, kv_norm, eps: float, w_uk, w_uv, meta):
        """An MLA layer's whole decode step in the CPU kernel (models/attention/cpu_decode.py
        mla_decode; models/mla.py calls it): [T, H * V] before o_proj, or None for anything but a
        step of single-token rows the kernel takes."""
        if meta.decode_lens is None or meta.prefills:
            return None
        return cpu_decode.mla_decode(self.kv.layer(layer), self.kv.layout == "HND", q, kv, cos, sin, kv_norm, eps,
                                     w_uk, w_uv, self.scale, (meta.write_pages, meta.write_offsets),
                                     meta.decode_pages, meta.decode_lens)

    _scales = (1.0, 1.0)  # this layer's FP8 K / V scales (set per layer before the helpers run)
    _compute_dtype = torch.float32  # what gathered FP8 pages dequantize to (the step's q dtype)

    def _write(self, cache, k, v, meta, hnd):
        """The step's new K/V into their pages; returns them as stored (FP8: quantized and back,
        module docstring of models/attention/fp8_kv.py)."""
        if fp8_kv.is_fp8(cache.dtype):
            ks, vs = self._scales
            kq = fp8_kv.quantize(k, ks)
            vq = None if v is None else fp8_kv.quantize(v, vs)
            self._store(cache, kq, vq, meta, hnd)
            return fp8_kv.dequantize(kq, ks, k.dtype), None if v is None else fp8_kv.dequantize(vq, vs, v.dtype)
        self._store(cache, k, v, meta, hnd)
        return k, v

    @staticmethod
    def _store(cache, k, v, meta, hnd) -> None:
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
        self._compute_dtype = q.dtype
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
        # prompt at once (tests/engine/test_chunk_attention.py pins it).
        qh = qs.transpose(0, 1)[None]  # [1, Hq, n, D]
        values = self._sdpa_values(keys, values)
        if p.mask is None:
            o = F.scaled_dot_product_attention(qh, keys[None], values[None], is_causal=True, scale=self.scale,
                                               enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qh, keys[None], values[None], attn_mask=p.mask, scale=self.scale,
                                               enable_gqa=True)
        return self._sdpa_out(o[0]).transpose(0, 1).reshape(n, -1)

    @staticmethod
    def _heads_view(cache, hnd):
        """The cache as a strided view [parts, Hkv, num_pages, P, D] (no copy), so one index_select
        over pages lands K/V directly in the [.., Hkv, pages * P, D] order SDPA wants."""
        return cache.permute(1, 2, 0, 3, 4) if hnd else cache.permute(1, 3, 0, 2, 4)

    def _kv(self, g):
        """Gathered [parts, ...] → (keys, values); a latent's values are a view of its keys."""
        return (g[0], g[0][..., :self.value_dim]) if self.latent else (g[0], g[1])

    # SDPA's fused CPU kernel needs the value width to equal the key width; a latent's values
    # (its first value_dim entries) would send it to the math kernel, ~2x slower at batch 1 and
    # a dozen more ops. So SDPA attends with the whole latent as the value and the outputs past
    # value_dim (the rope part's weighted sum) are dropped: the same softmax, the same sums.
    def _sdpa_values(self, keys, values):
        return keys if self.latent else values

    def _sdpa_out(self, o):
        return o[..., :self.value_dim] if self.latent else o

    def _gather(self, cache, pages, kv_len, hnd):
        """One sequence's keys and values: [Hkv, kv_len, D] and [Hkv, kv_len, Dv]."""
        g = self._heads_view(cache, hnd).index_select(2, pages)  # [parts, Hkv, n, P, D] contiguous
        if fp8_kv.is_fp8(g.dtype):
            g = fp8_kv.dequantize_parts(g, self._scales, self._compute_dtype)
        keys, values = self._kv(g.view(g.shape[0], self.num_kv_heads, -1, self.head_dim))
        return keys[:, :kv_len], values[:, :kv_len]

    def _decode(self, cache, q, meta, hnd, new=None):
        """q: [decode_tokens, Hq, D], each sequence's rows in order → [decode_tokens, Hq * Dv].
        ``new`` (the CPU kernel's path only): the rows' K/V and slots, stored by the same call."""
        B, Q, Hkv, G, D, Dv = meta.num_decodes, meta.decode_q, self.num_kv_heads, self.group, self.head_dim, self.value_dim
        if meta.decode_lens is not None:
            return cpu_decode.decode(cache, hnd, q, meta.decode_pages, meta.decode_lens, self.sliding_window,
                                     Hkv, G, Dv, self.scale, new)
        g = self._heads_view(cache, hnd).index_select(2, meta.decode_pages)  # [parts, Hkv, B*maxp, P, D]
        if fp8_kv.is_fp8(g.dtype):
            g = fp8_kv.dequantize_parts(g, self._scales, q.dtype)
        parts = g.shape[0]
        if B == 1 and meta.decode_blocked is None:  # one sequence: slice its keys; SDPA's fused kernel, masked when Q > 1
            keys, values = self._kv(g.view(parts, Hkv, -1, D)[:, :, :meta.decode_kv_len])
            values = self._sdpa_values(keys, values)
            if not meta.decode_masked:  # one row: the G heads of a KV head along the query axis
                o = F.scaled_dot_product_attention(q.view(1, Hkv, G, D), keys[None], values[None], scale=self.scale)
                return self._sdpa_out(o).reshape(1, Hkv * G * Dv)
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                               attn_mask=self._tail_bias(Q, meta.decode_kv_len, q.dtype, q.device),
                                               scale=self.scale, enable_gqa=True)
            return self._sdpa_out(o[0]).transpose(0, 1).reshape(Q, Hkv * G * Dv)
        if meta.pad_rows is not None:  # sequences with fewer rows than Q: pad to [B * Q]
            q = q.index_select(0, meta.pad_rows)
        # Batched matmuls in the gathered [Hkv, B, L, D] order (no transpose copy of K/V); the
        # Q rows of a sequence and the G query heads of a KV head share one matmul row block
        # ([Hkv, B, Q * G, D]), so K/V is read once per sequence. On the CPU this beats SDPA's
        # masked path by ~30% at batch 32.
        keys, values = self._kv(g.view(parts, Hkv, B, -1, D))
        qh = q.view(B, Q, Hkv, G, D).permute(2, 0, 1, 3, 4).reshape(Hkv, B, Q * G, D)
        scores = torch.matmul(qh, keys.transpose(-1, -2)).float() * self.scale  # [Hkv, B, Q * G, L]
        L = scores.shape[-1]
        scores.view(Hkv, B, Q, G, L).masked_fill_(meta.decode_blocked.view(1, B, Q, 1, L), float("-inf"))
        o = torch.matmul(scores.softmax(-1).to(q.dtype), values)  # [Hkv, B, Q * G, Dv]
        o = o.view(Hkv, B, Q, G, Dv).permute(1, 2, 0, 3, 4).reshape(B * Q, Hkv * G * Dv)
        return o if meta.unpad_rows is None else o.index_select(0, meta.unpad_rows)
