"""Mistral (``MistralForCausalLM``): the Llama architecture without biases, plus sliding-window
attention when ``sliding_window`` is set (keys more than that many positions back are masked)."""

from __future__ import annotations

from pdkv.models.registry import register_model
from pdkv.models.transformer import CausalLM


@register_model("MistralForCausalLM")
class MistralForCausalLM(CausalLM):
    pass
