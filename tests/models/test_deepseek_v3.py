"""DeepSeek-V3 (MLA + MoE) against transformers' ``DeepseekV3ForCausalLM`` (float32, tiny random
configs): greedy tokens identical for 32 new tokens over a batch of prompts of different lengths,
last-step logits within 1e-4; the cache is the latent (one kv_lora_rank + qk_rope_head_dim vector
per token and layer); chunked prefill, page sizes and layouts change nothing."""

from __future__ import annotations

import pytest

from _hf import VOCAB, assert_matches_hf, engine, prompts, run_greedy, save_hf_model

BASE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, vocab_size=VOCAB,
            max_position_embeddings=256, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5)
CASES = {
    # q LoRA, grouped top-k (2 groups, 1 kept), 2 shared experts, one dense layer first, 3 (odd)
    # heads, YaRN with mscale != mscale_all_dim (both the cos/sin factor and the softmax scale move).
    "yarn_groups": dict(num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=24,
                        n_group=2, topk_group=1, n_shared_experts=2, first_k_dense_replace=1, norm_topk_prob=True,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                                         "mscale": 1.0, "mscale_all_dim": 0.8}),
    # Plain q_proj (q_lora_rank null), one group, unnormalised weights, every layer sparse.
    "null_q_lora": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                        n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=0,
                        norm_topk_prob=False, num_experts_per_tok=3),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_model_dir):
    out = {}
    for case, extra in CASES.items():
        d = tmp_path_factory.mktemp(f"deepseek_v3_{case}")
        out[case] = (save_hf_model("DeepseekV3Config", "DeepseekV3ForCausalLM", {**BASE, **extra}, d,
                                   tiny_model_dir), d)
    return out


@pytest.mark.parametrize("prefill", ["decompressed", "absorbed"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(case, prefill, folders, monkeypatch):
    """Decode is always absorbed; a prefill step of first chunks runs decompressed (per-head K/V
    from kv_b_proj) or, with decompress_prefill off, absorbed like everything else."""
    from pdkv.models.mla import MLAttention

    calls = []
    real = MLAttention._decompressed
    monkeypatch.setattr(MLAttention, "_decompressed", lambda self, *a: calls.append(1) or real(self, *a))
    monkeypatch.setattr(MLAttention, "decompress_prefill", prefill == "decompressed")
    model, folder = folders[case]
    eng = engine(folder)
    kv = eng.kv
    assert (kv.kv_parts, kv.num_kv_heads, kv.head_dim) == (1, 1, 32 + 8), "not a latent cache"
    if case == "yarn_groups":
        kinds = [type(layer.mlp).__name__ for layer in eng.loaded.model.model.layers]
        assert kinds == ["MLP", "SparseMoE", "SparseMoE"], kinds
    assert_matches_hf(model, eng, prompts(), f"deepseek_v3/{case}/{prefill}")
    assert bool(calls) == (prefill == "decompressed")


def test_chunking_batching_pages_layouts_agree(folders):
    _, folder = folders["yarn_groups"]
    ps = prompts(seed=3, lens=(9, 70))
    ref, _ = run_greedy(engine(folder), ps, 16)
    for kw in ({"page_size": 1, "num_pages": 512}, {"page_size": 64, "num_pages": 16},
               {"layout": "NHD"}, {"chunk": 8, "budget": 16}, {"max_seqs": 1}):
        got, _ = run_greedy(engine(folder, **kw), ps, 16)
        assert got == ref, f"{kw} changed the tokens"
