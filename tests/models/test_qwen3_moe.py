"""Qwen3-MoE against transformers' ``Qwen3MoeForCausalLM`` (float32, tiny random configs): greedy
tokens identical for 32 new tokens over a batch of prompts of different lengths, last-step
logits within 1e-4; chunked prefill, page sizes and layouts change nothing."""

from __future__ import annotations

import pytest

from _hf import VOCAB, assert_matches_hf, engine, prompts, run_greedy, save_hf_model

BASE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, moe_intermediate_size=32, vocab_size=VOCAB, max_position_embeddings=256,
            num_experts=8, num_experts_per_tok=2)
CASES = {
    "norm_topk": {"norm_topk_prob": True},
    # Layer 1 dense by mlp_only_layers, layer 0 dense by decoder_sparse_step=2 (only layer 1.. odd):
    # every layer kind, odd head count, unnormalised top-k weights.
    "mixed_layers": {"norm_topk_prob": False, "mlp_only_layers": [2], "decoder_sparse_step": 2,
                     "num_attention_heads": 3, "num_key_value_heads": 1, "num_experts_per_tok": 3},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_model_dir):
    out = {}
    for case, extra in CASES.items():
        d = tmp_path_factory.mktemp(f"qwen3_moe_{case}")
        out[case] = (save_hf_model("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**BASE, **extra}, d, tiny_model_dir), d)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(case, folders):
    model, folder = folders[case]
    eng = engine(folder)
    if case == "mixed_layers":  # the config really mixes dense and sparse layers
        kinds = [type(layer.mlp).__name__ for layer in eng.loaded.model.model.layers]
        assert kinds == ["MLP", "SparseMoE", "MLP"], kinds
    assert_matches_hf(model, eng, prompts(), f"qwen3_moe/{case}")


def test_chunking_batching_pages_layouts_agree(folders):
    _, folder = folders["norm_topk"]
    ps = prompts(seed=3, lens=(9, 70))
    ref, _ = run_greedy(engine(folder), ps, 16)
    for kw in ({"page_size": 1, "num_pages": 512}, {"page_size": 64, "num_pages": 16},
               {"layout": "NHD"}, {"chunk": 8, "budget": 16}, {"max_seqs": 1}):
        got, _ = run_greedy(engine(folder, **kw), ps, 16)
        assert got == ref, f"{kw} changed the tokens"
