"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama-shaped, with biases on the q/k/v projections
(never on o_proj); sliding window only with ``use_sliding_window``."""

from __future__ import annotations

from pdkv.models.registry import register_model
from pdkv.models.transformer import CausalLM


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(CausalLM):
    pass
