"""TP2 produces what TP1 produces: the same logits (to float rounding) and the same greedy tokens,
for every model family, with GQA split across ranks and with KV heads replicated (fewer KV heads
than ranks), over chunked prefill mixed with decodes."""

from __future__ import annotations

import pytest
import torch

from pdkv.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _tokens(engine, prompts):
    return [o.output_token_ids for o in engine.generate(prompts, GREEDY)]


def _first_logits(engine, prompt: str) -> torch.Tensor:
    """Logits of the first sampled token: steps run until the prompt's last chunk has been sampled."""
    engine.add_request("probe", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        if any(o.new_token_ids for o in engine.step()):
            logits = engine.runner.last_logits.clone()
    return logits


def test_llama_tp2_matches_tp1(tp, llama_pair):
    one, two = llama_pair
    assert two.tp is not None and two.tp.size == 2 and one.tp is None
    torch.testing.assert_close(_first_logits(two, tp.PROMPTS[1]), _first_logits(one, tp.PROMPTS[1]),
                               rtol=1e-4, atol=1e-4)
    assert _tokens(two, tp.PROMPTS) == _tokens(one, tp.PROMPTS)
    assert two.allocator.num_free == two.allocator.num_total


@pytest.mark.parametrize("arch,num_kv_heads,layout", [
    ("qwen3", 2, "HND"),   # q/k norms per head, one KV head per rank
    ("qwen3", 1, "HND"),   # one KV head, two ranks: the head is replicated on both
    ("qwen2", 2, "HND"),   # biases on q/k/v, sliced with their rows
    ("mistral", 1, "NHD"),  # the other page layout
])
def test_family_tp2_matches_tp1(tp, arch, num_kv_heads, layout):
    d = tp.model_dir(arch, num_kv_heads)
    one = tp.engine(d, 1, layout)
    two = tp.engine(d, 2, layout)
    try:
        assert two.loaded.arch.num_kv_heads == 1 and two.loaded.arch.num_heads == 2  # this rank's share
        assert two.loaded.full_arch.num_kv_heads == num_kv_heads
        torch.testing.assert_close(_first_logits(two, tp.PROMPTS[0]), _first_logits(one, tp.PROMPTS[0]),
                                   rtol=1e-4, atol=1e-4)
        assert _tokens(two, tp.PROMPTS) == _tokens(one, tp.PROMPTS)
        regions = two.tp.regions
        if num_kv_heads == 1:  # replicated: both ranks hold head 0 and wrote the same K/V
            assert [r.kv_heads for r in regions] == [(0,), (0,)]
            for layer in range(two.kv.num_layers):
                a, b = regions[0].cache.layer(layer), regions[1].cache.layer(layer)
                assert a.abs().sum() > 0
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:
            assert [r.kv_heads for r in regions] == [(0,), (1,)]
    finally:
        two.close()
