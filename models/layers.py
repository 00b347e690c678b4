"""Building blocks shared by the GQA decoder families: RMSNorm, the gated MLP, attention with a
paged KV cache, and one decoder layer.

Parameter names follow Hugging Face (``self_attn.o_proj``, ``mlp.down_proj``, ...) except that
q/k/v are fused into ``qkv_proj`` and gate/up into ``gate_up_proj``: a decode step is bound by
reading weights and by per-op overhead, and one GEMM instead of three saves both. The loader
maps checkpoint names onto the fused rows (see ``CausalLM.STACKED``).
NOTE: inside a forward pass submodules are run through ``.forward`` / ``linear``
(models/cpu_kernels.py) rather than ``module(...)``: nn.Module's call machinery (hook checks)
costs ~1 ms per decode step of a small model, about 7% of it, and these modules never carry hooks.
Shapes: T = tokens in the step (all sequences flattened), H = hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdkv.models import cpu_kernels
from pdkv.models.config import ArchConfig
from pdkv.models.cpu_kernels import gated_mlp, linear
from pdkv.models.rope import apply_rope


class RMSNorm(nn.Module):
    cpu_kernel = True  # False: F.rms_norm always (the loader's model.cpu_kernels: false)

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim]. Computed in float32 and cast back, exactly as transformers does (for
        other dtypes this is a little faster on the CPU than F.rms_norm, which adds dtype round
        trips). A float32 x on the CPU goes through pdkv's kernel (~1 us against F.rms_norm's
        ~9 us per [1, 512] row; equal to float32 rounding), anything else float32 through
        F.rms_norm: the same ops in the same order as transformers, in one call instead of six
        (a MoE decode step runs ~30 norms)."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            if self.cpu_kernel:  # ~1 us against F.rms_norm's ~9 us on the CPU (models/cpu_kernels.py)
                y = cpu_kernels.rms_norm(x, self.weight, self.eps)
                if y is not None:
                    return y
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x if x.dtype == torch.float32 else x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (h if x.dtype == torch.float32 else h.to(x.dtype))


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, intermediate_size: int | None = None):
        """``intermediate_size``: default cfg.intermediate_size; MoE shared experts pass theirs."""
        super().__init__()
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"config.json: hidden_act '{cfg.hidden_act}' is not supported (silu)")
        self.inter = inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] → [T, H]."""
        gu, down = self.gate_up_proj, self.down_proj
        if gu.bias is None and down.bias is None:  # a decode step's few rows: one kernel call
            return gated_mlp(x, gu.weight, down.weight, self.inter)
        gate_up = linear(x, gu.weight, gu.bias)  # [T, 2 * I]
        return linear(F.silu(gate_up[:, :self.inter]) * gate_up[:, self.inter:], down.weight, down.bias)


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype)

    has_qk_norm = False
    cpu_kernel = True  # False: torch's ops for the norms and rope (the loader's model.cpu_kernels: false)

    def _kernel_rope(self, qkv, T, cos, sin):
        """(q, k) normed (Qwen3) and rotated by the CPU kernel (models/cpu_kernels.py norm_rope), or
        None: the torch ops below."""
        H, Hkv, D, qs = self.num_heads, self.num_kv_heads, self.head_dim, self.q_size
        if not self.has_qk_norm:
            qk = cpu_kernels.norm_rope(qkv[:, :qs + self.kv_size].view(T, H + Hkv, D), None, 0.0, cos, sin)
            return None if qk is None else (qk[:, :H], qk[:, H:])
        qn, kn = self.q_norm, self.k_norm
        q = cpu_kernels.norm_rope(qkv[:, :qs].view(T, H, D), qn.weight, qn.eps, cos, sin)
        if q is None:
            return None
        k = cpu_kernels.norm_rope(qkv[:, qs:qs + self.kv_size].view(T, Hkv, D), kn.weight, kn.eps, cos, sin)
        return None if k is None else (q, k)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook for families that normalize q/k per head before rope (Qwen3); identity here."""
        return q, k

    def forward(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend, meta) -> torch.Tensor:
        """x: [T, H]; cos/sin: [T, 1, head_dim] → [T, H] (after o_proj)."""
        T, H, D = x.shape[0], self.num_heads, self.head_dim
        qkv = linear(x, self.qkv_proj.weight, self.qkv_proj.bias)  # [T, q_size + 2 * kv_size]
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, D)
        qk = self._kernel_rope(qkv, T, cos, sin) if self.cpu_kernel else None
        if qk is not None:
            q, k = qk
        elif self.has_qk_norm:
            q = qkv[:, :self.q_size].view(T, H, D)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.num_kv_heads, D)
            # normalized apart (their own weights), rotated together: one rope call, not two
            qk = apply_rope(torch.cat(self.qk_norm(q, k), 1), cos, sin)
            q, k = qk[:, :H], qk[:, H:]
        else:
            # q and k heads side by side: one rope over [T, H + Hkv, D] instead of two.
            qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(T, H + self.num_kv_heads, D), cos, sin)
            q, k = qk[:, :H], qk[:, H:]
        o = self.o_proj
        return linear(backend.forward(layer, q, k, v, meta), o.weight, o.bias)


class DecoderLayer(nn.Module):
    attention_cls = Attention
    # Tensor parallelism (models/parallel.py): sums the row-parallel o_proj / down_proj partial
    # outputs across ranks, in place. None (one rank): no call.
    reduce = None

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, attention_cls=Attention, mlp: nn.Module | None = None):
        """``mlp``: this layer's MLP (a models.moe.SparseMoE in sparse layers); default the dense one."""
        super().__init__()
        self.self_attn = attention_cls(cfg, dtype)
        self.mlp = mlp if mlp is not None else MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, layer: int, x: torch.Tensor, cos, sin, backend, meta, hook) -> torch.Tensor:
        """x: [T, H] residual stream → [T, H]."""
        attn = self.self_attn.forward(layer, self.input_layernorm.forward(x), cos, sin, backend, meta)
        if self.reduce is not None:
            attn = self.reduce(attn)
        if hook is not None:
            # NOTE: fires after o_proj, when this layer's K/V are in the cache: the messenger
            # may post this layer's page writes from here on. With tensor parallelism it fires
            # after the all-reduce, which every rank joins only once it wrote its K/V: every
            # rank's pages of this layer are final.
            hook(layer)
        x = x + attn
        mlp = self.mlp.forward(self.post_attention_layernorm.forward(x))
        return x + (mlp if self.reduce is None else self.reduce(mlp))
