"""Greedy completions of fixed code prompts are plausible Python — most of them parse once cut at
their last complete line, whether the prompt ends where its line ends or after the newline (no
token healing here: transformers) — and the same check fails random weights of the same shape
and tokenizer, so it tells a trained model from noise."""
from __future__ import annotations

import pytest
import torch

from _common import CODE_PROMPTS, hf_generate, parses

NEW_TOKENS = 64


def _parsing(model, tokenizer, prompts) -> list[bool]:
    return [parses(p, *hf_generate(model, tokenizer, p, NEW_TOKENS)) for p in prompts]


@pytest.mark.slow  # generates with the default model: ~25 s
def test_trained_completions_parse_random_ones_do_not(hf_model, hf_tokenizer):
    from transformers import LlamaForCausalLM

    for prompts in (CODE_PROMPTS, [p + "\n" for p in CODE_PROMPTS]):
        trained = _parsing(hf_model, hf_tokenizer, prompts)
        assert sum(trained) >= 0.75 * len(prompts), (prompts, trained)
    torch.manual_seed(0)
    noise = LlamaForCausalLM(hf_model.config).eval()  # same shape and tokenizer, untrained
    random = _parsing(noise, hf_tokenizer, CODE_PROMPTS)
    assert sum(random) <= 1, random
