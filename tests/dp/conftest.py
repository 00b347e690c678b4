"""tests/dp: tiny MoE models (Qwen3-MoE, DeepSeek-V3 with MLA) built with transformers, shared by
the data-parallel expert-parallel tests; the helpers of tests/models (_hf.py) are reused, and the
disaggregated ones' (_dp_disagg.py over tests/disagg's _cluster.py / _procs.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _dp_disagg, the disaggregated tests' helpers

from _hf import VOCAB, save_hf_model  # noqa: E402

# 8 experts: DP2 holds 4 a rank, DP4 two. Two MoE layers so the lock step spans several all-to-alls.
QWEN = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, moe_intermediate_size=32, vocab_size=VOCAB, max_position_embeddings=256,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0])
DEEPSEEK = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, vocab_size=VOCAB,
                max_position_embeddings=256, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                v_head_dim=16, n_routed_experts=8, num_experts_per_tok=3, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, n_group=2, topk_group=1,
                n_shared_experts=2, first_k_dense_replace=1)
FAMILIES = {"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN),
            "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK)}


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory, tiny_model_dir):
    """family -> folder of a tiny random checkpoint, built once per session."""
    out = {}
    for family, (cfg, cls, kw) in FAMILIES.items():
        folder = tmp_path_factory.mktemp(f"dp_{family}")
        save_hf_model(cfg, cls, kw, folder, tiny_model_dir)
        out[family] = folder
    return out
