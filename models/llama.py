"""Llama 2 / Llama 3 (``LlamaForCausalLM``): RMSNorm, SwiGLU MLP, GQA, rotary embeddings with
optional llama3 frequency scaling; ``attention_bias`` puts biases on q/k/v/o."""

from __future__ import annotations

from pdkv.models.registry import register_model
from pdkv.models.transformer import CausalLM


@register_model("LlamaForCausalLM")
class LlamaForCausalLM(CausalLM):
    pass
