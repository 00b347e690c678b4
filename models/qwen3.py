"""Qwen3 (``Qwen3ForCausalLM``): Llama-shaped with a per-head RMSNorm on q and k (over head_dim,
before rope), and an explicit ``head_dim`` that need not be hidden_size / num_heads."""

from __future__ import annotations

import torch

from pdkv.models.config import ArchConfig
from pdkv.models.layers import Attention, RMSNorm
from pdkv.models.registry import register_model
from pdkv.models.transformer import CausalLM


class Qwen3Attention(Attention):
    has_qk_norm = True

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype):
        super().__init__(cfg, dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D], normalized over D."""
        return self.q_norm.forward(q), self.k_norm.forward(k)


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(CausalLM):
    attention_cls = Qwen3Attention
