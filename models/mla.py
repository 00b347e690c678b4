"""Multi-head latent attention (DeepSeek-V2/V3) over a latent KV cache, in the absorbed form.

Per token the cache holds one vector per layer: c_kv = RMSNorm(x W_DKV) [kv_lora_rank] and the
rotated rope key k_pe [qk_rope_head_dim], concatenated (``latent_dim`` values, no heads, no K/V
split). Head h's key is [c_kv W_UK_h, k_pe] and its value c_kv W_UV_h (W_UK, W_UV: the rows of
``kv_b_proj``), so

    q_h . k_h = (q_nope_h W_UK_h^T) . c_kv + q_pe_h . k_pe      (W_UK folded into the query)
    out_h     = (sum_s p_hs c_kv_s) W_UV_h                      (W_UV applied after attention)

and attention runs as multi-query attention of every head over the one cached latent
(models/attention: ``v=None``) for decodes and for prefill chunks that continue a sequence; it
never decompresses the cache. A step made only of first prefill chunks (the keys are exactly the
new tokens) is attended decompressed instead, per head over c_kv W_UK / c_kv W_UV of those
tokens, which is cheaper for long prompts (``decompress_prefill``); the latent is cached either way.
Rope touches only the rope part; DeepSeek stores those dims as interleaved pairs, which
post_load de-interleaves in the weights once (transformers' apply_rotary_pos_emb_interleave
gives the same numbers at run time).
Shapes: T tokens, H query heads (this rank's), L kv_lora_rank, R qk_rope_head_dim,
N qk_nope_head_dim, V v_head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdkv.models import fp8
from pdkv.models.config import ArchConfig
from pdkv.models.cpu_kernels import bmm, linear
from pdkv.models.layers import RMSNorm
from pdkv.models.rope import apply_rope

# transformers builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps, not rms_norm_eps.
LORA_NORM_EPS = 1e-6


def _lin(x: torch.Tensor, m: nn.Linear) -> torch.Tensor:
    return linear(x, m.weight, m.bias)


def _stored(w: torch.Tensor, in_major: bool) -> torch.Tensor:
    """w: [H, in, out] → a copy of it, in memory [H, out, in] (in_major) or [H, in, out]."""
    return w.transpose(1, 2).contiguous().transpose(1, 2) if in_major else w.contiguous()


class MLAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype):
        super().__init__()
        m = self.mla = cfg.mla
        H, bias = cfg.num_heads, cfg.attention_bias
        self.num_heads = H
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, H * m.qk_head_dim, bias=False, dtype=dtype)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, m.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS, dtype)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * m.qk_head_dim, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, m.latent_dim, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS, dtype)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim), bias=False, dtype=dtype)
        self.o_proj = nn.Linear(H * m.v_head_dim, cfg.hidden_size, bias=bias, dtype=dtype)
        self.w_uk: torch.Tensor | None = None  # [H, N, L], from kv_b_proj by post_load()
        self.w_uv: torch.Tensor | None = None  # [H, L, V]

    def post_load(self) -> None:
        """Splits kv_b_proj [H * (N + V), L] into the absorbed W_UK [H, N, L] and W_UV^T [H, L, V],
        de-interleaves the rope rows of the q and kv_a projections once, so that every step
        gets its rope inputs in rotate-half order straight from the GEMMs (an exact permutation
        of output rows; the cached rope key is in that order too, on every node alike), and
        fuses the two projections of the layer input (``_fuse_input_projections``).
        Runs once the loader has laid the weights out in memory (models/loader.py)."""
        m = self.mla
        # FP8 checkpoints: the absorbed form needs kv_b_proj's plain values (as DeepSeek's
        # reference and vLLM dequantize it once at load); it is the smallest of the projections.
        fp8.dequantize_param(self.kv_b_proj, "weight", self.kv_a_layernorm.weight.dtype)
        w = self.kv_b_proj.weight.detach().view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        # On the CPU each stored like the Linear weights (models/cpu_kernels.py): the input dimension
        # (N of W_UK, L of W_UV) contiguous when they are, else the output dimension (and on a GPU).
        in_major = w.device.type == "cpu" and self.kv_b_proj.weight.stride(1) == 1
        self.w_uk = _stored(w[:, :m.qk_nope_head_dim], in_major)
        self.w_uv = _stored(w[:, m.qk_nope_head_dim:].transpose(1, 2), in_major)
        if m.rope_interleave and not self._deinterleaved:
            R, N = m.qk_rope_head_dim, m.qk_nope_head_dim
            perm = torch.cat((torch.arange(0, R, 2), torch.arange(1, R, 2))).to(w.device)
            with torch.no_grad():
                q = self.q_proj if m.q_lora_rank is None else self.q_b_proj
                L = m.kv_lora_rank
                kv = self.kv_a_proj_with_mqa
                for lin, groups in ((q, [(h * m.qk_head_dim + N, perm) for h in range(self.num_heads)]),
                                    (kv, [(L, perm)])):
                    self._permute_rows(lin, groups)
                if kv.bias is not None:
                    kv.bias[L:] = kv.bias[L:][perm].clone()
            self._deinterleaved = True
        first = self.q_proj if m.q_lora_rank is None else self.q_a_proj
        if not (fp8.is_fp8(first.weight) or fp8.is_fp8(self.kv_a_proj_with_mqa.weight)):
            self._fuse_input_projections()  # FP8: two GEMMs (each with its own scales)

    def _permute_rows(self, lin: nn.Linear, groups) -> None:
        """lin.weight[s + i] = lin.weight[s + perm[i]] for each (s, perm). FP8 rows move as bytes
        when each stays in its 128-row block (DeepSeek's shapes: a head's 64 rope rows are one
        half of a block); otherwise that projection is dequantized first."""
        w = lin.weight
        if fp8.is_fp8(w):
            if fp8.permute_rows(w, groups):
                return
            fp8.dequantize_param(lin, "weight", self.kv_a_layernorm.weight.dtype)
            w = lin.weight
        for start, perm in groups:
            w[start:start + len(perm)] = w[start:start + len(perm)][perm].clone()

    _deinterleaved = False
    cpu_kernel = True  # False: torch's ops (the loader's model.cpu_kernels: false)
    # q_proj / q_a_proj and kv_a_proj_with_mqa as one GEMM (_fuse_input_projections). Plain
    # tensors, not parameters: they are the two Linears' own bytes, which must not count twice.
    in_weight: torch.Tensor | None = None
    in_bias: torch.Tensor | None = None

    def _fuse_input_projections(self) -> None:
        """One weight for the two GEMMs that read the layer input x, q_a_proj (or q_proj) and
        kv_a_proj_with_mqa: [Q + L + R, hidden], Q = q_lora_rank (or H * (N + R)). At batch 1
        that is one weight read of 416 rows instead of two of 256 and 160 (DeepSeek-V3 bench
        shapes), and small GEMVs are what a decode step spends most of its time in. The two
        Linears keep their parameters, as views of the fused rows (no copy, the same bytes),
        in the memory order the loader gave them."""
        first = self.q_proj if self.mla.q_lora_rank is None else self.q_a_proj
        kv = self.kv_a_proj_with_mqa
        parts = (first.weight.detach(), kv.weight.detach())
        if parts[0].stride(0) == 1:  # stored [in, out] (the CPU layout): cat along the columns
            weight = torch.cat([w.t() for w in parts], 1).t()
        else:
            weight = torch.cat(parts, 0)
        n = parts[0].shape[0]
        first.weight.data, kv.weight.data = weight[:n], weight[n:]
        self.in_weight = weight
        if kv.bias is not None:  # attention_bias: q_a_proj has one too, a plain q_proj never
            q_bias = torch.zeros(n, dtype=kv.bias.dtype, device=kv.bias.device) if first.bias is None \
                else first.bias.detach()
            self.in_bias = torch.cat((q_bias, kv.bias.detach()))
            kv.bias.data = self.in_bias[n:]
            if first.bias is not None:
                first.bias.data = self.in_bias[:n]

    def _rope(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """x: [T, heads, R] → rotated (rotate-half order: post_load de-interleaved the weights)."""
        if self.mla.rope_interleave and not self._deinterleaved:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), -1)
        return apply_rope(x, cos, sin)

    def forward(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend, meta) -> torch.Tensor:
        """x: [T, hidden]; cos/sin: [T, 1, R] → [T, hidden] (after o_proj)."""
        m, T, H = self.mla, x.shape[0], self.num_heads
        N, L = m.qk_nope_head_dim, m.kv_lora_rank
        if self.in_weight is None:  # weights not through post_load (a module built by hand)
            q_in = _lin(x, self.q_proj if m.q_lora_rank is None else self.q_a_proj)
            kv = _lin(x, self.kv_a_proj_with_mqa)  # [T, L + R]
        else:
            a = linear(x, self.in_weight, self.in_bias)  # [T, Q + L + R]
            q_in, kv = a[:, :a.shape[1] - m.latent_dim], a[:, a.shape[1] - m.latent_dim:]
        q = q_in if m.q_lora_rank is None else _lin(self.q_a_layernorm.forward(q_in), self.q_b_proj)
        q = q.view(T, H, m.qk_head_dim)
        if self.cpu_kernel and (self._deinterleaved or not m.rope_interleave):  # one kernel call from here on
            fused = getattr(backend, "latent_decode", None)
            o = None if fused is None else fused(layer, q, kv, cos, sin, self.kv_a_layernorm.weight,
                                                 self.kv_a_layernorm.eps, self.w_uk, self.w_uv, meta)
            if o is not None:
                return _lin(o, self.o_proj)
        spans = backend.fresh_prefill_spans(meta) if self.decompress_prefill else None
        if spans is not None:
            latent = torch.cat((self.kv_a_layernorm.forward(kv[:, :L]),
                                self._rope(kv[:, None, L:], cos, sin)[:, 0]), -1)  # [T, L + R]
            stored = backend.write(layer, latent[:, None], None, meta)
            if stored is not None:  # an FP8 cache: attend what later steps will read back
                latent = stored[:, 0]
            return _lin(self._decompressed(q, latent, spans, backend.scale, cos, sin), self.o_proj)
        # The query's and the key's rope parts rotate in one call ([T, H + 1, R]).
        pe = self._rope(torch.cat((q[..., N:], kv[:, None, L:]), 1), cos, sin)
        latent = torch.cat((self.kv_a_layernorm.forward(kv[:, :L]), pe[:, H]), -1)  # [T, L + R]
        q_abs = bmm(q[..., :N].transpose(0, 1), self.w_uk)  # [H, T, L]
        query = torch.cat((q_abs.transpose(0, 1), pe[:, :H]), -1)  # [T, H, L + R]
        o = backend.forward(layer, query, latent[:, None], None, meta)  # [T, H * L], latent space
        o = bmm(o.view(T, H, L).transpose(0, 1), self.w_uv)  # [H, T, V]
        return _lin(o.transpose(0, 1).reshape(T, H * m.v_head_dim), self.o_proj)

    # Prefill steps made only of first chunks attend decompressed (per head K = [c W_UK, k_pe],
    # V = c W_UV over the new tokens): N + R + V multiply-adds per query, key and head instead of
    # the absorbed form's 2L + R (320 against 1088 for DeepSeek-V3), as vLLM and SGLang prefill.
    # False: absorbed everywhere (the tests run both against transformers).
    decompress_prefill = True

    def _decompressed(self, q, latent, spans, scale, cos, sin) -> torch.Tensor:
        """q: [T, H, N + R] (rope part not yet rotated), latent: [T, L + R] → [T, H * V]."""
        m, T, H = self.mla, q.shape[0], self.num_heads
        N, L, V = m.qk_nope_head_dim, m.kv_lora_rank, m.v_head_dim
        kv = _lin(latent[:, :L], self.kv_b_proj).view(T, H, N + V)  # [T, H, N + V]
        query = torch.cat((q[..., :N], self._rope(q[..., N:], cos, sin)), -1)  # [T, H, N + R]
        key = torch.cat((kv[..., :N], latent[:, None, L:].expand(T, H, m.qk_rope_head_dim)), -1)
        out = torch.empty(T, H, V, dtype=q.dtype, device=q.device)
        for start, end in spans:
            o = F.scaled_dot_product_attention(query[start:end].transpose(0, 1), key[start:end].transpose(0, 1),
                                               kv[start:end, :, N:].transpose(0, 1), is_causal=True, scale=scale)
            out[start:end] = o.transpose(0, 1)  # [n, H, V]
        return out.view(T, H * V)
