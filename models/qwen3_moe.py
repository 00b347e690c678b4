"""Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3-30B-A3B, Qwen3-Coder-480B-A35B): the dense Qwen3's
attention (GQA with a per-head RMSNorm on q and k before rope) and, in the layers that
``decoder_sparse_step`` / ``mlp_only_layers`` select, a sparse MoE block with softmax top-k
routing (models/moe.py); the other layers keep the dense MLP of ``intermediate_size``."""

from __future__ import annotations

from pdkv.models.qwen3 import Qwen3Attention
from pdkv.models.registry import register_model
from pdkv.models.transformer import CausalLM


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(CausalLM):
    attention_cls = Qwen3Attention
