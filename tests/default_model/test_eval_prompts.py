"""The 16 code prompts of tools/default_model_prompts.json (written before any model's output on
them was seen; half end after a newline): the shipped model's greedy completions parse as Python
after their last complete line, scored without token healing (transformers) and with it (pdkv,
what /v1/completions gives by default); untrained weights of the same shape score near 0."""
from __future__ import annotations

import pytest
import torch

from default_model_eval import engine_score, score

from _cluster import make_engine, node_config

# Of 16, with healing off and on. The shipped 1.7 M-parameter checkpoint parses 11 either way
# (5 of the 8 prompts ending where their line ends, 6 of the 8 ending after a newline); one
# below it leaves room for float drift across CPUs. 12 is the aim, not yet reached.
WANT = 10


@pytest.mark.slow  # generates with the default model: ~30 s
def test_trained_completions_parse_with_and_without_healing(shipped_dir, hf_model, hf_tokenizer):
    from transformers import LlamaForCausalLM

    off = score(hf_model, hf_tokenizer)
    on = engine_score(make_engine(node_config(shipped_dir, "colocated")), token_healing=True)
    print(f"16 prompts parse: healing off {off['total']} (line end {off['line_end']}, after newline "
          f"{off['after_newline']}); healing on {on['total']} (line end {on['line_end']}, "
          f"after newline {on['after_newline']})")
    assert off["total"] >= WANT and off["after_newline"] >= 2, off
    assert on["total"] >= WANT and on["after_newline"] >= 2, on
    torch.manual_seed(0)
    noise = LlamaForCausalLM(hf_model.config).eval()  # same shape and tokenizer, untrained
    random = score(noise, hf_tokenizer)
    assert random["total"] <= 1, random


def test_the_demo_prompts_end_on_eos_and_parse(shipped_dir):
    """What `make demo` shows: /v1/completions' default (token healing on for a text prompt),
    greedy, within the demo's token budget."""
    from demo import DEFAULT_MAX_TOKENS, DEFAULT_PROMPTS

    from default_model_eval import parses
    from pdkv.engine import SamplingParams

    assert sorted(p.endswith("\n") for p in DEFAULT_PROMPTS) == [False, True]
    engine = make_engine(node_config(shipped_dir, "colocated"))
    params = SamplingParams(max_tokens=DEFAULT_MAX_TOKENS, temperature=0.0, token_healing=True)
    for p, o in zip(DEFAULT_PROMPTS, engine.generate(list(DEFAULT_PROMPTS), params)):
        assert o.finish_reason == "stop", (p, o.text)
        assert o.output_token_ids[-1] in engine.tokenizer.eos_token_ids, (p, o.text)
        assert parses(p, o.text, True), p + o.text
