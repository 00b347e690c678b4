"""Bad MoE / MLA input is refused before any tensor is built, naming the field or the tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from _hf import save_hf_model
from pdkv.models.config import parse_arch_config
from pdkv.models.loader import load_model
from pdkv.errors import ModelLoadError

QWEN = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "num_experts": 8, "num_experts_per_tok": 2}
DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
            "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4, "vocab_size": 128, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "n_group": 2, "topk_group": 1, "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16, "v_head_dim": 16, "n_shared_experts": 1, "first_k_dense_replace": 1}

BAD = [
    (QWEN, {"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds the 8 routed experts"),
    (QWEN, {"moe_intermediate_size": None}, "moe_intermediate_size"),
    (QWEN, {"mlp_only_layers": [5]}, "mlp_only_layers"),
    (QWEN, {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    (DEEPSEEK, {"n_group": 3}, "n_group=3 must divide the 8 routed experts"),
    (DEEPSEEK, {"topk_group": 3}, "topk_group=3 exceeds n_group=2"),
    (DEEPSEEK, {"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds the 4 experts of the topk_group=1"),
    (DEEPSEEK, {"kv_lora_rank": 0}, "kv_lora_rank must be an integer >= 1"),
    (DEEPSEEK, {"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
    (DEEPSEEK, {"q_lora_rank": -4}, "q_lora_rank"),
    (DEEPSEEK, {"v_head_dim": None}, "missing required field 'v_head_dim'"),
    (DEEPSEEK, {"scoring_func": "softmax"}, "scoring_func"),
]


@pytest.mark.parametrize("base,change,message", BAD, ids=[m.split()[0].split("=")[0] + str(i) for i, (_, _, m) in
                                                           enumerate(BAD)])
def test_inconsistent_config_names_the_field(base, change, message):
    with pytest.raises(ModelLoadError, match="config.json: .*" + message.replace("(", r"\(")):
        parse_arch_config({**base, **change})


def test_good_configs_parse():
    q, d = parse_arch_config(QWEN), parse_arch_config(DEEPSEEK)
    assert q.moe.sparse_layers == (0, 1) and q.mla is None and q.qk_norm
    assert d.moe.sparse_layers == (1,) and d.mla.latent_dim == 40 and d.moe.num_shared_experts == 1


def test_checkpoint_missing_an_expert_names_the_tensor(tmp_path, tiny_model_dir):
    cfg = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               intermediate_size=96, moe_intermediate_size=32, vocab_size=512, num_experts=4, num_experts_per_tok=2)
    save_hf_model("Qwen3MoeConfig", "Qwen3MoeForCausalLM", cfg, tmp_path, tiny_model_dir)
    load_model(tmp_path)  # the complete folder loads
    weights = load_file(tmp_path / "model.safetensors")
    gone = "model.layers.1.mlp.experts.3.up_proj.weight"
    del weights[gone]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"checkpoint lacks 1 tensor.*{gone}"):
        load_model(tmp_path)


def test_expert_tensor_of_wrong_shape_is_named(tmp_path, tiny_model_dir):
    cfg = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               intermediate_size=96, moe_intermediate_size=32, vocab_size=512, num_experts=4, num_experts_per_tok=2)
    save_hf_model("Qwen3MoeConfig", "Qwen3MoeForCausalLM", cfg, tmp_path, tiny_model_dir)
    weights = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.mlp.experts.2.down_proj.weight"
    weights[name] = torch.zeros(64, 16)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"{name}.*shape \\(64, 16\\)"):
        load_model(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["num_local_experts"] == 4  # transformers 5.x's spelling, read as num_experts


def test_unknown_expert_is_refused_and_the_mtp_layer_skipped(tmp_path, tiny_model_dir):
    """An expert id past num_experts is an unexpected tensor; DeepSeek's multi-token-prediction
    layer (model.layers.{num_hidden_layers}.*, as the R1 checkpoint ships it) is skipped."""
    cfg = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
               intermediate_size=96, moe_intermediate_size=32, vocab_size=512, n_routed_experts=4,
               num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
               qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1, first_k_dense_replace=0)
    save_hf_model("DeepseekV3Config", "DeepseekV3ForCausalLM", cfg, tmp_path, tiny_model_dir)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.1.eh_proj.weight"] = torch.zeros(64, 128)  # the MTP layer: ignored
    weights["model.layers.1.mlp.experts.0.up_proj.weight"] = torch.zeros(32, 64)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    load_model(tmp_path)
    name = "model.layers.0.mlp.experts.4.up_proj.weight"
    weights[name] = torch.zeros(32, 64)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"unexpected tensor '{name}'"):
        load_model(tmp_path)
